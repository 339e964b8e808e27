"""`patch_hf_model`: every MoE block of a Hugging Face model swapped for moe_lab's layer, in
place.

Each block is replaced by an `HFMoEAdapter` around the layer its family's ``from_hf_*``
builds; the adapter takes what the block takes (``hidden_states: [batch, seq, hidden]``) and
returns what it returns (the hidden states; for GPT-OSS also the router scores), so the
decoder layers around it run unchanged. moe_lab's routing statistics of the last call are
kept on the adapter (``adapter.stats``) for a caller who wants moe_lab's balance losses.

Back: the adapter's ``state_dict`` has the block's keys and layouts, so ``save_pretrained``
writes a stock checkpoint; `unpatch_hf_model` writes the weights into the blocks it returns.

Not carried over: Hugging Face records router logits with forward hooks on its router
modules (``output_router_logits=True``), and those modules are gone after the swap; the
model's own router aux loss is therefore refused rather than silently zero, whether asked
for in the call or in ``model.config``, before or after the patch. Refused too: a dispatcher
that drops tokens (`TOKEN_DROPPING`), which would change the logits the patch promises.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from moe_lab.moe.layer import MoELayer, MoEStats
from moe_lab.workbench.interop import hf_blocks as hf
from moe_lab.workbench.interop.deepseek_v3 import deepseek_v3_from_hf, deepseek_v3_to_hf, from_hf_deepseek_v3
from moe_lab.workbench.interop.gpt_oss import from_hf_gpt_oss, gpt_oss_from_hf, gpt_oss_to_hf

Tensor = torch.Tensor

_SWIGLU = (hf.swiglu_from_hf, hf.swiglu_to_hf)
# Hugging Face MoE block class name -> (builder of the equal moe_lab layer, whether the block
# also returns the router scores, block state -> layer state, layer state -> block state).
HF_MOE_BLOCKS: dict[str, tuple[Callable[..., MoELayer], bool, Callable, Callable]] = {
    "MixtralSparseMoeBlock": (hf.from_hf_mixtral, False, *_SWIGLU),
    "Qwen3MoeSparseMoeBlock": (hf.from_hf_qwen3_moe, False, *_SWIGLU),
    "OlmoeSparseMoeBlock": (hf.from_hf_qwen3_moe, False, *_SWIGLU),
    "DeepseekV3MoE": (from_hf_deepseek_v3, False, deepseek_v3_from_hf, deepseek_v3_to_hf),
    "GptOssMLP": (from_hf_gpt_oss, True, gpt_oss_from_hf, gpt_oss_to_hf),
}
_HOOK = "_moe_lab_router_logits_hook"
# Dispatchers that drop the assignments over an expert's capacity: a patched model would then
# compute other logits than the model it replaces, whose blocks drop nothing.
TOKEN_DROPPING = ("capacity",)


class HFMoEAdapter(nn.Module):
    """A moe_lab ``layer`` behind the interface of the Hugging Face MoE ``block`` it replaces:
    ``forward(hidden_states)`` returns ``y`` (or ``(y, router_scores: [tokens, top_k])`` where
    the block's family returns the router scores, `HF_MOE_BLOCKS`).

    It keeps the block (not as a submodule) for `to_hf`, and its ``state_dict`` /
    ``load_state_dict`` use the block's keys and layouts.
    """

    def __init__(self, layer: MoELayer, block: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.stats: MoEStats | None = None
        self._block = [block]  # a list hides it from nn.Module's registry
        _, self.returns_router_scores, self._from_hf, self._to_hf = HF_MOE_BLOCKS[type(block).__name__]
        self.register_state_dict_post_hook(_state_dict_in_hf_keys)
        self.register_load_state_dict_pre_hook(_load_hf_keys)

    def block_state_dict(self) -> dict[str, Tensor]:
        """The layer's weights in the block's keys and layouts (a lost selection bias refused)."""
        out = {k: v.detach() for k, v in self._to_hf(self.layer.state_dict()).items()}
        bias = self.layer.router.expert_bias
        if not torch.equal(self._from_hf(out)["router.expert_bias"], bias):
            raise ValueError(f"router.expert_bias is nonzero but a {type(self._block[0]).__name__} "
                             "has no selection bias to take it: train with the bias at zero")
        return out

    def to_hf(self) -> nn.Module:
        """The replaced block with the layer's weights written in, on the layer's device and
        dtype, in the adapter's train/eval mode."""
        block = self._block[0]
        w = self.layer.experts.w_gate_up
        block.to(device=w.device, dtype=w.dtype)
        block.load_state_dict(self.block_state_dict(), strict=True)
        return block.train(self.training)

    def forward(self, hidden_states: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        y, self.stats = self.layer(hidden_states)
        if self.returns_router_scores:
            return y, self.stats.routing.topk_weights.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"returns_router_scores={self.returns_router_scores}"


def _state_dict_in_hf_keys(adapter: HFMoEAdapter, state: dict, prefix: str, _meta: dict) -> None:
    # Runs after the layer wrote its keys under prefix + "layer.": swap them for the block's.
    for key in [k for k in state if k.startswith(prefix + "layer.")]:
        del state[key]
    state.update({prefix + k: v for k, v in adapter.block_state_dict().items()})


def _load_hf_keys(adapter: HFMoEAdapter, state: dict, prefix: str, *_args: object) -> None:
    # Runs before the layer loads: a state in the block's keys is turned into the layer's.
    ours = {k[len(prefix):]: state.pop(k) for k in list(state) if k.startswith(prefix)}
    if ours:  # else load_state_dict reports the layer's keys missing
        try:
            state.update({prefix + "layer." + k: v for k, v in adapter._from_hf(ours).items()})
        except KeyError as err:
            raise ValueError(f"state lacks the block's key {prefix}{err.args[0]}") from None


def patch_hf_model(model: nn.Module, dispatcher: str = "dropless", expert_backend: str = "torch",
                   router_impl: str = "reference") -> dict[str, nn.Module]:
    """Replace every MoE block of the Hugging Face ``model`` (classes in `HF_MOE_BLOCKS`) with
    an `HFMoEAdapter` around an equal moe_lab layer, in place; returns ``{qualified name:
    the block it replaced}`` (`unpatch_hf_model` writes the weights back and restores them).

    Each layer copies its block's weights and takes its device, dtype and train/eval mode;
    the model computes the same logits and gradients afterwards (to float32 rounding), which
    is why a ``dispatcher`` that drops tokens (`TOKEN_DROPPING`) is refused.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if dispatcher in TOKEN_DROPPING:
        raise ValueError(f"dispatcher={dispatcher!r} drops the tokens over an expert's capacity, "
                         "so the patched model would not compute the model's logits (its blocks "
                         "drop none); use dispatcher='dropless' (the default)")
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
    for name, block in targets:
        build = HF_MOE_BLOCKS[type(block).__name__][0]
        adapter = HFMoEAdapter(build(block, dispatcher, expert_backend, router_impl), block)
        adapter.train(block.training)
        model.set_submodule(name, adapter)
    setattr(model, _HOOK, model.register_forward_pre_hook(_refuse_router_logits, with_kwargs=True))
    return dict(targets)


def unpatch_hf_model(model: nn.Module) -> dict[str, nn.Module]:
    """Undo `patch_hf_model`, in place: every adapter's layer weights (trained or not) are
    written into the block it replaced (`HFMoEAdapter.to_hf`) and the block is put back, so
    ``model`` is a stock Hugging Face model again. Returns ``{qualified name: the block}``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    adapters = [(name, m) for name, m in model.named_modules() if isinstance(m, HFMoEAdapter)]
    if not adapters:
        raise ValueError(f"model {type(model).__name__} is not patched: it has no moe_lab adapter")
    blocks = {name: adapter.to_hf() for name, adapter in adapters}  # every one, before any swap
    for name, block in blocks.items():
        model.set_submodule(name, block)
    if (handle := model.__dict__.pop(_HOOK, None)) is not None:
        handle.remove()
    return blocks


def _refuse_router_logits(module: nn.Module, args: tuple, kwargs: dict) -> None:
    # Asked for at call time, or by a config changed after the patch (the call's None falls
    # back to it), Hugging Face gathers the logits of router modules that are gone.
    asked = kwargs.get("output_router_logits")
    if asked is None and getattr(getattr(module, "config", None), "output_router_logits", False):
        raise ValueError("model.config.output_router_logits=True is not supported by a patched "
                         "model: its routers are moe_lab's; set it to False and use each "
                         "adapter's .stats for balance losses")
    if asked:
        raise ValueError("output_router_logits=True is not supported by a patched model: its "
                         "routers are moe_lab's; use each adapter's .stats for balance losses")
