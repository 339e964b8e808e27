"""Causal attention implementations (moe_lab.attention): the float32 reference, PyTorch's
SDPA, the MXFP8 reference emulation and the Triton MXFP8 flash-attention kernel.

The Triton kernel runs compiled on CUDA and under the interpreter on a CPU (the ``device``
fixture): shapes stay small (T <= 200), and one shape spans several key tiles at the tile
size either path picks, so the online softmax's rescaling runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_lab.attention import (
    ATTENTION_IMPLS,
    causal_attention,
    expand_kv,
    mxfp8_reference_attention,
)
from moe_lab.kernels.mx_attention import (
    LOG2E,
    launch_config,
    mx_attention_forward,
    quantize_qkv,
)
from moe_lab.quant.mx import E4M3, quantize

# (batch, q heads, kv heads, seq, head_dim): head_dim 16 is the tiny preset's (padded to
# 32), 32 the small preset's; 70 keys are not a multiple of 32; 2 kv heads is GQA.
SHAPES = [(1, 2, 2, 64, 32), (2, 4, 2, 70, 16), (1, 2, 1, 96, 64)]
# 200 keys: several key tiles compiled (64) and interpreted (128).
MULTI_TILE = (1, 2, 1, 200, 32)


def qkv(b, h, hk, t, d, gen, dtype=torch.float32, t_q=None, device="cpu"):
    q = torch.randn(b, h, t_q or t, d, generator=gen).to(device, dtype)
    k = torch.randn(b, hk, t, d, generator=gen).to(device, dtype)
    v = torch.randn(b, hk, t, d, generator=gen).to(device, dtype)
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


@pytest.mark.parametrize("mma", [None, "fp8_promote"])
@pytest.mark.parametrize("shape", [*SHAPES, MULTI_TILE])
def test_triton_kernel_applies_block_scales_exactly(shape, mma, device):
    # With P left in float32, the kernel's only quantized inputs are Q, K, V: it must then
    # equal the reference on those operands up to float32 summation order (fp8_promote,
    # Hopper's mode: Q·Kᵀ one FP8 dot per 32-wide head-dim block, scaled in fp32).
    gen = torch.Generator().manual_seed(34)
    q, k, v = qkv(*shape, gen, device=device)
    out = mx_attention_forward(*quantize_qkv(q, k, v), quantize_p=False, mma=mma)
    ref = mxfp8_reference_attention(q, k, v, quantize=("q", "k", "v"))
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("mma", ["fp8_promote", "scaled"])
def test_triton_kernel_is_exact_at_the_tile_a_gpu_launch_picks(mma, device, monkeypatch):
    # The interpreter's own tile is one large block; a GPU launch takes 64 (Hopper) or 128
    # (Blackwell) queries by 32 keys. Run the kernel at that tile (several query and key tiles
    # at 200 keys, a diagonal tile cut mid-row) and check it as above. Under the interpreter
    # "scaled" has no tl.dot_scaled, so that tile runs with the interpreter's products.
    import moe_lab.kernels.mx_attention as ma
    gpu = launch_config(200, 200, 32, interpreted=False, mma=mma)
    assert gpu.blocks["BLOCK_M"] == (64 if mma == "fp8_promote" else 128)
    monkeypatch.setattr(ma, "launch_config", lambda *args, **kwargs: gpu)
    gen = torch.Generator().manual_seed(36)
    q, k, v = qkv(*MULTI_TILE, gen, device=device)
    run = mma if device.type == "cuda" or mma == "fp8_promote" else None
    out = mx_attention_forward(*quantize_qkv(q, k, v), quantize_p=False, mma=run)
    ref = mxfp8_reference_attention(q, k, v, quantize=("q", "k", "v"))
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kernel_against_reference_emulation_and_sdpa(shape, device):
    gen = torch.Generator().manual_seed(35)
    q, k, v = qkv(*shape, gen, device=device)
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


def fake_quantize_p(p: torch.Tensor, mode: str, exponent_shift: int = 0) -> torch.Tensor:
    """``p`` quantized to MXFP8 along the last dim and read back, with scale rule ``mode``;
    ``exponent_shift`` moves every block's scale by that many binades (a wrong rule)."""
    mx = quantize(p, dim=-1, scale_mode=mode, pad=True)
    if not exponent_shift:
        return mx.dequantize()
    exponent = mx.scale.view(torch.uint8).int() - 127 + exponent_shift
    factor = torch.exp2(exponent.float()).repeat_interleave(32, -1)[..., : p.shape[-1]]
    return (p / factor).clamp(-448, 448).to(E4M3).float() * factor


