"""What the Hugging Face families share: checking a block's shape and copying its stacked
SwiGLU experts into a moe_lab layer.

Layouts: Mixtral, Qwen3-MoE and DeepSeek-V3 store ``gate_up_proj: [E, 2·I, H]`` and
``down_proj: [E, H, I]`` applied with ``F.linear`` (``x · Wᵀ``), gate rows first; moe_lab
stores ``w_gate_up: [E, H, 2·I]`` and ``w_down: [E, I, H]`` applied as ``x · W``, gate
columns first — so each is the other's transpose in the last two dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_lab.config import MoEConfig
from moe_lab.moe.layer import MoELayer


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
    top-1 probability (Switch style). Refuse the combination rather than differ."""
    if top_k == 1 and renormalize:
        raise ValueError("top_k=1 with renormalised weights (every weight 1.0) is not supported: "
                         "moe_lab keeps the top-1 probability as the weight")


def stacked_swiglu_layer(cfg: MoEConfig, experts: torch.nn.Module, gate_weight: torch.Tensor,
                         dispatcher: str, expert_backend: str, router_impl: str) -> MoELayer:
    """A ``MoELayer`` for ``cfg`` with the router's gate and the experts' stacked
    ``[E, 2I, H]`` / ``[E, H, I]`` weights copied from a Hugging Face block, on their device
    and in their dtype."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    layer = MoELayer(cfg, dispatcher=dispatcher, expert_backend=expert_backend,
                     router_impl=router_impl)
    layer.to(device=gate_up.device, dtype=gate_up.dtype)
    with torch.no_grad():
        layer.router.weight.copy_(gate_weight)
        layer.experts.w_gate_up.copy_(gate_up.transpose(1, 2))
        layer.experts.w_down.copy_(down.transpose(1, 2))
    return layer
