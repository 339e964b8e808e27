"""`patch_hf_model`: every MoE block of a Hugging Face model swapped for moe_lab's layer, in
place.

Each block is replaced by an `HFMoEAdapter` around the layer its family's ``from_hf_*``
builds; the adapter takes what the block takes (``hidden_states: [batch, seq, hidden]``) and
returns what it returns (the hidden states; for GPT-OSS also the router scores), so the
decoder layers around it run unchanged. moe_lab's routing statistics of the last call are
kept on the adapter (``adapter.stats``) for a caller who wants moe_lab's balance losses.

Not carried over: Hugging Face records router logits with forward hooks on its router
modules (``output_router_logits=True``), and those modules are gone after the swap; the
model's own router aux loss is therefore refused rather than silently zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from moe_lab.interop.deepseek_v3 import from_hf_deepseek_v3
from moe_lab.interop.gpt_oss import from_hf_gpt_oss
from moe_lab.interop.mixtral import from_hf_mixtral
from moe_lab.interop.qwen3_moe import from_hf_qwen3_moe
from moe_lab.moe.layer import MoELayer, MoEStats

Tensor = torch.Tensor

# Hugging Face MoE block class name -> (builder, whether the block also returns router scores).
HF_MOE_BLOCKS: dict[str, tuple[Callable[..., MoELayer], bool]] = {
    "MixtralSparseMoeBlock": (from_hf_mixtral, False),
    "Qwen3MoeSparseMoeBlock": (from_hf_qwen3_moe, False),
    "OlmoeSparseMoeBlock": (from_hf_qwen3_moe, False),
    "DeepseekV3MoE": (from_hf_deepseek_v3, False),
    "GptOssMLP": (from_hf_gpt_oss, True),
}


class HFMoEAdapter(nn.Module):
    """A moe_lab ``layer`` behind a Hugging Face MoE block's interface: ``forward(hidden_states)``
    returns ``y`` (or ``(y, router_scores: [tokens, top_k])`` with ``returns_router_scores``)."""

    def __init__(self, layer: MoELayer, returns_router_scores: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.returns_router_scores = returns_router_scores
        self.stats: MoEStats | None = None

    def forward(self, hidden_states: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        y, self.stats = self.layer(hidden_states)
        if self.returns_router_scores:
            return y, self.stats.routing.topk_weights.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"returns_router_scores={self.returns_router_scores}"


def patch_hf_model(model: nn.Module, dispatcher: str = "dropless", expert_backend: str = "torch",
                   router_impl: str = "reference") -> dict[str, nn.Module]:
    """Replace every MoE block of the Hugging Face ``model`` (classes in `HF_MOE_BLOCKS`) with
    an `HFMoEAdapter` around an equal moe_lab layer, in place; returns ``{qualified name:
    the block it replaced}`` (put them back with ``model.set_submodule(name, block)``).

    Each layer copies its block's weights and takes its device, dtype and train/eval mode;
    the model computes the same logits and gradients afterwards (to float32 rounding).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise ValueError("model.config.output_router_logits=True is not supported: the router "
                         "modules Hugging Face records logits from are replaced; set it to False "
                         "and use each adapter's .stats for balance losses")
    targets = [(name, module) for name, module in model.named_modules()
               if type(module).__name__ in HF_MOE_BLOCKS]
    if not targets:
        patched = sum(isinstance(module, HFMoEAdapter) for module in model.modules())
        if patched:
            raise ValueError(f"model {type(model).__name__} is already patched: its {patched} MoE "
                             "blocks are moe_lab adapters")
        raise ValueError(f"model {type(model).__name__} has no MoE block of a supported family "
                         f"(expected one of {sorted(HF_MOE_BLOCKS)})")
    replaced: dict[str, nn.Module] = {}
    for name, block in targets:
        build, returns_scores = HF_MOE_BLOCKS[type(block).__name__]
        layer = build(block, dispatcher=dispatcher, expert_backend=expert_backend,
                      router_impl=router_impl)
        adapter = HFMoEAdapter(layer, returns_router_scores=returns_scores)
        adapter.train(block.training)
        model.set_submodule(name, adapter)
        replaced[name] = block
    model.register_forward_pre_hook(_refuse_router_logits, with_kwargs=True)
    return replaced


def _refuse_router_logits(module: nn.Module, args: tuple, kwargs: dict) -> None:
    # Asked for at call time, Hugging Face gathers the logits of router modules that are gone.
    if kwargs.get("output_router_logits"):
        raise ValueError("output_router_logits=True is not supported by a patched model: its "
                         "routers are moe_lab's; use each adapter's .stats for balance losses")
