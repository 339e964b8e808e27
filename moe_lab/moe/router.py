"""The MoE router: which experts each token goes to, and with what weight.

A router is a small linear layer (the *gate*) that scores every expert for every token,
followed by a chain of cheap elementwise steps: a score function (softmax or sigmoid),
optionally *group-limited* selection (DeepSeek-V3: experts are split into groups, and
only the best few groups — ranked by the sum of each group's top-2 scores — may be
picked), a per-expert bias added for selection only (aux-loss-free load balancing), the
top-k, renormalisation of the chosen weights and a scaling factor. Around it sit the
statistics that keep experts balanced: tokens per expert, the switch-style auxiliary
loss and the router z-loss.

This module is the *reference*: the unfused chain, written the way frameworks write it,
each step one or more full passes over a ``[tokens, n_experts]`` tensor. It runs in
float32 or float64 (``MoEConfig.router_dtype``); routers are kept in high precision
because the weights they produce multiply the experts' outputs directly.

Shapes: ``x: [tokens, d_model]`` → ``topk_ids: [tokens, top_k] int64``,
``topk_weights: [tokens, top_k]`` (router dtype), ``tokens_per_expert: [n_experts] int64``.
Ties in the top-k are broken towards the lower expert index (``torch.topk`` on the CPU
and CUDA returns the first occurrence among equal values for ``sorted=True``).
Every step here is sync-free: counts come from ``scatter_add_``, not ``bincount``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from moe_lab.config import MoEConfig

Tensor = torch.Tensor
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass
class RouterOutput:
    topk_ids: Tensor  # [T, k] int64
    topk_weights: Tensor  # [T, k] router dtype
    scores: Tensor  # [T, E] router dtype, after the score function
    logits: Tensor  # [T, E] router dtype
    tokens_per_expert: Tensor  # [E] int64
    aux_loss: Tensor  # [] router dtype (unscaled by the coefficient)
    z_loss: Tensor  # [] router dtype (unscaled)


def group_limited_mask(scores: Tensor, n_groups: int, topk_groups: int) -> Tensor:
    """Boolean ``[T, E]`` mask of the experts inside each token's ``topk_groups`` best groups.

    A group's score is the sum of its two best expert scores (one if a group has one expert).
    """
    tokens, n_experts = scores.shape
    per_group = n_experts // n_groups
    grouped = scores.view(tokens, n_groups, per_group)
    group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, G]
    best_groups = group_scores.topk(topk_groups, dim=-1).indices  # [T, g]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return group_mask.unsqueeze(-1).expand(tokens, n_groups, per_group).reshape(tokens, n_experts)


def tokens_per_expert_from_ids(topk_ids: Tensor, n_experts: int) -> Tensor:
    """``[n_experts]`` int64 counts of each expert id in ``topk_ids`` (sync-free)."""
    counts = torch.zeros(n_experts, dtype=torch.int64, device=topk_ids.device)
    return counts.scatter_add_(0, topk_ids.reshape(-1), torch.ones_like(topk_ids.reshape(-1)))


def switch_aux_loss(scores: Tensor, tokens_per_expert: Tensor, top_k: int) -> Tensor:
    """Switch-Transformer load-balancing loss: ``E · Σ_e f_e · P_e``.

    ``f_e`` is the fraction of routed slots that went to expert ``e`` (not differentiable),
    ``P_e`` the mean routing probability of ``e`` (differentiable). It equals 1 when both are
    uniform and grows as routing concentrates.
    """
    tokens, n_experts = scores.shape
    if tokens == 0:
        return scores.sum() * 0
    probs = scores / scores.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    f = tokens_per_expert.to(scores.dtype) / (tokens * top_k)
    return n_experts * (f * probs.mean(dim=0)).sum()


def route(
    x: Tensor,
    gate_weight: Tensor,
    cfg: MoEConfig,
    expert_bias: Tensor | None = None,
) -> RouterOutput:
    """The reference routing chain. ``gate_weight: [n_experts, d_model]``."""
    if x.dim() != 2 or x.shape[1] != cfg.d_model:
        raise ValueError(f"x must be [tokens, d_model={cfg.d_model}], got {tuple(x.shape)}")
    dtype = DTYPES[cfg.router_dtype]
    logits = x.to(dtype) @ gate_weight.to(dtype).t()  # [T, E]
    if cfg.score_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        scores = logits.sigmoid()
    selection = scores if expert_bias is None else scores + expert_bias.to(dtype)
    if cfg.n_groups > 1:
        mask = group_limited_mask(selection, cfg.n_groups, cfg.topk_groups)
        selection = selection.masked_fill(~mask, float("-inf"))
    topk_ids = selection.topk(cfg.top_k, dim=-1, sorted=True).indices  # [T, k]
    topk_weights = scores.gather(1, topk_ids)
    if cfg.renormalize and cfg.top_k > 1:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True).clamp_min(
            torch.finfo(dtype).tiny
        )
    topk_weights = topk_weights * cfg.scaling_factor
    tokens_per_expert = tokens_per_expert_from_ids(topk_ids, cfg.n_experts)
    aux = switch_aux_loss(scores, tokens_per_expert, cfg.top_k)
    z = logits.logsumexp(dim=-1).square().mean() if x.shape[0] else logits.sum() * 0
    return RouterOutput(topk_ids, topk_weights, scores, logits, tokens_per_expert, aux, z)


# name -> fn(x, gate_weight, cfg, expert_bias) -> RouterOutput; faster variants register here.
ROUTER_IMPLS = {"reference": route}


class Router(nn.Module):
    """The gate (``weight: [n_experts, d_model]``) and the routing chain of ``route``.

    ``expert_bias`` (a buffer, zeros by default) is added to the scores for selection only.
    """

    def __init__(self, cfg: MoEConfig, impl: str = "reference") -> None:
        super().__init__()
        if impl not in ROUTER_IMPLS:
            raise ValueError(f"router impl must be one of {sorted(ROUTER_IMPLS)}, got {impl!r}")
        self.cfg = cfg
        self.impl = impl
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.cfg.d_model**-0.5)

    def forward(self, x: Tensor) -> RouterOutput:
        return ROUTER_IMPLS[self.impl](x, self.weight, self.cfg, self.expert_bias)
