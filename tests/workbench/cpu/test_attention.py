"""moe_lab's fused CPU attention (attention impl ``cpu_fused``) against the float64 reference."""

import math

import pytest
import torch

from moe_lab.attention import causal_attention
from moe_lab.training.sync import assert_sync_free
from moe_lab.workbench.cpu import attention as cpu_attention
from moe_lab.workbench.cpu import build as cpu_ext

pytestmark = [pytest.mark.skipif(cpu_ext.compiler() is None,
                                reason="no C++ compiler: the CPU kernels cannot be built"),
              pytest.mark.usefixtures("cpu_plugin")]


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


BF16_SHAPES = {name: shape for name, shape in SHAPES.items() if shape[-1] % 2 == 0}
BF16_SHAPES["odd keys, odd block"] = (2, 2, 35, 70, 8)  # a query block of 3 rows, 35 + 3 keys
BF16_SHAPES["head_dim 2"] = (1, 2, 33, 33, 2)


def bf16_close(mine, theirs, frac=2e-2):
    """Within ``frac`` of the largest reference value: a few bf16 roundings (P, dS, the output)."""
    assert mine.dtype == torch.bfloat16
    err = (mine.double() - theirs).abs().max()
    assert err <= frac * theirs.abs().max(), f"max error {err:.3g} vs max {theirs.abs().max():.3g}"


@pytest.mark.parametrize("shape", list(BF16_SHAPES.values()), ids=list(BF16_SHAPES))
def test_bf16_forward_and_gradients_match_the_float64_reference(shape):
    if not cpu_ext.bf16_gemms():
        pytest.skip("no bf16 GEMMs on this CPU: bf16 is widened (test_bf16_is_widened_...)")
    q, k, v = (t.requires_grad_() for t in qkv(*shape, dtype=torch.bfloat16))
    out = cpu_attention.causal_attention(q, k, v)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).bfloat16()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr)
    rq, rk, rv = torch.autograd.grad(ref, (qr, kr, vr), grad.double())
    for mine, theirs in ((out, ref), (dq, rq), (dk, rk), (dv, rv)):
        bf16_close(mine, theirs)
    # and it is not the float32 kernel in disguise: P is rounded to bf16 before P V
    exact = cpu_attention.causal_attention(*(t.detach().float() for t in (q, k, v))).bfloat16()
    assert shape[2] == 1 or not torch.equal(out, exact)


def test_bf16_is_widened_where_it_cannot_take_bf16_gemms():
    # an odd head_dim cannot be paired for the bf16 GEMMs: float32 inside, the same bits as
    # the float32 kernel on the widened inputs
    q, k, v = qkv(2, 2, 40, 40, 33, dtype=torch.bfloat16)
    out = cpu_attention.causal_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, cpu_attention.causal_attention(q.float(), k.float(), v.float()).bfloat16())
    # float16 is widened too
    h = [t.half() for t in qkv(1, 2, 24, 24, 16)]
    assert torch.equal(cpu_attention.causal_attention(*h),
                       cpu_attention.causal_attention(*(t.float() for t in h)).half())


def test_bf16_non_contiguous_and_misaligned_inputs():
    g = torch.Generator().manual_seed(4)
    base = torch.randn(3, 2, 30, 4, 16, generator=g).bfloat16()  # the model's [b, s, h, d] layout
    q, k, v = (base[i].transpose(1, 2) for i in range(3))
    bf16_close(cpu_attention.causal_attention(q, k, v), reference(q, k, v))
    # rows starting at an odd element (not on a 32-bit boundary) and an odd row stride
    wide = torch.randn(2, 2, 30, 35, generator=g).bfloat16()
    q2, k2, v2 = wide[..., 1:17], wide.flip(2)[..., 3:19], wide[..., 17:33]
    assert k2.stride(2) % 2 == 1 and q2.data_ptr() % 4 == 2
    for t in (q2, k2, v2):
        t.requires_grad_()
    out = cpu_attention.causal_attention(q2, k2, v2)
    bf16_close(out, reference(q2, k2, v2))
    grad = torch.ones_like(out)
    mine = torch.autograd.grad(out, (q2, k2, v2), grad)
    contiguous = [t.detach().contiguous().requires_grad_() for t in (q2, k2, v2)]
    theirs = torch.autograd.grad(cpu_attention.causal_attention(*contiguous), contiguous, grad)
    assert torch.equal(out, cpu_attention.causal_attention(*contiguous))
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)


