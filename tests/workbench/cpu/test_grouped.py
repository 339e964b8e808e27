"""moe_lab's CPU grouped GEMM (expert backend ``openmp``) against torch._grouped_mm and mm."""

import pytest
import torch

from moe_lab.training.sync import assert_sync_free
from moe_lab.workbench.cpu import grouped as cpu_grouped
from moe_lab.workbench.cpu.build import compiler, extension

pytestmark = [pytest.mark.skipif(compiler() is None,
                                reason="no C++ compiler: the CPU grouped GEMM cannot be built"),
              pytest.mark.usefixtures("cpu_plugin")]


def reference(x, w, ends):
    """Plain per-expert matmuls; rows past the last end are zero."""
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        out[start:end] = x[start:end].double() @ w[e].double()
        start = end
    return out


def reference_wgrad(x, dy, ends):
    dw = torch.zeros(len(ends), x.shape[1], dy.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        dw[e] = x[start:end].double().t() @ dy[start:end].double()
        start = end
    return dw


def offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


COUNTS = {
    "even": [5, 5, 5, 5],
    "skewed": [0, 37, 1, 0],
    "one expert": [23],
    "empty experts": [0, 0, 0],
    "zero rows": [0, 0],
    "many": [3, 0, 9, 1, 0, 0, 12, 2, 7, 0, 4, 1],
}


@pytest.mark.parametrize("case", list(COUNTS))
def test_forward_and_wgrad_match_per_expert_matmuls(case):
    counts = COUNTS[case]
    m, k, n = sum(counts), 24, 40
    x, w, dy = torch.randn(m, k), torch.randn(len(counts), k, n), torch.randn(m, n)
    offs = offsets(counts)
    ends = offs.tolist()
    torch.testing.assert_close(cpu_grouped.grouped_mm(x, w, offs).double(), reference(x, w, ends),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_grouped.grouped_mm_wgrad(x, dy, offs).double(),
                               reference_wgrad(x, dy, ends), rtol=1e-5, atol=1e-4)
    if hasattr(torch, "_grouped_mm") and m:
        torch.testing.assert_close(cpu_grouped.grouped_mm(x, w, offs),
                                   torch._grouped_mm(x, w, offs=offs), rtol=1e-5, atol=1e-4)


def test_rows_past_the_last_offset_are_zero_and_int64_offsets_work():
    x, w = torch.randn(20, 8), torch.randn(2, 8, 6)
    offs = torch.tensor([4, 13])  # int64; rows 13.. belong to no expert
    out = cpu_grouped.grouped_mm(x, w, offs)
    assert torch.equal(out[13:], torch.zeros(7, 6))
    torch.testing.assert_close(out[:13].double(), reference(x, w, [4, 13])[:13], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes(dtype):
    counts = [7, 0, 18, 3]
    x = torch.randn(28, 32).to(dtype)
    w = torch.randn(4, 32, 16).to(dtype)
    out = cpu_grouped.grouped_mm(x, w, offsets(counts))
    assert out.dtype == dtype
    tol = 1e-10 if dtype == torch.float64 else 3e-2
    torch.testing.assert_close(out.double(), reference(x, w, offsets(counts).tolist()),
                               rtol=tol, atol=tol * 10)


def test_non_contiguous_inputs():
    counts = [6, 11, 0, 9]
    x = torch.randn(26, 48)[:, ::2]  # strided columns
    w = torch.randn(4, 20, 24).transpose(1, 2)  # [4, 24, 20] view, as the backward's wᵀ
    dy = torch.randn(20, 26).t()
    offs = offsets(counts)
    torch.testing.assert_close(cpu_grouped.grouped_mm(x, w, offs).double(),
                               reference(x, w, offs.tolist()), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_grouped.grouped_mm_wgrad(x, dy, offs).double(),
                               reference_wgrad(x, dy, offs.tolist()), rtol=1e-5, atol=1e-4)


def test_special_values_propagate_to_their_own_expert_only():
    counts = [3, 4]
    x, w = torch.randn(7, 8), torch.randn(2, 8, 5)
    x[1, 2] = float("nan")
    x[5, 0] = float("inf")
    out = cpu_grouped.grouped_mm(x, w, offsets(counts))
    assert out[1].isnan().all()
    assert out[5].isinf().all()  # one inf input per row: ±inf in every output column
    assert torch.isfinite(out[[0, 2, 3, 4, 6]]).all()


def test_autograd_matches_torch_grouped_mm():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing from this build")
    from moe_lab.moe.experts import grouped_mm as torch_grouped_mm

    counts = [9, 0, 14, 5]
    offs = offsets(counts)
    x0, w0 = torch.randn(28, 16), torch.randn(4, 16, 12)
    grads = []
    for fn in (cpu_grouped.grouped_mm, torch_grouped_mm):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn(x, w, offs).sum().backward()  # a stride-0 gradient
        grads.append((x.grad, w.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-5)


def test_is_sync_free_under_fake_tensors():
    x, w = torch.randn(12, 8, requires_grad=True), torch.randn(3, 8, 4, requires_grad=True)
    offs = offsets([4, 4, 4])

    def step():
        cpu_grouped.grouped_mm(x, w, offs).square().sum().backward()

    assert_sync_free(step)


@pytest.mark.parametrize("offs, match", [
    (torch.tensor([5, 3], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([5, 99], dtype=torch.int32), "within"),
    (torch.tensor([-1, 3], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([3], dtype=torch.int32), "shape"),
    (torch.tensor([3.0, 9.0]), "int32 or int64"),
])
def test_bad_offsets_raise(offs, match):
    x, w = torch.randn(10, 4), torch.randn(2, 4, 3)
    with pytest.raises(RuntimeError, match=match):
        cpu_grouped.grouped_mm(x, w, offs)


def test_mismatched_shapes_and_dtypes_raise():
    offs = offsets([2, 2])
    with pytest.raises(RuntimeError, match="K"):
        cpu_grouped.grouped_mm(torch.randn(4, 5), torch.randn(2, 4, 3), offs)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_grouped.grouped_mm(torch.randn(4, 4), torch.randn(2, 4, 3, dtype=torch.float64), offs)
    with pytest.raises(RuntimeError, match=r"dy \[M, N\]"):
        cpu_grouped.grouped_mm_wgrad(torch.randn(4, 4), torch.randn(5, 3), offs)


def test_thread_count_is_respected_and_results_do_not_depend_on_it():
    counts = [40, 3, 0, 25, 17, 1]
    x, w = torch.randn(86, 32), torch.randn(6, 32, 48)
    offs = offsets(counts)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(cpu_grouped.grouped_mm(x, w, offs))
    finally:
        torch.set_num_threads(before)
    # each expert is one whole GEMM on one thread either way: identical bits
    assert torch.equal(outs[0], outs[1])


def test_layer_backend_refuses_non_cpu_tokens_with_a_clear_error():
    from moe_lab import MoELayer
    from moe_lab.config import MoEConfig

    layer = MoELayer(MoEConfig(d_model=8, n_experts=2, top_k=1, d_expert=8), "dropless", "openmp")
    with torch.device("meta"):
        x = torch.empty(4, 8)
    with pytest.raises(ValueError, match="openmp"):
        layer.experts.grouped_forward(x, torch.zeros(3, dtype=torch.int32, device="meta"))


def unfused_mlp(x, w1, w2, offs):
    """Per expert: GEMM, SwiGLU (in float32 for 16-bit inputs, rounded once), GEMM."""
    from moe_lab.moe.experts import swiglu

    ends = offs.tolist()
    out, start = [], 0
    for e, end in enumerate(ends):
        h = x[start:end] @ w1[e]
        a = swiglu(h.float() if h.dtype in (torch.bfloat16, torch.float16) else h).to(h.dtype)
        out.append(a @ w2[e])
        start = end
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[-1])


# f = 12: the SwiGLU's scalar tail only; f = 40: two full vectors (AVX-512) and a tail.
@pytest.mark.parametrize("f", [12, 40])
@pytest.mark.parametrize("case", list(COUNTS))
def test_expert_mlp_forward_and_backward_match_the_plain_chain(case, f):
    counts = COUNTS[case]
    n, d = sum(counts), 16
    offs = offsets(counts)
    x0, w10, w20 = torch.randn(n + 2, d), torch.randn(len(counts), d, 2 * f), torch.randn(len(counts), f, d)
    dy = torch.randn(n, d)
    results = []
    for fn in (cpu_grouped.expert_mlp, unfused_mlp):
        x, w1, w2 = (t.clone().requires_grad_() for t in (x0, w10, w20))
        y = fn(x, w1, w2, offs)
        (y[:n] * dy).sum().backward()
        results.append((y[:n], x.grad[:n], w1.grad, w2.grad))
        if fn is cpu_grouped.expert_mlp:  # rows past the last offset: zero, and no gradient
            assert torch.equal(y[n:], torch.zeros(2, d))
            assert torch.equal(x.grad[n:], torch.zeros(2, d))
    for ours, ref in zip(*results, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


BF16_COUNTS = {**COUNTS, "several row blocks": [0, 150, 64, 1, 129]}  # blocks of 64 rows


@pytest.mark.parametrize("case", list(BF16_COUNTS))
def test_expert_mlp_bf16_blocks_match_the_plain_chain(case):
    # bf16 runs each expert in blocks of 64 rows on ATen's bf16 micro-kernel; against the
    # float64 chain on the same bf16 inputs, within a few bf16 roundings
    if not extension().bf16_gemms():
        pytest.skip("no bf16 GEMMs on this CPU: bf16 takes ATen's GEMMs (the float path)")
    counts = BF16_COUNTS[case]
    n, d, f = sum(counts), 32, 24
    offs = offsets(counts)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n + 3, d, generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(len(counts), d, 2 * f, generator=g) / d**0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(len(counts), f, d, generator=g) / f**0.5).bfloat16().requires_grad_()
    dy = torch.randn(n + 3, d, generator=g).bfloat16()
    y = cpu_grouped.expert_mlp(x, w1, w2, offs)
    y.backward(dy)
    assert torch.equal(y[n:], torch.zeros(3, d, dtype=torch.bfloat16))
    assert torch.equal(x.grad[n:], torch.zeros(3, d, dtype=torch.bfloat16))
    r = [t.detach().double().requires_grad_() for t in (x, w1, w2)]
    ref = unfused_mlp(r[0][:n], r[1], r[2], offs)
    ref.backward(dy[:n].double())
    pairs = ((y[:n], ref), (x.grad[:n], r[0].grad[:n]), (w1.grad, r[1].grad), (w2.grad, r[2].grad))
    for ours, theirs in pairs:
        assert ours.dtype == torch.bfloat16
        if theirs.numel():
            err = (ours.double() - theirs).abs().max()
            assert err <= 2e-2 * theirs.abs().max().clamp_min(1e-3), (err, theirs.abs().max())
    for e, c in enumerate(counts):  # an expert with no rows gets exactly zero weight gradients
        if c == 0:
            assert not w1.grad[e].any() and not w2.grad[e].any()


def test_expert_mlp_bf16_special_values_stay_in_their_own_expert():
    # one thread, so expert 1 reuses the scratch expert 0 filled with inf: an odd block's
    # padding must be zeros, not whatever the last transpose left there (inf * 0 = nan)
    counts = [5, 3, 7]
    offs = offsets(counts)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(15, 16, generator=g).bfloat16()
    x[3, 0] = float("inf")  # expert 0; its transpose puts it where expert 1's padding column goes
    w1, w2 = torch.randn(3, 16, 32, generator=g).bfloat16(), torch.randn(3, 16, 16, generator=g).bfloat16()
    dy = torch.randn(15, 16, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y, h = extension().expert_mlp(x, w1, w2, offs)
        dx, dw1, dw2 = extension().expert_mlp_backward(x, h, w1, w2, offs, dy)
    finally:
        torch.set_num_threads(before)
    assert not torch.isfinite(dw1[0]).all()
    for t in (y[5:], dx[5:], dw1[1:], dw2[1:]):
        assert torch.isfinite(t).all()


def test_expert_mlp_bf16_results_do_not_depend_on_the_thread_count():
    offs = offsets([70, 0, 33, 130])
    g = torch.Generator().manual_seed(6)
    x, dy = torch.randn(233, 16, generator=g).bfloat16(), torch.randn(233, 16, generator=g).bfloat16()
    w1, w2 = torch.randn(4, 16, 32, generator=g).bfloat16(), torch.randn(4, 16, 16, generator=g).bfloat16()
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y, h = extension().expert_mlp(x, w1, w2, offs)
            outs.append((y, h, *extension().expert_mlp_backward(x, h, w1, w2, offs, dy)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_expert_mlp_bf16_non_contiguous_and_partial_grads():
    counts = [9, 0, 17, 4]
    offs = offsets(counts)
    x = torch.randn(30, 64)[:, ::2].bfloat16()  # strided columns, d = 32
    w1 = torch.randn(4, 48, 32).transpose(1, 2).bfloat16().requires_grad_()  # [4, 32, 48] view
    w2 = torch.randn(4, 24, 32).bfloat16().requires_grad_()
    y = cpu_grouped.expert_mlp(x, w1, w2, offs)  # x needs no gradient
    same_steps = unfused_mlp(x, w1.detach(), w2.detach(), offs)  # the same roundings
    torch.testing.assert_close(y, same_steps, rtol=1e-2, atol=1e-2)
    exact = unfused_mlp(x.double(), w1.double(), w2.double(), offs)
    assert (y.double() - exact).norm() / exact.norm() < 1e-2
    dy = torch.randn_like(y)
    y.backward(dy)
    assert x.grad is None
    r1, r2 = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    unfused_mlp(x, r1, r2, offs).backward(dy)
    for ours, ref in ((w1.grad, r1.grad), (w2.grad, r2.grad)):
        assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
        assert (ours.float() - ref.float()).norm() / ref.float().norm() < 1e-2


def test_expert_mlp_extreme_pre_activations_stay_finite_and_match():
    # gates of +-60 put exp() at its range ends (silu -> gate, or -> -0); both paths agree
    counts = [7, 9]
    offs = offsets(counts)
    x = torch.randn(16, 8)
    w1 = torch.randn(2, 8, 64) * 20
    w2 = torch.randn(2, 32, 8)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        xs, w1s, w2s = (t.detach().to(dtype).requires_grad_() for t in (x, w1, w2))
        y = cpu_grouped.expert_mlp(xs, w1s, w2s, offs)
        y.float().square().sum().backward()
        rs = [t.detach().clone().requires_grad_() for t in (xs, w1s, w2s)]
        ref = unfused_mlp(*rs, offs)
        ref.float().square().sum().backward()
        assert torch.isfinite(y).all() and all(torch.isfinite(t.grad).all() for t in (xs, w1s, w2s))
        scale = ref.float().abs().max()
        torch.testing.assert_close(y.float() / scale, ref.float() / scale, rtol=tol, atol=tol)
        for ours, theirs in zip((xs, w1s, w2s), rs):
            g = theirs.grad.float().abs().max()
            torch.testing.assert_close(ours.grad.float() / g, theirs.grad.float() / g, rtol=tol, atol=tol)


def test_expert_mlp_is_sync_free_and_the_layer_uses_it():
    from moe_lab import MoELayer
    from moe_lab.config import MoEConfig

    layer = MoELayer(MoEConfig(d_model=32, n_experts=4, top_k=2, d_expert=32), "dropless", "openmp")
    assert_sync_free(layer, torch.randn(10, 32, requires_grad=True))
    with torch.profiler.profile() as prof:
        layer(torch.randn(10, 32))[0].sum().backward()
    names = {e.name for e in prof.events()}
    assert "moe_lab::openmp_expert_mlp" in names and "moe_lab::openmp_expert_mlp_backward" in names
    # with MXFP8 emulation the quantizers sit between the GEMMs: the two grouped GEMMs then
    layer.experts.quant = "mxfp8"
    with torch.profiler.profile() as prof:
        layer(torch.randn(10, 32))
    names = {e.name for e in prof.events()}
    assert "moe_lab::openmp_grouped_mm" in names and "moe_lab::openmp_expert_mlp" not in names


def test_expert_mlp_bad_shapes_raise():
    offs = offsets([2, 2])
    with pytest.raises(RuntimeError, match="chain"):
        cpu_grouped.expert_mlp(torch.randn(4, 8), torch.randn(2, 8, 6), torch.randn(2, 4, 8), offs)
    op = torch.ops.moe_lab.openmp_expert_mlp
    with pytest.raises(RuntimeError, match="must share a dtype"):
        op(torch.randn(4, 8), torch.randn(2, 8, 6), torch.randn(2, 3, 8).double(), offs)
    with pytest.raises(RuntimeError, match="must share a dtype"):  # fp32 weights need even f
        op(torch.randn(4, 8).bfloat16(), torch.randn(2, 8, 6), torch.randn(2, 3, 8), offs)
    # the wrapper casts weights of another dtype to x's
    y = cpu_grouped.expert_mlp(torch.randn(4, 8), torch.randn(2, 8, 6).double(), torch.randn(2, 3, 8), offs)
    assert y.dtype == torch.float32


def test_expert_mlp_takes_fp32_weights_with_bf16_tokens():
    # fp32 (master) weights are rounded to bf16 as they are repacked: the same bits as casting
    # them first; their gradients come back in fp32, unrounded (rounded, the bf16 path's bits)
    if not extension().bf16_gemms():
        pytest.skip("no bf16 GEMMs on this CPU: fp32 weights are cast to bf16 first")
    offs = offsets([70, 0, 5, 64])
    g = torch.Generator().manual_seed(8)
    x0, dy = torch.randn(139, 32, generator=g).bfloat16(), torch.randn(139, 32, generator=g).bfloat16()
    w1, w2 = torch.randn(4, 32, 48, generator=g) / 6, torch.randn(4, 24, 32, generator=g) / 5
    assert cpu_grouped.takes_fp32_weights(x0, w1, w2)
    results = []
    for cast in (False, True):
        x = x0.clone().requires_grad_()
        a, b = (w.bfloat16() if cast else w.clone() for w in (w1, w2))
        a.requires_grad_(), b.requires_grad_()
        y = cpu_grouped.expert_mlp(x, a, b, offs)
        y.backward(dy)
        results.append((y, x.grad, a.grad, b.grad))
    (y32, dx32, dw1_32, dw2_32), (y16, dx16, dw1_16, dw2_16) = results
    assert dw1_32.dtype == dw2_32.dtype == torch.float32 and y32.dtype == torch.bfloat16
    assert torch.equal(y32, y16) and torch.equal(dx32, dx16)
    assert torch.equal(dw1_32.bfloat16(), dw1_16) and torch.equal(dw2_32.bfloat16(), dw2_16)
    assert not torch.equal(dw1_32, dw1_16.float())  # fp32 gradients: not rounded to bf16
    assert not dw1_32[1].any() and not dw2_32[1].any()  # the empty expert
    torch.library.opcheck(torch.ops.moe_lab.openmp_expert_mlp.default,
                          (x0, w1.requires_grad_(), w2.requires_grad_(), offs))
    # the choice is a constant to torch.compile: one graph, the same result
    compiled = torch.compile(lambda x, a, b: cpu_grouped.expert_mlp(x, a, b, offs), fullgraph=True)
    assert torch.equal(compiled(x0, w1, w2), y32)
