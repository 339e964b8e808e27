"""Mixtral: softmax over all experts, top-k, the chosen weights always renormalised to sum to
one (with one expert per token, 1.0: refused, moe_lab's router cannot express it)."""

from __future__ import annotations

import torch

import moe_lab.workbench.interop.hf_blocks as hf
from moe_lab.moe.layer import MoELayer


def from_hf_mixtral(block: torch.nn.Module, dispatcher: str = "dropless",
                    expert_backend: str = "torch", router_impl: str = "reference") -> MoELayer:
    """A ``MoELayer`` equal to the Hugging Face Mixtral block ``block`` (weights copied).

    ``y, stats = layer(x)`` equals ``block(x)`` for ``x: [batch, seq, hidden]`` to float32
    tolerance. Router jitter noise (a training-time input perturbation) and
    ``num_experts_per_tok=1`` are refused rather than computed differently.
    """
    hf.require_attrs(block, "MixtralSparseMoeBlock", "gate", "experts", "top_k")
    if getattr(block, "jitter_noise", 0) and block.jitter_noise > 0:
        raise ValueError(f"block.jitter_noise={block.jitter_noise} is not supported; build the "
                         "block with router_jitter_noise=0")
    return hf.softmax_swiglu_layer(block, int(block.top_k), True, dispatcher, expert_backend, router_impl)
