"""DeepSeek-V3: sigmoid scores; a per-expert correction bias added for *selection only*
(aux-loss-free balancing); group-limited selection (the ``topk_group`` groups with the best
sum of their two best biased scores); the chosen unbiased scores optionally renormalised,
then multiplied by the routed scaling factor; plus shared experts every token passes
through."""

from __future__ import annotations

import torch

import moe_lab.workbench.interop.hf_blocks as hf
from moe_lab.moe.layer import MoELayer

Tensor = torch.Tensor


def deepseek_v3_from_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A layer's state from a ``DeepseekV3MoE`` block's: the correction bias is the selection
    bias; the shared MLP's gate and up go in one ``[2·I, H]`` linear (none if ``I = 0``)."""
    out = hf.swiglu_from_hf(state)
    out["router.expert_bias"] = state["gate.e_score_correction_bias"]
    if state["shared_experts.gate_proj.weight"].shape[0]:
        out["shared.gate_up.weight"] = torch.cat([state["shared_experts.gate_proj.weight"],
                                                  state["shared_experts.up_proj.weight"]])
        out["shared.down.weight"] = state["shared_experts.down_proj.weight"]
    return out


def deepseek_v3_to_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`deepseek_v3_from_hf` inverted (no shared experts: the block's empty weights)."""
    out = {**hf.swiglu_to_hf(state), "gate.e_score_correction_bias": state["router.expert_bias"]}
    w = state["router.weight"]
    gate_up = state.get("shared.gate_up.weight", w.new_zeros(0, w.shape[1]))
    half = gate_up.shape[0] // 2
    out.update({"shared_experts.gate_proj.weight": gate_up[:half], "shared_experts.up_proj.weight":
                gate_up[half:], "shared_experts.down_proj.weight": state.get(
                    "shared.down.weight", w.new_zeros(w.shape[1], 0))})
    return out


def from_hf_deepseek_v3(block: torch.nn.Module, dispatcher: str = "dropless",
                        expert_backend: str = "torch", router_impl: str = "reference") -> MoELayer:
    """A ``MoELayer`` equal to the Hugging Face ``DeepseekV3MoE`` block ``block`` (router gate,
    correction bias, routed and shared experts copied): ``layer(x)[0]`` equals ``block(x)``
    for ``x: [batch, seq, hidden]`` to float32 tolerance.

    The shared experts become moe_lab's shared SwiGLU of width
    ``moe_intermediate_size · n_shared_experts`` (none for 0), as DeepSeek-V3 sizes them.
    """
    hf.require_attrs(block, "DeepseekV3MoE", "gate", "experts", "shared_experts")
    gate, shared = block.gate, block.shared_experts
    hf.require_attrs(gate, "DeepseekV3TopkRouter", "weight", "top_k", "num_group", "topk_group",
                  "norm_topk_prob", "routed_scaling_factor", "e_score_correction_bias")
    hf.require_attrs(shared, "DeepseekV3MLP", "gate_proj", "up_proj", "down_proj")
    hf.require_silu(shared)
    d_expert = block.experts.gate_up_proj.shape[1] // 2
    d_shared = shared.gate_proj.weight.shape[0]
    if d_shared % d_expert:
        raise ValueError(f"block.shared_experts width {d_shared} must be a multiple of the routed "
                         f"experts' width {d_expert} (moe_intermediate_size · n_shared_experts)")
    return hf.swiglu_layer(block, int(gate.top_k), bool(gate.norm_topk_prob), dispatcher, expert_backend,
                           router_impl, deepseek_v3_from_hf, n_shared_experts=d_shared // d_expert,
                           score_func="sigmoid", scaling_factor=float(gate.routed_scaling_factor),
                           n_groups=int(gate.num_group), topk_groups=int(gate.topk_group))
