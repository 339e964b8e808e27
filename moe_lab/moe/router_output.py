"""What every router implementation takes and returns: the contract that the reference chain
(`moe_lab.moe.router`), its compiled form and the fused Triton router
(`moe_lab.kernels.fused_router`) share, kept apart so that a kernel can return the same
output without importing the reference it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lab.checks import positive_int
from moe_lab.config import MoEConfig

Tensor = torch.Tensor
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass
class RouterOutput:
    topk_ids: Tensor  # [T, k] int64, ordered by score (highest first)
    topk_weights: Tensor  # [T, k] router dtype (float32 for the fused router)
    scores: Tensor | None  # [T, E] after the score function; None where not materialised
    logits: Tensor  # [T, E] router dtype
    tokens_per_expert: Tensor  # [E] int64
    aux_loss: Tensor  # [] switch (global) load-balancing loss, unscaled by the coefficient
    z_loss: Tensor  # [] router z-loss, unscaled
    seq_aux_loss: Tensor | None = None  # [] sequence-level aux loss when seq_len was given

    @property
    def routing_map(self) -> Tensor:
        """``[T, E]`` bool: ``True`` where the token was routed to the expert (built on use)."""
        tokens, n_experts = self.logits.shape
        out = torch.zeros(tokens, n_experts, dtype=torch.bool, device=self.topk_ids.device)
        return out.scatter_(1, self.topk_ids, True)


def check_seq_len(tokens: int, seq_len: int | None) -> None:
    """``seq_len``: None, or a positive integer that divides ``tokens`` (whole sequences)."""
    if positive_int(seq_len, "seq_len", or_none=True) is None:
        return
    if tokens % seq_len:
        raise ValueError(f"tokens={tokens} must be a multiple of seq_len={seq_len}")


def check_router_input(x: Tensor, cfg: MoEConfig) -> None:
    """``x: [tokens, d_model]``, what every router implementation routes."""
    if x.dim() != 2 or x.shape[1] != cfg.d_model:
        raise ValueError(f"x must be [tokens, d_model={cfg.d_model}], got {tuple(x.shape)}")


def check_logits(logits: Tensor, cfg: MoEConfig) -> None:
    """``logits: [tokens, n_experts]``, what every routing chain after the gate takes."""
    if logits.dim() != 2 or logits.shape[1] != cfg.n_experts:
        raise ValueError(f"logits must be [tokens, n_experts={cfg.n_experts}], got {tuple(logits.shape)}")


def gate_logits(x: Tensor, gate_weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``x · gate_weightᵀ`` computed in ``dtype``: ``[tokens, n_experts]``."""
    return x.to(dtype) @ gate_weight.to(dtype).t()


def require_fp32_router(cfg: MoEConfig) -> None:
    """The fused router computes in float32 only: ``MoEConfig.router_dtype`` must say so."""
    if cfg.router_dtype != "fp32":
        raise ValueError(f"the fused router (router impl 'triton') computes in float32: "
                         f"MoEConfig.router_dtype must be 'fp32', got {cfg.router_dtype!r}")