def flash_emulation(q, k, v, block_n: int, p_rule) -> torch.Tensor:
    """The kernel's algorithm in PyTorch: Q, K, V quantized as `quantize_qkv` does, then
    the online softmax over key tiles of ``block_n`` — each tile's probabilities taken
    relative to the running maximum, passed through ``p_rule`` for ``P·V`` (the row sum
    uses them unquantized), the accumulator rescaled when the maximum grows."""
    qm, km, vm = quantize_qkv(q, k, v)
    kf, vf = expand_kv(q, km.dequantize(), vm.dequantize())
    t_q, t_k, d = q.shape[2], k.shape[2], q.shape[3]
    scale = torch.tensor(LOG2E / math.sqrt(d), dtype=torch.float32, device=q.device)
    s = (qm.dequantize() @ kf.transpose(-1, -2)) * scale
    mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
    s = s.masked_fill(~mask, -math.inf)
    m = torch.full(s.shape[:-1], -math.inf, device=q.device)
    l_sum = torch.zeros(s.shape[:-1], device=q.device)
    acc = torch.zeros(*s.shape[:-1], d, device=q.device)
    rescaled = 0
    for start in range(0, t_k, block_n):
        tile = s[..., start:start + block_n]
        m_new = torch.maximum(m, tile.amax(-1))
        alpha = torch.exp2(m - m_new)
        rescaled += int(((alpha < 1) & (l_sum > 0)).sum())
        p = torch.exp2(tile - m_new[..., None])
        l_sum = l_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p_rule(p) @ vf[..., start:start + block_n, :]
        m = m_new
    assert rescaled > 0 or t_k <= block_n  # the rescale path is what the tiles are for
    return acc / l_sum[..., None]


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_triton_kernel_quantizes_p_with_the_scale_rule_asked_for(mode, device, interpreted):
    # Q and K hold -1, 0, 1 (exact in E4M3 whatever the scale), so every score is an exact
    # integer dot times one float32 constant and the kernel's probabilities are the
    # emulation's up to exp2's last bit: the kernel must match the emulation of its own
    # algorithm with the same P rule, and miss it with any other.
    gen = torch.Generator().manual_seed(42)
    b, h, hk, t, d = MULTI_TILE
    # Every probability such scores can give, 2^(s_i - s_max), lies far from an E4M3
    # rounding midpoint, so exp2 differing in its last bits on a device cannot change how
    # a probability rounds.
    s = torch.arange(-d, d + 1, dtype=torch.float32) * torch.tensor(LOG2E / math.sqrt(d))
    args = s[:, None] - s[None, :]
    significand, _ = torch.frexp(torch.exp2(args[args <= 0].double()))
    assert ((significand * 16).frac() - 0.5).abs().min() > 2**-11
    q = torch.randint(-1, 2, (b, h, t, d), generator=gen).float().to(device)
    k = torch.randint(-1, 2, (b, hk, t, d), generator=gen).float().to(device)
    v = torch.randn(b, hk, t, d, generator=gen).to(device)
    block_n = launch_config(t, t, d, interpreted).blocks["BLOCK_N"]
    assert t > block_n  # several key tiles
    out = mx_attention_forward(*quantize_qkv(q, k, v), scale_mode=mode)
    other = "floor" if mode == "rceil" else "rceil"
    rules = {
        f"{mode} (the rule asked for)": lambda p: fake_quantize_p(p, mode),
        f"{other} instead": lambda p: fake_quantize_p(p, other),
        "P not quantized": lambda p: p,
        # (One binade up is no rule to catch: E4M3 keeps its 4 significant bits at any
        # scale, so only values 2^13 below their block's maximum would lose one.)
        "scale one binade down": lambda p: fake_quantize_p(p, mode, -1),
    }
    want, *wrong = (flash_emulation(q, k, v, block_n, rule) for rule in rules.values())
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-6)
    for name, emulated in zip(list(rules)[1:], wrong, strict=True):
        # The test can tell: every wrong rule lands far outside that tolerance.
        assert (emulated - want).abs().max() > 100 * 2e-5, name


