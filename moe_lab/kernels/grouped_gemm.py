"""Triton grouped GEMM over per-expert row offsets held on the device: forward, backward, SwiGLU.

Once the tokens are permuted so that each expert's rows are contiguous, the experts' work
is one *grouped GEMM*: ``x: [M, K]`` is cut into segments, ``offsets[e]:offsets[e+1]``, and
each segment is multiplied by its own ``w[e]: [K, N]``. The segment lengths are the router's
decision, so they live on the device. A loop over experts reads them on the host (a sync per
step); this kernel does not. The key trick is the tile schedule
(`moe_lab.kernels.common.tile_schedule`, shared with the fused kernels): the grid is sized
from static shapes only — at most
``cdiv(M, BLOCK_M) + E`` row tiles, since ``E`` segments add at most one partial tile each —
and every program reads ``offsets`` from device memory to find its expert and rows (or exits:
no work). Rows after ``offsets[E]`` are written as zeros. So the step can be captured in a
CUDA graph, and no tile spans two experts.

The backward is two more grouped GEMMs: ``dX = dY·W[e]ᵀ`` is the forward kernel fed ``W`` as
a transposed view; ``dW[e] = X_eᵀ·dY_e`` runs one program per ``(expert, K tile, N tile)``
over the expert's rows. ``grouped_gemm_swiglu`` fuses SwiGLU into the first expert GEMM
(gate ``w[..., :F]``, up ``w[..., F:]``), so the ``[M, 2F]`` pre-activation is never
written; its backward recomputes it in the same kernel rather than saving it.

Products accumulate in float32 (`moe_lab.kernels.common.mma`: bfloat16 tiles to the tensor
cores compiled, exact float32 products interpreted); every index that multiplies a stride is
int64 (one DeepSeek-V3 layer's expert weights hold 3.8·10⁹ elements). Each launch is a
``torch.library`` custom op (`moe_lab.kernels.common.kernel_op`), so ``FakeTensorMode`` and
``torch.compile`` trace through it.
"""

from dataclasses import replace

import torch
import triton
import triton.language as tl
from torch._subclasses import FakeTensor
from torch.autograd.function import FunctionCtx

from moe_lab.checks import first_derivative_only, one_of
from moe_lab.kernels import common
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.perf.hardware import GPUArch, gpu_arch

Tensor = torch.Tensor
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr,
    M_ROWS, N, K, E,
    s_xm, s_xk, s_we, s_wk, s_wn, s_ym, s_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, DOT_BF16: tl.constexpr,
):
    # x: [M, K]; w: [E, K, N] (any strides: dX passes Wᵀ as a view); y: [M, N];
    # offsets: [E + 1] int32, on device. Grid: 1-D, `grouped_grid` over N.
    # 1. Which output tile: this program's (row tile, N tile) in the grouped order, then the
    #    expert (segment) whose rows the row tile covers, read from the device offsets.
    tile_m, tile_n = common.tile_order(N, BLOCK_N, GROUP_M)
    seg, row0, row_end = common.tile_schedule(offsets_ptr, tile_m, E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg > E:  # past the last tile: no work
        return
    # 2. Its rows and columns, as int64 indices (every index that multiplies a stride is).
    rows, cols, row_ok = common.tile_rows(row0, row_end, tile_n, BLOCK_M, BLOCK_N)
    y_ptrs = y_ptr + rows[:, None] * s_ym + cols[None, :] * s_yn
    y_mask = row_ok[:, None] & (cols[None, :] < N)
    if seg == E:  # padding rows
        tl.store(y_ptrs, common.cast_for_store(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), y_ptr),
                 mask=y_mask)
        return
    # 3. The K loop of Triton's matmul tutorial (`gemm_k_loop`) against this expert's w[seg].
    acc = common.gemm_k_loop(x_ptr, rows, row_ok, w_ptr + seg.to(tl.int64) * s_we, cols, N, K,
                             s_xm, s_xk, s_wk, s_wn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_BF16)
    # 4. Rounded once to y's dtype, stored.
    tl.store(y_ptrs, common.cast_for_store(acc, y_ptr), mask=y_mask)


