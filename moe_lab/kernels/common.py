"""The Triton pieces several kernels share: the grouped tile order and the tile schedule over
device offsets, the K loops and the SwiGLU epilogue of the fused kernels, the rounding store, the
gather of token rows and the weighted scatter; the device check of a compiled launch; and
`kernel_op`, which makes a launch a ``torch.library`` custom op that is its own fake
implementation (on fake tensors it allocates its outputs and launches nothing).

The grouped GEMM (`moe_lab.kernels.grouped_gemm`) tells their story (its first kernel runs the
K loop of Triton's matmul tutorial, `gemm_k_loop`, which the fused kernels run too) and owns their
launch (``GROUP_M``, the grid: `moe_lab.kernels.grouped_gemm.launch`);
the fused kernels (`moe_lab.kernels.fused_moe`, `moe_lab.kernels.fused_mxfp8`) and the
persistent TMA GEMM reuse them, so the grouped tile order exists once in Triton (its Python twin
is the traffic model's, `moe_lab.perf.traffic.grouped_order`, tested equal). Nothing here changes
Triton: what makes the kernels run interpreted on a CPU is `moe_lab.kernels.interpreter`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from moe_lab.perf.hardware import ARCHS, gpu_arch

Tensor = torch.Tensor
#: Whether this process runs the kernels under Triton's interpreter: Triton's knob as the kernels
#: were defined (`moe_lab.kernels.interpreter` sets it where there is no CUDA device).
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


def check_device(name: str, device: torch.device, needs: str = "bf16_mma",
                 what: str = "compiled Triton", **others: Tensor | None) -> None:
    """Every tensor of ``others`` (by name; None: absent) on ``device``, ``name``'s. Compiled Triton
    reads and writes CUDA memory only (interpreted, any device will do), of a GPU whose
    `moe_lab.perf.hardware.ARCHS` row has ``needs`` (Triton itself: ``bf16_mma``, sm_80 on): else
    one line naming the tensor or the GPU and what ``what`` requires."""
    for other, t in others.items():
        if t is not None and t.device != device:
            raise ValueError(f"{other} must be on {device} ({name}'s device), got {t.device}")
    if INTERPRETED:
        return
    if device.type != "cuda":
        raise ValueError(
            f"{name} must be on a CUDA device for compiled Triton, got {device} (moe_lab's "
            "kernels run interpreted on a machine without CUDA, or with TRITON_INTERPRET=1)")
    major, minor = torch.cuda.get_device_capability(device)
    arch = gpu_arch((major, minor))
    needs, what = (needs, what) if arch.bf16_mma else ("bf16_mma", "compiled Triton")
    if not getattr(arch, needs):
        first = min((a for a in ARCHS.values() if getattr(a, needs)), key=lambda a: a.capability)
        raise ValueError(f"{what} requires {needs} ({first.arch} or newer); this "
                         f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}")


def kernel_op(name: str) -> Callable[[Callable[..., object]], object]:
    """``fn`` as the custom op ``moe_lab::<name>``, so that ``FakeTensorMode`` and
    ``torch.compile`` trace through it: ``fn`` is its own fake implementation too, which on
    fake tensors (a shape, no memory) allocates the outputs and launches nothing: each op
    launches its kernel only ``if not isinstance(x, FakeTensor)``."""
    def register(fn: Callable[..., object]) -> object:
        op = torch.library.custom_op(f"moe_lab::{name}", fn, mutates_args=())
        op.register_fake(fn)
        return op
    return register


# A dense GEMM's group (`dense_group`) keeps its row tiles' A panels in L2 while the group sweeps
# every N tile: at most these bytes of them, well under the smallest L2 moe_lab targets (the
# H200's), so that the N tiles' panels of a wave fit beside them.
DENSE_GROUP_BYTES = 32 << 20


def dense_group(m: int, k: int, block_m: int, elem_bytes: int) -> int:
    """``GROUP_M`` of `tile_order` for a dense ``[m, k]`` x ``[k, n]`` GEMM: the most row tiles,
    a power of two, whose A panels (``block_m x k`` elements of ``elem_bytes``) fit
    `DENSE_GROUP_BYTES`; at least 1. Row-fastest order (a group of every row tile) shares a B
    panel between neighbours but fetches each A panel again for every N tile; N-fastest (a
    group of one) shares an A panel and fetches each B panel again for every row tile. The
    group between keeps its A panels in L2 while it sweeps the N tiles, so each B panel is
    fetched once per group (`moe_lab.perf.traffic` models the bytes each order moves)."""
    fits = max(1, DENSE_GROUP_BYTES // max(1, block_m * k * elem_bytes))
    return 1 << (min(fits, triton.cdiv(max(m, 1), block_m)).bit_length() - 1)


# ------------------------------------------------------------------ Triton pieces


@triton.jit
def segment_table(offsets_ptr, E, M_ROWS, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """``(s, start, end, n_tiles, last)`` of segments ``s = 0..BLOCK_E-1`` (``BLOCK_E >= E + 1``):
    segments ``0..E-1`` are the experts' rows ``offsets[s]:offsets[s+1]``, segment ``E`` the
    padding ``offsets[E]:M_ROWS``, each ``n_tiles`` row tiles, ``last`` the row tiles in segments
    ``0..s``. Offsets are clamped into ``[0, M_ROWS]`` so that bad ones cannot address memory
    outside the buffers. `tile_schedule` reads it for one tile; the persistent TMA GEMM builds it
    once and reads it for each of its tiles (`segment_of`)."""
    s = tl.arange(0, BLOCK_E)
    start = tl.load(offsets_ptr + s, mask=s <= E, other=M_ROWS)
    end = tl.load(offsets_ptr + s + 1, mask=s < E, other=M_ROWS)
    start = tl.minimum(tl.maximum(start, 0), M_ROWS)
    end = tl.minimum(tl.maximum(end, start), M_ROWS)
    n_tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    return s, start, end, n_tiles, tl.cumsum(n_tiles, 0)


@triton.jit
def segment_of(tile, s, start, end, n_tiles, last, BLOCK_M: tl.constexpr):
    """``(segment, first row, end row)`` of row tile number ``tile`` in `segment_table`'s
    segments (tiles are numbered segment after segment)."""
    seg = tl.sum((last <= tile).to(tl.int32), 0)
    here = s == seg
    row0 = tl.sum(tl.where(here, start + (tile - last + n_tiles) * BLOCK_M, 0), 0)
    row_end = tl.sum(tl.where(here, end, 0), 0)
    return seg, row0, row_end


@triton.jit
def tile_schedule(offsets_ptr, tile, E, M_ROWS, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """``(segment, first row, end row)`` of row tile number ``tile``.

    Segments ``0..E-1`` are the experts' rows ``offsets[s]:offsets[s+1]``, segment ``E``
    the padding ``offsets[E]:M_ROWS``; tiles are numbered segment after segment. A segment
    number above ``E`` means the tile has no work. Offsets are clamped into ``[0, M_ROWS]``
    so that bad ones cannot address memory outside the buffers (`segment_table`).
    """
    s, start, end, n_tiles, last = segment_table(offsets_ptr, E, M_ROWS, BLOCK_M, BLOCK_E)
    return segment_of(tile, s, start, end, n_tiles, last, BLOCK_M)


@triton.jit
def grouped_tile(t, n_row_tiles, n_col_tiles, GROUP_M: tl.constexpr):
    """``(row tile, N tile)`` of tile number ``t`` of ``n_row_tiles x n_col_tiles`` in grouped
    rasterisation: ``GROUP_M`` consecutive row tiles (the last group may be smaller) take every
    N tile, row tile fastest, before the next group starts; ``GROUP_M = 1`` is N-fastest order.
    `tile_order` is this for the program of a 1-D grid; a persistent kernel walks ``t`` itself."""
    per_group = GROUP_M * n_col_tiles
    first = (t // per_group) * GROUP_M
    size = tl.minimum(n_row_tiles - first, GROUP_M)
    inside = t % per_group
    return first + inside % size, inside // size


@triton.jit
def tile_order(N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(row tile, N tile)`` of this program in a 1-D grid of ``(cdiv(M_ROWS, BLOCK_M) + E) x
    cdiv(N, BLOCK_N)`` programs, in grouped rasterisation (`grouped_tile`: ``GROUP_M``
    consecutive row tiles take every N tile, row tile fastest;
    `moe_lab.kernels.grouped_gemm.tile_group` picks ``GROUP_M`` per launch;
    `moe_lab.perf.traffic` models the bytes each order moves)."""
    t_n = tl.cdiv(N, BLOCK_N)
    return grouped_tile(tl.program_id(0), tl.num_programs(0) // t_n, t_n, GROUP_M)


@triton.jit
def expert_tile_order(K, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr):
    """``(expert, K tile, N tile)`` of this program in a weight gradient's grid
    (`moe_lab.kernels.grouped_gemm.expert_grid`): expert after expert (the expert is the second
    axis), and inside one `grouped_tile`'s rasterisation, ``GROUP_K`` K tiles taking every N
    tile, K tile fastest. (A
    grid with the expert fastest has consecutive programs read different experts' rows and
    share nothing.) The expert as a program id, not a quotient, keeps the 64-bit address
    arithmetic that scales by it cheaper (a spill in the gathered dW otherwise)."""
    tile_k, tile_n = grouped_tile(tl.program_id(0), tl.cdiv(K, BLOCK_K), tl.cdiv(N, BLOCK_N), GROUP_K)
    return tl.program_id(1), tile_k, tile_n


@triton.jit
def tile_rows(row0, row_end, tile_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(rows, cols, row_ok)`` of a scheduled program's output tile: its ``BLOCK_M`` rows from
    ``row0`` (those below ``row_end`` are its expert's) and its ``BLOCK_N`` columns (N tile
    ``tile_n``), as int64 indices: every index that multiplies a stride is int64."""
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    return rows, cols, rows < row_end


@triton.jit
def cast_for_store(x, ptr):
    """float32 ``x`` in the element type of ``ptr``. bfloat16 is rounded to nearest even in
    integer arithmetic: Triton's interpreter truncates float32 -> bfloat16 casts, a GPU
    rounds them; this gives the GPU's answer on both."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # carries into the exponent
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)  # NaN stays a (quiet) NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def mma(acc, a, b, DOT_BF16: tl.constexpr):
    """``acc + a @ b``, accumulated in float32, for tiles ``a``, ``b`` as loaded.

    ``DOT_BF16`` (bfloat16 inputs, compiled): the bfloat16 tiles go to the tensor cores as
    they are. Otherwise the tiles are float32 values (float32 inputs, or bfloat16 ones under
    the interpreter) multiplied at IEEE float32 precision: each product of two bfloat16
    values is exact in float32, so both paths give the same sums up to their order."""
    if DOT_BF16:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def gemm_k_loop(x_ptr, a_rows, a_ok, w_ptr, cols, N, K, s_xm, s_xk, s_wk, s_wn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_BF16: tl.constexpr):
    """The grouped GEMM's K loop, as Triton's matmul tutorial writes it: one ``BLOCK_K`` slice of
    A and of B per step, multiplied into a float32 accumulator. ``x[a_rows] · w``,
    ``[BLOCK_M, BLOCK_N]``, for rows ``a_rows`` of ``x`` (``a_ok`` masks them: a masked row
    contributes zeros) and columns ``cols`` of one expert's ``w: [K, N]``."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        a = tl.load(x_ptr + a_rows[:, None] * s_xm + ks[None, :] * s_xk,
                    mask=a_ok[:, None] & (ks[None, :] < K), other=0.0)
        b = tl.load(w_ptr + ks[:, None] * s_wk + cols[None, :] * s_wn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = mma(acc, a, b, DOT_BF16)
    return acc


@triton.jit
def swiglu_k_loop(x_ptr, a_rows, a_ok, w_ptr, cols, F, K, s_xm, s_xk, s_wk, s_wn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_BF16: tl.constexpr):
    """The SwiGLU K loop: ``(x·Wg, x·Wu)`` in float32, ``[BLOCK_M, BLOCK_N]`` each, for rows
    ``a_rows`` of ``x`` (``a_ok`` masks them) and columns ``cols`` of one expert's
    ``w: [K, 2F]`` (gate ``[:, :F]``, up ``[:, F:]``). Each ``x`` tile is loaded once and
    multiplied by both halves, so the ``[M, 2F]`` pre-activation is never written."""
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        a = tl.load(x_ptr + a_rows[:, None] * s_xm + ks[None, :] * s_xk,
                    mask=a_ok[:, None] & (ks[None, :] < K), other=0.0)
        w_mask = (ks[:, None] < K) & (cols[None, :] < F)
        bg = tl.load(w_ptr + ks[:, None] * s_wk + cols[None, :] * s_wn, mask=w_mask, other=0.0)
        bu = tl.load(w_ptr + ks[:, None] * s_wk + (cols + F)[None, :] * s_wn, mask=w_mask, other=0.0)
        gate = mma(gate, a, bg, DOT_BF16)
        up = mma(up, a, bu, DOT_BF16)
    return gate, up


@triton.jit
def swiglu_epilogue(gate, up, out_ptr, out_ptrs, up_out_ptrs, dh_ptrs, mask, BACKWARD: tl.constexpr):
    """Forward: ``silu(gate) ⊙ up`` to ``out_ptrs``. Backward: ``dh`` in (``dh_ptrs``), the
    pre-activation's gradient out, ``dgate`` to ``out_ptrs`` and ``dup`` to ``up_out_ptrs``
    (``[M, 2F]``), from the recomputed ``gate`` and ``up``. (The kernels form the pointer
    tiles before their K loop: where they are formed changes the registers ptxas gives.)"""
    sig = tl.sigmoid(gate)
    silu = gate * sig
    if BACKWARD:
        dh = tl.load(dh_ptrs, mask=mask, other=0.0).to(tl.float32)
        dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(out_ptrs, cast_for_store(dgate, out_ptr), mask=mask)
        tl.store(up_out_ptrs, cast_for_store(dh * silu, out_ptr), mask=mask)
    else:
        tl.store(out_ptrs, cast_for_store(silu * up, out_ptr), mask=mask)


@triton.jit
def gather_rows(src_ptr, rows, row_ok, TOP_K):
    """The gather prologue's row source: ``(token, src, valid)`` of permuted rows ``rows``,
    ``src[r] = t·k + j`` giving ``t``; a row no (token, slot) maps to (``src < 0``:
    alignment padding) is not valid."""
    src = tl.load(src_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    ok = row_ok & (src >= 0)
    return tl.where(ok, src // TOP_K, 0), src, ok


@triton.jit
def scatter_rows(acc, out_ptr, weight_ptr, token, src, ok, cols, N, s_om, s_on,
                 HAS_WEIGHTS: tl.constexpr, ATOMIC: tl.constexpr):
    """The weighted-scatter epilogue: rows of ``acc`` times ``weight[src]`` (``HAS_WEIGHTS``)
    to their tokens — ``ATOMIC``: added into a float32 ``[T, N]`` at row ``token``; else
    stored at row ``src`` of a token-major ``[T·k, N]`` (one writer per element)."""
    if HAS_WEIGHTS:
        acc = acc * tl.load(weight_ptr + src, mask=ok, other=0.0).to(tl.float32)[:, None]
    mask = ok[:, None] & (cols[None, :] < N)
    if ATOMIC:
        tl.atomic_add(out_ptr + token[:, None] * s_om + cols[None, :] * s_on, acc, mask=mask)
    else:
        dest = tl.where(ok, src, 0)
        tl.store(out_ptr + dest[:, None] * s_om + cols[None, :] * s_on, cast_for_store(acc, out_ptr),
                 mask=mask)


def row_source(row_id_map: Tensor, n_rows: int) -> Tensor:
    """The inverse of the row-id map: ``src[r] = t·k + j`` for ``r = row_id_map[t, j]``, and
    ``-1`` for a row no (token, slot) maps to. ``[n_rows]`` int32, on the device, no sync."""
    src = torch.full((n_rows,), -1, dtype=torch.int32, device=row_id_map.device)
    entries = torch.arange(row_id_map.numel(), dtype=torch.int32, device=row_id_map.device)
    return src.scatter_(0, row_id_map.reshape(-1).long(), entries)