def test_triton_kernel_is_causal(device):
    gen = torch.Generator().manual_seed(36)
    q, k, v = qkv(1, 2, 2, 96, 32, gen, device=device)
    out = causal_attention(q, k, v, "mxfp8_triton")
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 50:] = torch.randn(1, 2, 46, 32, generator=gen).to(device) * 10
    v2[:, :, 50:] = torch.randn(1, 2, 46, 32, generator=gen).to(device) * 10
    out2 = causal_attention(q, k2, v2, "mxfp8_triton")
    # Changing keys >= 50 leaves queries < 50 alone (V's scales for keys 32..63 change,
    # so compare only the queries whose keys all lie in unchanged V blocks: 0..31).
    assert torch.equal(out[:, :, :32], out2[:, :, :32])
    assert not torch.equal(out[:, :, 50:], out2[:, :, 50:])


def test_triton_kernel_with_fewer_queries_than_keys(device):
    gen = torch.Generator().manual_seed(37)
    q, k, v = qkv(1, 2, 2, 64, 32, gen, t_q=20, device=device)
    out = mx_attention_forward(*quantize_qkv(q, k, v), quantize_p=False)
    ref = mxfp8_reference_attention(q, k, v, quantize=("q", "k", "v"))
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="T_q = 64 must be <= T_k = 20"):
        mx_attention_forward(*quantize_qkv(k.repeat(1, 1, 1, 1), q, q))


def test_triton_kernel_takes_bf16_and_non_contiguous_inputs(device):
    gen = torch.Generator().manual_seed(38)
    # [batch, seq, heads, dim] transposed, as the model produces q, k, v.
    q, k, v = (torch.randn(2, 64, 2, 32, generator=gen).to(device).transpose(1, 2).bfloat16()
               for _ in range(3))
    assert not q.is_contiguous()
    out = causal_attention(q, k, v, "mxfp8_triton")
    assert out.dtype == torch.bfloat16
    same = causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), "mxfp8_triton")
    assert torch.equal(out, same)


def test_quantize_qkv_matches_the_reference_quantizer(device):
    gen = torch.Generator().manual_seed(39)
    q, k, v = qkv(2, 2, 1, 70, 16, gen, device=device)
    qm, km, vm = quantize_qkv(q, k, v)
    for mx, x, dim in ((qm, q, -1), (km, k, -1), (vm, v, -2)):
        ref = quantize(x, dim=dim, scale_mode="rceil", pad=True)
        assert mx.dim == ref.dim and mx.data.shape == ref.data.shape
        assert torch.equal(mx.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(mx.scale.view(torch.uint8), ref.scale.view(torch.uint8))


def test_triton_backward_is_the_reference_emulation_backward(device):
    gen = torch.Generator().manual_seed(40)
    leaves = [x.requires_grad_() for x in qkv(1, 2, 1, 64, 32, gen, device=device)]
    grad = torch.randn(1, 2, 64, 32, generator=gen).to(device)
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


def test_nan_in_a_value_stays_in_its_column(device):
    gen = torch.Generator().manual_seed(41)
    q, k, v = qkv(1, 1, 1, 64, 32, gen, device=device)
    v[0, 0, 40, 5] = math.nan
    out = causal_attention(q, k, v, "mxfp8_triton")
    # V is blocked along the keys, so the NaN scale covers keys 32..63 of column 5 only;
    # 0 * NaN is NaN, so every query's column 5 is NaN, as in the emulation.
    nan = torch.isnan(out[0, 0])
    assert nan[:, 5].all() and nan.sum() == 64
    assert torch.equal(nan, torch.isnan(causal_attention(q, k, v, "mxfp8")[0, 0]))


def test_empty_and_bad_inputs(device):
    for impl in ("mxfp8", "mxfp8_triton"):
        empty = torch.randn(0, 2, 8, 32, device=device)
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
