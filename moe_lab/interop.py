"""Bridges to other libraries' MoE blocks.

``from_hf_mixtral(block)`` builds a moe_lab ``MoELayer`` that computes the same function as
a Hugging Face ``transformers`` ``MixtralSparseMoeBlock`` — same router, same experts, same
weights (copied) — but with moe_lab's dispatchers: by default the dropless, sync-free one.
It lets a user drop moe_lab's layer into real model code, and it gives the benchmark a
fair, widely used baseline. ``transformers`` is a test extra, not a dependency: this module
imports nothing from it and reads the block's attributes only.

Layouts: Hugging Face stores ``gate_up_proj: [E, 2·I, H]`` and ``down_proj: [E, H, I]``
applied with ``F.linear`` (``x · Wᵀ``), gate rows first; moe_lab stores
``w_gate_up: [E, H, 2·I]`` and ``w_down: [E, I, H]`` applied as ``x · W``, gate columns
first — so each is the other's transpose in the last two dims.
"""

from __future__ import annotations

import torch

from moe_lab.config import MoEConfig
from moe_lab.moe.layer import MoELayer


def from_hf_mixtral(block: torch.nn.Module, dispatcher: str = "dropless",
                    expert_backend: str = "torch") -> MoELayer:
    """A ``MoELayer`` equal to the Hugging Face Mixtral block ``block`` (weights copied).

    ``y, stats = layer(x)`` equals ``block(x)`` for ``x: [batch, seq, hidden]`` to float32
    tolerance. Router jitter noise (a training-time input perturbation) is refused rather than
    silently ignored.
    """
    for attr in ("gate", "experts", "top_k"):
        if not hasattr(block, attr):
            raise ValueError(
                f"block must be a transformers MixtralSparseMoeBlock (missing .{attr}), "
                f"got {type(block).__name__}"
            )
    if getattr(block, "jitter_noise", 0) and block.jitter_noise > 0:
        raise ValueError(
            f"block.jitter_noise={block.jitter_noise} is not supported; build the block with "
            "router_jitter_noise=0"
        )
    experts = block.experts
    gate_up, down = experts.gate_up_proj, experts.down_proj  # [E, 2I, H], [E, H, I]
    n_experts, two_i, hidden = gate_up.shape
    config = getattr(experts, "config", None)
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"only SwiGLU experts (hidden_act='silu') are supported, got {act!r}")
    cfg = MoEConfig(
        d_model=hidden, n_experts=n_experts, top_k=int(block.top_k), d_expert=two_i // 2,
        score_func="softmax", renormalize=True,
        aux_loss_coef=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
    )
    layer = MoELayer(cfg, dispatcher=dispatcher, expert_backend=expert_backend)
    layer.to(device=gate_up.device, dtype=gate_up.dtype)
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.w_gate_up.copy_(gate_up.transpose(1, 2))
        layer.experts.w_down.copy_(down.transpose(1, 2))
    return layer
