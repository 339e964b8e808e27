"""GPT-OSS: a router with a bias (top-k of the biased logits, softmax over the chosen ones)
and experts with biases on both GEMMs and a clamped SwiGLU
(`moe_lab.moe.experts.ClampedSwiGLUExperts`).

Softmax over the top-k logits equals softmax over all experts followed by renormalising the
chosen weights (the other experts' terms cancel), so moe_lab's softmax chain with
``renormalize=True`` computes it; only the logits gain the bias, which `BiasedRouter` adds.
Hugging Face stores ``gate_up_proj: [E, H, 2·I]`` applied as ``x · W`` with gate and up
*interleaved* (gate in the even columns); moe_lab keeps the gate columns first.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moe_lab.config import MoEConfig
from moe_lab.moe.layer import MoELayer
from moe_lab.moe.router import (
    DTYPES,
    Router,
    RouterOutput,
    compiled_route_from_logits,
    gate_logits,
    route_from_logits,
)
from moe_lab.workbench.interop.hf_blocks import load_layer, require_attrs, require_renormalized_top1

Tensor = torch.Tensor


class BiasedRouter(Router):
    """`Router` with a learned per-expert bias on the logits (``bias: [n_experts]``), before
    the score function — unlike ``expert_bias``, which shifts selection only.

    Runs the reference chain or its compiled form (``impl`` "reference" or "compiled"); the
    fused Triton router has no logit bias and is refused.
    """

    IMPLS = ("reference", "compiled")

    def __init__(self, cfg: MoEConfig, impl: str = "reference") -> None:
        if impl not in self.IMPLS:
            raise ValueError(f"router_impl for a biased router must be one of {self.IMPLS}, "
                             f"got {impl!r}")
        super().__init__(cfg, impl)
        self.bias = nn.Parameter(torch.zeros(cfg.n_experts))

    def forward(self, x: Tensor, seq_len: int | None = None) -> RouterOutput:
        dtype = DTYPES[self.cfg.router_dtype]
        logits = gate_logits(x, self.weight, dtype) + self.bias.to(dtype)
        chain = route_from_logits if self.impl == "reference" else compiled_route_from_logits
        return chain(logits, self.cfg, self.expert_bias, seq_len=seq_len)


class GptOssMoELayer(MoELayer):
    """`MoELayer` with GPT-OSS's parts: a `BiasedRouter` and `ClampedSwiGLUExperts`
    (``alpha``, ``limit``: the clamped unit's constants). Expert backends ``loop`` and
    ``torch``; every dispatcher but the fused ones."""

    def __init__(self, cfg: MoEConfig, dispatcher: str = "dropless", expert_backend: str = "torch",
                 router_impl: str = "reference", alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__(cfg, dispatcher, expert_backend, expert_kind="clamped_swiglu",
                         alpha=alpha, limit=limit)
        self.router = BiasedRouter(cfg, impl=router_impl)


def _gate_first(w: Tensor) -> Tensor:
    """``[..., 2I]`` with gate and up interleaved → gate columns first, then up."""
    return torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1)


def _interleaved(w: Tensor) -> Tensor:
    """`_gate_first` inverted: ``[..., 2I]`` gate columns first → gate and up interleaved."""
    return torch.stack(w.chunk(2, dim=-1), dim=-1).flatten(-2)


def gpt_oss_from_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A `GptOssMoELayer`'s state from a ``GptOssMLP`` block's."""
    weight = state["router.weight"]
    return {"router.weight": weight, "router.bias": state["router.bias"],
            "router.expert_bias": weight.new_zeros(weight.shape[0]),
            "experts.w_gate_up": _gate_first(state["experts.gate_up_proj"]),
            "experts.b_gate_up": _gate_first(state["experts.gate_up_proj_bias"]),
            "experts.w_down": state["experts.down_proj"], "experts.b_down": state["experts.down_proj_bias"]}


def gpt_oss_to_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`gpt_oss_from_hf` inverted."""
    return {"router.weight": state["router.weight"], "router.bias": state["router.bias"],
            "experts.gate_up_proj": _interleaved(state["experts.w_gate_up"]),
            "experts.gate_up_proj_bias": _interleaved(state["experts.b_gate_up"]),
            "experts.down_proj": state["experts.w_down"], "experts.down_proj_bias": state["experts.b_down"]}


def from_hf_gpt_oss(block: torch.nn.Module, dispatcher: str = "dropless",
                    expert_backend: str = "torch", router_impl: str = "reference") -> GptOssMoELayer:
    """A `GptOssMoELayer` equal to the Hugging Face ``GptOssMLP`` block ``block`` (router
    weight and bias, expert weights and biases copied): ``layer(x)[0]`` equals
    ``block(x)[0]`` for ``x: [batch, seq, hidden]`` to float32 tolerance, and
    ``layer(x)[1].routing.topk_weights`` equals the block's router scores."""
    require_attrs(block, "GptOssMLP", "router", "experts")
    router, experts = block.router, block.experts
    require_attrs(router, "GptOssTopKRouter", "weight", "bias", "top_k")
    require_attrs(experts, "GptOssExperts", "gate_up_proj", "gate_up_proj_bias", "down_proj",
                  "down_proj_bias", "alpha", "limit")
    top_k = int(router.top_k)
    require_renormalized_top1(top_k, True)
    n_experts, hidden, two_i = experts.gate_up_proj.shape
    cfg = MoEConfig(d_model=hidden, n_experts=n_experts, top_k=top_k, d_expert=two_i // 2,
                    score_func="softmax", renormalize=True, aux_loss_coef=0.0)
    layer = GptOssMoELayer(cfg, dispatcher, expert_backend, router_impl,
                           alpha=float(experts.alpha), limit=float(experts.limit))
    return load_layer(layer, gpt_oss_from_hf(block.state_dict()), experts.gate_up_proj)
