"""Fused causal attention for the CPU (attention implementation ``cpu_fused``).

At the small preset's shapes (head_dim 32, 128 positions, 64 heads in a batch) PyTorch's
CPU flash attention spends most of its time between the work: every head is split into
query blocks, every block pair is a separate BLAS call of a few microseconds, and the
softmax passes run between them. The kernel here (``cpu_attention.cpp``, beside this file)
gives one core a whole (batch, head) at a time and keeps everything for it in that core's
cache:

- forward, per block of 32 query rows: ``S = Q Kᵀ`` over only the keys the block may see
  (blocks above the causal diagonal are never computed), the softmax row by row, and
  ``O = P V``; the log-sum-exp of every row is kept for the backward;
- backward, per block: ``P`` recomputed from the log-sum-exp, ``dP = dO Vᵀ``,
  ``dS = P ∘ (dP − rowsum(dO ∘ O))``, ``dQ = dS K``, ``dK += dSᵀ Q``, ``dV += Pᵀ dO``.

The small GEMMs run through ATen's batch-reduce GEMM micro-kernel (oneDNN's brgemm, which
costs almost nothing per call), the elementwise passes through ATen's vector types. Float32
inputs compute in float32. Bfloat16 inputs (the model under BF16 autocast) take bfloat16
GEMMs with float32 accumulation, where the CPU has them: the softmax and its gradient stay in
float32, ``P`` and ``dS`` are rounded to bfloat16 for the products that take them, and ``dK``,
``dV`` accumulate over the query blocks in float32 — what a GPU flash attention does. The
GEMMs' B operands are repacked per head into the pairs layout bfloat16 GEMMs read (two rows
of the reduction dimension interleaved); for ``Kᵀ`` that is a transpose of K read as 32-bit
words. Float16, an odd head dimension, or a CPU without bfloat16 GEMMs are widened to float32
and the output rounded back. Where the CPU has AVX512_BF16, P, dS and the outputs are rounded
to bfloat16 as they are computed, one instruction per rounding (compiled with ``-mavx512bf16``
there: `moe_lab.workbench.cpu.build`).
The bfloat16 forward rounds ``exp(s − max)`` to bfloat16 in the pass that computes it and
scales the ``[rows, head_dim]`` output of ``P V`` by ``1/sum`` (as a flash attention does),
instead of normalising ``P`` itself: one pass over the scores fewer.
`tests/workbench/cpu/test_attention.py` checks both against the float64 reference.

`rope_causal_attention` is the entry the model uses under BF16 autocast: it takes the QKV
projection's output as it is (``[batch, seq, 3 · heads · head_dim]``), applies the rotary
embedding to q and k inside the kernel, and writes the output with the heads side by side,
as the output projection reads it — and in the backward the gradient of that packed tensor.
The layout changes around the attention (split, rotate, transpose into heads, and back, in
both passes) would otherwise be passes of their own in the compiled step. The model takes
this entry through ``moe_lab.attention.PACKED_ATTENTION_IMPLS["cpu_fused"]`` (`PackedRope`),
registered by `moe_lab.workbench.cpu.register`.

Both passes are ``torch.library`` custom ops with fake implementations, so the sync
detector and ``torch.compile`` trace through them (Inductor calls them as opaque kernels).
Built with the rest of moe_lab's CPU kernels (`moe_lab.workbench.cpu.build`).
"""

from __future__ import annotations

import torch

from moe_lab.attention import expand_kv
from moe_lab.checks import first_derivative_only
from moe_lab.workbench.cpu.build import kernel_op

Tensor = torch.Tensor


