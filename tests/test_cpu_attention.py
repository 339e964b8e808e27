"""moe_lab's fused CPU attention (attention impl ``cpu_fused``) against the float64 reference."""

import math

import pytest
import torch

from moe_lab.attention import causal_attention
from moe_lab.kernels import cpu_attention, cpu_ext
from moe_lab.sync import assert_sync_free

pytestmark = pytest.mark.skipif(cpu_ext.compiler() is None,
                                reason="no C++ compiler: the CPU kernels cannot be built")


def reference(q, k, v):
    """softmax(q kᵀ/√d + causal mask) v in float64; query i sees keys up to i + (Sk - Sq)."""
    q, k, v = q.double(), k.double(), v.double()
    sq, sk = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def qkv(b, h, sq, sk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, sq, d, generator=g).to(dtype),
            torch.randn(b, h, sk, d, generator=g).to(dtype),
            torch.randn(b, h, sk, d, generator=g).to(dtype))


SHAPES = {
    "model": (2, 4, 128, 128, 32),
    "odd length": (1, 3, 37, 37, 16),
    "fewer queries than keys": (2, 2, 5, 70, 8),
    "one position": (1, 1, 1, 1, 4),
    "longer than four blocks": (1, 2, 200, 200, 64),
    "head_dim not a vector multiple": (2, 1, 64, 64, 33),
    "one query": (1, 2, 1, 50, 16),
}


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_forward_and_gradients_match_the_float64_reference(shape):
    q, k, v = (t.requires_grad_() for t in qkv(*shape))
    out = cpu_attention.causal_attention(q, k, v)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr)
    rq, rk, rv = torch.autograd.grad(ref, (qr, kr, vr), grad.double())
    assert out.dtype == torch.float32 and out.shape == ref.shape
    for mine, theirs in ((out, ref), (dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(mine.double(), theirs, rtol=2e-5, atol=2e-5)


def test_matches_sdpa_through_the_registry_with_grouped_heads():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 48, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 48, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 48, 16, generator=g, requires_grad=True)
    mine = causal_attention(q, k, v, impl="cpu_fused")
    theirs = causal_attention(q, k, v, impl="sdpa")
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(mine)
    for a, b in zip(torch.autograd.grad(mine, (q, k, v), grad),
                    torch.autograd.grad(theirs, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bf16_inputs_compute_in_float32_and_return_bf16():
    q, k, v = (t.requires_grad_() for t in qkv(2, 2, 40, 40, 32, dtype=torch.bfloat16))
    out = cpu_attention.causal_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    ref = reference(q.detach(), k.detach(), v.detach())
    # one rounding of the float32 result to bf16
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    out.float().square().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_under_autocast_the_core_stays_float32():
    q, k, v = qkv(1, 2, 16, 16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cpu_attention.causal_attention(q, k, v)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=2e-5, atol=2e-5)


def test_non_contiguous_inputs():
    # the model's layout: [batch, seq, heads, d] viewed as [batch, heads, seq, d] (rows contiguous)
    g = torch.Generator().manual_seed(2)
    base = torch.randn(3, 2, 30, 4, 16, generator=g)  # q/k/v, batch, seq, heads, d
    q, k, v = (base[i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous() and q.stride(-1) == 1
    torch.testing.assert_close(cpu_attention.causal_attention(q, k, v).double(), reference(q, k, v),
                               rtol=2e-5, atol=2e-5)
    # one key row broadcast over the sequence (seq stride 0): copied first
    k1 = k[:, :, :1].expand(-1, -1, 30, -1)
    torch.testing.assert_close(cpu_attention.causal_attention(q, k1, v).double(), reference(q, k1, v),
                               rtol=2e-5, atol=2e-5)
    # last dim strided too: copied first
    wide = torch.randn(2, 2, 30, 32, generator=g)
    q2, k2, v2 = wide[..., ::2], wide.flip(2)[..., ::2], wide[..., 1::2]
    torch.testing.assert_close(cpu_attention.causal_attention(q2, k2, v2).double(),
                               reference(q2, k2, v2), rtol=2e-5, atol=2e-5)


def test_empty_batch_and_zero_length():
    for shape in ((0, 2, 8, 8, 4), (2, 2, 0, 0, 4)):
        q, k, v = (t.requires_grad_() for t in qkv(*shape))
        out = cpu_attention.causal_attention(q, k, v)
        assert out.shape == q.shape
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_large_logits_do_not_overflow():
    q, k, v = qkv(1, 2, 64, 64, 32)
    q = q * 300  # scores in the thousands: exp overflows without the running max
    out = cpu_attention.causal_attention(q, k, v)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k, v), rtol=1e-4, atol=1e-4)


def test_nan_stays_in_the_rows_that_see_it():
    q, k, v = qkv(1, 2, 40, 40, 16)
    q[0, 0, 7, 3] = float("nan")   # query 7 of head 0
    k[0, 1, 20, 0] = float("nan")  # key 20 of head 1: seen by queries 20..39 only
    out = cpu_attention.causal_attention(q, k, v)
    bad = torch.isnan(out).any(-1)[0]  # [heads, seq]
    expected = torch.zeros(2, 40, dtype=torch.bool)
    expected[0, 7] = True
    expected[1, 20:] = True
    assert torch.equal(bad, expected)


def test_results_do_not_depend_on_the_thread_count():
    q, k, v = qkv(2, 3, 70, 70, 32)
    grad = torch.randn(2, 3, 70, 32)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
            out = cpu_attention.causal_attention(qs, ks, vs)
            results.append((out, *torch.autograd.grad(out, (qs, ks, vs), grad)))
    finally:
        torch.set_num_threads(before)
    # each (batch, head) is computed whole by one thread: identical bits
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_custom_ops_pass_opcheck():
    q, k, v = qkv(1, 2, 33, 33, 8)
    out, lse = torch.ops.moe_lab.cpu_causal_attention(q, k, v)
    torch.library.opcheck(torch.ops.moe_lab.cpu_causal_attention.default,
                          (q.requires_grad_(), k, v))
    torch.library.opcheck(torch.ops.moe_lab.cpu_causal_attention_backward.default,
                          (torch.randn_like(out), q.detach(), k, v, out, lse))


def test_sync_free_and_compiles_fullgraph():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 32, 32, 16))

    def step(q, k, v):
        return cpu_attention.causal_attention(q, k, v).square().sum()

    assert_sync_free(step, q, k, v)
    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v))
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(step(q, k, v), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_bad_inputs_raise_clear_errors():
    q, k, v = qkv(1, 2, 8, 8, 4)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        cpu_attention.causal_attention(q.double(), k, v)
    with pytest.raises(ValueError, match=r"\[batch, heads, seq, head_dim\]"):
        cpu_attention.causal_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="runs on the CPU"):
        cpu_attention.causal_attention(q.to("meta"), k, v)
    with pytest.raises(RuntimeError, match="at most as many queries as keys"):
        cpu_attention.causal_attention(*qkv(1, 2, 9, 8, 4)[:1], k, v)
    with pytest.raises(RuntimeError, match="k and v must have the same shape"):
        cpu_attention.causal_attention(q, k, v[..., :2])
    with pytest.raises(RuntimeError, match="head_dim must be > 0"):
        cpu_attention.causal_attention(q[..., :0], k[..., :0], v[..., :0])
    with pytest.raises(RuntimeError, match="expand grouped"):
        cpu_attention.causal_attention(q, k[:, :1], v[:, :1])


def test_model_trains_with_it_like_with_sdpa():
    from moe_lab.config import preset
    from moe_lab.model import MoETransformer

    cfg = preset("tiny")
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    losses, grads = [], []
    for impl in ("sdpa", "cpu_fused"):
        torch.manual_seed(0)
        model = MoETransformer(cfg, dispatcher="dropless", expert_backend="torch", attention_impl=impl)
        out = model(x[:, :-1], x[:, 1:])
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-5)