def test_bf16_nan_stays_in_the_rows_that_see_it():
    q, k, v = qkv(1, 2, 40, 40, 16, dtype=torch.bfloat16)
    q[0, 0, 7, 3] = float("nan")
    k[0, 1, 21, 0] = float("nan")  # key 21: seen by queries 21..39; odd, so paired with key 20
    out = cpu_attention.causal_attention(q, k, v)
    bad = torch.isnan(out).any(-1)[0]
    expected = torch.zeros(2, 40, dtype=torch.bool)
    expected[0, 7] = True
    expected[1, 21:] = True
    assert torch.equal(bad, expected)


def test_bf16_backward_nan_stays_in_the_rows_that_see_it():
    # 33 positions: the last query block has one row, padded to a pair with a zero column in
    # the scratch the first block's transposes filled (NaN from query 1); one thread, in order
    q, k, v = (t.requires_grad_() for t in qkv(1, 1, 33, 33, 16, dtype=torch.bfloat16))
    with torch.no_grad():
        q[0, 0, 1, 3] = float("nan")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out = cpu_attention.causal_attention(q, k, v)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        torch.set_num_threads(before)
    def nan_rows(t):
        return set(torch.isnan(t[0, 0]).any(-1).nonzero().flatten().tolist())

    # query 1's output and dQ; dV of the keys it sees (0, 1); dK = dSᵀ Q of the keys of its
    # query block (0..31: their masked dS are zeros, and 0 · NaN is NaN in a GEMM), not key 32,
    # whose block above the diagonal is never computed — as in the float32 kernel
    assert nan_rows(out) == nan_rows(dq) == {1} and nan_rows(dv) == {0, 1}
    assert nan_rows(dk) == set(range(32))
    wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out32 = cpu_attention.causal_attention(*wide)
    for mine, theirs in zip((out, dq, dk, dv),
                            (out32, *torch.autograd.grad(out32, wide, torch.ones_like(out32)))):
        assert nan_rows(mine) == nan_rows(theirs)


def test_bf16_under_autocast_and_through_the_model_layout():
    q, k, v = qkv(2, 2, 24, 24, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cpu_attention.causal_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    bf16_close(out, reference(q, k, v))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_do_not_depend_on_the_thread_count(dtype):
    q, k, v = qkv(2, 3, 70, 70, 32, dtype=dtype)
    grad = torch.randn(2, 3, 70, 32).to(dtype)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_custom_ops_pass_opcheck(dtype):
    q, k, v = qkv(1, 2, 33, 33, 8, dtype=dtype)
    out, lse = torch.ops.moe_lab.cpu_causal_attention(q, k, v)
    torch.library.opcheck(torch.ops.moe_lab.cpu_causal_attention.default,
                          (q.requires_grad_(), k, v))
    torch.library.opcheck(torch.ops.moe_lab.cpu_causal_attention_backward.default,
                          (torch.randn_like(out), q.detach(), k, v, out, lse))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sync_free_and_compiles_fullgraph(dtype):
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 32, 32, 16, dtype=dtype))

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
    with pytest.raises(RuntimeError, match=r"\[batch, heads, seq, head_dim\]"):
        cpu_attention.causal_attention(q[0], k[0], v[0])
    with pytest.raises(RuntimeError, match="at most as many queries as keys"):
        cpu_attention.causal_attention(*qkv(1, 2, 9, 8, 4)[:1], k, v)
    with pytest.raises(RuntimeError, match="k and v must have the same shape"):
        cpu_attention.causal_attention(q, k, v[..., :2])
    with pytest.raises(RuntimeError, match="head_dim must be > 0"):
        cpu_attention.causal_attention(q[..., :0], k[..., :0], v[..., :0])
    with pytest.raises(RuntimeError, match="expand grouped"):
        cpu_attention.causal_attention(q, k[:, :1], v[:, :1])
    op = torch.ops.moe_lab.cpu_causal_attention
    with pytest.raises(RuntimeError, match="all be float32 or all bfloat16"):
        op(q.bfloat16(), k, v)
    with pytest.raises(RuntimeError, match="even head_dim"):
        op(*(t[..., :3].bfloat16() for t in (q, k, v)))
    out, lse = op(q, k, v)
    with pytest.raises(RuntimeError, match="dout and out must have q's dtype"):
        torch.ops.moe_lab.cpu_causal_attention_backward(out.bfloat16(), q, k, v, out, lse)


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


