"""The MoE router: which experts each token goes to, and with what weight.

A router is a small linear layer (the *gate*) that scores every expert for every token,
followed by a chain of cheap elementwise steps: a score function (softmax or sigmoid),
optionally *group-limited* selection (DeepSeek-V3: experts are split into groups, and
only the best few groups — ranked by the sum of each group's top-2 scores — may be
picked), a per-expert bias added for selection only (aux-loss-free load balancing), the
top-k, renormalisation of the chosen weights and a scaling factor. Around it sit the
statistics that keep experts balanced: tokens per expert, the switch-style auxiliary
loss, the sequence-level auxiliary loss (DeepSeek-V3) and the router z-loss.

This module is the *reference*: the unfused chain, written the way frameworks write it,
each step one or more full passes over a ``[tokens, n_experts]`` tensor. It runs in
float32 or float64 (``MoEConfig.router_dtype``); routers are kept in high precision
because the weights they produce multiply the experts' outputs directly. The fused
router (`moe_lab.kernels.fused_router`) and a ``torch.compile`` of this chain are registered
beside it in ``ROUTER_IMPLS`` and tested against it.

Shapes: ``x: [tokens, d_model]`` → ``topk_ids: [tokens, top_k] int64``,
``topk_weights: [tokens, top_k]`` (router dtype), ``tokens_per_expert: [n_experts] int64``.

Defined behaviour, kept by every implementation:

- **Ties** go to the lower expert index, and the ``top_k`` slots are ordered by score,
  highest first. ``torch.topk`` does not promise this (on the CPU it returns equal values
  in no fixed order), so the reference uses `topk_lowest_index` (a top-k of unique keys
  that pack the score and the index, or a stable sort in float64); the same rule picks
  the groups.
- **-inf logits** are allowed and mean "this expert is unavailable to this token": it is
  never chosen while another expert is available (whatever its bias), and it is chosen,
  lowest index first, only when fewer than ``top_k`` are. Its score, weight and gradient
  are 0. Under softmax a token whose logits are *all* -inf has no scores: they are NaN.
- **NaN logits** propagate: the token's scores, and through them the weights or the
  auxiliary statistics, become NaN, so the loss shows it; the ids stay valid indices, but
  which ones is not specified. Nothing is checked on the host (that would be a sync);
  ``torch.isfinite(logits).all()`` is the explicit, syncing check.

Every step here is sync-free: counts come from ``scatter_add_``, not ``bincount``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn

from moe_lab.config import ModelImpls, MoEConfig
from moe_lab.moe.router_output import (
    DTYPES,
    RouterOutput,
    check_logits,
    check_router_input,
    check_seq_len,
    gate_logits,
    require_fp32_router,
)
from moe_lab.registry import TRITON_MISSING, Registry

Tensor = torch.Tensor


def topk_lowest_index(values: Tensor, k: int) -> Tensor:
    """Indices ``[..., k]`` of the ``k`` largest ``values`` along the last dim, highest first,
    ties to the lower index.

    float64: the first ``k`` of a stable descending sort. float32: a top-k of *unique*
    64-bit keys — the float's bits made monotone (for negative floats the magnitude bits
    are flipped, so larger float means larger integer), shifted up, and the reversed
    expert index in the low bits — so no two keys are equal and ``torch.topk``'s order among
    equal values never matters. Packing value and index into one key is how GPU top-k
    kernels make ties deterministic; it is also a top-k, not a sort, so it stays cheap.
    """
    if values.dtype != torch.float32:
        return values.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return topk_by_unique_keys(values, k)


def topk_by_unique_keys(values: Tensor, k: int) -> Tensor:
    """`topk_lowest_index` for float32 in PyTorch ops (the reference; any device, any rank)."""
    n = values.shape[-1]
    bits = (values + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    shift = max(1, (n - 1).bit_length())
    reversed_index = (1 << shift) - 1 - torch.arange(n, device=values.device)
    keys = ordered * (1 << shift) + reversed_index
    low = keys.topk(k, dim=-1, sorted=True).values & ((1 << shift) - 1)
    return (1 << shift) - 1 - low


def _torch_topk(values: Tensor, k: int) -> Tensor:
    """``torch.topk``'s indices along the last dim, highest first, equal values in no fixed order:
    the top-k frameworks run (``route_from_logits(..., lowest_index_ties=False)``)."""
    return values.topk(k, dim=-1).indices


def group_limited_mask(scores: Tensor, n_groups: int, topk_groups: int,
                       topk: Callable[[Tensor, int], Tensor] = topk_lowest_index) -> Tensor:
    """Boolean ``[T, E]`` mask of the experts inside each token's ``topk_groups`` best groups.

    A group's score is the sum of its two best expert scores (one if a group has one expert);
    groups with equal scores go to the lower group index (with ``topk=_torch_topk``,
    ``torch.topk``'s order, as frameworks do).
    """
    tokens, n_experts = scores.shape
    per_group = n_experts // n_groups
    grouped = scores.view(tokens, n_groups, per_group)
    # The sum of the two best values does not depend on which of two equal values is first.
    group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, G]
    best_groups = topk(group_scores, topk_groups)  # [T, g]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return group_mask.unsqueeze(-1).expand(tokens, n_groups, per_group).reshape(tokens, n_experts)


def tokens_per_expert_from_ids(topk_ids: Tensor, n_experts: int) -> Tensor:
    """``[n_experts]`` int64 counts of each expert id in ``topk_ids`` (sync-free)."""
    counts = torch.zeros(n_experts, dtype=torch.int64, device=topk_ids.device)
    return counts.scatter_add_(0, topk_ids.reshape(-1), torch.ones_like(topk_ids.reshape(-1)))


def routing_agreement(topk_ids: Tensor, reference_ids: Tensor) -> float:
    """Fraction of the (token, slot) choices in ``topk_ids`` that ``reference_ids`` also made
    for that token (order within a token's top-k ignored); 1.0 for no tokens. Reads the
    answer back to the host: for reports, not for the training step."""
    if topk_ids.shape != reference_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and reference_ids "
                         f"{tuple(reference_ids.shape)} must have the same shape")
    if topk_ids.numel() == 0:
        return 1.0
    hit = (topk_ids.unsqueeze(-1) == reference_ids.unsqueeze(-2)).any(-1)
    return float(hit.float().mean())


def switch_aux_loss(scores: Tensor, tokens_per_expert: Tensor, top_k: int) -> Tensor:
    """Switch-Transformer load-balancing loss: ``E · Σ_e f_e · P_e``.

    ``f_e`` is the fraction of routed slots that went to expert ``e`` (not differentiable),
    ``P_e`` the mean routing probability of ``e`` (differentiable; scores are normalised to
    sum to one per token, which matters for sigmoid scores). It equals 1 when both are
    uniform and grows as routing concentrates.
    """
    tokens, n_experts = scores.shape
    if tokens == 0:
        return scores.sum() * 0
    probs = scores / scores.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    f = tokens_per_expert.to(scores.dtype) / (tokens * top_k)
    return n_experts * (f * probs.mean(dim=0)).sum()


def sequence_aux_loss(scores: Tensor, topk_ids: Tensor, top_k: int, seq_len: int) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss: the switch loss of each sequence of
    ``seq_len`` consecutive tokens, averaged over sequences. It keeps every *sequence*
    balanced, not just the batch. ``tokens`` must be a multiple of ``seq_len``."""
    tokens, n_experts = scores.shape
    if tokens == 0:
        return scores.sum() * 0
    n_seqs = tokens // seq_len
    probs = scores / scores.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    seq_of_token = torch.arange(tokens, device=scores.device) // seq_len  # [T]
    slots = seq_of_token.unsqueeze(1) * n_experts + topk_ids  # [T, k]: (sequence, expert) bins
    counts = tokens_per_expert_from_ids(slots, n_seqs * n_experts).to(scores.dtype)
    f = counts.view(n_seqs, n_experts) / (seq_len * top_k)
    p = probs.view(n_seqs, seq_len, n_experts).mean(dim=1)
    return n_experts * (f * p).sum(dim=-1).mean()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE's z-loss: the mean squared log-sum-exp of each token's logits."""
    if logits.shape[0] == 0:
        return logits.sum() * 0
    return logits.logsumexp(dim=-1).square().mean()


def route_from_logits(logits: Tensor, cfg: MoEConfig, expert_bias: Tensor | None = None, *,
                      seq_len: int | None = None, lowest_index_ties: bool = True,
                      topk: Callable[[Tensor, int], Tensor] = topk_lowest_index) -> RouterOutput:
    """The reference chain after the gating matmul. ``logits: [tokens, n_experts]`` float32 or
    float64; the chain computes in that dtype.

    ``lowest_index_ties=False`` takes ``torch.topk`` for the groups and the experts, as
    frameworks do (equal scores in no fixed order): the same function on data without
    ties, used to time the chain the way frameworks run it. ``topk`` is the lowest-index
    top-k used otherwise (`topk_lowest_index`; a plug-in may pass a faster one giving the same
    indices).
    """
    check_logits(logits, cfg)
    if logits.dtype not in DTYPES.values():
        raise ValueError(f"logits must be float32 or float64, got {logits.dtype}")
    check_seq_len(logits.shape[0], seq_len)
    return _routing_chain(logits, cfg, expert_bias, seq_len, topk if lowest_index_ties else _torch_topk)


def _routing_chain(logits: Tensor, cfg: MoEConfig, expert_bias: Tensor | None, seq_len: int | None,
                   topk: Callable[[Tensor, int], Tensor]) -> RouterOutput:
    """`route_from_logits` after its checks: scores, selection, top-k, weights, loss terms."""
    dtype = logits.dtype
    scores = logits.softmax(dim=-1) if cfg.score_func == "softmax" else logits.sigmoid()
    selection = scores if expert_bias is None else scores + expert_bias.to(dtype)
    # A -inf logit marks the expert unavailable, whatever its bias.
    selection = selection.masked_fill(logits == float("-inf"), float("-inf"))
    if cfg.n_groups > 1:
        mask = group_limited_mask(selection, cfg.n_groups, cfg.topk_groups, topk)
        selection = selection.masked_fill(~mask, float("-inf"))
    topk_ids = topk(selection, cfg.top_k)  # [T, k]
    topk_weights = scores.gather(1, topk_ids)
    if cfg.renormalize and cfg.top_k > 1:
        tiny = torch.finfo(dtype).tiny
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True).clamp_min(tiny)
    topk_weights = topk_weights * cfg.scaling_factor
    tokens_per_expert = tokens_per_expert_from_ids(topk_ids, cfg.n_experts)
    aux = switch_aux_loss(scores, tokens_per_expert, cfg.top_k)
    seq_aux = None if seq_len is None else sequence_aux_loss(scores, topk_ids, cfg.top_k, seq_len)
    z = router_z_loss(logits)
    return RouterOutput(topk_ids, topk_weights, scores, logits, tokens_per_expert, aux, z, seq_aux)


def route(x: Tensor, gate_weight: Tensor, cfg: MoEConfig, expert_bias: Tensor | None = None, *,
          seq_len: int | None = None,
          topk: Callable[[Tensor, int], Tensor] = topk_lowest_index) -> RouterOutput:
    """The reference routing chain. ``gate_weight: [n_experts, d_model]``; ``seq_len`` (the
    tokens are whole sequences of that length, in order) adds ``seq_aux_loss``; ``topk`` as
    in `route_from_logits`. Checked here, once: ``x: [tokens, d_model]`` and ``seq_len``."""
    if x.dim() != 2 or x.shape[1] != cfg.d_model:
        raise ValueError(f"x must be [tokens, d_model={cfg.d_model}], got {tuple(x.shape)}")
    if seq_len is not None:
        check_seq_len(x.shape[0], seq_len)
    dtype = DTYPES[cfg.router_dtype]
    logits_TE = x.to(dtype) @ gate_weight.to(dtype).t()  # what `gate_logits` computes
    return _routing_chain(logits_TE, cfg, expert_bias, seq_len, topk)


@functools.cache
def _compiled_chain() -> Callable[..., RouterOutput]:
    # torch.compile of the chain after the matmul: the fair fused baseline on a CPU, where
    # Inductor fuses the elementwise steps into a few loops. Compiled on first use.
    return torch.compile(route_from_logits, dynamic=False)


def compiled_route_from_logits(logits: Tensor, cfg: MoEConfig, expert_bias: Tensor | None = None, *,
                               seq_len: int | None = None) -> RouterOutput:
    """`route_from_logits` under ``torch.compile`` (same function, same tie rule)."""
    return _compiled_chain()(logits, cfg, expert_bias, seq_len=seq_len)


def compiled_route(x: Tensor, gate_weight: Tensor, cfg: MoEConfig, expert_bias: Tensor | None = None, *,
                   seq_len: int | None = None) -> RouterOutput:
    """`route` with the chain after the matmul compiled (``ROUTER_IMPLS["compiled"]``)."""
    check_router_input(x, cfg)
    logits = gate_logits(x, gate_weight, DTYPES[cfg.router_dtype])
    return compiled_route_from_logits(logits, cfg, expert_bias, seq_len=seq_len)


def fused_route(x: Tensor, gate_weight: Tensor, cfg: MoEConfig, expert_bias: Tensor | None = None, *,
                seq_len: int | None = None) -> RouterOutput:
    """The fused Triton router (``ROUTER_IMPLS["triton"]``); see `moe_lab.kernels.fused_router`.
    Imported on first use, so that importing this module does not import Triton."""
    from moe_lab.kernels.fused_router import fused_route as fused

    return fused(x, gate_weight, cfg, expert_bias, seq_len=seq_len)


# name -> fn(x, gate_weight, cfg, expert_bias, *, seq_len=None) -> RouterOutput; each is
# tested against "reference" (tests/lesson/moe/test_router.py,
# tests/lesson/kernels/test_router_kernel.py). A plug-in
# may register more; "reference" is always the pure PyTorch chain above.
ROUTER_IMPLS: Registry[Callable[..., RouterOutput]] = Registry(
    "router impl", "routing chains, each the reference's function", plugin=True)
ROUTER_IMPLS.register("reference", route)
ROUTER_IMPLS.register("compiled", compiled_route)
ROUTER_IMPLS.register("triton", fused_route, missing=TRITON_MISSING)


class Router(nn.Module):
    """The gate (``weight: [n_experts, d_model]``) and the routing chain of ``route``.

    ``expert_bias`` (a buffer, zeros by default) is added to the scores for selection only;
    `moe_lab.moe.balance.update_expert_bias` moves it after each optimizer step.
    """

    def __init__(self, cfg: MoEConfig, impl: str = ModelImpls.router_impl) -> None:
        super().__init__()
        self.cfg, self.impl = cfg, ROUTER_IMPLS.check(impl, "router_impl")
        if impl == "triton":
            require_fp32_router(cfg)
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        nn.init.normal_(self.weight, std=cfg.d_model**-0.5)

    def forward(self, x: Tensor, seq_len: int | None = None) -> RouterOutput:
        """Route ``x: [tokens, d_model]``; with ``seq_len`` (the tokens are whole sequences of
        that length, in order) the output carries ``seq_aux_loss`` too."""
        return ROUTER_IMPLS[self.impl](x, self.weight, self.cfg, self.expert_bias, seq_len=seq_len)
