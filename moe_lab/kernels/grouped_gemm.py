"""Triton grouped GEMM over per-expert row offsets held on the device: forward, backward, SwiGLU.

After the tokens are permuted so that each expert's rows are contiguous, the experts'
work is one *grouped GEMM*: ``x: [M, K]`` is cut into segments of rows, segment ``e`` =
``offsets[e]:offsets[e+1]``, and each segment is multiplied by its own weight ``w[e]:
[K, N]``. The segment lengths are the router's decision, so they live on the device and
change every step. A loop over experts needs them on the host (``offsets.tolist()``, a
host sync per step, and ``E`` small GEMMs); ``torch._grouped_mm`` and this kernel do not.
The grid is sized from static shapes only — at most ``cdiv(M, BLOCK_M) + E`` row tiles,
because cutting ``M`` rows into ``E`` segments adds at most one partial tile per segment —
and every program reads ``offsets`` from device memory, counts each segment's tiles
(``cdiv(rows, BLOCK_M)``), takes their running sum, finds the segment its tile number falls
in and multiplies that expert's rows; a program whose tile number is past the last tile
exits at once. The rows after ``offsets[E]`` (buffer padding) form one more segment that
is written as zeros. Nothing is read on the host, so the step can be captured in a CUDA
graph, and a tile that spans two experts never exists.

The backward is two more grouped GEMMs over the same offsets: ``dX = dY·W[e]ᵀ`` is the
forward kernel fed ``W`` as a transposed view; ``dW[e] = X[rows of e]ᵀ·dY[rows of e]``
reduces over each expert's rows, one program per ``(expert, K tile, N tile)`` looping
over the rows of its expert (none: ``dW[e] = 0``). ``grouped_gemm_swiglu`` fuses the
SwiGLU activation into the first expert GEMM: each program loads the same ``x`` tile once
and multiplies it by both halves of ``w_gate_up`` (gate ``[..., :F]``, up ``[..., F:]``,
as in `moe_lab.moe.experts.SwiGLUExperts`), so the ``[M, 2F]`` pre-activation is never
written. Its backward *recomputes* the pre-activation in the same kernel and emits its
gradient from the epilogue, rather than saving ``[M, 2F]`` in the forward: one extra GEMM
buys the memory of the layer's largest activation (the trade activation recomputation
makes everywhere in large-model training).

Products accumulate in float32. Compiled, bfloat16 tiles go from memory to the tensor
cores as bfloat16 (``DOT_BF16``); under ``TRITON_INTERPRET=1``, whose ``tl.dot`` multiplies
a bfloat16 tile's raw 16-bit patterns as integers, the same values are multiplied as
float32 — a product of two bfloat16 is exact in float32, so both give the same sums up to
order. The result is cast on the store,
rounding to nearest even (in integers for bfloat16, because the interpreter's own cast
truncates), so the CPU gives the GPU's answer. Every index that multiplies a stride is
int64: one DeepSeek-V3 layer's expert weights, ``[256, 7168, 2048]``, hold 3.8·10⁹
elements, past int32's 2.1·10⁹, and so can any operand view with a large stride.

Block sizes, warps and stages come from one function, `launch_config`, which the wrappers
call at launch time and `compile_specs` at the DeepSeek-V3 and GPT-OSS-20B shapes, for the
compile report (`moe_lab.workbench.compile_report.report`) to build for Hopper and Blackwell. Compiled,
it picks per shape from a small space of tiles per kernel (`TILE_SPACE`, by the rule of
`choose_config`), and `compile_specs` lists every config of the space, the chosen one first.

Each launch is a ``torch.library.custom_op`` with a fake implementation (the output shape
follows from the input shapes), so ``FakeTensorMode`` — `moe_lab.training.sync.assert_sync_free` —
and ``torch.compile`` can trace through a kernel they cannot run.
"""

import torch
import triton
import triton.language as tl

from moe_lab.config import preset
from moe_lab.kernels.launch import SPEC_PRESETS, SPEC_TOKENS, CompileSpec, LaunchConfig, int_args, merge_specs