# ------------------------------------------------------------------ RoPE fused, packed QKV


def rope_reference(qkv, cos, sin, heads):
    """apply_rope on the [b, h, s, d] views of a packed qkv, then the float64 reference."""
    from moe_lab.model import apply_rope

    b, s, width = qkv.shape
    d = width // (3 * heads)
    q, k, v = (t.view(b, s, heads, d).transpose(1, 2) for t in qkv.split(heads * d, dim=-1))
    out = reference(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    return out.transpose(1, 2).reshape(b, s, heads * d)


def packed(b, s, heads, d, seed=0):
    from moe_lab.model import rope_cache

    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, s, 3 * heads * d, generator=g).bfloat16()
    cos, sin = rope_cache(max(s, 1) + 3, d)  # a longer cache, as a model's for seq_len
    return qkv, cos, sin


ROPE_SHAPES = {
    "model": (2, 128, 4, 32),
    "odd length, odd block": (1, 37, 3, 16),
    "one position": (2, 1, 2, 8),
    "longer than four blocks": (1, 200, 2, 64),
    "head_dim 2": (1, 33, 2, 2),
}


@pytest.mark.parametrize("shape", list(ROPE_SHAPES.values()), ids=list(ROPE_SHAPES))
def test_rope_attention_matches_rope_then_attention(shape):
    b, s, heads, d = shape
    qkv, cos, sin = packed(*shape)
    qkv.requires_grad_()
    out = cpu_attention.rope_causal_attention(qkv, cos, sin, heads)
    assert out.shape == (b, s, heads * d) and out.dtype == torch.bfloat16 and out.is_contiguous()
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    (dqkv,) = torch.autograd.grad(out, qkv, grad)
    assert dqkv.shape == qkv.shape and dqkv.dtype == torch.bfloat16
    # against the float64 reference (the rotation itself in float64 on the same inputs)
    q64 = qkv.detach().double().requires_grad_()
    ref = rope_reference(q64, cos.double(), sin.double(), heads)
    (ref_grad,) = torch.autograd.grad(ref, q64, grad.double())
    bf16_close(out, ref)
    bf16_close(dqkv, ref_grad)
    # and against the unfused bf16 path of the model (apply_rope, then the kernel): the same
    # forward bits; gradients one rounding apart (dq, dk rounded before their rotary gradient)
    from moe_lab.model import apply_rope

    q16 = qkv.detach().clone().requires_grad_()
    qv, kv, vv = (t.view(b, s, heads, d).transpose(1, 2) for t in q16.split(heads * d, dim=-1))
    unfused = cpu_attention.causal_attention(apply_rope(qv, cos, sin), apply_rope(kv, cos, sin), vv)
    unfused = unfused.transpose(1, 2).reshape(b, s, heads * d)
    assert torch.equal(out, unfused)
    (unfused_grad,) = torch.autograd.grad(unfused, q16, grad)
    bf16_close(dqkv, unfused_grad.double(), frac=1e-2)


