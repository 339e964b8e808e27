"""What the Hugging Face families share: checking a block's shape, and turning its stacked
SwiGLU experts' weights into a moe_lab layer's and back; and the families that are nothing
more: Mixtral and Qwen3-MoE (OLMoE's block is Qwen3-MoE's), softmax routing over a plain gate.

Layouts: Mixtral, Qwen3-MoE and DeepSeek-V3 store ``gate_up_proj: [E, 2·I, H]`` and
``down_proj: [E, H, I]`` applied with ``F.linear`` (``x · Wᵀ``), gate rows first; moe_lab
stores ``w_gate_up: [E, H, 2·I]`` and ``w_down: [E, I, H]`` applied as ``x · W``, gate
columns first — so each is the other's transpose in the last two dims.

``*_from_hf`` / ``*_to_hf``: a block's ``state_dict`` to a layer's and back (bias aside).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_lab.config import MoEConfig
from moe_lab.moe.layer import MoELayer

Tensor = torch.Tensor


def require_attrs(block: torch.nn.Module, family: str, *attrs: str) -> None:
    """Refuse ``block`` unless it has every attribute in ``attrs`` (``family`` names the
    Hugging Face class expected, for the message)."""
    for attr in attrs:
        if not hasattr(block, attr):
            raise ValueError(f"block must be a transformers {family} (missing .{attr}), "
                             f"got {type(block).__name__}")


def require_silu(experts: torch.nn.Module) -> None:
    """Refuse experts whose activation is not SiLU (moe_lab's experts are SwiGLU), checked
    by value so that any module computing SiLU passes."""
    act = getattr(experts, "act_fn", None)
    probe = torch.linspace(-6, 6, 25)
    if act is None or not torch.allclose(act(probe), F.silu(probe)):
        raise ValueError(f"only SwiGLU experts (hidden_act='silu') are supported, got "
                         f"act_fn={type(act).__name__}")


def require_renormalized_top1(top_k: int, renormalize: bool) -> None:
    """Hugging Face renormalises a single chosen weight to 1; moe_lab's router keeps the
    top-1 probability (Switch style). Refuse the combination."""
    if top_k == 1 and renormalize:
        raise ValueError("num_experts_per_tok=1 (top_k=1) with renormalised weights (every weight 1.0) "
                         "is not supported: moe_lab keeps the top-1 probability as the weight")


def swiglu_from_hf(state: dict[str, Tensor], router: str = "gate") -> dict[str, Tensor]:
    """A `MoELayer`'s state from a stacked-SwiGLU block's; the selection bias zero."""
    gate = state[f"{router}.weight"]
    return {"router.weight": gate, "router.expert_bias": gate.new_zeros(gate.shape[0]),
            "experts.w_gate_up": state["experts.gate_up_proj"].transpose(1, 2),
            "experts.w_down": state["experts.down_proj"].transpose(1, 2)}


def swiglu_to_hf(state: dict[str, Tensor], router: str = "gate") -> dict[str, Tensor]:
    """`swiglu_from_hf` inverted."""
    return {f"{router}.weight": state["router.weight"],
            "experts.gate_up_proj": state["experts.w_gate_up"].transpose(1, 2),
            "experts.down_proj": state["experts.w_down"].transpose(1, 2)}


def load_layer(layer: MoELayer, state: dict[str, Tensor], like: Tensor) -> MoELayer:
    """``layer`` on ``like``'s device and dtype with ``state`` copied in (no shared storage)."""
    layer.to(device=like.device, dtype=like.dtype)
    layer.load_state_dict(state, strict=True)
    return layer


def swiglu_layer(block: torch.nn.Module, top_k: int, renormalize: bool, dispatcher: str, expert_backend: str,
                 router_impl: str, from_hf: Callable = swiglu_from_hf, **routing: float | str) -> MoELayer:
    """The ``MoELayer`` of a block with stacked SwiGLU experts, holding ``from_hf`` of the
    block's state. Its routing is a plain gate unless ``routing`` (more `MoEConfig` fields)
    says otherwise: softmax over all experts, top-k, the chosen weights renormalised where
    ``renormalize``, as Mixtral, Qwen3-MoE and OLMoE route (DeepSeek-V3 passes its sigmoid,
    groups, scaling and shared experts). Its experts' activation and a renormalised top-1 are
    refused."""
    require_silu(block.experts)
    require_renormalized_top1(top_k, renormalize)
    n_experts, two_i, hidden = block.experts.gate_up_proj.shape
    cfg = MoEConfig(d_model=hidden, n_experts=n_experts, top_k=top_k, d_expert=two_i // 2,
                    renormalize=renormalize, aux_loss_coef=0.0, **routing)
    layer = MoELayer(cfg, dispatcher, expert_backend, router_impl)
    return load_layer(layer, from_hf(block.state_dict()), block.experts.gate_up_proj)


def from_hf_mixtral(block: torch.nn.Module, dispatcher: str = "dropless",
                    expert_backend: str = "torch", router_impl: str = "reference") -> MoELayer:
    """A ``MoELayer`` equal to the Hugging Face Mixtral block ``block`` (weights copied).

    Mixtral: softmax over all experts, top-k, the chosen weights always renormalised to sum to
    one (with one expert per token, 1.0: refused, moe_lab's router cannot express it).

    ``y, stats = layer(x)`` equals ``block(x)`` for ``x: [batch, seq, hidden]`` to float32
    tolerance. Router jitter noise (a training-time input perturbation) and
    ``num_experts_per_tok=1`` are refused rather than computed differently.
    """
    require_attrs(block, "MixtralSparseMoeBlock", "gate", "experts", "top_k")
    if getattr(block, "jitter_noise", 0) and block.jitter_noise > 0:
        raise ValueError(f"block.jitter_noise={block.jitter_noise} is not supported; build the "
                         "block with router_jitter_noise=0")
    return swiglu_layer(block, int(block.top_k), True, dispatcher, expert_backend, router_impl)


def from_hf_qwen3_moe(block: torch.nn.Module, dispatcher: str = "dropless",
                      expert_backend: str = "torch", router_impl: str = "reference") -> MoELayer:
    """A ``MoELayer`` equal to the Hugging Face ``Qwen3MoeSparseMoeBlock`` (or
    ``OlmoeSparseMoeBlock``) ``block``, weights copied: ``layer(x)[0]`` equals ``block(x)``
    for ``x: [batch, seq, hidden]`` to float32 tolerance.

    Qwen3-MoE (and OLMoE, whose block is the same): softmax over all experts, top-k, the
    chosen weights renormalised only where the config says (``norm_topk_prob``)."""
    require_attrs(block, "Qwen3MoeSparseMoeBlock", "gate", "experts")
    gate = block.gate
    require_attrs(gate, "Qwen3MoeTopKRouter", "weight", "top_k", "norm_topk_prob")
    return swiglu_layer(block, int(gate.top_k), bool(gate.norm_topk_prob), dispatcher,
                        expert_backend, router_impl)
