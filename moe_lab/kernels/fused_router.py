"""The fused MoE router: one Triton kernel from logits to ids, weights, counts and loss statistics.

The reference router (`moe_lab.moe.router.route_from_logits`) is a chain of some thirty small
operations — score function, bias, group scores and their top groups, the top-k, the
renormalisation, the histogram, the aux-loss and z-loss reductions — each reading a
``[tokens, n_experts]`` tensor and writing another: memory bound many times over, twice the bytes
in FP64. NVIDIA's MLPerf Training v6.0 DeepSeek-V3 submission fused it and moved it to FP32
(Megatron-Core ``--moe-router-fusion``; Transformer Engine's ``fused_topk_with_score_function``).

Here one program (grid: ``cdiv(T, BLOCK_T)``) keeps ``BLOCK_T`` tokens' logits in registers as a
``[BLOCK_T, groups, experts per group]`` tile, reads them once and, writing nothing in between,
scores them in FP32, picks the groups and the top-k by repeated arg-max (the lowest index wins
among equal scores: the reference's rule), renormalises and scales the weights, and adds the
statistics — tokens per expert and score sums per sequence, the z-loss sum — with atomics. What
leaves is ``[T, k]`` ids and weights and ``[S, E]`` statistics; the losses are finished on
``[E]``-sized tensors. The backward is a second kernel that *recomputes* the scores from the
logits rather than storing ``[T, E]`` of them.

Both launches are custom ops (`moe_lab.kernels.common.kernel_op`: FakeTensorMode and
``torch.compile`` trace them); the forward's autograd is ``register_autograd``. Atomic float
adds make the statistics' last bits depend on the order programs finish; the ids, weights and
counts do not. No ``tl.dot``: compiled, the router runs on the CUDA cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses import FakeTensor

from moe_lab.checks import first_derivative_only
from moe_lab.config import MoEConfig
from moe_lab.kernels.common import INTERPRETED, kernel_op
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.moe import router_output

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _load_logits(logits_ptr, T, EG, G, s_lt, s_le, BLOCK_T: tl.constexpr, GP: tl.constexpr,
                 EGP: tl.constexpr):
    # This program's tokens t [BLOCK_T] and experts e = g * EG + j [GP, EGP] (group g < G, slot
    # j < EG), their masks, and the logits lg [BLOCK_T, GP, EGP] float32. Padding lanes (no
    # expert) are -inf, so they score 0 and are never selected; rows past the last token are 0
    # (finite: no NaN in masked rows).
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    g = tl.arange(0, GP)
    j = tl.arange(0, EGP)
    e = g[:, None] * EG + j[None, :]
    e_ok = (g[:, None] < G) & (j[None, :] < EG)
    t_ok = t < T
    ok = t_ok[:, None, None] & e_ok[None, :, :]
    lg = tl.load(logits_ptr + t[:, None, None] * s_lt + e[None, :, :] * s_le,
                 mask=ok, other=float("-inf")).to(tl.float32)
    return t, e, t_ok, e_ok, tl.where(t_ok[:, None, None] | ~e_ok[None, :, :], lg, 0.0)


@triton.jit
def _scores(lg, SOFTMAX: tl.constexpr):
    # scores s, their sum, the log-sum-exp and the softmax q of the logits (z-loss).
    m = tl.max(tl.max(lg, 2), 1)  # [BLOCK_T]
    ex = tl.exp(lg - m[:, None, None])
    den = tl.sum(tl.sum(ex, 2), 1)
    lse = m + tl.log(den)
    q = ex / den[:, None, None]
    if SOFTMAX:
        s = q
    else:
        s = 1.0 / (1.0 + tl.exp(-lg))  # sigmoid; exactly 0 at -inf
    return s, lse, q


@triton.jit
def _router_fwd_kernel(
    logits_ptr, bias_ptr, ids_ptr, w_ptr, counts_ptr, psum_ptr, zsum_ptr,
    T, E, EG, G, SEQ_LEN, s_lt, s_le, scaling,
    TOP_K: tl.constexpr, KP: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
    PAIR: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr, GP: tl.constexpr, EGP: tl.constexpr,
):
    # logits: [T, E] float32, experts e = g * EG + j for group g < G, slot j < EG.
    # bias: [E] float32 (if HAS_BIAS). Outputs: ids [T, TOP_K] int64 and w [T, TOP_K]
    # float32, contiguous; counts [S, E] int32, psum [S, E] float32 and zsum [1] float32,
    # zero-initialised and accumulated with atomics (S = T / SEQ_LEN sequences).
    # Grid: (cdiv(T, BLOCK_T),).
    t, e, t_ok, e_ok, lg = _load_logits(logits_ptr, T, EG, G, s_lt, s_le, BLOCK_T, GP, EGP)
    s, lse, q = _scores(lg, SOFTMAX)

    # Selection scores: bias added; -inf logits, padding lanes and NaN are "unavailable".
    sel = s
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)[None, :, :]
    sel = tl.where((lg == float("-inf")) | (sel != sel), float("-inf"), sel)
    valid = tl.broadcast_to(e_ok[None, :, :], (BLOCK_T, GP, EGP))

    if GROUPED:
        # Group score = sum of the group's two best selection scores.
        jj = tl.broadcast_to(tl.arange(0, EGP)[None, None, :], (BLOCK_T, GP, EGP))
        m1 = tl.max(sel, 2)  # [BLOCK_T, GP]
        j1 = tl.min(tl.where(sel == m1[:, :, None], jj, EGP), 2)
        gscore = m1
        if PAIR:
            gscore = m1 + tl.max(tl.where(jj == j1[:, :, None], float("-inf"), sel), 2)
        gg = tl.broadcast_to(tl.arange(0, GP)[None, :], (BLOCK_T, GP))
        g_free = gg < G
        chosen_g = gg < 0  # all False
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.max(tl.where(g_free, gscore, float("-inf")), 1)
            pick = tl.min(tl.where(g_free & (gscore == best[:, None]), gg, GP), 1)
            hit = gg == pick[:, None]
            chosen_g = chosen_g | hit
            g_free = g_free & ~hit
        sel = tl.where(chosen_g[:, :, None], sel, float("-inf"))

    # Top-k by repeated arg-max; among equal scores the lowest expert index wins.
    ee = tl.broadcast_to(e[None, :, :], (BLOCK_T, GP, EGP))
    free = valid
    kk = tl.arange(0, KP)
    ids = tl.zeros((BLOCK_T, KP), tl.int64)
    wts = tl.zeros((BLOCK_T, KP), tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(tl.where(free, sel, float("-inf")), 2), 1)
        pick = tl.min(tl.min(tl.where(free & (sel == best[:, None, None]), ee, E), 2), 1)
        hit = ee == pick[:, None, None]
        free = free & ~hit
        gk = tl.sum(tl.sum(tl.where(hit, s, 0.0), 2), 1)
        ids = tl.where(kk[None, :] == k, pick[:, None].to(tl.int64), ids)
        wts = tl.where(kk[None, :] == k, gk[:, None], wts)
    if RENORM:
        wts = wts / tl.maximum(tl.sum(wts, 1), 1.1754943508222875e-38)[:, None]
    wts = wts * scaling
    out_ok = t_ok[:, None] & (kk[None, :] < TOP_K)
    tl.store(ids_ptr + t[:, None] * TOP_K + kk[None, :], ids, mask=out_ok)
    tl.store(w_ptr + t[:, None] * TOP_K + kk[None, :], wts, mask=out_ok)

    # Statistics, reduced over this block's tokens of each sequence, then one atomic add
    # per expert (a block spans at most BLOCK_T / SEQ_LEN + 2 sequences).
    routed = (valid & ~free).to(tl.int32)
    p = s / tl.maximum(tl.sum(tl.sum(s, 2), 1), 1.1754943508222875e-38)[:, None, None]
    seq = t // SEQ_LEN
    first = (tl.program_id(0) * BLOCK_T) // SEQ_LEN
    last = (tl.minimum(tl.program_id(0) * BLOCK_T + BLOCK_T, T) - 1) // SEQ_LEN
    for sq in range(first, last + 1):
        mine = (t_ok & (seq == sq))[:, None, None]
        tl.atomic_add(counts_ptr + sq * E + e, tl.sum(tl.where(mine, routed, 0), 0), mask=e_ok)
        tl.atomic_add(psum_ptr + sq * E + e, tl.sum(tl.where(mine, p, 0.0), 0), mask=e_ok)
    tl.atomic_add(zsum_ptr, tl.sum(tl.where(t_ok, lse * lse, 0.0), 0))


@triton.jit
def _router_bwd_kernel(
    logits_ptr, ids_ptr, dw_ptr, dpsum_ptr, dz_ptr, dl_ptr,
    T, E, EG, G, SEQ_LEN, s_lt, s_le, s_dt, s_de, scaling,
    TOP_K: tl.constexpr, KP: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr, GP: tl.constexpr, EGP: tl.constexpr,
):
    # logits: [T, E] float32; ids, dw: [T, TOP_K] contiguous (int64, float32); dpsum:
    # [S, E] float32 contiguous; dz: [1] float32; dl: [T, E] float32 (strides s_dt, s_de).
    # Grid: (cdiv(T, BLOCK_T),).
    t, e, t_ok, e_ok, lg = _load_logits(logits_ptr, T, EG, G, s_lt, s_le, BLOCK_T, GP, EGP)
    ok = t_ok[:, None, None] & e_ok[None, :, :]
    s, lse, q = _scores(lg, SOFTMAX)
    ee = tl.broadcast_to(e[None, :, :], (BLOCK_T, GP, EGP))

    # Weights: w_k = c · g_k / G (renormalised) or c · g_k, with g_k = s[id_k].
    kk = tl.arange(0, KP)
    k_ok = t_ok[:, None] & (kk[None, :] < TOP_K)
    ids = tl.load(ids_ptr + t[:, None] * TOP_K + kk[None, :], mask=k_ok, other=-1)
    dw = tl.load(dw_ptr + t[:, None] * TOP_K + kk[None, :], mask=k_ok, other=0.0).to(tl.float32)
    gsel = tl.zeros((BLOCK_T, KP), tl.float32)
    for k in tl.static_range(TOP_K):
        id_k = tl.sum(tl.where(kk[None, :] == k, ids, 0), 1)
        g_k = tl.sum(tl.sum(tl.where(ee == id_k[:, None, None], s, 0.0), 2), 1)
        gsel = tl.where(kk[None, :] == k, g_k[:, None], gsel)
    if RENORM:
        gsum = tl.maximum(tl.sum(gsel, 1), 1.1754943508222875e-38)
        dg = scaling / gsum[:, None] * (dw - tl.sum(dw * gsel, 1)[:, None] / gsum[:, None])
    else:
        dg = scaling * dw
    ds = tl.zeros((BLOCK_T, GP, EGP), tl.float32)
    for k in tl.static_range(TOP_K):
        id_k = tl.sum(tl.where(kk[None, :] == k, ids, 0), 1)
        dg_k = tl.sum(tl.where(kk[None, :] == k, dg, 0.0), 1)
        ds += tl.where(ee == id_k[:, None, None], dg_k[:, None, None], 0.0)

    # Aux statistics: psum[seq, e] += p[t, e] with p = s / Σ_e s.
    seq = t // SEQ_LEN
    dp = tl.load(dpsum_ptr + seq[:, None, None] * E + e[None, :, :], mask=ok, other=0.0)
    ssum = tl.maximum(tl.sum(tl.sum(s, 2), 1), 1.1754943508222875e-38)
    p = s / ssum[:, None, None]
    ds += (dp - tl.sum(tl.sum(dp * p, 2), 1)[:, None, None]) / ssum[:, None, None]

    # Through the score function, then the z-loss term d(lse²)/dl = 2 · lse · softmax(l).
    if SOFTMAX:
        dl = s * (ds - tl.sum(tl.sum(ds * s, 2), 1)[:, None, None])
    else:
        dl = ds * s * (1.0 - s)
    dz = tl.load(dz_ptr).to(tl.float32)
    dl += (2.0 * dz) * lse[:, None, None] * q
    tl.store(dl_ptr + t[:, None, None] * s_dt + e[None, :, :] * s_de, dl, mask=ok)


# --------------------------------------------------------------------------------------
# Launches (custom ops, `kernel_op`: FakeTensorMode and torch.compile see the shapes, not the kernel)
# --------------------------------------------------------------------------------------


def launch_config(tokens: int, n_experts: int, n_groups: int, *, interpreted: bool) -> LaunchConfig:
    """Blocks, warps and stages of a forward or backward router launch over ``tokens`` rows
    of ``n_experts`` logits in ``n_groups`` groups.

    Blocks: ``GP`` and ``EGP``, the groups and the experts per group padded to powers of two
    (the register tile of one token is ``[GP, EGP]``; either is 1 for one group or one expert
    per group), and ``BLOCK_T`` tokens per program: under the
    interpreter as many as fit 64K tile elements (each program is a Python round trip);
    compiled, a ``[BLOCK_T, GP, EGP]`` tile of about 2K elements (16 per thread of 4 warps:
    the kernel keeps several such tiles live, logits, scores and masks, in registers).
    ``num_stages`` is Triton's default: the kernel has no loop that loads, so there is
    nothing to pipeline."""
    gp, egp = triton.next_power_of_2(n_groups), triton.next_power_of_2(n_experts // n_groups)
    width = gp * egp
    if interpreted:
        block_t = max(2, min(triton.next_power_of_2(max(tokens, 1)), 65536 // width))
    else:
        block_t = max(2, min(64, 2048 // width))
    return LaunchConfig({"BLOCK_T": block_t, "GP": gp, "EGP": egp}, num_warps=4, num_stages=3)


def fwd_constexprs(top_k: int, softmax: bool, n_experts: int, n_groups: int, topk_groups: int,
                    renormalize: bool, has_bias: bool) -> dict[str, object]:
    """The forward kernel's constexprs other than the blocks (the launch's, the compile report's)."""
    return dict(bwd_constexprs(top_k, softmax, renormalize), TOPK_GROUPS=topk_groups, HAS_BIAS=has_bias,
                GROUPED=n_groups > 1, PAIR=n_experts // n_groups > 1)


def bwd_constexprs(top_k: int, softmax: bool, renormalize: bool) -> dict[str, object]:
    """The backward kernel's constexprs other than the blocks (the launch's, the compile report's)."""
    return dict(TOP_K=top_k, KP=triton.next_power_of_2(top_k), SOFTMAX=softmax,
                RENORM=renormalize and top_k > 1)


def _launch(kernel: object, logits: Tensor, pointers: tuple, n_groups: int, seq_len: int,
            strides: tuple, scaling_factor: float, **constexprs: object) -> None:
    """``kernel(logits, *pointers, T, E, EG, G, SEQ_LEN, *strides, scaling)`` over the ``T`` rows
    of ``logits: [T, E]`` in `launch_config`'s blocks, one program per ``BLOCK_T`` tokens; nothing
    without tokens or on fake tensors (the op only allocates)."""
    tokens, n_experts = logits.shape
    if tokens and not isinstance(logits, FakeTensor):
        config = launch_config(tokens, n_experts, n_groups, interpreted=INTERPRETED)
        kernel[(triton.cdiv(tokens, config.blocks["BLOCK_T"]),)](
            logits, *pointers, tokens, n_experts, n_experts // n_groups, n_groups, seq_len or tokens,
            *strides, float(scaling_factor), **constexprs, **config.blocks,
            num_warps=config.num_warps, num_stages=config.num_stages)


@kernel_op("fused_router")
def _fused_router_op(
    logits: Tensor, expert_bias: Tensor | None, top_k: int, softmax: bool, n_groups: int,
    topk_groups: int, renormalize: bool, scaling_factor: float, seq_len: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    tokens, n_experts = logits.shape
    dev = logits.device
    n_seqs = tokens // seq_len if seq_len else 1
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=dev)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=dev)
    counts = torch.zeros((n_seqs, n_experts), dtype=torch.int32, device=dev)
    prob_sums = torch.zeros((n_seqs, n_experts), dtype=torch.float32, device=dev)
    z_sum = torch.zeros((1,), dtype=torch.float32, device=dev)
    bias = expert_bias if expert_bias is not None else logits
    _launch(_router_fwd_kernel, logits, (bias, ids, weights, counts, prob_sums, z_sum), n_groups, seq_len,
            logits.stride(), scaling_factor,
            **fwd_constexprs(top_k, softmax, n_experts, n_groups, topk_groups, renormalize,
                             expert_bias is not None))
    return ids, weights, counts, prob_sums, z_sum