@triton.jit
def _grouped_gemm_swiglu_kernel(
    x_ptr, w_ptr, out_ptr, dh_ptr, offsets_ptr,
    M_ROWS, F, K, E,
    s_xm, s_xk, s_we, s_wk, s_wn, s_om, s_on, s_dm, s_dn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, DOT_BF16: tl.constexpr, BACKWARD: tl.constexpr,
):
    # x: [M, K]; w: [E, K, 2F], gate = w[..., :F], up = w[..., F:]; offsets: [E + 1] int32.
    # Forward: out = h = silu(x·Wg) ⊙ (x·Wu): [M, F] (dh unused).
    # Backward: dh: [M, F] in; out = d(pre-activation) = [dgate, dup]: [M, 2F].
    # Grid: 1-D, `grouped_grid` over F.
    tile_m, tile_n = common.tile_order(F, BLOCK_N, GROUP_M)
    seg, row0, row_end = common.tile_schedule(offsets_ptr, tile_m, E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg > E:
        return
    rows, cols, row_ok = common.tile_rows(row0, row_end, tile_n, BLOCK_M, BLOCK_N)
    mask = row_ok[:, None] & (cols[None, :] < F)
    out_ptrs = out_ptr + rows[:, None] * s_om + cols[None, :] * s_on
    up_out_ptrs = out_ptr + rows[:, None] * s_om + (cols + F)[None, :] * s_on  # backward: dup
    if seg == E:  # padding rows
        zero = common.cast_for_store(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), out_ptr)
        tl.store(out_ptrs, zero, mask=mask)
        if BACKWARD:
            tl.store(up_out_ptrs, zero, mask=mask)
        return
    gate, up = common.swiglu_k_loop(x_ptr, rows, row_ok, w_ptr + seg.to(tl.int64) * s_we, cols, F, K,
                                    s_xm, s_xk, s_wk, s_wn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_BF16)
    common.swiglu_epilogue(gate, up, out_ptr, out_ptrs, up_out_ptrs,
                           dh_ptr + rows[:, None] * s_dm + cols[None, :] * s_dn, mask, BACKWARD)


