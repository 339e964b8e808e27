"""Token dispatchers: how routed tokens reach their experts and come back.

A dispatcher takes the tokens ``x: [T, d_model]``, the router's choice
``topk_ids: [T, k]`` and ``topk_weights: [T, k]``, and the experts, and returns
``y: [T, d_model] = Σ_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])`` together
with the number of (token, expert) assignments it dropped.

``naive`` is the loop most code starts from (Hugging Face's Mixtral block is written this
way): for every expert, find its tokens with a boolean mask, gather them, run the expert,
scatter-add the weighted result. Finding "its tokens" is ``torch.where(mask)`` — a
``nonzero`` whose output size depends on the data, so the host must wait for the device
once per expert. It drops nothing and is the correctness reference for every other
dispatcher; it is slow on purpose.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_lab.moe.experts import SwiGLUExperts

Tensor = torch.Tensor
# name -> fn(x, topk_ids, topk_weights, experts, cfg) -> (y, dropped_tokens: Tensor[] int64)
DISPATCHERS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {}


def register_dispatcher(name: str):
    def add(fn):
        DISPATCHERS[name] = fn
        return fn

    return add


@register_dispatcher("naive")
def naive_dispatch(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, experts: SwiGLUExperts, cfg=None
) -> tuple[Tensor, Tensor]:
    """Loop over experts; boolean-mask selection of each expert's tokens (one sync each)."""
    out = torch.zeros_like(x)
    # [E, T, k]: expert_mask[e, t, j] is True where token t's j-th choice is expert e.
    expert_mask = F.one_hot(topk_ids, experts.n_experts).permute(2, 0, 1).bool()
    for e in range(experts.n_experts):
        token_idx, slot = torch.where(expert_mask[e])  # data-dependent size: a host sync
        y_e = experts.forward_expert(e, x[token_idx])
        weight = topk_weights[token_idx, slot].unsqueeze(-1).to(y_e.dtype)
        out.index_add_(0, token_idx, y_e * weight)
    return out, torch.zeros((), dtype=torch.int64, device=x.device)
