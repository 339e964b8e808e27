"""The Triton grouped GEMM (moe_lab.kernels.grouped_gemm) against the loop reference and
``torch._grouped_mm``: forward, backward, the fused SwiGLU, awkward partitions, and the
sync-free certificate.

Every kernel output is allocated NaN-filled here (``poisoned_outputs``), so an element a
kernel forgot to write fails the comparison. Under ``TRITON_INTERPRET=1`` each program
instance is a Python round trip: shapes are small, tiles large.
"""

from __future__ import annotations

import pytest
import torch

from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels.grouped_gemm import (
    grouped_gemm,
    grouped_gemm_reference,
    grouped_gemm_swiglu,
)
from moe_lab.moe.experts import swiglu
from moe_lab.training.sync import SyncError, assert_sync_free, count_syncs

DTYPES = [torch.float32, torch.bfloat16]
# Row counts per expert, and padding rows after them: experts with no rows, every row in
# one expert, one expert, no rows at all, counts that are not multiples of any block.
PARTITIONS = {
    "mixed": ([5, 0, 70, 13], 12),
    "all_in_one": ([0, 0, 77, 0], 0),
    "one_expert": ([45], 3),
    "no_rows": ([0, 0, 0], 0),
    "only_padding": ([0, 0], 9),
    "many_small": ([1, 17, 2, 0, 33, 3, 0, 16], 5),
}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    def nan_output(shape, like):
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)

    monkeypatch.setattr(gg, "_new_output", nan_output)


def make_offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def problem(counts: list[int], pad: int, k: int, n: int, dtype=torch.float32):
    """Fresh random ``x: [sum(counts) + pad, k]``, ``w: [E, k, n]``, offsets."""
    x = torch.randn(sum(counts) + pad, k).to(dtype)
    w = (torch.randn(len(counts), k, n) / k**0.5).to(dtype)
    return x, w, make_offsets(counts)


def tolerances(dtype: torch.dtype) -> dict:
    # fp32: only the summation order differs. bf16: the kernel accumulates in fp32 and
    # rounds once on the store (half an ulp, 2^-9 relative); the reference is fp32.
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-3}


def reference_grads(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor):
    """Output and gradients of ``fn`` in float32 autograd on the same values."""
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, grad_out.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(PARTITIONS))
def test_forward_matches_loop_reference(name, dtype):
    counts, pad = PARTITIONS[name]
    x, w, offsets = problem(counts, pad, 48, 40, dtype)
    y = grouped_gemm(x, w, offsets)
    assert y.shape == (x.shape[0], 40) and y.dtype == dtype
    expected = grouped_gemm_reference(x.float(), w.float(), offsets)
    torch.testing.assert_close(y.float(), expected, **tolerances(dtype))
    assert torch.all(y[sum(counts):] == 0)  # padding rows written as zeros


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["mixed", "all_in_one", "no_rows", "many_small"])
def test_backward_matches_autograd_on_the_loop(name, dtype):
    counts, pad = PARTITIONS[name]
    x, w, offsets = problem(counts, pad, 40, 24, dtype)
    x.requires_grad_(), w.requires_grad_()
    y = grouped_gemm(x, w, offsets)
    grad_out = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), grad_out)
    _, (rdx, rdw) = reference_grads(lambda a, b: grouped_gemm_reference(a, b, offsets),
                                    [x, w], grad_out)
    tol = tolerances(dtype)
    torch.testing.assert_close(dx.float(), rdx, **tol)
    torch.testing.assert_close(dw.float(), rdw, **tol)
    assert dx.dtype == dw.dtype == dtype
    for e, count in enumerate(counts):
        if count == 0:
            assert torch.all(dw[e] == 0), f"expert {e} has no rows: its dW must be zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["mixed", "one_expert", "only_padding"])
def test_swiglu_fused_forward_and_backward(name, dtype):
    counts, pad = PARTITIONS[name]
    x, w, offsets = problem(counts, pad, 32, 2 * 24, dtype)
    x.requires_grad_(), w.requires_grad_()
    h = grouped_gemm_swiglu(x, w, offsets)
    assert h.shape == (x.shape[0], 24) and h.dtype == dtype
    grad_out = torch.randn_like(h)
    dx, dw = torch.autograd.grad(h, (x, w), grad_out)
    def reference(a, b):
        return swiglu(grouped_gemm_reference(a, b, offsets))

    expected, (rdx, rdw) = reference_grads(reference, [x, w], grad_out)
    tol = tolerances(dtype)
    torch.testing.assert_close(h.float(), expected, **tol)
    assert torch.all(h[sum(counts):] == 0)
    if dtype == torch.float32:
        torch.testing.assert_close(dx, rdx, **tol)
        torch.testing.assert_close(dw, rdw, **tol)
    else:
        # The gradient of the pre-activation is rounded to bf16 before the dX and dW GEMMs
        # (as in any bf16 autograd), and dX sums products that cancel: hold the kernel to
        # the error of PyTorch's own bf16 autograd of the loop, against the fp32 result.
        xb, wb = x.detach().requires_grad_(), w.detach().requires_grad_()
        torch_grads = torch.autograd.grad(reference(xb, wb), (xb, wb), grad_out)
        for mine, theirs, exact in zip((dx, dw), torch_grads, (rdx, rdw), strict=True):
            err, torch_err = (mine.float() - exact).abs().max(), (theirs.float() - exact).abs().max()
            assert err <= 1.25 * torch_err + 1e-3, (err, torch_err)