def _attention_shapes(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _attention_backward_shapes(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                               lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_attention = kernel_op("cpu_causal_attention", "causal_attention_forward", _attention_shapes)
_attention_backward = kernel_op("cpu_causal_attention_backward", "causal_attention_backward",
                                _attention_backward_shapes)


def _setup(ctx, inputs, output) -> None:
    q, k, v = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)


@first_derivative_only("the CPU plug-in's attention")
def _backward(ctx, dout: Tensor, _dlse: Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    return _attention_backward(dout.to(q.dtype), q, k, v, out, lse)


_attention.register_autograd(_backward, setup_context=_setup)


def _rope_attention_shapes(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    b, s, width = qkv.shape
    return qkv.new_empty(b, s, width // 3), qkv.new_empty(b, heads, s, dtype=torch.float32)


def _rope_attention_backward_shapes(dout: Tensor, qkv: Tensor, cos: Tensor, sin: Tensor, out: Tensor,
                                    lse: Tensor, heads: int) -> Tensor:
    return qkv.new_empty(qkv.shape)


# The trailing True: the kernel's own bfloat16 path (False, ATen's GEMMs, is for the tests).
_rope_attention = kernel_op("cpu_rope_attention", "rope_attention_forward", _rope_attention_shapes, True)
_rope_attention_backward = kernel_op("cpu_rope_attention_backward", "rope_attention_backward",
                                     _rope_attention_backward_shapes, True)


def _rope_setup(ctx, inputs, output) -> None:
    qkv, cos, sin, heads = inputs
    out, lse = output
    ctx.save_for_backward(qkv, cos, sin, out, lse)
    ctx.heads = heads
    ctx.mark_non_differentiable(lse)


@first_derivative_only("the CPU plug-in's RoPE attention")
def _rope_backward(ctx, dout: Tensor, _dlse: Tensor | None):
    qkv, cos, sin, out, lse = ctx.saved_tensors
    return (_rope_attention_backward(dout.to(qkv.dtype), qkv, cos, sin, out, lse, ctx.heads),
            None, None, None)


_rope_attention.register_autograd(_rope_backward, setup_context=_rope_setup)


def rope_causal_attention(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
    """Causal attention straight from the packed QKV projection output, with the rotary
    embedding of `moe_lab.model.apply_rope` applied to q and k inside the kernel.

    ``qkv: [batch, seq, 3 · heads · head_dim]`` bfloat16 (the q, k and v heads in that
    order, as ``moe_lab.model.Attention.qkv`` makes them), ``cos``/``sin``: ``[>= seq,
    head_dim / 2]`` float32 (`moe_lab.model.rope_cache`). Returns ``[batch, seq, heads ·
    head_dim]`` bfloat16, the heads side by side as the output projection takes them; the
    backward returns the gradient of ``qkv`` in the same packed layout.

    The same arithmetic as ``apply_rope`` then `causal_attention` on the ``[batch, heads,
    seq, head_dim]`` views (the rotated q and k rounded to bfloat16 once, as there), with
    the layout changes around them gone: the kernel reads q, k and v where the projection
    wrote them and writes the output and the gradients where the next GEMM reads them. The
    gradients of q and k leave the kernel after the rotary gradient, rounded once (the
    unfused path rounds dq and dk, then their rotary gradients)."""
    with torch.autocast("cpu", enabled=False):
        out, _ = _rope_attention(qkv, cos.float(), sin.float(), heads)
    return out


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``softmax(q kᵀ / √d + causal mask) v`` for ``q: [batch, heads, seq_q, d]`` and
    ``k, v: [batch, heads, seq_k, d]`` (``seq_q <= seq_k``; query ``i`` sees keys up to
    ``i + seq_k − seq_q``), on the CPU, returned in ``q.dtype``. ``k``/``v`` with the same
    number of heads as ``q`` (expand grouped heads first).

    bfloat16 inputs (all three, even ``head_dim``) run bfloat16 GEMMs with float32
    accumulation and a float32 softmax, ``P`` rounded to bfloat16 for ``P V`` (forward and
    backward, as a GPU flash attention does); float32 inputs compute in float32; anything
    else (float16, an odd ``head_dim``, or a CPU without bfloat16 GEMMs, see
    `moe_lab.workbench.cpu.build.bf16_gemms`) is widened to float32 and the output rounded back."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        # the kernel checks the rest; float64 would be narrowed unseen
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"cpu_fused attention takes float32, bfloat16 or float16 inputs, got "
                             f"{name} in {t.dtype}")
    with torch.autocast("cpu", enabled=False):
        if q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.shape[-1] % 2 == 0:
            out, _ = _attention(q, k, v)  # widened inside when this CPU has no bf16 GEMMs
            return out
        out, _ = _attention(q.float(), k.float(), v.float())
    return out.to(q.dtype)


def grouped_query_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """`causal_attention` with grouped-query heads expanded first: the ``cpu_fused`` entry of
    ``moe_lab.attention.ATTENTION_IMPLS``."""
    k, v = expand_kv(q, k, v)
    return causal_attention(q, k, v)


class PackedRope:
    """``PACKED_ATTENTION_IMPLS["cpu_fused"]``: `rope_causal_attention` where it `accepts` the input."""

    @staticmethod
    def accepts(qkv: Tensor, heads: int, kv_heads: int) -> bool:
        """Whether `rope_causal_attention` takes this QKV projection output: bfloat16 on the
        CPU (the model under BF16 autocast), as many key/value heads as query heads, an even
        head_dim. Shapes and dtypes only, so ``torch.compile`` decides it while tracing."""
        return (qkv.device.type == "cpu" and qkv.dtype == torch.bfloat16 and qkv.dim() == 3
                and heads == kv_heads and heads > 0 and qkv.shape[-1] % (3 * heads) == 0
                and (qkv.shape[-1] // (3 * heads)) % 2 == 0)

    def __call__(self, qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
        return rope_causal_attention(qkv, cos, sin, heads)
