"""Qwen3-MoE (and OLMoE, whose block is the same): softmax over all experts, top-k, the
chosen weights renormalised only where the config says (``norm_topk_prob``)."""

from __future__ import annotations

import torch

import moe_lab.workbench.interop.hf_blocks as hf
from moe_lab.moe.layer import MoELayer


def from_hf_qwen3_moe(block: torch.nn.Module, dispatcher: str = "dropless",
                      expert_backend: str = "torch", router_impl: str = "reference") -> MoELayer:
    """A ``MoELayer`` equal to the Hugging Face ``Qwen3MoeSparseMoeBlock`` (or
    ``OlmoeSparseMoeBlock``) ``block``, weights copied: ``layer(x)[0]`` equals ``block(x)``
    for ``x: [batch, seq, hidden]`` to float32 tolerance."""
    hf.require_attrs(block, "Qwen3MoeSparseMoeBlock", "gate", "experts")
    gate = block.gate
    hf.require_attrs(gate, "Qwen3MoeTopKRouter", "weight", "top_k", "norm_topk_prob")
    return hf.softmax_swiglu_layer(block, int(gate.top_k), bool(gate.norm_topk_prob), dispatcher,
                                   expert_backend, router_impl)