Tensor = torch.Tensor
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _tile_schedule(offsets_ptr, tile, E, M_ROWS, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """``(segment, first row, end row)`` of row tile number ``tile``.

    Segments ``0..E-1`` are the experts' rows ``offsets[s]:offsets[s+1]``, segment ``E``
    the padding ``offsets[E]:M_ROWS``; tiles are numbered segment after segment. A segment
    number above ``E`` means the tile has no work. Offsets are clamped into ``[0, M_ROWS]``
    so that bad ones cannot address memory outside the buffers.
    """
    s = tl.arange(0, BLOCK_E)  # BLOCK_E >= E + 1
    start = tl.load(offsets_ptr + s, mask=s <= E, other=M_ROWS)
    end = tl.load(offsets_ptr + s + 1, mask=s < E, other=M_ROWS)
    start = tl.minimum(tl.maximum(start, 0), M_ROWS)
    end = tl.minimum(tl.maximum(end, start), M_ROWS)
    n_tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(n_tiles, 0)  # tiles in segments 0..s
    seg = tl.sum((last <= tile).to(tl.int32), 0)
    here = s == seg
    first_tile = tl.sum(tl.where(here, last - n_tiles, 0), 0)
    row0 = tl.sum(tl.where(here, start, 0), 0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(here, end, 0), 0)
    return seg, row0, row_end


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
def _mma(acc, a, b, DOT_BF16: tl.constexpr):
    """``acc + a @ b``, accumulated in float32, for tiles ``a``, ``b`` as loaded.

    ``DOT_BF16`` (bfloat16 inputs, compiled): the bfloat16 tiles go to the tensor cores as
    they are. Otherwise the tiles are float32 values (float32 inputs, or bfloat16 ones under
    the interpreter, whose ``tl.dot`` cannot take bfloat16) multiplied at IEEE float32
    precision: each product of two bfloat16 values is exact in float32, so both paths give
    the same sums up to their order."""
    if DOT_BF16:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr,
    M_ROWS, N, K, E,
    s_xm, s_xk, s_we, s_wk, s_wn, s_ym, s_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, DOT_BF16: tl.constexpr,
):
    # x: [M, K]; w: [E, K, N] (any strides: dX passes Wᵀ as a view); y: [M, N];
    # offsets: [E + 1] int32, on device. Grid: (cdiv(M_ROWS, BLOCK_M) + E, cdiv(N, BLOCK_N)).
    seg, row0, row_end = _tile_schedule(offsets_ptr, tl.program_id(0), E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg > E:  # past the last tile: no work
        return
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < row_end
    y_ptrs = y_ptr + rows[:, None] * s_ym + cols[None, :] * s_yn
    y_mask = row_ok[:, None] & (cols[None, :] < N)
    if seg == E:  # padding rows
        tl.store(y_ptrs, cast_for_store(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), y_ptr),
                 mask=y_mask)
        return
    w_ptr += seg.to(tl.int64) * s_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        a = tl.load(x_ptr + rows[:, None] * s_xm + ks[None, :] * s_xk,
                    mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
        b = tl.load(w_ptr + ks[:, None] * s_wk + cols[None, :] * s_wn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = _mma(acc, a, b, DOT_BF16)
    tl.store(y_ptrs, cast_for_store(acc, y_ptr), mask=y_mask)


@triton.jit
def _grouped_gemm_swiglu_kernel(
    x_ptr, w_ptr, out_ptr, dh_ptr, offsets_ptr,
    M_ROWS, F, K, E,
    s_xm, s_xk, s_we, s_wk, s_wn, s_om, s_on, s_dm, s_dn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, DOT_BF16: tl.constexpr, BACKWARD: tl.constexpr,
):
    # x: [M, K]; w: [E, K, 2F], gate = w[..., :F], up = w[..., F:]; offsets: [E + 1] int32.
    # Forward: out = h = silu(x·Wg) ⊙ (x·Wu): [M, F] (dh unused).
    # Backward: dh: [M, F] in; out = d(pre-activation) = [dgate, dup]: [M, 2F].
    # Grid: (cdiv(M_ROWS, BLOCK_M) + E, cdiv(F, BLOCK_N)).
    seg, row0, row_end = _tile_schedule(offsets_ptr, tl.program_id(0), E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg > E:
        return
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < row_end
    mask = row_ok[:, None] & (cols[None, :] < F)
    out_ptrs = out_ptr + rows[:, None] * s_om + cols[None, :] * s_on
    up_out_ptrs = out_ptr + rows[:, None] * s_om + (cols + F)[None, :] * s_on  # backward: dup
    if seg == E:  # padding rows
        zero = cast_for_store(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), out_ptr)
        tl.store(out_ptrs, zero, mask=mask)
        if BACKWARD:
            tl.store(up_out_ptrs, zero, mask=mask)
        return
    w_ptr += seg.to(tl.int64) * s_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        a = tl.load(x_ptr + rows[:, None] * s_xm + ks[None, :] * s_xk,
                    mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
        w_mask = (ks[:, None] < K) & (cols[None, :] < F)
        bg = tl.load(w_ptr + ks[:, None] * s_wk + cols[None, :] * s_wn, mask=w_mask, other=0.0)
        bu = tl.load(w_ptr + ks[:, None] * s_wk + (cols + F)[None, :] * s_wn, mask=w_mask, other=0.0)
        gate = _mma(gate, a, bg, DOT_BF16)
        up = _mma(up, a, bu, DOT_BF16)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    if BACKWARD:
        dh = tl.load(dh_ptr + rows[:, None] * s_dm + cols[None, :] * s_dn,
                     mask=mask, other=0.0).to(tl.float32)
        dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(out_ptrs, cast_for_store(dgate, out_ptr), mask=mask)
        tl.store(up_out_ptrs, cast_for_store(dh * silu, out_ptr), mask=mask)
    else:
        tl.store(out_ptrs, cast_for_store(silu * up, out_ptr), mask=mask)


@triton.jit
def _grouped_gemm_dw_kernel(
    x_ptr, dy_ptr, dw_ptr, offsets_ptr,
    M_ROWS, N, K,
    s_xm, s_xk, s_ym, s_yn, s_we, s_wk, s_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    # x: [M, K]; dy: [M, N]; dw: [E, K, N], dw[e] = x[rows of e]ᵀ · dy[rows of e];
    # offsets: [E + 1] int32, on device. Grid: (E, cdiv(K, BLOCK_K), cdiv(N, BLOCK_N)).
    e = tl.program_id(0)
    start = tl.minimum(tl.maximum(tl.load(offsets_ptr + e), 0), M_ROWS)
    end = tl.minimum(tl.maximum(tl.load(offsets_ptr + e + 1), start), M_ROWS)
    ks = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    ns = (tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    for m0 in range(start, end, BLOCK_M):  # no rows: no iterations, dW[e] = 0
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < end
        a = tl.load(x_ptr + rows[:, None] * s_xm + ks[None, :] * s_xk,
                    mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
        g = tl.load(dy_ptr + rows[:, None] * s_ym + ns[None, :] * s_yn,
                    mask=row_ok[:, None] & (ns[None, :] < N), other=0.0)
        acc = _mma(acc, tl.trans(a), g, DOT_BF16)
    dw_ptrs = dw_ptr + e.to(tl.int64) * s_we + ks[:, None] * s_wk + ns[None, :] * s_wn
    tl.store(dw_ptrs, cast_for_store(acc, dw_ptr), mask=(ks[:, None] < K) & (ns[None, :] < N))


# --------------------------------------------------------------------------------------
# Launches (custom ops: FakeTensorMode and torch.compile see the shapes, not the kernel)
# --------------------------------------------------------------------------------------


@torch.compiler.assume_constant_result  # detected once; torch.compile need not trace it
def _interpreted() -> bool:
    from moe_lab.perf.capabilities import triton_interpreted

    return triton_interpreted()


# Which kernel a launch runs, as `launch_config` and `compile_specs` name it: "gemm" (the
# forward, and dX = the same kernel fed Wᵀ), "swiglu" (the fused forward and its backward),
# "dw" (the weight gradient).
KERNELS = ("gemm", "swiglu", "dw")


def _config(bm: int, bn: int, bk: int, warps: int, stages: int) -> LaunchConfig:
    return LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps,
                        num_stages=stages)


# The compiled tile space of each kernel: a few configs, every one compiled and reported by
# `compile_specs`; `choose_config` picks one per shape. For "gemm" and "swiglu" the output
# tile is BLOCK_M x BLOCK_N over BLOCK_K; for "dw" it is BLOCK_K x BLOCK_N over BLOCK_M rows.
# A warpgroup MMA (Hopper's ``wgmma``, Blackwell's ``tcgen05.mma``) takes 64 output rows per
# 4 warps, so every bf16 tile gives each 4 warps at least 64 rows; a 64-deep bf16 K step
# is one 128-byte line per row, the widest swizzle for the asynchronous copies. The report
# compiles every config in both dtypes; the bf16 tiles spill in float32 (on the CUDA
# cores), which is why the rule never picks them for float32.
TILE_SPACE: dict[str, tuple[LaunchConfig, ...]] = {
    "gemm": (
        _config(64, 64, 32, 4, 3),    # float32 (CUDA cores), or a narrow N
        _config(64, 128, 64, 4, 3),   # bf16, few rows per expert, wide N
        _config(128, 128, 64, 8, 3),  # bf16, many rows per expert, wide N
        _config(128, 64, 64, 4, 3),   # bf16, many rows per expert, narrow N
    ),
    "swiglu": (  # two accumulators (gate, up) per output tile
        _config(64, 64, 32, 4, 3),    # bf16, few rows per expert
        _config(128, 64, 64, 8, 3),   # bf16, many rows per expert
        _config(64, 64, 16, 8, 3),    # float32: 8 warps, a 16-deep K step (no spills)
    ),
    "dw": (
        _config(32, 64, 64, 4, 3),    # float32 (CUDA cores)
        _config(64, 128, 64, 4, 3),   # bf16, few rows per expert (a short reduction)
        _config(64, 128, 128, 8, 3),  # bf16, many rows per expert
    ),
}
# From this many routed rows per expert on, a 128-row tile is chosen: below it, an expert's
# last, partial tile would leave up to half of a 128-row tile idle.
MANY_ROWS = 512
# From this many output columns on, a 128-wide tile is chosen: each loaded x tile then
# feeds twice the columns.
WIDE_N = 1024


def choose_config(kernel: str, m: int, n: int, k: int, n_experts: int,
                  dtype: torch.dtype) -> LaunchConfig:
    """The compiled config of ``kernel`` at one shape, from `TILE_SPACE` by a fixed rule
    (a reasoned default, not a measurement; no GPU has timed the space yet).

    float32 runs on the CUDA cores (IEEE products, no tensor cores), where a larger tile
    only adds registers: the first "gemm" and "dw" configs, and for "swiglu" 64 x 64 x 16 on
    8 warps (its backward holds two float32 accumulators and their operand slices: with 4
    warps or a 32-deep K step it spills). bfloat16, with ``r = m //
    n_experts`` routed rows per expert: "gemm" takes 128 rows when ``r >= MANY_ROWS`` (a
    partial last tile per expert then wastes little) and 128 columns when ``n >= WIDE_N``
    (each x tile feeds more columns); "swiglu" takes 128 rows when ``r >= MANY_ROWS`` (its
    columns stay 64: it holds two accumulators); "dw", whose loop runs over the ``r`` rows,
    takes the 128-deep tile on 8 warps when ``r >= MANY_ROWS`` and otherwise the 64-deep
    one. ``k`` does not enter the rule: every config streams K in steps.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in KERNEL_DTYPES]}, got {dtype}")
    space = TILE_SPACE[kernel]
    many_rows = m // max(1, n_experts) >= MANY_ROWS
    if kernel == "gemm":
        if dtype == torch.float32:
            return space[0]
        if n >= WIDE_N:
            return space[2 if many_rows else 1]
        return space[3 if many_rows else 0]
    if kernel == "swiglu":
        return space[2] if dtype == torch.float32 else space[1 if many_rows else 0]
    if dtype == torch.float32:
        return space[0]
    return space[2 if many_rows else 1]


def launch_config(kernel: str, m: int, n: int, k: int, n_experts: int, *,
                  interpreted: bool, dtype: torch.dtype = torch.bfloat16) -> LaunchConfig:
    """Tiles, warps and stages of one launch: ``kernel`` (one of `KERNELS`) over ``m``
    routed rows, ``n`` output columns (``F`` for "swiglu"), reduction depth ``k``, in
    ``dtype``.

    The wrappers call this at launch time and `compile_specs` at the DeepSeek-V3 and
    GPT-OSS-20B shapes. Under the interpreter each program costs a Python round trip, so
    tiles are as large as the problem allows (rows per expert for ``BLOCK_M``). Compiled,
    `choose_config` picks from `TILE_SPACE` by the shape and dtype.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if interpreted:
        blocks = {
            "BLOCK_M": min(128, max(16, triton.next_power_of_2(max(1, m // max(1, n_experts))))),
            "BLOCK_N": min(128, max(16, triton.next_power_of_2(n))),
            "BLOCK_K": min(128, max(16, triton.next_power_of_2(k))),
        }
        return LaunchConfig(blocks, num_warps=4, num_stages=1)
    return choose_config(kernel, m, n, k, n_experts, dtype)


def describe(cfg: LaunchConfig) -> str:
    """A config as the report's labels show it: ``"64x128x64 (M x N x K blocks), 4 warps,
    3 stages"``."""
    b = cfg.blocks
    return (f"{b['BLOCK_M']}x{b['BLOCK_N']}x{b['BLOCK_K']} (M x N x K blocks), "
            f"{cfg.num_warps} warps, {cfg.num_stages} stages")


def _block_e(n_experts: int) -> int:
    """``BLOCK_E`` of the tile schedule: a power of two holding the ``E + 1`` segments."""
    return triton.next_power_of_2(n_experts + 1)


def _dot_bf16(dtype: torch.dtype, interpreted: bool) -> bool:
    """Whether bfloat16 tiles go to ``tl.dot`` as bfloat16 (``DOT_BF16``): compiled, yes;
    the interpreter's ``tl.dot`` multiplies bfloat16 bit patterns as integers, so it gets
    float32 tiles of the same values."""
    return dtype == torch.bfloat16 and not interpreted


# The shapes `compile_specs` describes: each preset's experts at a realistic load per GPU.
SPEC_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # Triton's name: torch's dtype


def _spec(kernel: str, label: str, dtype: str, pointers: tuple[str, ...], cfg: LaunchConfig,
          ints: dict[str, int], **constexprs) -> CompileSpec:
    """A `CompileSpec` of ``kernel`` in this module: ``pointers`` to ``dtype`` tensors (and
    ``offsets_ptr`` to int32), ``ints`` typed as a launch types them, ``cfg``'s blocks and
    ``DOT_BF16`` as the wrapper picks it, besides ``constexprs``."""
    signature, constants = int_args(**ints)
    return CompileSpec(
        f"{__name__}:{kernel}", label,
        {**{p: f"*{dtype}" for p in pointers}, "offsets_ptr": "*i32", **signature},
        {**constants, **cfg.blocks, "DOT_BF16": _dot_bf16(SPEC_DTYPES[dtype], interpreted=False),
         **constexprs},
        cfg,
        FP32_NOTE if dtype == "fp32" else "",
    )


# Why the float32 rows show no tensor cores: by design, not by accident.
FP32_NOTE = ("float32 is the exact path: its products are IEEE float32 on the CUDA cores "
             "(`input_precision=\"ieee\"`; a TF32 tensor-core dot would round the inputs to 11 "
             "significant bits); training on a GPU runs the experts in bfloat16.")


def _space_specs(kernel: str, fn: str, what: str, dtype: str, pointers: tuple[str, ...],
                 shape: tuple[int, int, int, int], ints: dict[str, int],
                 **constexprs) -> tuple[CompileSpec, list[CompileSpec]]:
    """The spec of the config `launch_config` chooses at ``shape = (m, n, k, n_experts)``,
    labelled "[chosen …]", and one per other config of ``kernel``'s `TILE_SPACE`,
    labelled "[candidate …]"."""
    chosen = launch_config(kernel, *shape, interpreted=False, dtype=SPEC_DTYPES[dtype])
    # The space is the tensor-core path's (bfloat16); float32 runs on the CUDA cores with the
    # one config the rule gives it, so only that one is compiled (bf16-sized tiles would
    # only show float32 spilling where no launch puts it).
    space = TILE_SPACE[kernel] if dtype == "bf16" else (chosen,)
    specs = [_spec(fn, f"[{'chosen' if cfg == chosen else 'candidate'} {describe(cfg)}] {what}",
                   dtype, pointers, cfg, ints, **constexprs)
             for cfg in space]
    first = space.index(chosen)
    return specs[first], specs[:first] + specs[first + 1:]


def compile_specs() -> list[CompileSpec]:
    """What a CUDA launch compiles for one MoE layer's experts (SwiGLU up/gate, down
    projection) at DeepSeek-V3's and GPT-OSS-20B's shapes, forward and backward, in
    bfloat16 (the training dtype) and float32, with contiguous tensors as the layer passes
    them: first the config `launch_config` chooses at each shape ("[chosen …]" in the
    label), then, in bfloat16, every other config of the kernel's `TILE_SPACE`
    ("[candidate …]"), so the report compiles the whole space. dX = dY·Wᵀ runs the forward
    kernel on a transposed view of ``W``: its unit stride sits on the other axis, so Triton
    compiles it separately, and so does this list."""
    chosen, candidates = [], []

    def add(pair: tuple[CompileSpec, list[CompileSpec]]) -> None:
        chosen.append(pair[0])
        candidates.extend(pair[1])

    for name, model in SPEC_PRESETS.items():
        moe = preset(name).moe
        n_experts, d, f = moe.n_experts, moe.d_model, moe.d_expert
        m = SPEC_TOKENS * moe.top_k
        shape = (f"{model}: E={n_experts}, d_model={d}, d_expert={f}, "
                 f"{SPEC_TOKENS} tokens x top-{moe.top_k} = {m} rows")
        block_e = _block_e(n_experts)
        for dtype in SPEC_DTYPES:
            at = f"{dtype}, {shape}"
            # y = x @ w[e] with x: [M, K], w: [E, K, N], y: [M, N] and their strides.
            gemms = [
                ("grouped GEMM forward (down projection)", d, f, (f, 1), (f * d, d, 1), (d, 1)),
                ("grouped GEMM dX = dY·Wᵀ (the forward kernel on a transposed W; down projection)",
                 f, d, (d, 1), (f * d, 1, d), (f, 1)),
                ("grouped GEMM dX = dY·Wᵀ (the forward kernel on a transposed W; up/gate projection)",
                 d, 2 * f, (2 * f, 1), (2 * f * d, 1, 2 * f), (d, 1)),
            ]
            for what, n, k, x, w, y in gemms:
                add(_space_specs(
                    "gemm", "_grouped_gemm_kernel", f"{what}, {at}", dtype, ("x_ptr", "w_ptr", "y_ptr"),
                    (m, n, k, n_experts),
                    dict(M_ROWS=m, N=n, K=k, E=n_experts, s_xm=x[0], s_xk=x[1],
                         s_we=w[0], s_wk=w[1], s_wn=w[2], s_ym=y[0], s_yn=y[1]),
                    BLOCK_E=block_e))
            for backward in (False, True):
                out_cols = 2 * f if backward else f
                what = ("backward: recomputed pre-activation, dgate/dup epilogue" if backward
                        else "forward")
                add(_space_specs(
                    "swiglu", "_grouped_gemm_swiglu_kernel",
                    f"grouped GEMM + SwiGLU {what} (up/gate projection), {at}",
                    dtype, ("x_ptr", "w_ptr", "out_ptr", "dh_ptr"), (m, f, d, n_experts),
                    dict(M_ROWS=m, F=f, K=d, E=n_experts, s_xm=d, s_xk=1, s_we=2 * f * d, s_wk=2 * f,
                         s_wn=1, s_om=out_cols, s_on=1, s_dm=f, s_dn=1),
                    BLOCK_E=block_e, BACKWARD=backward))
            # dW[e] = X_eᵀ·dY_e: down projection (x = h: [M, F], dy: [M, d]), up/gate (x, dpre)
            for what, k, n in (("down projection", f, d), ("up/gate projection", d, 2 * f)):
                add(_space_specs(
                    "dw", "_grouped_gemm_dw_kernel",
                    f"grouped GEMM dW = Xᵀ·dY per expert ({what}), {at}",
                    dtype, ("x_ptr", "dy_ptr", "dw_ptr"), (m, n, k, n_experts),
                    dict(M_ROWS=m, N=n, K=k, s_xm=k, s_xk=1, s_ym=n, s_yn=1, s_we=k * n, s_wk=n, s_wn=1)))
    return merge_specs(chosen + candidates)


def _new_output(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """Every kernel output starts uninitialised: the kernels write each element. (Tests
    replace this with a NaN fill to prove it.)"""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


@torch.library.custom_op("moe_lab::grouped_gemm", mutates_args=())
def _grouped_gemm_op(x: Tensor, w: Tensor, offsets: Tensor, m_bound: int) -> Tensor:
    m, k = x.shape
    n_experts, _, n = w.shape
    y = _new_output((m, n), x)
    y[m_bound:].zero_()  # rows past the static bound: a plain memset, sized on the host
    if m_bound and n:
        interpreted = _interpreted()
        cfg = launch_config("gemm", m_bound, n, k, n_experts, interpreted=interpreted,
                            dtype=x.dtype)
        grid = (triton.cdiv(m_bound, cfg.blocks["BLOCK_M"]) + n_experts,
                triton.cdiv(n, cfg.blocks["BLOCK_N"]))
        _grouped_gemm_kernel[grid](
            x, w, y, offsets, m_bound, n, k, n_experts,
            *x.stride(), *w.stride(), *y.stride(),
            **cfg.blocks, BLOCK_E=_block_e(n_experts), DOT_BF16=_dot_bf16(x.dtype, interpreted),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return y


@_grouped_gemm_op.register_fake
def _(x: Tensor, w: Tensor, offsets: Tensor, m_bound: int) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("moe_lab::grouped_gemm_dw", mutates_args=())
def _grouped_gemm_dw_op(x: Tensor, dy: Tensor, offsets: Tensor, m_bound: int) -> Tensor:
    k, n, n_experts = x.shape[1], dy.shape[1], offsets.shape[0] - 1
    dw = _new_output((n_experts, k, n), x)
    if k and n:
        interpreted = _interpreted()
        cfg = launch_config("dw", m_bound, n, k, n_experts, interpreted=interpreted,
                            dtype=x.dtype)
        grid = (n_experts, triton.cdiv(k, cfg.blocks["BLOCK_K"]), triton.cdiv(n, cfg.blocks["BLOCK_N"]))
        _grouped_gemm_dw_kernel[grid](
            x, dy, dw, offsets, m_bound, n, k,
            *x.stride(), *dy.stride(), *dw.stride(),
            **cfg.blocks, DOT_BF16=_dot_bf16(x.dtype, interpreted),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return dw


@_grouped_gemm_dw_op.register_fake
def _(x: Tensor, dy: Tensor, offsets: Tensor, m_bound: int) -> Tensor:
    return x.new_empty((offsets.shape[0] - 1, x.shape[1], dy.shape[1]))


def _launch_swiglu(x: Tensor, w: Tensor, offsets: Tensor, m_bound: int, out: Tensor,
                   dh: Tensor | None) -> Tensor:
    m, k = x.shape
    n_experts, f = w.shape[0], w.shape[2] // 2
    out[m_bound:].zero_()
    if m_bound and f:
        interpreted = _interpreted()
        cfg = launch_config("swiglu", m_bound, f, k, n_experts, interpreted=interpreted,
                            dtype=x.dtype)
        grid = (triton.cdiv(m_bound, cfg.blocks["BLOCK_M"]) + n_experts,
                triton.cdiv(f, cfg.blocks["BLOCK_N"]))
        dh_arg = out if dh is None else dh  # unused by the forward
        _grouped_gemm_swiglu_kernel[grid](
            x, w, out, dh_arg, offsets, m_bound, f, k, n_experts,
            *x.stride(), *w.stride(), *out.stride(), *dh_arg.stride(),
            **cfg.blocks, BLOCK_E=_block_e(n_experts), DOT_BF16=_dot_bf16(x.dtype, interpreted),
            BACKWARD=dh is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out


@torch.library.custom_op("moe_lab::grouped_gemm_swiglu", mutates_args=())
def _grouped_gemm_swiglu_op(x: Tensor, w: Tensor, offsets: Tensor, m_bound: int) -> Tensor:
    return _launch_swiglu(x, w, offsets, m_bound, _new_output((x.shape[0], w.shape[2] // 2), x),
                          None)


@_grouped_gemm_swiglu_op.register_fake
def _(x: Tensor, w: Tensor, offsets: Tensor, m_bound: int) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[2] // 2))


@torch.library.custom_op("moe_lab::grouped_gemm_swiglu_bwd", mutates_args=())
def _grouped_gemm_swiglu_bwd_op(x: Tensor, w: Tensor, offsets: Tensor, dh: Tensor,
                                m_bound: int) -> Tensor:
    return _launch_swiglu(x, w, offsets, m_bound, _new_output((x.shape[0], w.shape[2]), x), dh)


@_grouped_gemm_swiglu_bwd_op.register_fake
def _(x: Tensor, w: Tensor, offsets: Tensor, dh: Tensor, m_bound: int) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[2]))


# --------------------------------------------------------------------------------------
# Autograd and the public wrappers
# --------------------------------------------------------------------------------------


class GroupedGEMM(torch.autograd.Function):
    """``y = grouped_gemm(x, w, offsets)``; backward ``dX = dY·W[e]ᵀ``, ``dW[e] = X_eᵀ·dY_e``."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offsets: Tensor, m_bound: int) -> Tensor:
        ctx.save_for_backward(x, w, offsets)
        ctx.m_bound = m_bound
        return _grouped_gemm_op(x, w, offsets, m_bound)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, offsets = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_gemm_op(dy, w.transpose(1, 2), offsets, ctx.m_bound)
        if ctx.needs_input_grad[1]:
            dw = _grouped_gemm_dw_op(x, dy, offsets, ctx.m_bound)
        return dx, dw, None, None


class GroupedGEMMSwiGLU(torch.autograd.Function):
    """``h = silu(x·Wg) ⊙ (x·Wu)`` per expert; backward recomputes ``x·W`` (not saved)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offsets: Tensor, m_bound: int) -> Tensor:
        ctx.save_for_backward(x, w, offsets)
        ctx.m_bound = m_bound
        return _grouped_gemm_swiglu_op(x, w, offsets, m_bound)

    @staticmethod
    def backward(ctx, dh: Tensor):
        x, w, offsets = ctx.saved_tensors
        dpre = _grouped_gemm_swiglu_bwd_op(x, w, offsets, dh, ctx.m_bound)  # [M, 2F]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_gemm_op(dpre, w.transpose(1, 2), offsets, ctx.m_bound)
        if ctx.needs_input_grad[1]:
            dw = _grouped_gemm_dw_op(x, dpre, offsets, ctx.m_bound)
        return dx, dw, None, None


def _check(x: Tensor, w: Tensor, offsets: Tensor, m_bound: int | None, w_name: str) -> int:
    """Validate the arguments of a grouped GEMM; returns ``m_bound`` filled in."""
    for name, t in (("x", x), (w_name, w), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if w.dim() != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(
            f"{w_name} must be [E, K={x.shape[1]}, N] (K = x.shape[1]), got shape {tuple(w.shape)}"
        )
    if w.shape[0] < 1:
        raise ValueError(f"{w_name} must hold at least one expert, got shape {tuple(w.shape)}")
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"x.dtype must be one of {[str(d) for d in KERNEL_DTYPES]}, got {x.dtype}")
    if w.dtype != x.dtype:
        raise ValueError(f"{w_name}.dtype must equal x.dtype = {x.dtype}, got {w.dtype}")
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (w.shape[0] + 1,):
        raise ValueError(
            f"offsets must be [E + 1 = {w.shape[0] + 1}] int32, "
            f"got shape {tuple(offsets.shape)} {offsets.dtype}"
        )
    for name, t in ((w_name, w), ("offsets", offsets)):
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if x.device.type != "cuda" and not _interpreted():
        raise ValueError(
            f"x must be on a CUDA device for compiled Triton, got {x.device} "
            "(set TRITON_INTERPRET=1 before importing triton to run on the CPU)"
        )
    if m_bound is None:
        return x.shape[0]
    if not isinstance(m_bound, int) or not 0 <= m_bound <= x.shape[0]:
        raise ValueError(f"m_bound must be an int in [0, M = {x.shape[0]}], got {m_bound!r}")
    return m_bound


def grouped_gemm(x: Tensor, w: Tensor, offsets: Tensor, *, m_bound: int | None = None) -> Tensor:
    """Rows ``offsets[e]:offsets[e+1]`` of ``x`` times ``w[e]``, for every expert ``e``.

    Args:
        x: ``[M, K]`` float32 or bfloat16, any strides.
        w: ``[E, K, N]``, ``x``'s dtype, any strides.
        offsets: ``[E + 1]`` int32 on ``x``'s device: nondecreasing, ``offsets[0] = 0``,
            ``offsets[E] <= m_bound`` (as `moe_lab.kernels.permute.make_row_id_map` makes
            them). Never read on the host; values outside ``[0, m_bound]`` are clamped.
        m_bound: a static upper bound on ``offsets[E]`` (default ``M``): the grid is sized
            from it, and rows ``m_bound:`` are zeroed without a kernel.

    Returns:
        ``y: [M, N]`` in ``x``'s dtype (accumulated in float32); rows from ``offsets[E]``
        on are zeros. Differentiable in ``x`` and ``w``.
    """
    m_bound = _check(x, w, offsets, m_bound, "w")
    return GroupedGEMM.apply(x, w, offsets.contiguous(), m_bound)


def grouped_gemm_swiglu(x: Tensor, w_gate_up: Tensor, offsets: Tensor, *,
                        m_bound: int | None = None) -> Tensor:
    """``silu(x·Wg) ⊙ (x·Wu)`` per expert, the activation fused into the GEMM's epilogue.

    ``w_gate_up: [E, K, 2F]`` with gate ``[..., :F]`` and up ``[..., F:]`` (the layout of
    `moe_lab.moe.experts.SwiGLUExperts`); the other arguments as in `grouped_gemm`.
    Returns ``h: [M, F]``, zero rows from ``offsets[E]`` on. Differentiable in ``x`` and
    ``w_gate_up``; the backward recomputes the pre-activation instead of saving it.
    """
    m_bound = _check(x, w_gate_up, offsets, m_bound, "w_gate_up")
    if w_gate_up.shape[2] % 2:
        raise ValueError(
            f"w_gate_up must be [E, K, 2F] (an even last dim), got shape {tuple(w_gate_up.shape)}"
        )
    return GroupedGEMMSwiGLU.apply(x, w_gate_up, offsets.contiguous(), m_bound)


def grouped_gemm_reference(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """The textbook loop: ``y[offsets[e]:offsets[e+1]] = x[...] @ w[e]``, zeros elsewhere.

    Reads ``offsets`` on the host (one sync): it is the reference, not a fast path.
    Differentiable through autograd.
    """
    bounds = offsets.tolist()
    pieces = [x[bounds[e]:bounds[e + 1]] @ w[e] for e in range(w.shape[0])]
    pieces.append(x.new_zeros((x.shape[0] - bounds[-1], w.shape[2])))  # padding rows
    return torch.cat(pieces)
