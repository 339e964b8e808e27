"""The MoE layer: router → dispatcher → experts (+ an optional shared expert).

``y, stats = MoELayer(cfg, dispatcher="naive")(x)`` with ``x: [tokens, d_model]`` or
``[batch, seq, d_model]``. Each choice is one name in one registry: the dispatcher
(`moe_lab.moe.dispatch.DISPATCHERS`), the expert backend (`moe_lab.moe.experts.EXPERT_BACKENDS`:
its grouped MLP and its token permutation), the experts' class (``EXPERT_KINDS``), the router
(`moe_lab.moe.router.ROUTER_IMPLS`). What a dispatcher needs of the experts (an expert class
the backends it runs on) is checked as the layer is built (`moe_lab.moe.dispatch.check_pairing`).
Every combination computes the same function (up to the dropped tokens ``stats`` counts) and
is tested against ``naive``.

Shapes on the forward's path, in the tensors' names (the habit of torchtitan's ``x_RD``):
``T`` tokens, ``D`` d_model, ``E`` experts, ``K`` top-k choices per token, ``M = T·K`` rows in
expert order, ``F`` d_expert. ``x_TD`` is ``[T, D]``, ``topk_ids_TK`` ``[T, K]``, ``x_MD``
``[M, D]``, ``w_gate_up_EDF2`` ``[E, D, 2F]``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from moe_lab.config import ModelImpls, MoEConfig
from moe_lab.moe.dispatch import DISPATCHERS, check_pairing
from moe_lab.moe.experts import EXPERT_KINDS, SwiGLU
from moe_lab.moe.router import Router, RouterOutput

Tensor = torch.Tensor


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (devices autocast does not know, such as
    ``meta``, never are)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


@dataclass
class MoEStats:
    """What one MoE forward reports; every field stays on the device."""

    tokens_per_expert: Tensor  # [E] int64
    aux_loss: Tensor  # [] the load-balancing loss, already times cfg.aux_loss_coef
    z_loss: Tensor  # [] router z-loss, already times cfg.z_loss_coef
    dropped_tokens: Tensor  # [] int64: (token, expert) assignments not computed
    routing: RouterOutput

    @property
    def imbalance(self) -> Tensor:
        """max load / mean load (1.0 is perfectly balanced)."""
        load = self.tokens_per_expert.float()
        return load.max() / load.mean().clamp_min(1e-9)


def shared_expert(cfg: MoEConfig) -> SwiGLU | None:
    """The shared expert every token passes through (DeepSeek-V3's), where ``cfg`` has one."""
    return SwiGLU(cfg.d_model, cfg.d_expert * cfg.n_shared_experts) if cfg.n_shared_experts else None


class MoELayer(nn.Module):
    """Router, dispatcher and experts of ``cfg``, each named (see the module docstring; the
    defaults are `moe_lab.config.ModelImpls`'s); ``quant="mxfp8"`` runs the expert GEMMs on MXFP8
    operands; ``expert_options`` go to the expert class (``alpha=``, ``limit=`` of
    ``clamped_swiglu``)."""

    def __init__(self, cfg: MoEConfig, dispatcher: str = ModelImpls.dispatcher,
                 expert_backend: str = ModelImpls.expert_backend,
                 router_impl: str = ModelImpls.router_impl, *, quant: str | None = None,
                 expert_kind: str = "swiglu", **expert_options: float) -> None:
        super().__init__()
        if not isinstance(cfg, MoEConfig):
            raise ValueError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.router = Router(cfg, impl=router_impl)
        experts = EXPERT_KINDS.lookup(expert_kind, "expert_kind")
        self.experts = experts(cfg.n_experts, cfg.d_model, cfg.d_expert, expert_backend,
                               quant=quant, **expert_options)
        check_pairing(dispatcher, self.experts)
        self.dispatcher = dispatcher
        self.shared = shared_expert(cfg)

    def forward(self, x: Tensor) -> tuple[Tensor, MoEStats]:
        """``x: [T, D]`` or ``[B, S, D]`` → ``(y, stats)``, ``y`` shaped as ``x``.

        0. The door: ``x`` is checked once, here (its shape, a floating dtype, the weights'
           device and dtype, or autocast's); nothing after it checks again.
        1. Route: the router scores each token against every expert, in its own dtype, and
           keeps the top ``K`` (`moe_lab.moe.router`): ``topk_ids_TK``, ``topk_weights_TK``.
        2. Permute: the dispatcher copies each token once per choice into expert order, ``x_MD``,
           and counts each expert's rows into device ``offsets [E + 1]`` (``dropless``: the expert
           backend's permutation, `moe_lab.moe.experts.ExpertBackend`).
        3. Experts: every expert on its rows, one grouped GEMM per weight with SwiGLU between
           (``grouped_forward``): ``y_MD``.
        4. Unpermute: each token's ``K`` rows summed back, weighted by the router: ``y_TD``.
        5. Combine: the shared expert's output added, the loss terms scaled into `MoEStats`.

        (``naive`` and ``capacity`` do steps 2-4 their own way: a loop over experts, padded
        buffers.) Under autocast the router still computes in its own dtype (a bf16 router flips
        near-tie choices), the experts take the tokens in the autocast dtype, and the dispatcher
        runs outside autocast so that its gathers and scatter-adds see one dtype.
        """
        cfg, w_gate_up_EDF2 = self.cfg, self.experts.w_gate_up
        if x.dim() not in (2, 3) or x.shape[-1] != cfg.d_model or not x.is_floating_point():
            raise ValueError(f"x must be a floating-point [tokens, d_model={cfg.d_model}] or "
                             f"[batch, seq, d_model], got {tuple(x.shape)} {x.dtype}")
        device_type = x.device.type
        autocast = autocast_enabled(device_type)
        compute_dtype = torch.get_autocast_dtype(device_type) if autocast else w_gate_up_EDF2.dtype
        if x.dtype not in (w_gate_up_EDF2.dtype, compute_dtype) or x.device != w_gate_up_EDF2.device:
            raise ValueError(
                f"x is {x.dtype} on {x.device} but the layer's weights are "
                f"{w_gate_up_EDF2.dtype} on {w_gate_up_EDF2.device}"
                + (f" (under autocast x may also be {compute_dtype})" if autocast else ""))
        x_TD = x.reshape(-1, cfg.d_model)
        with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
            routing = self.router(x_TD.to(self.router.weight.dtype))  # 1
            y_TD, dropped = DISPATCHERS[self.dispatcher](  # 2, 3, 4
                x_TD.to(compute_dtype), routing.topk_ids, routing.topk_weights, self.experts, cfg)
        if self.shared is not None:  # 5
            y_TD = y_TD + self.shared(x_TD)
        loss_dtype = w_gate_up_EDF2.dtype if autocast else x.dtype  # loss terms stay in full precision
        stats = MoEStats(tokens_per_expert=routing.tokens_per_expert,
                         aux_loss=(routing.aux_loss * cfg.aux_loss_coef).to(loss_dtype),
                         z_loss=(routing.z_loss * cfg.z_loss_coef).to(loss_dtype),
                         dropped_tokens=dropped, routing=routing)
        return y_TD.reshape(x.shape), stats