@kernel_op("fused_router_bwd")
def _fused_router_bwd_op(
    logits: Tensor, ids: Tensor, grad_weights: Tensor, grad_prob_sums: Tensor, grad_z_sum: Tensor,
    softmax: bool, n_groups: int, renormalize: bool, scaling_factor: float, seq_len: int,
) -> Tensor:
    grad_logits = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    _launch(_router_bwd_kernel, logits, (ids, grad_weights, grad_prob_sums, grad_z_sum, grad_logits),
            n_groups, seq_len, (*logits.stride(), *grad_logits.stride()), scaling_factor,
            **bwd_constexprs(ids.shape[1], softmax, renormalize))
    return grad_logits


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    logits, _, _, softmax, n_groups, _, renormalize, scaling_factor, seq_len = inputs
    ctx.save_for_backward(logits, output[0])
    ctx.args = (softmax, n_groups, renormalize, scaling_factor, seq_len)


@first_derivative_only("the fused Triton router")
def _backward(ctx: torch.autograd.function.FunctionCtx, d_ids: Tensor, d_weights: Tensor,
              d_counts: Tensor, d_prob_sums: Tensor, d_z_sum: Tensor) -> tuple[Tensor | None, ...]:
    # Autograd hands an output nobody differentiated in as zeros (it materializes them).
    logits, ids = ctx.saved_tensors
    grad = _fused_router_bwd_op(logits, ids, d_weights.float().contiguous(),
                                d_prob_sums.float().contiguous(), d_z_sum.float().contiguous(),
                                *ctx.args)
    return grad, None, None, None, None, None, None, None, None


