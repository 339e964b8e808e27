"""A persistent grouped GEMM fed by TMA: one program per SM walks a tile list built on the device.

`moe_lab.kernels.grouped_gemm` launches one program per output tile, and each program copies
its operands into shared memory with per-thread ``cp.async``. Hopper and Blackwell have a copy
engine, the *Tensor Memory Accelerator* (TMA): one thread hands it a *tensor descriptor*
(base, shape, strides, box) and a tile's coordinates, and the whole tile lands in shared
memory, signalled on an mbarrier; out-of-bounds elements read as zeros and are not written on
a store. This kernel uses it three ways (https://triton-lang.org/main/getting-started/tutorials/09-persistent-matmul.html):

- **Descriptors per expert, built on the device** (``tl.make_tensor_descriptor``) from the
  offsets: ``x`` and ``y`` as ``[offsets[e+1], K]`` and ``[offsets[e+1], N]`` tensors (so the
  rows past the expert's last one are outside the descriptor), ``w[e]`` as ``[K, N]``. The tail
  of an expert's segment is handled by the descriptor's bounds: a partial row tile loads zeros
  past the expert's rows and its TMA store clips them, so no tile writes another expert's rows
  and no mask is needed. (TMA wants 16-byte aligned rows: ``K`` and ``N`` multiples of 8 in
  bfloat16, of 4 in float32; the wrapper says so otherwise.)
- **A persistent grid**: ``P`` programs (`default_programs`: the SM count on CUDA, a few
  interpreted), each taking tiles ``pid, pid + P, ...`` of one list over (segment, row tile,
  N tile). Every program computes the list from ``offsets`` itself: no host sync, and the grid
  is static (a CUDA graph can capture it). Segment ``E`` is the padding rows
  ``offsets[E]:M``: its tiles load their ``x`` boxes from past column ``K`` (wholly out of
  bounds: zeros), so they multiply zeros and store zeros. Every tile runs the same K loop:
  Triton 3.7.1 fails to warp-specialise a loop whose trip count changes from tile to tile.
- **Pipelined TMA loads** (``num_stages`` >= 3 compiled: the loads of the next K steps are in
  flight while this one multiplies), and on sm_100 a warp-specialised tile loop
  (``tl.range(..., warp_specialize=True)``: loads and MMAs in partitions of warps of their own).

The order of the list is what makes L2 work, and it is the one every grouped kernel uses
(`moe_lab.kernels.common.grouped_tile`, the tile-by-number form of `tile_order`): the programs
in flight at once hold consecutive tiles, and ``GROUP_M`` row tiles share each N tile, so a
weight tile fetched from HBM serves ``GROUP_M`` row tiles and those rows' ``x`` tiles stay in
L2 while the group sweeps N; a group may straddle two experts (Triton's grouped ordering,
https://triton-lang.org/main/getting-started/tutorials/03-matrix-multiplication.html).
``GROUP_M`` is chosen per launch by `moe_lab.kernels.grouped_gemm.tile_group` (about one average
expert's row tiles), as for the other grouped kernels.

The backward: ``dX = dY·W[e]ᵀ`` is this kernel on ``W`` transposed (``TRANS_W``: the descriptor
is over ``W`` as stored, each tile transposed in shared memory); ``dW[e] = X_eᵀ·dY_e`` is the
existing grouped dW kernel (``moe_lab::grouped_gemm_dw``), not a TMA one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from torch._subclasses import FakeTensor

from moe_lab.checks import first_derivative_only
from moe_lab.kernels import common
from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels.common import INTERPRETED, check_device, kernel_op
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.perf.hardware import gpu_arch

Tensor = torch.Tensor

# Programs of an interpreted launch: more than one, so that the strided walk is exercised.
INTERPRETED_PROGRAMS = 3


@triton.jit
def _tma_grouped_gemm_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr,
    M_ROWS, N, K, E, s_xm, s_we, s_wr, s_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, TRANS_W: tl.constexpr, DOT_BF16: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    # x: [M, K] rows of stride s_xm; w: [E, K, N], expert stride s_we, stored [K, N] with row
    # stride s_wr, or (TRANS_W) stored [N, K]; y: [M, N] rows of stride s_ym; offsets: [E + 1]
    # int32 on the device. Grid: (number of programs,); each walks the tile list.
    # Segments 0..E-1 the experts, E the padding rows: built once, read for every tile.
    s, start, end, seg_tiles, last = common.segment_table(offsets_ptr, E, M_ROWS, BLOCK_M, BLOCK_E)
    n_row_tiles = tl.sum(seg_tiles, 0)
    n_col_tiles = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for t in tl.range(tl.program_id(0), n_row_tiles * n_col_tiles, tl.num_programs(0),
                      warp_specialize=WARP_SPECIALIZE):
        r, c = common.grouped_tile(t, n_row_tiles, n_col_tiles, GROUP_M)
        seg, row0, row_end = common.segment_of(r, s, start, end, seg_tiles, last, BLOCK_M)
        col0 = c * BLOCK_N
        expert = tl.minimum(seg, E - 1).to(tl.int64)
        k_skip = tl.where(seg < E, 0, k_steps * BLOCK_K)  # the padding segment reads zeros
        x_desc = tl.make_tensor_descriptor(x_ptr, [row_end, K], [s_xm, 1], [BLOCK_M, BLOCK_K])
        y_desc = tl.make_tensor_descriptor(y_ptr, [row_end, N], [s_ym, 1], [BLOCK_M, BLOCK_N])
        if TRANS_W:
            w_desc = tl.make_tensor_descriptor(w_ptr + expert * s_we, [N, K], [s_wr, 1], [BLOCK_N, BLOCK_K])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr + expert * s_we, [K, N], [s_wr, 1], [BLOCK_K, BLOCK_N])
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for kk in range(0, k_steps):
            a = x_desc.load([row0, k_skip + kk * BLOCK_K])
            if TRANS_W:
                b = tl.trans(w_desc.load([col0, kk * BLOCK_K]))
            else:
                b = w_desc.load([kk * BLOCK_K, col0])
            acc = common.mma(acc, a, b, DOT_BF16)
        y_desc.store([row0, col0], common.cast_for_store(acc, y_ptr))


# --------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------


def launch_config(m: int, n: int, k: int, n_experts: int, *, interpreted: bool,
                  dtype: torch.dtype = torch.bfloat16) -> LaunchConfig:
    """Tiles, warps and stages of one launch. Compiled bfloat16: 128 x 128 x 64 on 8 warps
    with 4 stages (the persistent tutorial's tile: four stages of both operands' tiles and the
    output tile fit an H100's shared memory); float32 (the CUDA cores): 64 x 64 x 32 on 4 warps,
    3 stages. Interpreted: `moe_lab.kernels.grouped_gemm.launch_config`'s (large tiles)."""
    if interpreted:
        return gg.launch_config("gemm", m, n, k, n_experts, interpreted=True)
    if dtype == torch.float32:
        return LaunchConfig({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3)
    return LaunchConfig({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4)


def warp_specialized(device: torch.device) -> bool:
    """Whether the tile loop is warp-specialised: where `moe_lab.perf.hardware.ARCHS` says so
    (Blackwell, sm_100)."""
    return device.type == "cuda" and gpu_arch(torch.cuda.get_device_capability(device)).warp_specialize


def default_programs(device: torch.device) -> int:
    """The persistent grid: one program per SM on CUDA, `INTERPRETED_PROGRAMS` elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETED_PROGRAMS


@contextlib.contextmanager
def _descriptor_scratch(device: torch.device) -> Iterator[None]:
    """Device-side descriptors live in a global scratch buffer Triton asks an allocator for
    (``triton.set_allocator``); for one launch, torch allocates it on ``device`` (the allocator
    in place before is put back after; the interpreter never asks)."""
    from triton.runtime import _allocation

    token = _allocation._allocator.set(
        lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def _tma_ready(t: Tensor, swap: bool = False) -> tuple[Tensor, bool]:
    """``(t, False)`` if TMA can read ``t`` (unit last stride, 16-byte aligned base and strides), with
    ``swap`` ``(t's last two axes swapped, True)`` if it can read that, else ``(a fresh copy, False)``."""
    size = t.element_size()
    for swapped, view in ((False, t), (True, t.transpose(-1, -2)))[:1 + swap]:
        if (view.stride(-1) == 1 and view.data_ptr() % 16 == 0
                and all(st * size % 16 == 0 for st in view.stride()[:-1])):
            return view, swapped
    return t.clone(memory_format=torch.contiguous_format), False  # fresh, so aligned


@kernel_op("grouped_gemm_tma")
def _grouped_gemm_tma_op(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    m, k = x.shape
    n_experts, _, n = w.shape
    # No reduction (and a TMA tensor has no empty dimension): zeros.
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if k else x.new_zeros((m, n))
    if k and m and n and not isinstance(x, FakeTensor):
        x, (stored, trans) = _tma_ready(x)[0], _tma_ready(w, swap=True)  # trans: stored [E, N, K]
        cfg = launch_config(m, n, k, n_experts, interpreted=INTERPRETED, dtype=x.dtype)
        b = cfg.blocks  # at most cdiv(m, BLOCK_M) + E row tiles: a static bound on the list
        tiles = (triton.cdiv(m, b["BLOCK_M"]) + n_experts) * triton.cdiv(n, b["BLOCK_N"])
        grid = (min(default_programs(x.device), tiles),)
        with _descriptor_scratch(x.device):
            _tma_grouped_gemm_kernel[grid](
                x, stored, y, offsets, m, n, k, n_experts,
                x.stride(0), stored.stride(0), stored.stride(1), y.stride(0),
                **b, BLOCK_E=gg.block_e(n_experts), GROUP_M=gg.tile_group(m, n_experts, b["BLOCK_M"]),
                TRANS_W=trans, DOT_BF16=gg.dot_bf16(x.dtype, INTERPRETED),
                WARP_SPECIALIZE=warp_specialized(x.device),  # the interpreter ignores it
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
    return y


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs)  # x, w, offsets


@first_derivative_only("the TMA grouped GEMM")
def _backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple[Tensor | None, ...]:
    """``dX`` by this kernel on ``Wᵀ``, ``dW`` by the grouped dW kernel of
    `moe_lab.kernels.grouped_gemm`."""
    x, w, offsets = ctx.saved_tensors
    dx = _grouped_gemm_tma_op(dy, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
    dw = torch.ops.moe_lab.grouped_gemm_dw(x, dy, offsets) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_gemm_tma_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_gemm_tma(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """`moe_lab.kernels.grouped_gemm.grouped_gemm` (same arguments, same result, rows from
    ``offsets[E]`` on zeros, differentiable in ``x`` and ``w``) by the persistent TMA kernel.

    ``x: [M, K]``, ``w: [E, K, N]`` in float32 or bfloat16 with ``K`` and ``N`` whole 16-byte
    rows (multiples of 8 in bfloat16, 4 in float32: TMA's alignment); any strides (a copy is
    made where TMA cannot read them). The persistent grid: `default_programs`, capped at the
    tile count.
    """
    gg.check_operands(x, w, offsets, "w")
    unit = 16 // x.element_size()
    if x.shape[1] % unit or w.shape[2] % unit:
        raise ValueError(f"the TMA grouped GEMM needs 16-byte rows: K = x.shape[1] and N = w.shape[2] "
                         f"must be multiples of {unit} in {x.dtype}, got K={x.shape[1]}, N={w.shape[2]}")
    check_device("x", x.device, "tma", "the persistent TMA grouped GEMM (expert_backend='triton_tma')")
    return _grouped_gemm_tma_op(x, w, offsets.contiguous())