def test_bf16_output_is_rounded_to_nearest_even_like_torch():
    # y = a + b summed exactly in fp32, then rounded once to bf16 on the store: the result
    # must be torch's round-to-nearest-even, ties included (the interpreter's own cast
    # truncates, so the kernel rounds in integers).
    a = torch.randn(64).bfloat16()
    b = (a.float() * torch.randint(1, 256, (64,)) * 2.0**-9).bfloat16()  # ties and non-ties
    x = torch.ones(3, 2, dtype=torch.bfloat16)
    w = torch.stack([a, b]).unsqueeze(0)  # [1, 2, 64]
    y = grouped_gemm(x, w, make_offsets([3]))
    expected = (a.float() + b.float()).bfloat16().expand(3, 64)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


def test_random_partitions_fresh_each_time():
    for _ in range(4):
        n_experts = int(torch.randint(1, 9, ()))
        counts = torch.randint(0, 40, (n_experts,))
        counts[torch.rand(n_experts) < 0.3] = 0
        pad = int(torch.randint(0, 20, ()))
        x, w, offsets = problem(counts.tolist(), pad, 24, 16)
        torch.testing.assert_close(grouped_gemm(x, w, offsets),
                                   grouped_gemm_reference(x, w, offsets), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tiles", [(16, 16, 16), (64, 64, 32)], ids=["small", "compiled"])
def test_other_tile_sizes(monkeypatch: pytest.MonkeyPatch, tiles):
    # The interpreter picks large tiles; force small ones (several tiles per expert, several
    # K steps, several N tiles) and the compiled default.
    monkeypatch.setattr(gg, "_blocks", lambda m, n, k, n_experts: (*tiles, 4))
    counts, pad = PARTITIONS["many_small"]
    x, w, offsets = problem(counts, pad, 48, 40)
    x.requires_grad_(), w.requires_grad_()
    y = grouped_gemm(x, w, offsets)
    grad_out = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), grad_out)
    expected, ref_grads = reference_grads(lambda a, b: grouped_gemm_reference(a, b, offsets),
                                          [x, w], grad_out)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    for mine, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    w2 = torch.randn(len(counts), 48, 2 * 24)
    torch.testing.assert_close(grouped_gemm_swiglu(x, w2, offsets),
                               swiglu(grouped_gemm_reference(x, w2, offsets)), rtol=1e-5, atol=1e-5)


def test_non_contiguous_inputs_and_expanded_gradient():
    counts, pad = PARTITIONS["mixed"]
    m, k, n = sum(counts) + pad, 40, 24
    x = torch.randn(k, 2 * m)[:, ::2].t()  # [m, k], strides (2, 2m)
    w = torch.randn(len(counts), n, k).transpose(1, 2)  # [E, k, n], column-major per expert
    offsets = make_offsets(counts).repeat_interleave(2)[::2]  # stride 2
    assert not (x.is_contiguous() or w.is_contiguous() or offsets.is_contiguous())
    torch.testing.assert_close(grouped_gemm(x, w, offsets),
                               grouped_gemm_reference(x, w, offsets), rtol=1e-5, atol=1e-5)
    # .sum().backward() hands the kernel a stride-0 gradient (torch._grouped_mm's CPU
    # backward rejects it).
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    grouped_gemm(x, w, offsets).sum().backward()
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    grouped_gemm_reference(xr, wr, offsets).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-5)


def test_m_bound_limits_the_grid_and_zeroes_the_tail():
    counts = [7, 0, 20]
    x, w, offsets = problem(counts, 30, 32, 16)  # 57 rows, offsets[E] = 27
    y = grouped_gemm(x, w, offsets, m_bound=40)
    torch.testing.assert_close(y, grouped_gemm_reference(x, w, offsets), rtol=1e-5, atol=1e-5)
    assert torch.all(y[27:] == 0)