_fused_router_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------


def fused_router(
    logits: Tensor, cfg: MoEConfig, expert_bias: Tensor | None = None, *, seq_len: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The raw kernel outputs for ``logits: [T, E]`` float32 (any strides):
    ``(topk_ids [T, k] int64, topk_weights [T, k] float32, counts [S, E] int32,
    prob_sums [S, E] float32, z_sum [1] float32)`` where ``S`` is ``T / seq_len`` (1 without
    ``seq_len``), ``counts[s, e]`` the routed slots of sequence ``s`` to expert ``e``,
    ``prob_sums[s, e]`` the sum over its tokens of ``scores[t, e] / Σ_e scores[t, e]`` and
    ``z_sum`` the sum over tokens of ``logsumexp(logits[t])²``. Differentiable in ``logits``
    through ``topk_weights``, ``prob_sums`` and ``z_sum``."""
    router_output.check_logits(logits, cfg)
    if logits.dtype != torch.float32:
        raise ValueError(f"the fused router computes in float32: logits must be float32, "
                         f"got {logits.dtype}")
    router_output.check_seq_len(logits.shape[0], seq_len)
    if expert_bias is not None:
        if expert_bias.shape != (cfg.n_experts,):
            raise ValueError(f"expert_bias must be [n_experts={cfg.n_experts}], got "
                             f"{tuple(expert_bias.shape)}")
        if expert_bias.device != logits.device:
            raise ValueError(f"expert_bias is on {expert_bias.device}, logits on {logits.device}")
        expert_bias = expert_bias.detach().float().contiguous()
    return _fused_router_op(logits, expert_bias, cfg.top_k, cfg.score_func == "softmax",
                            cfg.n_groups, cfg.topk_groups, cfg.renormalize,
                            float(cfg.scaling_factor), seq_len or 0)


def fused_route_from_logits(
    logits: Tensor, cfg: MoEConfig, expert_bias: Tensor | None = None, *, seq_len: int | None = None,
) -> router_output.RouterOutput:
    """`moe_lab.moe.router.route_from_logits`, fused: one kernel, then the losses from the
    ``[S, E]`` statistics. ``scores`` is ``None`` (never materialised). With no tokens the
    statistics are empty sums and every loss is 0 (the divisors are taken at least 1)."""
    ids, weights, counts, prob_sums, z_sum = fused_router(logits, cfg, expert_bias, seq_len=seq_len)
    tokens, n_experts, k = max(logits.shape[0], 1), cfg.n_experts, cfg.top_k
    tokens_per_expert = counts.sum(dim=0)  # int64
    # E · Σ_e f_e · P_e with f_e = count_e / (T·k) and P_e = prob_sum_e / T.
    aux = (tokens_per_expert.float() * prob_sums.sum(dim=0)).sum() * (n_experts / (tokens * k * tokens))
    seq_aux = None
    if seq_len is not None:
        n_seqs = max(logits.shape[0] // seq_len, 1)
        seq_aux = (counts.float() * prob_sums).sum() * (
            n_experts / (seq_len * k * seq_len * n_seqs))
    z = z_sum.view(()) / tokens
    return router_output.RouterOutput(ids, weights, None, logits, tokens_per_expert, aux, z, seq_aux)


def fused_route(
    x: Tensor, gate_weight: Tensor, cfg: MoEConfig, expert_bias: Tensor | None = None,
    *, seq_len: int | None = None,
) -> router_output.RouterOutput:
    """The gating matmul in float32, then the fused router (``ROUTER_IMPLS["triton"]``)."""
    router_output.check_router_input(x, cfg)
    router_output.require_fp32_router(cfg)
    logits = router_output.gate_logits(x, gate_weight, torch.float32)
    return fused_route_from_logits(logits, cfg, expert_bias, seq_len=seq_len)