def test_rope_attention_fallback_path_agrees():
    # the ATen path (a CPU without bf16 GEMMs, forced here): the same computation
    qkv, cos, sin = packed(2, 45, 2, 16, seed=1)
    ext = cpu_ext.extension()
    fused_out, fused_lse = ext.rope_attention_forward(qkv, cos, sin, 2, True)
    plain_out, plain_lse = ext.rope_attention_forward(qkv, cos, sin, 2, False)
    assert torch.equal(fused_out, plain_out)
    torch.testing.assert_close(fused_lse, plain_lse)
    dout = torch.randn(fused_out.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    fused = ext.rope_attention_backward(dout, qkv, cos, sin, fused_out, fused_lse, 2, True)
    plain = ext.rope_attention_backward(dout, qkv, cos, sin, plain_out, plain_lse, 2, False)
    bf16_close(fused, plain.double(), frac=1e-2)


def test_rope_attention_non_contiguous_empty_and_threads():
    g = torch.Generator().manual_seed(3)
    from moe_lab.model import rope_cache

    cos, sin = rope_cache(40, 16)
    wide = torch.randn(2, 40, 3 * 2 * 16 + 5, generator=g).bfloat16()
    qkv = wide[..., 1:97]  # rows on an odd element, a row stride of 101
    assert not qkv.is_contiguous() and qkv.data_ptr() % 4 == 2
    out = cpu_attention.rope_causal_attention(qkv, cos, sin, 2)
    assert torch.equal(out, cpu_attention.rope_causal_attention(qkv.contiguous(), cos, sin, 2))
    # no sequences, no positions
    for shape in ((0, 8, 96), (2, 0, 96)):
        empty = torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True)
        out = cpu_attention.rope_causal_attention(empty, cos, sin, 2)
        assert out.shape == (*shape[:2], 32)
        (grad,) = torch.autograd.grad(out.float().sum(), empty)
        assert grad.shape == shape
    # one thread or two: each (batch, head) is one thread's, the same bits
    qkv = qkv.contiguous().requires_grad_()
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = cpu_attention.rope_causal_attention(qkv, cos, sin, 2)
            results.append((out, *torch.autograd.grad(out.float().square().sum(), qkv)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_rope_attention_ops_check_sync_free_and_compile():
    qkv, cos, sin = packed(1, 33, 2, 8, seed=4)
    out, lse = torch.ops.moe_lab.cpu_rope_attention(qkv, cos, sin, 2)
    torch.library.opcheck(torch.ops.moe_lab.cpu_rope_attention.default,
                          (qkv.clone().requires_grad_(), cos, sin, 2))
    torch.library.opcheck(torch.ops.moe_lab.cpu_rope_attention_backward.default,
                          (torch.randn_like(out), qkv, cos, sin, out, lse, 2))
    x = qkv.clone().requires_grad_()

    def step(x):
        return cpu_attention.rope_causal_attention(x, cos, sin, 2).float().square().sum()

    assert_sync_free(step, x)
    compiled = torch.compile(step, fullgraph=True)
    assert torch.equal(compiled(x), step(x))
    assert torch.equal(torch.autograd.grad(compiled(x), x)[0], torch.autograd.grad(step(x), x)[0])


def test_rope_attention_bad_inputs_raise_clear_errors():
    qkv, cos, sin = packed(1, 8, 2, 8)
    f = cpu_attention.rope_causal_attention
    with pytest.raises(RuntimeError, match="bfloat16"):
        f(qkv.float(), cos, sin, 2)
    with pytest.raises(RuntimeError, match="3 \\* heads \\* head_dim"):
        f(qkv, cos, sin, 5)
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        f(qkv[..., :42], cos, sin, 2)  # head_dim 7
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        f(qkv, cos[:4], sin, 2)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        f(qkv, cos, sin[:, :3], 2)
    with pytest.raises(RuntimeError, match="dout and out must be bfloat16"):
        out, lse = torch.ops.moe_lab.cpu_rope_attention(qkv, cos, sin, 2)
        torch.ops.moe_lab.cpu_rope_attention_backward(out.float(), qkv, cos, sin, out, lse, 2)


def test_model_takes_the_rope_path_under_bf16_autocast():
    from moe_lab.config import preset
    from moe_lab.model import MoETransformer

    cfg = preset("tiny")
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(6))
    torch.manual_seed(0)
    model = MoETransformer(cfg, dispatcher="dropless", attention_impl="cpu_fused")
    with torch.profiler.profile() as prof, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x[:, :-1], x[:, 1:])
    out.loss.backward()
    names = {e.name for e in prof.events()}
    assert "moe_lab::cpu_rope_attention" in names and "moe_lab::cpu_causal_attention" not in names
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # FP32 (no autocast) keeps the [b, h, s, d] kernel
    with torch.profiler.profile() as prof:
        model(x[:, :-1], x[:, 1:])
    names = {e.name for e in prof.events()}
    assert "moe_lab::cpu_causal_attention" in names and "moe_lab::cpu_rope_attention" not in names