@triton.jit
def _grouped_gemm_dw_kernel(
    x_ptr, dy_ptr, dw_ptr, offsets_ptr,
    M_ROWS, N, K,
    s_xm, s_xk, s_ym, s_yn, s_we, s_wk, s_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr, GROUP_K: tl.constexpr,
):
    # x: [M, K]; dy: [M, N]; dw: [E, K, N], dw[e] = x[rows of e]ᵀ · dy[rows of e];
    # offsets: [E + 1] int32, on device. Grid: expert_grid, in expert_tile_order.
    e, tile_k, tile_n = common.expert_tile_order(K, N, BLOCK_K, BLOCK_N, GROUP_K)
    start = tl.minimum(tl.maximum(tl.load(offsets_ptr + e), 0), M_ROWS)
    end = tl.minimum(tl.maximum(tl.load(offsets_ptr + e + 1), start), M_ROWS)
    ks = (tile_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    ns = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    for m0 in range(start, end, BLOCK_M):  # no rows: no iterations, dW[e] = 0
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < end
        a = tl.load(x_ptr + rows[:, None] * s_xm + ks[None, :] * s_xk,
                    mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
        g = tl.load(dy_ptr + rows[:, None] * s_ym + ns[None, :] * s_yn,
                    mask=row_ok[:, None] & (ns[None, :] < N), other=0.0)
        acc = common.mma(acc, tl.trans(a), g, DOT_BF16)
    dw_ptrs = dw_ptr + e.to(tl.int64) * s_we + ks[:, None] * s_wk + ns[None, :] * s_wn
    tl.store(dw_ptrs, common.cast_for_store(acc, dw_ptr), mask=(ks[:, None] < K) & (ns[None, :] < N))


# --------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------

# The kernels whose programs walk the grouped tile order (`moe_lab.kernels.common.tile_order`),
# so whose ``GROUP_M`` is a knob; "dw" walks its experts one after another
# (`moe_lab.kernels.common.expert_tile_order`, `DW_GROUP_K` K tiles per group inside each).
TILE_ORDERED = ("gemm", "swiglu")
# ``GROUP_K`` of "dw": a weight gradient reads its expert's rows of X and dY whole for every
# tile, so what matters is that an expert's tiles run together (its X and dY then come from HBM
# once); any group from 4 up keeps them in L2 at DeepSeek-V3's and GPT-OSS-20B's shapes on an
# H200 (`moe_lab.perf.traffic.simulate_dw`).
DW_GROUP_K = 8


def _config(bm: int, bn: int, bk: int, warps: int) -> LaunchConfig:
    return LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=3)


# The compiled tile space of each kernel, by the name `launch_config` gives it: "gemm" (the
# forward, and dX = the same kernel fed Wᵀ), "swiglu" (the fused forward and its backward), "dw"
# (the weight gradient). A few configs each, every one compiled by the compile report;
# `choose_config` picks one per shape. For "gemm" and "swiglu" the output tile is BLOCK_M x
# BLOCK_N over BLOCK_K; for "dw" it is BLOCK_K x BLOCK_N over BLOCK_M rows. A
# warpgroup MMA (Hopper's ``wgmma``, Blackwell's ``tcgen05.mma``) takes 64 output rows per
# 4 warps, so every bf16 tile gives each 4 warps at least 64 rows; a 64-deep bf16 K step is
# one 128-byte line per row, the widest swizzle for the asynchronous copies. The bf16 tiles
# spill in float32 (on the CUDA cores), which is why the rule never picks them for float32.
TILE_SPACE: dict[str, tuple[LaunchConfig, ...]] = {
    "gemm": (
        _config(64, 64, 32, 4),    # float32 (CUDA cores), or a narrow N
        _config(64, 128, 64, 4),   # bf16, few rows per expert, wide N
        _config(128, 128, 64, 8),  # bf16, many rows per expert, wide N
        _config(128, 64, 64, 4),   # bf16, many rows per expert, narrow N
    ),
    "swiglu": (  # two accumulators (gate, up) per output tile
        _config(64, 64, 32, 4),    # bf16, few rows per expert
        _config(128, 64, 64, 8),   # bf16, many rows per expert
        _config(64, 64, 16, 8),    # float32: 8 warps, a 16-deep K step (no spills)
    ),
    "dw": (
        _config(32, 64, 64, 4),    # float32 (CUDA cores)
        _config(64, 128, 64, 4),   # bf16, few rows per expert (a short reduction)
        _config(64, 128, 128, 8),  # bf16, many rows per expert
    ),
}
# From this many routed rows per expert on, a 128-row tile is chosen: below it, an expert's
# last, partial tile would leave up to half of a 128-row tile idle.
MANY_ROWS = 512
# From this many output columns on, a 128-wide tile is chosen: each loaded x tile then
# feeds twice the columns.
WIDE_N = 1024
# `choose_config`'s rule as tables of positions in `TILE_SPACE`: float32's config per kernel;
# bfloat16's by (kernel, ``n >= WIDE_N`` for "gemm") as (few, many) routed rows per expert.
FP32_PICK = {"gemm": 0, "swiglu": 2, "dw": 0}
BF16_PICK = {("gemm", False): (0, 3), ("gemm", True): (1, 2),
             ("swiglu", False): (0, 1), ("dw", False): (1, 2)}
#: Configs applied explicitly, by kernel name (``FORCED["gemm"] = config``): the tuner times
#: each config through the real op this way (`moe_lab.workbench.measure.autotune.forcing`), and
#: a GPU's tuned winner is applied the same way by whoever measured it. Empty: the rule decides.
FORCED: dict[str, LaunchConfig] = {}


def choose_config(kernel: str, m: int, n: int, k: int, n_experts: int,
                  dtype: torch.dtype) -> LaunchConfig:
    """The compiled config of ``kernel`` at one shape, from `TILE_SPACE` by a fixed rule: a
    reasoned default, not a measurement (a measured one is applied explicitly: `FORCED`).

    float32 runs on the CUDA cores (IEEE products, no tensor cores), where a larger tile
    only adds registers: the first "gemm" and "dw" configs, and for "swiglu" 64 x 64 x 16 on
    8 warps (its backward holds two float32 accumulators and their operand slices: with 4
    warps or a 32-deep K step it spills). bfloat16, with ``r = m // n_experts`` routed rows
    per expert: "gemm" takes 128 rows when ``r >= MANY_ROWS`` (a partial last tile per
    expert then wastes little) and 128 columns when ``n >= WIDE_N`` (each x tile feeds more
    columns); "swiglu" takes 128 rows when ``r >= MANY_ROWS`` (its columns stay 64: it holds
    two accumulators); "dw", whose loop runs over the ``r`` rows, takes the 128-deep tile on
    8 warps when ``r >= MANY_ROWS`` and otherwise the 64-deep one. ``k`` does not enter the
    rule: every config streams K in steps.
    """
    if dtype == torch.float32:
        return TILE_SPACE[kernel][FP32_PICK[kernel]]
    many_rows = m // max(1, n_experts) >= MANY_ROWS
    wide = kernel == "gemm" and n >= WIDE_N
    return TILE_SPACE[kernel][BF16_PICK[kernel, wide][many_rows]]


def tile_group(m: int, n_experts: int, block_m: int) -> int:
    """``GROUP_M`` of `moe_lab.kernels.common.tile_order`: the row tiles of an average expert
    (``m // n_experts`` rows), rounded down to a power of two, at least 1. A group then spans
    about one expert's rows, so the expert's weight is read once per group while its rows stay
    in L2 across the N sweep (`moe_lab.perf.traffic` models the bytes each order moves)."""
    tiles = max(1, m // max(1, n_experts) // block_m)
    return 1 << (tiles.bit_length() - 1)


def launch_config(kernel: str, m: int, n: int, k: int, n_experts: int, *,
                  interpreted: bool, dtype: torch.dtype = torch.bfloat16,
                  device: torch.device | None = None, arch: GPUArch | None = None) -> LaunchConfig:
    """Tiles, warps and stages of one launch: ``kernel`` (a key of `TILE_SPACE`) over ``m``
    routed rows, ``n`` output columns (``F`` for "swiglu"), reduction depth ``k``, in
    ``dtype``, on ``device``. A config applied through `FORCED` comes first. Otherwise: under
    the interpreter each program costs a Python round trip, so tiles are as large as the
    problem allows (rows per expert for ``BLOCK_M``); compiled, `choose_config` picks from
    `TILE_SPACE`, with no more stages than the shared memory of a CUDA ``device``'s GPU, or of
    ``arch``, holds (`fit_shared`)."""
    if kernel in FORCED:
        return FORCED[kernel]
    if interpreted:
        sizes = {"BLOCK_M": m // max(1, n_experts), "BLOCK_N": n, "BLOCK_K": k}
        blocks = {name: min(128, max(16, triton.next_power_of_2(size))) for name, size in sizes.items()}
        return LaunchConfig(blocks, num_warps=4, num_stages=1)
    cfg = choose_config(kernel, m, n, k, n_experts, dtype)
    if device is not None and device.type == "cuda":
        arch = arch or gpu_arch(torch.cuda.get_device_capability(device))
    return cfg if arch is None else fit_shared(kernel, cfg, dtype, arch)


def fit_shared(kernel: str, cfg: LaunchConfig, dtype: torch.dtype, arch: GPUArch) -> LaunchConfig:
    """``cfg`` with no more pipeline stages than ``arch``'s shared memory per block holds
    (`moe_lab.perf.hardware.GPUArch.max_shared_per_block`; a stage: one x and one w tile, two
    w tiles for "swiglu"), at least one."""
    b = cfg.blocks
    tiles = (b["BLOCK_M"] + (2 if kernel == "swiglu" else 1) * b["BLOCK_N"]) * b["BLOCK_K"]
    stages = max(1, min(cfg.num_stages, arch.max_shared_per_block // (tiles * dtype.itemsize)))
    return cfg if stages == cfg.num_stages else replace(cfg, num_stages=stages)


def grouped_grid(m: int, n_experts: int, n: int, block_m: int, block_n: int) -> tuple[int]:
    """The 1-D grid of `moe_lab.kernels.common.tile_order`: at most ``cdiv(m, block_m) + E``
    row tiles (``E`` segments add at most one partial tile each) times ``cdiv(n, block_n)``."""
    return ((triton.cdiv(m, block_m) + n_experts) * triton.cdiv(n, block_n),)


def expert_grid(n_experts: int, k: int, n: int, block_k: int, block_n: int) -> tuple[int, int]:
    """The grid of `moe_lab.kernels.common.expert_tile_order`: ``(cdiv(k, block_k) *
    cdiv(n, block_n), E)``, one expert's tiles along the first axis, which the hardware walks
    fastest."""
    return (triton.cdiv(k, block_k) * triton.cdiv(n, block_n), n_experts)


def block_e(n_experts: int) -> int:
    """``BLOCK_E`` of `moe_lab.kernels.common.tile_schedule`: a power of two holding the
    ``E + 1`` segments."""
    return triton.next_power_of_2(n_experts + 1)


def dot_bf16(dtype: torch.dtype, interpreted: bool) -> bool:
    """``DOT_BF16`` of `moe_lab.kernels.common.mma`: bfloat16 tiles go to ``tl.dot`` as
    bfloat16 when compiled; the interpreter's ``tl.dot`` multiplies bfloat16 bit patterns as
    integers, so it gets float32 tiles of the same values."""
    return dtype == torch.bfloat16 and not interpreted


def launch(kernel: object, cfg: LaunchConfig, m: int, n: int, k: int, n_experts: int, dtype: torch.dtype,
           *args: object, dw: bool = False, **flags: object) -> None:
    """``kernel[grid](*args, **flags, ...)`` at ``cfg`` (this module's kernels and the fused ones of
    `moe_lab.kernels.fused_moe` and `moe_lab.kernels.fused_mxfp8`) over ``m`` rows of ``n_experts``
    experts, ``n`` output columns, reduction depth ``k``: a weight gradient's (``dw``) on
    `expert_grid`, ``GROUP_K`` = `DW_GROUP_K`; any other on `grouped_grid`, ``GROUP_M`` the config's
    else `tile_group`'s. It adds the blocks, ``DOT_BF16``, the warps and the stages to the kernel's
    own ``flags``."""
    b = cfg.blocks
    if dw:
        grid = expert_grid(n_experts, k, n, b["BLOCK_K"], b["BLOCK_N"])
        order = {"GROUP_K": DW_GROUP_K}
    else:
        grid = grouped_grid(m, n_experts, n, b["BLOCK_M"], b["BLOCK_N"])
        group_m = cfg.group_m or tile_group(m, n_experts, b["BLOCK_M"])
        order = {"GROUP_M": group_m, "BLOCK_E": block_e(n_experts)}
    kernel[grid](*args, **flags, **b, **order, DOT_BF16=dot_bf16(dtype, common.INTERPRETED),
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# --------------------------------------------------------------------------------------
# Launches (custom ops, `kernel_op`: FakeTensorMode and torch.compile see the shapes, not the kernel)
# --------------------------------------------------------------------------------------


def _launch(kernel: str, fn: object, out: Tensor, m: int, n: int, k: int, n_experts: int, x: Tensor,
            *args: object, **flags: object) -> None:
    """`launch` of ``fn`` at `launch_config`'s tile for ``kernel``, ``x`` its first argument; nothing
    when ``out`` is empty or fake (a fake tensor has a shape and no memory: the op only allocates)."""
    if out.numel() and not isinstance(x, FakeTensor):
        cfg = launch_config(kernel, m, n, k, n_experts, interpreted=common.INTERPRETED, dtype=x.dtype,
                            device=x.device)
        launch(fn, cfg, m, n, k, n_experts, x.dtype, x, *args, dw=kernel == "dw", **flags)


@common.kernel_op("grouped_gemm")
def grouped_gemm_op(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    m, k = x.shape
    n_experts, _, n = w.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _launch("gemm", _grouped_gemm_kernel, y, m, n, k, n_experts,
            x, w, y, offsets, m, n, k, n_experts, *x.stride(), *w.stride(), *y.stride())
    return y


@common.kernel_op("grouped_gemm_dw")
def _grouped_gemm_dw_op(x: Tensor, dy: Tensor, offsets: Tensor) -> Tensor:
    m, k, n, n_experts = x.shape[0], x.shape[1], dy.shape[1], offsets.shape[0] - 1
    dw = torch.empty((n_experts, k, n), dtype=x.dtype, device=x.device)
    _launch("dw", _grouped_gemm_dw_kernel, dw, m, n, k, n_experts,
            x, dy, dw, offsets, m, n, k, *x.stride(), *dy.stride(), *dw.stride())
    return dw


@common.kernel_op("grouped_gemm_swiglu")
def grouped_gemm_swiglu_op(x: Tensor, w: Tensor, offsets: Tensor, dh: Tensor | None = None) -> Tensor:
    """The forward ``h: [M, F]``; given ``dh`` (the backward), ``[dgate, dup]: [M, 2F]``."""
    m, k = x.shape
    n_experts, f = w.shape[0], w.shape[2] // 2
    out = torch.empty((m, f if dh is None else 2 * f), dtype=x.dtype, device=x.device)
    dh_arg = out if dh is None else dh  # unused by the forward
    _launch("swiglu", _grouped_gemm_swiglu_kernel, out, m, f, k, n_experts,
            x, w, out, dh_arg, offsets, m, f, k, n_experts, *x.stride(), *w.stride(), *out.stride(),
            *dh_arg.stride(), BACKWARD=dh is not None)
    return out


# --------------------------------------------------------------------------------------
# Autograd (each op's backward, registered on the op) and the public wrappers
# --------------------------------------------------------------------------------------


def _save_operands(ctx: FunctionCtx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:3])  # x, w, offsets (a ``dh`` is passed by the backward only)


@first_derivative_only("the Triton grouped GEMM")
def _gemm_backward(ctx: FunctionCtx, dy: Tensor) -> tuple[Tensor | None, ...]:
    """The backward of ``y = grouped_gemm(x, w, offsets)``: ``dX = dY·W[e]ᵀ`` (the forward
    kernel on ``Wᵀ``), ``dW[e] = X_eᵀ·dY_e``, each where autograd asks for it."""
    x, w, offsets = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = grouped_gemm_op(dy, w.transpose(1, 2), offsets)
    if ctx.needs_input_grad[1]:
        dw = _grouped_gemm_dw_op(x, dy, offsets)
    return dx, dw, None


@first_derivative_only("the Triton grouped GEMM + SwiGLU")
def _swiglu_backward(ctx: FunctionCtx, dh: Tensor) -> tuple[Tensor | None, ...]:
    """The backward of ``h = silu(x·Wg) ⊙ (x·Wu)``: the pre-activation's gradient, its
    ``x·W`` recomputed in the forward's kernel (not saved), then the backward of that GEMM."""
    x, w, offsets = ctx.saved_tensors
    dpre = grouped_gemm_swiglu_op(x, w, offsets, dh)  # [M, 2F]
    return *_gemm_backward(ctx, dpre), None


grouped_gemm_op.register_autograd(_gemm_backward, setup_context=_save_operands)
grouped_gemm_swiglu_op.register_autograd(_swiglu_backward, setup_context=_save_operands)


def check_operands(x: Tensor, w: Tensor, offsets: Tensor, w_name: str) -> None:
    """The door of a grouped GEMM (this module's wrappers, the TMA one's, the fused expert MLP's):
    ``x: [M, K]`` and ``w: [E, K, N]`` (named ``w_name``, at least one expert) in one of
    `KERNEL_DTYPES`, ``offsets: [E + 1]`` int32, all on one device compiled Triton runs on."""
    for name, t in (("x", x), (w_name, w), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if w.dim() != 3 or w.shape[1] != x.shape[1] or w.shape[0] < 1:
        raise ValueError(f"{w_name} must be [E, K={x.shape[1]}, N]: {w_name} [E >= 1, K, N] holds at least "
                         f"one expert, and its K is x.shape[1]; got shape {tuple(w.shape)}")
    one_of(x.dtype, "x.dtype", KERNEL_DTYPES)
    if w.dtype != x.dtype:
        raise ValueError(f"{w_name}.dtype must equal x.dtype = {x.dtype}, got {w.dtype}")
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (w.shape[0] + 1,):
        raise ValueError(f"offsets must be [E + 1 = {w.shape[0] + 1}] int32, "
                         f"got shape {tuple(offsets.shape)} {offsets.dtype}")
    common.check_device("x", x.device, **{w_name: w, "offsets": offsets})


def grouped_gemm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """Rows ``offsets[e]:offsets[e+1]`` of ``x`` times ``w[e]``, for every expert ``e``.

    Args:
        x: ``[M, K]`` float32 or bfloat16, any strides.
        w: ``[E, K, N]``, ``x``'s dtype, any strides.
        offsets: ``[E + 1]`` int32 on ``x``'s device: nondecreasing, ``offsets[0] = 0``,
            ``offsets[E] <= M`` (as `moe_lab.kernels.permute.make_row_id_map` makes them).
            Never read on the host; values outside ``[0, M]`` are clamped. The grid is sized
            from ``M``, a static bound on ``offsets[E]``.

    Returns:
        ``y: [M, N]`` in ``x``'s dtype (accumulated in float32); rows from ``offsets[E]``
        on are zeros. Differentiable in ``x`` and ``w``.
    """
    check_operands(x, w, offsets, "w")
    return grouped_gemm_op(x, w, offsets.contiguous())


def grouped_gemm_swiglu(x: Tensor, w_gate_up: Tensor, offsets: Tensor) -> Tensor:
    """``silu(x·Wg) ⊙ (x·Wu)`` per expert, the activation fused into the GEMM's epilogue.

    ``w_gate_up: [E, K, 2F]`` with gate ``[..., :F]`` and up ``[..., F:]`` (the layout of
    `moe_lab.moe.experts.SwiGLUExperts`); the other arguments as in `grouped_gemm`.
    Returns ``h: [M, F]``, zero rows from ``offsets[E]`` on. Differentiable in ``x`` and
    ``w_gate_up``; the backward recomputes the pre-activation instead of saving it.
    """
    check_operands(x, w_gate_up, offsets, "w_gate_up")
    if w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up must be [E, K, 2F] (an even last dim), "
                         f"got shape {tuple(w_gate_up.shape)}")
    return grouped_gemm_swiglu_op(x, w_gate_up, offsets.contiguous())


# --------------------------------------------------------------------------------------
# Reference (plain PyTorch; what the kernels are tested against)
# --------------------------------------------------------------------------------------


def grouped_gemm_reference(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """The textbook loop: ``y[offsets[e]:offsets[e+1]] = x[...] @ w[e]``, zeros elsewhere.

    Reads ``offsets`` on the host (one sync): it is the reference, not a fast path.
    Differentiable through autograd.
    """
    bounds = offsets.tolist()
    pieces = [x[bounds[e]:bounds[e + 1]] @ w[e] for e in range(w.shape[0])]
    pieces.append(x.new_zeros((x.shape[0] - bounds[-1], w.shape[2])))  # padding rows
    return torch.cat(pieces)
