"""The MoE layer: router → dispatcher → experts (+ an optional shared expert).

``y, stats = MoELayer(cfg, dispatcher="naive")(x)`` with ``x: [tokens, d_model]`` or
``[batch, seq, d_model]``. Each part is named: the dispatcher (`moe_lab.moe.dispatch.DISPATCHERS`),
the experts' class and grouped GEMM (`moe_lab.moe.experts.EXPERT_KINDS`, ``EXPERT_BACKENDS``),
the router (`moe_lab.moe.router.ROUTER_IMPLS`). The names pair by what their entries declare
(a dispatcher how it runs the experts, an expert class the backends it runs on, a backend its
token permutation), checked as the layer is built (`moe_lab.moe.dispatch.check_pairing`).
Every pairing computes the same function (up to the dropped tokens ``stats`` counts) and is
tested against ``naive``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from moe_lab.config import MoEConfig
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


class MoELayer(nn.Module):
    """Router, dispatcher and experts of ``cfg``, each named (see the module docstring);
    ``expert_options`` go to the expert class (``alpha=``, ``limit=`` of ``clamped_swiglu``)."""

    def __init__(self, cfg: MoEConfig, dispatcher: str = "naive",
                 expert_backend: str = "loop", router_impl: str = "reference", *,
                 expert_kind: str = "swiglu", **expert_options: float) -> None:
        super().__init__()
        if not isinstance(cfg, MoEConfig):
            raise ValueError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.router = Router(cfg, impl=router_impl)
        experts = EXPERT_KINDS.lookup(expert_kind, "expert_kind")
        self.experts = experts(cfg.n_experts, cfg.d_model, cfg.d_expert, expert_backend,
                               **expert_options)
        check_pairing(dispatcher, self.experts)
        self.dispatcher = dispatcher
        self.shared = (
            SwiGLU(cfg.d_model, cfg.d_expert * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )

    def set_dispatcher(self, dispatcher: str, expert_backend: str | None = None) -> None:
        """Switch to ``dispatcher`` (and, given, the experts to ``expert_backend``); the
        weights stay."""
        DISPATCHERS.check(dispatcher, "dispatcher")
        previous = self.experts.backend
        if expert_backend is not None:
            self.experts.use_backend(expert_backend)
        try:
            check_pairing(dispatcher, self.experts)
        except ValueError:
            self.experts.use_backend(previous)
            raise
        self.dispatcher = dispatcher

    def forward(self, x: Tensor) -> tuple[Tensor, MoEStats]:
        if x.dim() not in (2, 3) or x.shape[-1] != self.cfg.d_model:
            raise ValueError(
                f"x must be [tokens, d_model={self.cfg.d_model}] or [batch, seq, d_model], "
                f"got {tuple(x.shape)}"
            )
        if not x.is_floating_point():
            raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
        w = self.experts.w_gate_up
        device_type = x.device.type
        autocast = autocast_enabled(device_type)
        compute_dtype = torch.get_autocast_dtype(device_type) if autocast else w.dtype
        if x.dtype not in (w.dtype, compute_dtype) or x.device != w.device:
            raise ValueError(
                f"x is {x.dtype} on {x.device} but the layer's weights are "
                f"{w.dtype} on {w.device}"
                + (f" (under autocast x may also be {compute_dtype})" if autocast else "")
            )
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        # Under autocast the router still computes in its own dtype (cfg.router_dtype: a
        # bf16 router flips near-tie choices), and the experts take the tokens in the
        # autocast dtype; the dispatcher runs outside autocast so its gathers and
        # scatter-adds see one dtype.
        with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
            routing = self.router(tokens.to(self.router.weight.dtype))
            y, dropped = DISPATCHERS[self.dispatcher](
                tokens.to(compute_dtype), routing.topk_ids, routing.topk_weights, self.experts,
                self.cfg
            )
        if self.shared is not None:
            y = y + self.shared(tokens)
        loss_dtype = w.dtype if autocast else x.dtype  # loss terms stay in full precision
        stats = MoEStats(
            tokens_per_expert=routing.tokens_per_expert,
            aux_loss=(routing.aux_loss * self.cfg.aux_loss_coef).to(loss_dtype),
            z_loss=(routing.z_loss * self.cfg.z_loss_coef).to(loss_dtype),
            dropped_tokens=dropped,
            routing=routing,
        )
        return y.reshape(shape), stats

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"experts={c.n_experts}, top_k={c.top_k}, dispatcher={self.dispatcher!r}, "
                f"expert_backend={self.experts.backend!r}")
