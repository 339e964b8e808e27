"""Causal self-attention, as a registry of implementations selected by name.

``causal_attention(q, k, v, impl="sdpa")`` with ``q, k, v: [batch, heads, seq, head_dim]``
(``k``/``v`` may have fewer heads than ``q``: grouped-query attention) returns
``[batch, heads, seq, head_dim]``. ``reference`` is the textbook definition
(softmax(QKᵀ/√d + causal mask)·V, computed in float32); ``sdpa`` is PyTorch's fused
``scaled_dot_product_attention``; ``sdpa_fp32`` the same with the core in float32;
``cpu_fused`` is moe_lab's own CPU kernel (`moe_lab.kernels.cpu_attention`: one core per
batch and head, causal blocks skipped, float32).

MXFP8 attention (NVIDIA's MoE recipe moves attention's two batched matmuls to MXFP8):
each matmul's operands are blocked along *its* reduction dimension — Q and K along
head_dim for ``QKᵀ``, the probabilities P and V along the keys for ``P·V`` — with E4M3
elements and one power-of-two scale per 32 values (`moe_lab.quant.mx`); the softmax
stays in float32. ``mxfp8`` is the reference emulation: quantize → dequantize each
operand, then the float32 reference computation (head_dim and key length are padded
with zeros to a multiple of 32 where needed; zeros change no block's scale and no dot
product). Its backward is straight-through and in float32: the gradient GEMMs are not
emulated in MXFP8 here. ``mxfp8_triton`` runs the forward as one Triton flash-attention
pass on MX inputs (`moe_lab.kernels.attention`), quantizing Q, K, V with the Triton
quantizer (`moe_lab.kernels.mx`) and P inside the kernel, and differentiates through the
reference emulation (recomputed in the backward).
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


@register_attention("sdpa_fp32")
def sdpa_fp32_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """`sdpa_attention` with the core in float32 whatever the inputs' dtype (output cast back
    to ``q.dtype``). For bf16 autocast on a CPU, where PyTorch's bf16 flash-attention
    backward runs several times slower than its float32 one while the projections around it
    gain from bf16."""
    k, v = _expand_kv(q, k, v)
    with torch.autocast(q.device.type, enabled=False):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    return out.to(q.dtype)


@register_attention("cpu_fused")
def cpu_fused_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """moe_lab's fused causal attention for the CPU (`moe_lab.kernels.cpu_attention`): one
    core per (batch, head), the causal blocks above the diagonal skipped; bfloat16 inputs
    take bfloat16 GEMMs with float32 accumulation and softmax, anything else computes in
    float32 (output cast back to ``q.dtype``). Needs the C++ CPU kernels
    (`moe_lab.kernels.cpu_ext.available`)."""
    from moe_lab.kernels.cpu_attention import causal_attention as fused

    k, v = _expand_kv(q, k, v)
    return fused(q, k, v)


MX_OPERANDS = ("q", "k", "p", "v")


def _fake_mx(x: Tensor, dim: int, scale_mode: str) -> Tensor:
    from moe_lab.quant.mx import fake_quantize

    return fake_quantize(x, dim=dim, scale_mode=scale_mode, pad=True, quantize_grad=False)


def mxfp8_reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    quantize: tuple[str, ...] = MX_OPERANDS,
    scale_mode: str = "rceil",
) -> Tensor:
    """Causal attention with MXFP8 (E4M3, 32-blocks) operands, emulated in float32.

    ``q``: ``[B, H, T_q, d]``; ``k``, ``v``: ``[B, H_kv, T_k, d]``. ``quantize`` names the
    operands to quantize (any of ``"q"``, ``"k"`` along head_dim; ``"p"``, ``"v"`` along the
    keys) — all four is the recipe; fewer shows where the error comes from. Returns
    ``[B, H, T_q, d]`` in ``q.dtype``.
    """
    unknown = set(quantize) - set(MX_OPERANDS)
    if unknown:
        raise ValueError(f"quantize must name operands from {MX_OPERANDS}, got {sorted(unknown)}")
    k, v = _expand_kv(q, k, v)
    qf, kf, vf = q.float(), k.float(), v.float()
    if "q" in quantize:
        qf = _fake_mx(qf, -1, scale_mode)
    if "k" in quantize:
        kf = _fake_mx(kf, -1, scale_mode)
    if "v" in quantize:
        vf = _fake_mx(vf, -2, scale_mode)
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = (qf @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    if "p" in quantize:
        probs = _fake_mx(probs, -1, scale_mode)
    return (probs @ vf).to(q.dtype)


@register_attention("mxfp8")
def mxfp8_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """MXFP8 reference emulation: Q, K quantized along head_dim, P and V along the keys."""
    return mxfp8_reference_attention(q, k, v)


class _MXFP8TritonAttention(torch.autograd.Function):
    """Forward: the Triton MX flash-attention kernel. Backward: autograd through the
    reference emulation, recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from moe_lab.kernels.attention import mx_attention_forward, quantize_qkv

        ctx.save_for_backward(q, k, v)
        up = [x.float() if x.dtype == torch.float16 else x for x in (q, k, v)]
        return mx_attention_forward(*quantize_qkv(*up)).to(q.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = (x.detach().requires_grad_() for x in ctx.saved_tensors)
        with torch.enable_grad():
            out = mxfp8_reference_attention(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad)


@register_attention("mxfp8_triton")
def mxfp8_triton_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """MXFP8 attention forward as one Triton flash-attention pass on MX inputs (compiled
    on CUDA, interpreted on the CPU); backward through the reference emulation."""
    return _MXFP8TritonAttention.apply(q, k, v)


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