def test_zero_total_rows_backward():
    x, w, offsets = problem([0, 0, 0], 0, 16, 16)
    x.requires_grad_(), w.requires_grad_()
    y = grouped_gemm(x, w, offsets)
    assert y.shape == (0, 16)
    dx, dw = torch.autograd.grad(y, (x, w), torch.randn_like(y))
    assert dx.shape == (0, 16) and torch.all(dw == 0)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm not in this build")
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_grouped_mm(dtype):
    # torch._grouped_mm takes the cumulative *end* offsets [E] (offsets[1:]) and, on the CPU,
    # row strides that are multiples of 16 bytes (K and N multiples of 8 for bf16). Rows
    # past offs[-1] it leaves unwritten, so the comparison is on the experts' rows.
    counts = [9, 0, 31, 24]
    x, w, offsets = problem(counts, 0, 32, 24, dtype)
    x.requires_grad_(), w.requires_grad_()
    y = grouped_gemm(x, w, offsets)
    y_torch = torch._grouped_mm(x, w, offs=offsets[1:])
    grad_out = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), grad_out)
    # Its CPU backward needs an explicit (non-expanded) output gradient.
    grads_torch = torch.autograd.grad(y_torch, (x, w), grad_out)
    # Both accumulate in fp32 (bf16: both round once), so they agree to the reference's tolerance.
    tol = tolerances(dtype)
    torch.testing.assert_close(y.float(), y_torch.float(), **tol)
    for mine, theirs in zip(grads, grads_torch, strict=True):
        torch.testing.assert_close(mine.float(), theirs.float(), **tol)


def test_sync_free_forward_and_backward():
    x, w, offsets = problem([5, 0, 70, 13], 12, 32, 16)
    x.requires_grad_(), w.requires_grad_()
    out = assert_sync_free(lambda x, w, off: grouped_gemm(x, w, off), x, w, offsets)
    assert out.shape == (100, 16)
    w2 = torch.randn(4, 32, 2 * 16, requires_grad=True)
    out = assert_sync_free(lambda x, w, off: grouped_gemm_swiglu(x, w, off), x, w2, offsets)
    assert out.shape == (100, 16)
    # ... and in a real run, nothing is counted either.
    def step(x, w, off):
        y = grouped_gemm_swiglu(x, w, off)
        return torch.autograd.grad(y, (x, w), torch.ones_like(y))

    _, counts = count_syncs(step, x, w2, offsets)
    assert sum(counts.values()) == 0, counts


def test_the_loop_reference_is_not_sync_free():
    x, w, offsets = problem([3, 4], 0, 16, 16)
    with pytest.raises(SyncError):
        assert_sync_free(grouped_gemm_reference, x, w, offsets)


def test_torch_compile_traces_the_custom_ops():
    x, w, offsets = problem([6, 0, 20], 4, 16, 32)
    x.requires_grad_(), w.requires_grad_()

    def expert_ffn(x, w, off):
        return grouped_gemm(grouped_gemm_swiglu(x, w, off), w[:, :16, :16], off)

    compiled = torch.compile(expert_ffn, fullgraph=True, backend="aot_eager")
    y, y_eager = compiled(x, w, offsets), expert_ffn(x, w, offsets)
    torch.testing.assert_close(y, y_eager, rtol=0, atol=0)
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, (x, w), g), torch.autograd.grad(y_eager, (x, w), g),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x, w, o: (x[0], w, o), "x must be \\[M, K\\]"),
        (lambda x, w, o: (x, w[:, :5], o), "w must be \\[E, K=16, N\\]"),
        (lambda x, w, o: (x, w.double(), o), "w.dtype must equal x.dtype"),
        (lambda x, w, o: (x.double(), w.double(), o), "x.dtype must be one of"),
        (lambda x, w, o: (x, w, o.long()), "offsets must be \\[E \\+ 1 = 3\\] int32"),
        (lambda x, w, o: (x, w, o[:-1]), "offsets must be \\[E \\+ 1 = 3\\] int32"),
        (lambda x, w, o: (x, w, o.to("meta")), "offsets must be on x's device"),
        (lambda x, w, o: (x, w[:0], o[:1]), "at least one expert"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, match):
    x, w, offsets = problem([3, 4], 1, 16, 8)
    with pytest.raises(ValueError, match=match):
        grouped_gemm(*change(x, w, offsets))


def test_bad_m_bound_and_odd_swiglu_width():
    x, w, offsets = problem([3, 4], 1, 16, 8)
    with pytest.raises(ValueError, match="m_bound must be an int in \\[0, M = 8\\], got 9"):
        grouped_gemm(x, w, offsets, m_bound=9)
    with pytest.raises(ValueError, match="even last dim"):
        grouped_gemm_swiglu(x, w[..., :7], offsets)
