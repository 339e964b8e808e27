"""Causal self-attention, as a registry of implementations selected by name.

``causal_attention(q, k, v, impl="sdpa")`` with ``q, k, v: [batch, heads, seq, head_dim]``
(``k``/``v`` may have fewer heads than ``q``: grouped-query attention) returns
``[batch, heads, seq, head_dim]``. ``reference`` is the textbook definition
(softmax(QKᵀ/√d + causal mask)·V, computed in float32); ``sdpa`` is PyTorch's fused
``scaled_dot_product_attention``; ``sdpa_fp32`` the same with the core in float32. A plug-in may register more
(``moe_lab.workbench.cpu`` adds ``cpu_fused``), each tested against ``reference``.

An implementation may also come in a *packed* form (`PACKED_ATTENTION_IMPLS`, under the same
name): it takes the QKV projection's output ``[batch, seq, (heads + 2·kv_heads)·head_dim]``
as it is, applies the rotary embedding itself and returns ``[batch, seq, heads·head_dim]``,
ready for the output projection — the split, rotation and transposes around the core fused
into it. The model uses it where ``accepts`` says it applies.

MXFP8 attention (NVIDIA's MoE recipe moves attention's two batched matmuls to MXFP8):
each matmul's operands are blocked along *its* reduction dimension — Q and K along
head_dim for ``QKᵀ``, the probabilities P and V along the keys for ``P·V`` — with E4M3
elements and one power-of-two scale per 32 values (`moe_lab.quant.mx`); the softmax
stays in float32. ``mxfp8`` is the reference emulation: quantize → dequantize each
operand, then the float32 reference computation (head_dim and key length are padded
with zeros to a multiple of 32 where needed; zeros change no block's scale and no dot
product). Its backward is straight-through and in float32: the gradient GEMMs are not
emulated in MXFP8 here. ``mxfp8_triton`` runs the forward as one Triton flash-attention
pass on MX inputs (`moe_lab.kernels.mx_attention`), quantizing Q, K, V with the Triton
quantizer (`moe_lab.kernels.mx_quantize`) and P inside the kernel, and differentiates through the
reference emulation (recomputed in the backward).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from moe_lab.checks import first_derivative_only
from moe_lab.quant.mx import fake_quantize
from moe_lab.registry import TRITON_MISSING, Registry

Tensor = torch.Tensor
ATTENTION_IMPLS: Registry[Callable[..., Tensor]] = Registry(
    "attention", "causal attention cores: fn(q, k, v) -> out, all [batch, heads, seq, head_dim] "
    "(k, v may have fewer heads)", plugin=True)


# Empty in the core. A packed form is a callable ``packed(qkv, cos, sin, heads)`` taking
# ``qkv: [B, S, (heads + 2·kv_heads)·D]`` and ``cos, sin: [>= S, D/2]`` to ``[B, S, heads·D]``,
# with a method ``packed.accepts(qkv, heads, kv_heads) -> bool`` saying whether this input can
# take the packed path (else the model splits and rotates).
PACKED_ATTENTION_IMPLS: Registry[Callable[..., Tensor]] = Registry(
    "packed attention", "the packed forms of ATTENTION_IMPLS names: fn(qkv, cos, sin, heads) -> out",
    plugin=True)


def expand_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``k, v`` with their heads repeated to ``q``'s (grouped-query attention: ``k`` heads divide
    ``q`` heads)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return k, v


def causal_softmax(q: Tensor, k: Tensor) -> Tensor:
    """softmax(QKᵀ/√d + causal mask) in float32: ``[B, H, T_q, T_k]`` (``k`` expanded to ``q``'s heads)."""
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


@ATTENTION_IMPLS.register("reference")
def reference_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(QKᵀ/√d + causal mask)·V in float32, cast back to ``q.dtype``."""
    k, v = expand_kv(q, k, v)
    return (causal_softmax(q, k) @ v.float()).to(q.dtype)


@ATTENTION_IMPLS.register("sdpa")
def sdpa_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """PyTorch's fused attention (flash / memory-efficient / math, whichever applies)."""
    k, v = expand_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@ATTENTION_IMPLS.register("sdpa_fp32")
def sdpa_fp32_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """`sdpa_attention` with the core in float32 whatever the inputs' dtype (output cast back
    to ``q.dtype``). For bf16 autocast on a CPU, where PyTorch's bf16 flash-attention
    backward runs several times slower than its float32 one while the projections around it
    gain from bf16."""
    with torch.autocast(q.device.type, enabled=False):
        return sdpa_attention(q.float(), k.float(), v.float()).to(q.dtype)


#: The operands of the two matmuls, each with the dimension its MX blocks run along.
MX_OPERANDS = {"q": -1, "k": -1, "p": -1, "v": -2}


def _mx_operand(x: Tensor, name: str, quantize: tuple[str, ...]) -> Tensor:
    """``x`` in float32, through MXFP8 and back (RCEIL scales, blocks along `MX_OPERANDS`'
    dimension of ``name``, zero-padded) where ``quantize`` names it."""
    x = x.float()
    return fake_quantize(x, MX_OPERANDS[name], pad=True, quantize_grad=False) if name in quantize else x


def mxfp8_reference_attention(q: Tensor, k: Tensor, v: Tensor, *,
                              quantize: tuple[str, ...] = tuple(MX_OPERANDS)) -> Tensor:
    """Causal attention with MXFP8 (E4M3, 32-blocks, RCEIL scales) operands, emulated in float32.

    ``q``: ``[B, H, T_q, d]``; ``k``, ``v``: ``[B, H_kv, T_k, d]``. ``quantize`` names the
    operands to quantize (any of ``"q"``, ``"k"`` along head_dim; ``"p"``, ``"v"`` along the
    keys) — all four is the recipe; fewer shows where the error comes from. Returns
    ``[B, H, T_q, d]`` in ``q.dtype``. The registered ``"mxfp8"`` attention is this function
    with its defaults.
    """
    unknown = set(quantize) - set(MX_OPERANDS)
    if unknown:
        raise ValueError(f"quantize must name operands from {tuple(MX_OPERANDS)}, got {sorted(unknown)}")
    k, v = expand_kv(q, k, v)
    qf, kf, vf = (_mx_operand(x, name, quantize) for name, x in zip("qkv", (q, k, v), strict=True))
    return (_mx_operand(causal_softmax(qf, kf), "p", quantize) @ vf).to(q.dtype)


ATTENTION_IMPLS.register("mxfp8", mxfp8_reference_attention)


class _MXFP8TritonAttention(torch.autograd.Function):
    """The registered ``"mxfp8_triton"`` attention: the forward as one Triton flash-attention
    pass on MX inputs (compiled on CUDA, interpreted on the CPU); the backward is autograd
    through the reference emulation, recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx: FunctionCtx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # Imported on first use: the reference attention (and the model) never loads Triton.
        from moe_lab.kernels.mx_attention import mx_attention_forward, quantize_qkv

        ctx.save_for_backward(q, k, v)
        up = [x.float() if x.dtype == torch.float16 else x for x in (q, k, v)]
        return mx_attention_forward(*quantize_qkv(*up)).to(q.dtype)

    @staticmethod
    @first_derivative_only("the MXFP8 Triton attention")
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = (x.detach().requires_grad_() for x in ctx.saved_tensors)
        with torch.enable_grad():
            out = mxfp8_reference_attention(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad)


ATTENTION_IMPLS.register("mxfp8_triton", _MXFP8TritonAttention.apply, missing=TRITON_MISSING)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, impl: str = "sdpa") -> Tensor:
    """Causal attention by the implementation named ``impl`` (see ``ATTENTION_IMPLS``)."""
    fn = ATTENTION_IMPLS.lookup(impl, "attention impl")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [batch, heads, seq, head_dim], got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    return fn(q, k, v)
