"""Causal attention implementations (moe_lab.attention): the float32 reference, PyTorch's
SDPA, the MXFP8 reference emulation and the Triton MXFP8 flash-attention kernel.

The Triton kernel runs under the interpreter on a CPU: shapes stay small (T <= 128).
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_lab.attention import (
    ATTENTION_IMPLS,
    causal_attention,
    mxfp8_reference_attention,
)
from moe_lab.kernels.mx_attention import mx_attention_forward, quantize_qkv
from moe_lab.quant.mx import quantize

# (batch, q heads, kv heads, seq, head_dim): head_dim 16 is the tiny preset's (padded to
# 32), 32 the small preset's; 70 keys are not a multiple of 32; 2 kv heads is GQA.
SHAPES = [(1, 2, 2, 64, 32), (2, 4, 2, 70, 16), (1, 2, 1, 96, 64)]


def qkv(b, h, hk, t, d, gen, dtype=torch.float32, t_q=None):
    q = torch.randn(b, h, t_q or t, d, generator=gen).to(dtype)
    k = torch.randn(b, hk, t, d, generator=gen).to(dtype)
    v = torch.randn(b, hk, t, d, generator=gen).to(dtype)
    return q, k, v


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_registry_holds_all_four():
    assert {"reference", "sdpa", "mxfp8", "mxfp8_triton"} <= set(ATTENTION_IMPLS)


@pytest.mark.parametrize("shape", SHAPES)
def test_sdpa_matches_reference(shape):
    gen = torch.Generator().manual_seed(31)
    q, k, v = qkv(*shape, gen)
    torch.testing.assert_close(causal_attention(q, k, v, "sdpa"),
                               causal_attention(q, k, v, "reference"), rtol=1e-5, atol=1e-5)


def test_reference_is_causal_and_handles_fewer_queries_than_keys():
    gen = torch.Generator().manual_seed(32)
    q, k, v = qkv(1, 2, 2, 40, 32, gen, t_q=8)
    out = causal_attention(q, k, v, "reference")
    # Query i of the last 8 sees keys 0..32+i: compute row 0 by hand.
    s = (q[0, 0, 0] @ k[0, 0, :33].t()) / math.sqrt(32)
    torch.testing.assert_close(out[0, 0, 0], s.softmax(-1) @ v[0, 0, :33], rtol=1e-5, atol=1e-6)


def test_mxfp8_reference_is_the_reference_on_quantized_operands():
    gen = torch.Generator().manual_seed(33)
    q, k, v = qkv(2, 2, 2, 64, 32, gen)
    assert torch.equal(mxfp8_reference_attention(q, k, v, quantize=()),
                       causal_attention(q, k, v, "reference"))

    def fq(x, dim):
        return quantize(x, dim=dim, scale_mode="rceil").dequantize()

    scores = fq(q, -1) @ fq(k, -1).transpose(-1, -2) / math.sqrt(32)
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    probs = fq(scores.masked_fill(~mask, -math.inf).softmax(-1), -1)
    torch.testing.assert_close(causal_attention(q, k, v, "mxfp8"), probs @ fq(v, -2),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="quantize must name operands from"):
        mxfp8_reference_attention(q, k, v, quantize=("s",))


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kernel_applies_block_scales_exactly(shape):
    # With P left in float32, the kernel's only quantized inputs are Q, K, V: it must then
    # equal the reference on those operands up to float32 summation order.
    gen = torch.Generator().manual_seed(34)
    q, k, v = qkv(*shape, gen)
    out = mx_attention_forward(*quantize_qkv(q, k, v), quantize_p=False)
    ref = mxfp8_reference_attention(q, k, v, quantize=("q", "k", "v"))
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kernel_against_reference_emulation_and_sdpa(shape):
    gen = torch.Generator().manual_seed(35)
    q, k, v = qkv(*shape, gen)
    exact = causal_attention(q, k, v, "reference")
    kernel = causal_attention(q, k, v, "mxfp8_triton")
    emulated = causal_attention(q, k, v, "mxfp8")
    bf16 = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), "sdpa")
    # The kernel quantizes running-max-relative probabilities tile by tile, the reference
    # the normalized ones: the rounding differs, the size of the error does not.
    assert rel(kernel, emulated) < 0.05
    assert 0.5 < rel(kernel, exact) / rel(emulated, exact) < 1.5
    assert rel(kernel, exact) < 0.08
    assert rel(bf16, exact) < 0.01 < rel(kernel, exact)  # MXFP8 costs more than bf16


def test_triton_kernel_is_causal():
    gen = torch.Generator().manual_seed(36)
    q, k, v = qkv(1, 2, 2, 96, 32, gen)
    out = causal_attention(q, k, v, "mxfp8_triton")
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 50:] = torch.randn(1, 2, 46, 32, generator=gen) * 10
    v2[:, :, 50:] = torch.randn(1, 2, 46, 32, generator=gen) * 10
    out2 = causal_attention(q, k2, v2, "mxfp8_triton")
    # Changing keys >= 50 leaves queries < 50 alone (V's scales for keys 32..63 change,
    # so compare only the queries whose keys all lie in unchanged V blocks: 0..31).
    assert torch.equal(out[:, :, :32], out2[:, :, :32])
    assert not torch.equal(out[:, :, 50:], out2[:, :, 50:])


def test_triton_kernel_with_fewer_queries_than_keys():
    gen = torch.Generator().manual_seed(37)
    q, k, v = qkv(1, 2, 2, 64, 32, gen, t_q=20)
    out = mx_attention_forward(*quantize_qkv(q, k, v), quantize_p=False)
    ref = mxfp8_reference_attention(q, k, v, quantize=("q", "k", "v"))
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="T_q = 64 must be <= T_k = 20"):
        mx_attention_forward(*quantize_qkv(k.repeat(1, 1, 1, 1), q, q))


def test_triton_kernel_takes_bf16_and_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(38)
    # [batch, seq, heads, dim] transposed, as the model produces q, k, v.
    q, k, v = (torch.randn(2, 64, 2, 32, generator=gen).transpose(1, 2).bfloat16()
               for _ in range(3))
    assert not q.is_contiguous()
    out = causal_attention(q, k, v, "mxfp8_triton")
    assert out.dtype == torch.bfloat16
    same = causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), "mxfp8_triton")
    assert torch.equal(out, same)


def test_quantize_qkv_matches_the_reference_quantizer():
    gen = torch.Generator().manual_seed(39)
    q, k, v = qkv(2, 2, 1, 70, 16, gen)
    qm, km, vm = quantize_qkv(q, k, v)
    for mx, x, dim in ((qm, q, -1), (km, k, -1), (vm, v, -2)):
        ref = quantize(x, dim=dim, scale_mode="rceil", pad=True)
        assert mx.dim == ref.dim and mx.data.shape == ref.data.shape
        assert torch.equal(mx.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(mx.scale.view(torch.uint8), ref.scale.view(torch.uint8))


def test_triton_backward_is_the_reference_emulation_backward():
    gen = torch.Generator().manual_seed(40)
    leaves = [x.requires_grad_() for x in qkv(1, 2, 1, 64, 32, gen)]
    grad = torch.randn(1, 2, 64, 32, generator=gen)
    causal_attention(*leaves, "mxfp8_triton").backward(grad)
    got = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    causal_attention(*leaves, "mxfp8").backward(grad)
    for a, b in zip(got, [x.grad for x in leaves], strict=True):
        assert torch.equal(a, b)
    for x in leaves:
        x.grad = None
    causal_attention(*leaves, "reference").backward(grad)
    for a, b in zip(got, [x.grad for x in leaves], strict=True):
        assert rel(a, b) < 0.1  # straight-through: close to the exact gradient


def test_nan_in_a_value_stays_in_its_column():
    gen = torch.Generator().manual_seed(41)
    q, k, v = qkv(1, 1, 1, 64, 32, gen)
    v[0, 0, 40, 5] = math.nan
    out = causal_attention(q, k, v, "mxfp8_triton")
    # V is blocked along the keys, so the NaN scale covers keys 32..63 of column 5 only;
    # 0 * NaN is NaN, so every query's column 5 is NaN, as in the emulation.
    nan = torch.isnan(out[0, 0])
    assert nan[:, 5].all() and nan.sum() == 64
    assert torch.equal(nan, torch.isnan(causal_attention(q, k, v, "mxfp8")[0, 0]))


def test_empty_and_bad_inputs():
    for impl in ("mxfp8", "mxfp8_triton"):
        empty = torch.randn(0, 2, 8, 32)
        assert causal_attention(empty, empty, empty, impl).shape == (0, 2, 8, 32)
        with pytest.raises(ValueError, match=r"q, k, v must be \[batch, heads, seq, head_dim\]"):
            causal_attention(torch.randn(2, 8, 32), torch.randn(2, 8, 32),
                             torch.randn(2, 8, 32), impl)
    with pytest.raises(ValueError, match="attention impl must be one of"):
        causal_attention(empty, empty, empty, "flash4")
    q = quantize(torch.randn(1, 1, 32, 32), scale_mode="rceil")
    with pytest.raises(ValueError, match="v must be a .* blocked along dim 2"):
        mx_attention_forward(q, q, q)
    with pytest.raises(TypeError, match="k must be an MXTensor"):
        mx_attention_forward(q, torch.randn(1), q)
