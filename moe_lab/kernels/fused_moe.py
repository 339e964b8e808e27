"""The permute and the combine fused into the grouped GEMMs: a gather prologue, a weighted-scatter epilogue.

The unfused dropless layer is a chain of launches, each reading its inputs from memory and
writing its output back: ``permute`` copies every token row to its ``k`` rows of an
expert-sorted buffer, the first grouped GEMM (SwiGLU in its epilogue) reads that buffer, the
second writes ``[T·k, d]`` rows in expert order, and ``unpermute`` reads them back, weights
them and sums each token's ``k`` rows. The two copies do no arithmetic, yet at fine-grained
shapes they move about as many bytes as the GEMMs. Here they are folded into the GEMMs:

* **gather prologue** — the first GEMM loads row ``r`` of its A tile straight from the token
  rows, ``x[token(r)]``, through the *row source* ``src[r] = t·k + j``
  (`moe_lab.kernels.common.row_source`, the inverse of the row-id map). The permuted copy of
  ``x`` is never written; the backward's weight gradient gathers the same way.
* **weighted-scatter epilogue** — the second GEMM multiplies each output row by its routing
  weight and sends it to its token. ``scatter="deterministic"`` stores row ``(t, j)`` at
  position ``t·k + j`` of a token-major ``[T·k, d]`` buffer (one writer per element), then
  sums over ``k`` in float32: bit-for-bit reproducible (ScatterMoE's scheme).
  ``scatter="atomic"`` adds into a float32 ``[T, d]`` with ``tl.atomic_add``: no ``[T·k, d]``
  buffer, but with ``k >= 3`` the last bits can differ between runs (float addition is not
  associative, and tiles finish in any order).

The combine's backward is a gather prologue too (``dh = w·(dout[token]·W2ᵀ)``, the routing
weights' gradient ``<dout[t]·W2ᵀ, h[r]>`` summed in the same epilogue), and the first GEMM's
``dX`` is scattered back to the tokens. Tiles come from the grouped GEMM's `launch_config`
(a prologue or an epilogue does not change the MMA's tile). The MXFP8-quantize epilogue is
`moe_lab.kernels.fused_mxfp8`. Each fused function's unfused chain closes this file; both are
registered side by side in `moe_lab.kernels.fusions.FUSIONS` and tested against each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses import FakeTensor
from torch.autograd.function import FunctionCtx

from moe_lab.checks import first_derivative_only, one_of
from moe_lab.kernels import common
from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.kernels.permute import check_map, permute_reference, unpermute_reference

Tensor = torch.Tensor
SCATTER_MODES = ("deterministic", "atomic")


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _gather_swiglu_kernel(
    x_ptr, src_ptr, w_ptr, out_ptr, dh_ptr, offsets_ptr,
    M_ROWS, F, K, E, TOP_K,
    s_xm, s_xk, s_we, s_wk, s_wn, s_om, s_on, s_dm, s_dn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, DOT_BF16: tl.constexpr, BACKWARD: tl.constexpr,
):
    # x: [T, K] token rows; src: [M_ROWS] int32 (t·k + j of each permuted row, -1: none);
    # w: [E, K, 2F]; offsets: [E + 1]. The A tile's rows are x[src // TOP_K] (the gather
    # prologue). Forward: out = h = silu(gate)·up [M, F]. Backward: dh [M, F] in,
    # out = [dgate, dup] [M, 2F]. Grid: 1-D, `grouped_grid` over F.
    tile_m, tile_n = common.tile_order(F, BLOCK_N, GROUP_M)
    seg, row0, row_end = common.tile_schedule(offsets_ptr, tile_m, E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg > E:
        return
    rows, cols, row_ok = common.tile_rows(row0, row_end, tile_n, BLOCK_M, BLOCK_N)
    mask = row_ok[:, None] & (cols[None, :] < F)
    out_ptrs = out_ptr + rows[:, None] * s_om + cols[None, :] * s_on
    up_out_ptrs = out_ptr + rows[:, None] * s_om + (cols + F)[None, :] * s_on
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if seg < E:  # the padding segment (seg == E) keeps zero accumulators: zero rows out
        token, _src, a_ok = common.gather_rows(src_ptr, rows, row_ok, TOP_K)
        gate, up = common.swiglu_k_loop(x_ptr, token, a_ok, w_ptr + seg.to(tl.int64) * s_we, cols, F, K,
                                        s_xm, s_xk, s_wk, s_wn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_BF16)
    common.swiglu_epilogue(gate, up, out_ptr, out_ptrs, up_out_ptrs,
                           dh_ptr + rows[:, None] * s_dm + cols[None, :] * s_dn, mask, BACKWARD)


@triton.jit
def _gemm_scatter_kernel(
    a_ptr, w_ptr, out_ptr, src_ptr, weight_ptr, offsets_ptr,
    M_ROWS, N, K, E, TOP_K,
    s_am, s_ak, s_we, s_wk, s_wn, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, DOT_BF16: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    # a: [M, K] expert-sorted rows; w: [E, K, N] (any strides); src: [M_ROWS] int32;
    # weight: [T·k] float32 routing weights (if HAS_WEIGHTS). Row r's product, times
    # weight[src[r]], goes to its token (`scatter_rows`). Rows without a source and the
    # padding segment write nothing. Grid: 1-D, `grouped_grid` over N.
    tile_m, tile_n = common.tile_order(N, BLOCK_N, GROUP_M)
    seg, row0, row_end = common.tile_schedule(offsets_ptr, tile_m, E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg >= E:
        return
    rows, cols, row_ok = common.tile_rows(row0, row_end, tile_n, BLOCK_M, BLOCK_N)
    token, src, ok = common.gather_rows(src_ptr, rows, row_ok, TOP_K)
    acc = common.gemm_k_loop(a_ptr, rows, row_ok, w_ptr + seg.to(tl.int64) * s_we, cols, N, K,
                             s_am, s_ak, s_wk, s_wn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_BF16)
    common.scatter_rows(acc, out_ptr, weight_ptr, token, src, ok, cols, N, s_om, s_on, HAS_WEIGHTS, ATOMIC)


@triton.jit
def _gather_gemm_kernel(
    g_ptr, src_ptr, w_ptr, h_ptr, weight_ptr, out_ptr, part_ptr, offsets_ptr,
    M_ROWS, N, K, E, TOP_K, N_TILES,
    s_gm, s_gk, s_we, s_wk, s_wn, s_hm, s_hn, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, DOT_BF16: tl.constexpr,
):
    # The combine's backward. g: [T, K] token rows (dout); w: [E, K, N] (W2ᵀ as a view);
    # h: [M, N] (the second GEMM's saved input); weight: [T·k] fp32. Row r:
    # c = g[src // TOP_K]·W[e] (the gather prologue); out[r] = weight[src]·c (dh) and
    # part[r, tile] = <c, h[r]> over this tile's columns (summed over tiles after the
    # launch: the routing weight's gradient, deterministic).
    # Grid: 1-D, `grouped_grid` over N (N_TILES tiles).
    tile_m, tile_n = common.tile_order(N, BLOCK_N, GROUP_M)
    seg, row0, row_end = common.tile_schedule(offsets_ptr, tile_m, E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg > E:
        return
    rows, cols, row_ok = common.tile_rows(row0, row_end, tile_n, BLOCK_M, BLOCK_N)
    mask = row_ok[:, None] & (cols[None, :] < N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    wt = tl.zeros((BLOCK_M,), tl.float32)
    if seg < E:
        token, src, ok = common.gather_rows(src_ptr, rows, row_ok, TOP_K)
        acc = common.gemm_k_loop(g_ptr, token, ok, w_ptr + seg.to(tl.int64) * s_we, cols, N, K,
                                 s_gm, s_gk, s_wk, s_wn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_BF16)
        wt = tl.load(weight_ptr + src, mask=ok, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + rows[:, None] * s_hm + cols[None, :] * s_hn, mask=mask, other=0.0).to(tl.float32)
    tl.store(part_ptr + rows * N_TILES + tile_n, tl.sum(acc * h, 1), mask=row_ok)
    tl.store(out_ptr + rows[:, None] * s_om + cols[None, :] * s_on,
             common.cast_for_store(acc * wt[:, None], out_ptr), mask=mask)


@triton.jit
def _gather_dw_kernel(
    x_ptr, dy_ptr, dw_ptr, src_ptr, weight_ptr, offsets_ptr,
    M_ROWS, N, K, TOP_K,
    s_xm, s_xk, s_ym, s_yn, s_we, s_wk, s_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr, GATHER_X: tl.constexpr, GROUP_K: tl.constexpr,
):
    # dw[e] = X_eᵀ·DY_e over expert e's rows, one operand read through the row source:
    # GATHER_X: X row r = x[src // TOP_K] (x: [T, K] tokens), DY row r = dy[r] (dy: [M, N]);
    # else X row r = x[r] (x: [M, K]) and DY row r = weight[src]·dy[src // TOP_K]
    # (dy: [T, N] token gradients, weight: [T·k] fp32). Grid: expert_grid, in expert_tile_order.
    e, tile_k, tile_n = common.expert_tile_order(K, N, BLOCK_K, BLOCK_N, GROUP_K)
    start = tl.minimum(tl.maximum(tl.load(offsets_ptr + e), 0), M_ROWS)
    end = tl.minimum(tl.maximum(tl.load(offsets_ptr + e + 1), start), M_ROWS)
    ks = (tile_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    ns = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    # The row sources of the next row tile are loaded one iteration ahead (carried through
    # the loop), so the gathered loads' addresses never wait on a load of the same
    # iteration: the software pipeliner can then keep several tiles' copies in flight.
    rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
    src = tl.load(src_ptr + rows, mask=rows < end, other=-1).to(tl.int64)
    for _m0 in range(start, end, BLOCK_M):  # no rows: no iterations, dW[e] = 0
        ok = (rows < end) & (src >= 0)
        token = tl.where(ok, src // TOP_K, 0)
        if GATHER_X:
            x_rows, dy_rows = token, rows
        else:
            x_rows, dy_rows = rows, token
        a = tl.load(x_ptr + x_rows[:, None] * s_xm + ks[None, :] * s_xk,
                    mask=ok[:, None] & (ks[None, :] < K), other=0.0)
        g = tl.load(dy_ptr + dy_rows[:, None] * s_ym + ns[None, :] * s_yn,
                    mask=ok[:, None] & (ns[None, :] < N), other=0.0)
        if not GATHER_X:
            wt = tl.load(weight_ptr + src, mask=ok, other=0.0).to(tl.float32)
            g = common.cast_for_store(g.to(tl.float32) * wt[:, None], dy_ptr)  # the weighted dY, rounded
        acc = common.mma(acc, tl.trans(a), g, DOT_BF16)
        rows += BLOCK_M
        src = tl.load(src_ptr + rows, mask=rows < end, other=-1).to(tl.int64)
    dw_ptrs = dw_ptr + e.to(tl.int64) * s_we + ks[:, None] * s_wk + ns[None, :] * s_wn
    tl.store(dw_ptrs, common.cast_for_store(acc, dw_ptr), mask=(ks[:, None] < K) & (ns[None, :] < N))


# --------------------------------------------------------------------------------------
# Launches (custom ops, `kernel_op`: FakeTensorMode and torch.compile see the shapes, not the kernel)
# --------------------------------------------------------------------------------------

# The gathered weight gradient in float32 (CUDA cores): the grouped GEMM's 32 x 64 x 64 on
# 4 warps spills once the row sources ride along, so 8 warps share the tile.
GATHER_DW_FP32 = LaunchConfig({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=8, num_stages=3)


def launch_config(kernel: str, m: int, n: int, k: int, n_experts: int, *, interpreted: bool,
                  dtype: torch.dtype = torch.bfloat16) -> LaunchConfig:
    """The launch of a fused kernel: the tile `moe_lab.kernels.grouped_gemm.launch_config`
    gives the unfused ``kernel`` ("gemm", "swiglu", "dw") it replaces — a prologue or an
    epilogue does not change the MMA — except the gathered ``dw`` in float32 compiled
    (`GATHER_DW_FP32`)."""
    if kernel == "dw" and dtype == torch.float32 and not interpreted:
        return GATHER_DW_FP32
    return gg.launch_config(kernel, m, n, k, n_experts, interpreted=interpreted, dtype=dtype)


def _launch(kernel: str, fn: object, out: Tensor, m: int, n: int, k: int, n_experts: int, x: Tensor,
            *args: object, **flags: object) -> None:
    """`moe_lab.kernels.grouped_gemm.launch` of ``fn`` at `launch_config`'s tile for ``kernel``,
    ``x`` its first argument; nothing when ``out`` is empty or fake (the op only allocates)."""
    if out.numel() and not isinstance(x, FakeTensor):
        cfg = launch_config(kernel, m, n, k, n_experts, interpreted=common.INTERPRETED, dtype=x.dtype)
        gg.launch(fn, cfg, m, n, k, n_experts, x.dtype, x, *args, dw=kernel == "dw", **flags)


@common.kernel_op("gather_swiglu")
def _gather_swiglu_op(x: Tensor, src: Tensor, w: Tensor, offsets: Tensor, top_k: int,
                      dh: Tensor | None = None) -> Tensor:
    """The forward ``h: [M, F]``; given ``dh`` (the backward), ``[dgate, dup]: [M, 2F]``."""
    m, (n_experts, k, two_f) = src.shape[0], w.shape
    f = two_f // 2
    out = torch.empty((m, f if dh is None else two_f), dtype=x.dtype, device=x.device)
    dh_arg = out if dh is None else dh
    _launch("swiglu", _gather_swiglu_kernel, out, m, f, k, n_experts,
            x, src, w, out, dh_arg, offsets, m, f, k, n_experts, top_k, *x.stride(), *w.stride(),
            *out.stride(), *dh_arg.stride(), BACKWARD=dh is not None)
    return out


@common.kernel_op("gemm_scatter")
def _gemm_scatter_op(a: Tensor, w: Tensor, src: Tensor, weights: Tensor | None, offsets: Tensor,
                     tokens: int, top_k: int, atomic: bool) -> Tensor:
    """Token rows ``[tokens, N]``: the scattered, weighted products summed over each
    token's ``top_k`` rows (float32 accumulation; the output in ``a``'s dtype)."""
    (m, k), (n_experts, _, n) = a.shape, w.shape
    if atomic:
        out = torch.zeros((tokens, n), dtype=torch.float32, device=a.device)
    else:  # every (token, slot) has its row in some expert's segment: every element written
        out = torch.empty((tokens * top_k, n), dtype=a.dtype, device=a.device)
    _launch("gemm", _gemm_scatter_kernel, out, m, n, k, n_experts,
            a, w, out, src, src if weights is None else weights, offsets, m, n, k, n_experts, top_k,
            *a.stride(), *w.stride(), *out.stride(), HAS_WEIGHTS=weights is not None, ATOMIC=atomic)
    if atomic:
        return out.to(a.dtype)  # float32: no pass at all; bfloat16: one cast
    return out.view(tokens, top_k, n).sum(1, dtype=torch.float32).to(a.dtype)


@common.kernel_op("gather_gemm_combine_bwd")
def _gather_gemm_op(g: Tensor, src: Tensor, w: Tensor, h: Tensor, weights: Tensor, offsets: Tensor,
                    top_k: int) -> tuple[Tensor, Tensor]:
    """``(dh: [M, N], dweights: [T·k] float32)`` of the weighted combine."""
    (m, n), (n_experts, k, _) = h.shape, w.shape
    cfg = launch_config("gemm", m, n, k, n_experts, interpreted=common.INTERPRETED, dtype=g.dtype)
    n_tiles = triton.cdiv(n, cfg.blocks["BLOCK_N"]) if n else 0
    dh = torch.empty((m, n), dtype=g.dtype, device=g.device)
    part = torch.empty((m, n_tiles), dtype=torch.float32, device=g.device)
    _launch("gemm", _gather_gemm_kernel, dh, m, n, k, n_experts,
            g, src, w, h, weights, dh, part, offsets, m, n, k, n_experts, top_k, n_tiles,
            *g.stride(), *w.stride(), *h.stride(), *dh.stride())
    per_row = part.sum(1)
    # Back from permuted rows to (token, slot) entries; rows without a source are dropped.
    dweights = torch.zeros(weights.shape[0] + 1, dtype=torch.float32, device=g.device)
    dweights.index_copy_(0, torch.where(src >= 0, src, weights.shape[0]).long(), per_row)
    return dh, dweights[:-1]


@common.kernel_op("gather_dw")
def _gather_dw_op(x: Tensor, dy: Tensor, src: Tensor, weights: Tensor | None, offsets: Tensor,
                  top_k: int, gather_x: bool) -> Tensor:
    k, n, n_experts, m = x.shape[1], dy.shape[1], offsets.shape[0] - 1, src.shape[0]
    dw = torch.empty((n_experts, k, n), dtype=x.dtype, device=x.device)
    _launch("dw", _gather_dw_kernel, dw, m, n, k, n_experts,
            x, dy, dw, src, src if weights is None else weights, offsets, m, n, k, top_k,
            *x.stride(), *dy.stride(), *dw.stride(), GATHER_X=gather_x)
    return dw


# --------------------------------------------------------------------------------------
# Autograd (each op's backward, registered on the op) and the public functions
# --------------------------------------------------------------------------------------


def _gather_swiglu_setup(ctx: FunctionCtx, inputs: tuple, output: Tensor) -> None:
    x, src, w, offsets, ctx.top_k, _ = inputs
    ctx.save_for_backward(x, src, w, offsets)


@first_derivative_only("the fused gather + SwiGLU kernel")
def _gather_swiglu_backward(ctx: FunctionCtx, dh: Tensor) -> tuple[Tensor | None, ...]:
    """``h[r] = swiglu(x[token(r)]·W1[e])``, the first GEMM with the gather prologue: the
    pre-activation's gradient recomputed in the same kernel, ``dX`` back to the tokens by the
    scatter epilogue (unweighted), ``dW1`` with ``x`` gathered."""
    x, src, w, offsets = ctx.saved_tensors
    dpre = _gather_swiglu_op(x, src, w, offsets, ctx.top_k, dh.contiguous())
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _gemm_scatter_op(dpre, w.transpose(1, 2), src, None, offsets, x.shape[0], ctx.top_k, False)
    if ctx.needs_input_grad[2]:
        dw = _gather_dw_op(x, dpre, src, None, offsets, ctx.top_k, True)
    return dx, None, dw, None, None, None


_gather_swiglu_op.register_autograd(_gather_swiglu_backward, setup_context=_gather_swiglu_setup)


def _gemm_scatter_setup(ctx: FunctionCtx, inputs: tuple, output: Tensor) -> None:
    h, w, src, weights, offsets, _, ctx.top_k, _ = inputs
    ctx.save_for_backward(h, w, src, weights, offsets)


@first_derivative_only("the fused GEMM + scatter kernel")
def _gemm_scatter_backward(ctx: FunctionCtx, dout: Tensor) -> tuple[Tensor | None, ...]:
    """``out[t] = Σ_j w[t, j]·(h[row(t, j)]·W2[e])``, the second GEMM with the weighted scatter
    epilogue (the combine): ``dh`` and the routing weights' gradient from one gathered GEMM,
    ``dW2`` with the weighted ``dout`` gathered."""
    h, w, src, weights, offsets = ctx.saved_tensors
    dout = dout.contiguous()
    dh, dweights = _gather_gemm_op(dout, src, w.transpose(1, 2), h, weights, offsets, ctx.top_k)
    dw = None
    if ctx.needs_input_grad[1]:
        dw = _gather_dw_op(h, dout, src, weights, offsets, ctx.top_k, False)
    return dh, dw, None, dweights, None, None, None, None


_gemm_scatter_op.register_autograd(_gemm_scatter_backward, setup_context=_gemm_scatter_setup)


def check_mlp_args(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor, offsets: Tensor,
                   topk_weights: Tensor) -> None:
    """The door of a fused expert MLP (`fused_moe_mlp`'s, the MXFP8 paths' too): ``x: [T, d]``,
    ``w_gate_up: [E, d, 2F]`` and ``offsets`` as the grouped GEMM's
    (`moe_lab.kernels.grouped_gemm.check_operands`), ``w_down: [E, F, d]`` like them,
    ``row_id_map: [T, k]`` int32 as permute's and ``topk_weights`` its shape; ``ValueError``
    naming the first one wrong."""
    gg.check_operands(x, w_gate_up, offsets, "w_gate_up")
    n_experts, d, two_f = w_gate_up.shape
    if two_f % 2 or tuple(w_down.shape) != (n_experts, two_f // 2, d):
        raise ValueError(f"w_gate_up must be [E, d, 2F] and w_down [E, F, d], got {tuple(w_gate_up.shape)} "
                         f"and {tuple(w_down.shape)}")
    if w_down.dtype != x.dtype or w_down.device != x.device:
        raise ValueError(f"w_down must be {x.dtype} on {x.device}, got {w_down.dtype} on {w_down.device}")
    check_map(row_id_map, x.shape[0], row_id_map.numel())
    if tuple(topk_weights.shape) != tuple(row_id_map.shape):
        raise ValueError(f"topk_weights must be {tuple(row_id_map.shape)}, got {tuple(topk_weights.shape)}")


def fused_moe_mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor, offsets: Tensor,
                  topk_weights: Tensor, *, n_rows: int | None = None,
                  scatter: str = "deterministic") -> Tensor:
    """The dropless experts and their combine in two fused launches (and their backward):
    ``out[t] = Σ_j w[t, j]·down_e(swiglu(x[t]·W1[e]))`` with ``e = topk_ids[t, j]``.

    Args:
        x: ``[T, d]`` token rows (float32 or bfloat16), never permuted.
        w_gate_up: ``[E, d, 2F]`` (gate ``[..., :F]``, up ``[..., F:]``); w_down:
            ``[E, F, d]``; both in ``x``'s dtype.
        row_id_map, offsets: from `moe_lab.kernels.permute.make_row_id_map`.
        topk_weights: ``[T, k]`` routing weights (any float dtype; used in float32).
        n_rows: rows of the expert-sorted layout (default ``T·k``; larger with aligned segments).
        scatter: ``"deterministic"`` or ``"atomic"`` (see the module docstring).

    Returns ``[T, d]`` in ``x``'s dtype. Differentiable in ``x``, both weights and
    ``topk_weights``; no host sync.
    """
    check_mlp_args(x, w_gate_up, w_down, row_id_map, offsets, topk_weights)
    one_of(scatter, "scatter", SCATTER_MODES)
    tokens, top_k = row_id_map.shape
    src = common.row_source(row_id_map, tokens * top_k if n_rows is None else n_rows)
    offsets = offsets.contiguous()
    h = _gather_swiglu_op(x, src, w_gate_up, offsets, top_k)
    weights = topk_weights.reshape(-1).float()
    return _gemm_scatter_op(h, w_down, src, weights, offsets, tokens, top_k, scatter == "atomic")


def gather_swiglu(x: Tensor, w_gate_up: Tensor, row_id_map: Tensor, offsets: Tensor, *,
                  n_rows: int | None = None) -> Tensor:
    """The first expert GEMM with the gather prologue: ``h[r] = swiglu(x[t]·W1[e])`` for
    ``r = row_id_map[t, j]`` in ``e``'s segment; ``[n_rows, F]``, zero rows where no
    (token, slot) maps. Differentiable in ``x`` and ``w_gate_up``."""
    tokens, top_k = row_id_map.shape
    src = common.row_source(row_id_map, tokens * top_k if n_rows is None else n_rows)
    return _gather_swiglu_op(x, src, w_gate_up, offsets.contiguous(), top_k)


def gemm_scatter(h: Tensor, w_down: Tensor, row_id_map: Tensor, offsets: Tensor, topk_weights: Tensor,
                 *, scatter: str = "deterministic") -> Tensor:
    """The second expert GEMM with the weighted-scatter epilogue: ``out[t] = Σ_j w[t, j]·
    (h[row_id_map[t, j]]·W2[e])``; ``[T, d]``. Differentiable in ``h``, ``w_down`` and
    ``topk_weights``."""
    one_of(scatter, "scatter", SCATTER_MODES)
    tokens, top_k = row_id_map.shape
    src = common.row_source(row_id_map, h.shape[0])
    return _gemm_scatter_op(h, w_down, src, topk_weights.reshape(-1).float(), offsets.contiguous(),
                            tokens, top_k, scatter == "atomic")


# --------------------------------------------------------------------------------------
# References: the unfused chains (what each fusion is tested against)
# --------------------------------------------------------------------------------------


def gather_swiglu_unfused(x: Tensor, w_gate_up: Tensor, row_id_map: Tensor, offsets: Tensor, *,
                          n_rows: int | None = None) -> Tensor:
    """permute → grouped GEMM → SwiGLU, in plain PyTorch."""
    from moe_lab.moe.experts import swiglu

    tokens, top_k = row_id_map.shape
    permuted = permute_reference(x, row_id_map, tokens * top_k if n_rows is None else n_rows)
    return swiglu(gg.grouped_gemm_reference(permuted, w_gate_up, offsets))


def gemm_scatter_unfused(h: Tensor, w_down: Tensor, row_id_map: Tensor, offsets: Tensor,
                         topk_weights: Tensor, *, scatter: str = "deterministic") -> Tensor:
    """grouped GEMM → weighted unpermute, in plain PyTorch (``scatter`` is ignored)."""
    return unpermute_reference(gg.grouped_gemm_reference(h, w_down, offsets), row_id_map,
                               topk_weights.float())


def fused_moe_mlp_unfused(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor,
                          offsets: Tensor, topk_weights: Tensor, *, n_rows: int | None = None,
                          scatter: str = "deterministic") -> Tensor:
    """The whole unfused chain: permute → GEMM + SwiGLU → GEMM → weighted unpermute."""
    h = gather_swiglu_unfused(x, w_gate_up, row_id_map, offsets, n_rows=n_rows)
    return gemm_scatter_unfused(h, w_down, row_id_map, offsets, topk_weights)

