"""Causal self-attention, as a registry of implementations selected by name.

``causal_attention(q, k, v, impl="sdpa")`` with ``q, k, v: [batch, heads, seq, head_dim]``
(``k``/``v`` may have fewer heads than ``q``: grouped-query attention) returns
``[batch, heads, seq, head_dim]``. ``reference`` is the textbook definition
(softmax(QKᵀ/√d + causal mask)·V, computed in float32); ``sdpa`` is PyTorch's fused
``scaled_dot_product_attention``. Other implementations (MXFP8) register beside them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
ATTENTION_IMPLS: dict[str, Callable[..., Tensor]] = {}


def register_attention(name: str) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    def add(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        ATTENTION_IMPLS[name] = fn
        return fn

    return add


def _expand_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"k heads ({k.shape[1]}) must divide q heads ({q.shape[1]})")
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return k, v


@register_attention("reference")
def reference_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(QKᵀ/√d + causal mask)·V in float32, cast back to ``q.dtype``."""
    k, v = _expand_kv(q, k, v)
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


@register_attention("sdpa")
def sdpa_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """PyTorch's fused attention (flash / memory-efficient / math, whichever applies)."""
    k, v = _expand_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, impl: str = "sdpa") -> Tensor:
    """Causal attention by the implementation named ``impl`` (see ``ATTENTION_IMPLS``)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl must be one of {sorted(ATTENTION_IMPLS)}, got {impl!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "q, k, v must be [batch, heads, seq, head_dim], got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    return ATTENTION_IMPLS[impl](q, k, v)
