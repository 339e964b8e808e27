"""The Triton grouped GEMM (moe_lab.kernels.grouped_gemm) against the loop reference and
``torch._grouped_mm``: forward, backward, the fused SwiGLU, awkward partitions, and the
sync-free certificate.

Every kernel output is allocated NaN-filled here (`moe_lab.kernels.common.poison_outputs`),
so an element a kernel forgot to write fails the comparison. Tensors live on the ``device`` fixture's
device: on a CUDA machine the kernels run compiled, elsewhere under ``TRITON_INTERPRET=1``,
where each program instance is a Python round trip: shapes are small, tiles large. The
paths only a GPU takes by default (small tiles, bfloat16 tiles into ``tl.dot``) are forced
here (what the compiled kernels become is tests/workbench/compile_report/test_specs.py's).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import triton.language as tl
from support import poison_outputs

from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels.grouped_gemm import (
    dot_bf16,
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
def poisoned_outputs() -> Iterator[None]:
    with poison_outputs():
        yield


def make_offsets(counts: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def problem(counts: list[int], pad: int, k: int, n: int, dtype=torch.float32,
            device: torch.device | str = "cpu"):
    """Fresh random ``x: [sum(counts) + pad, k]``, ``w: [E, k, n]``, offsets, on ``device``."""
    x = torch.randn(sum(counts) + pad, k).to(device, dtype)
    w = (torch.randn(len(counts), k, n) / k**0.5).to(device, dtype)
    return x, w, make_offsets(counts, device)


def force_small_tiles(monkeypatch: pytest.MonkeyPatch, blocks: tuple[int, int, int]) -> list[str]:
    """Every launch gets ``(BLOCK_M, BLOCK_N, BLOCK_K) = blocks``: several tiles per
    expert, several K steps and N tiles, as compiled tiles give at real sizes. Returns the
    list the launches' kernel names are appended to."""
    bm, bn, bk = blocks
    config = gg.LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4, num_stages=2)
    launched = []

    def launch_config(kernel, m, n, k, n_experts, *, interpreted, dtype, device=None):
        launched.append(kernel)
        return config

    monkeypatch.setattr(gg, "launch_config", launch_config)
    return launched


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
def test_forward_matches_loop_reference(name, dtype, device):
    counts, pad = PARTITIONS[name]
    x, w, offsets = problem(counts, pad, 48, 40, dtype, device)
    y = grouped_gemm(x, w, offsets)
    assert y.shape == (x.shape[0], 40) and y.dtype == dtype
    expected = grouped_gemm_reference(x.float(), w.float(), offsets)
    torch.testing.assert_close(y.float(), expected, **tolerances(dtype))
    assert torch.all(y[sum(counts):] == 0)  # padding rows written as zeros


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["mixed", "all_in_one", "no_rows", "many_small"])
def test_backward_matches_autograd_on_the_loop(name, dtype, device):
    counts, pad = PARTITIONS[name]
    x, w, offsets = problem(counts, pad, 40, 24, dtype, device)
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
def test_swiglu_fused_forward_and_backward(name, dtype, device):
    counts, pad = PARTITIONS[name]
    x, w, offsets = problem(counts, pad, 32, 2 * 24, dtype, device)
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


def test_bf16_output_is_rounded_to_nearest_even_like_torch(device):
    # y = a + b summed exactly in fp32, then rounded once to bf16 on the store: the result
    # must be torch's round-to-nearest-even, ties included (the interpreter's own cast
    # truncates, so the kernel rounds in integers).
    a = torch.randn(64).bfloat16()
    b = (a.float() * torch.randint(1, 256, (64,)) * 2.0**-9).bfloat16()  # ties and non-ties
    a, b = a.to(device), b.to(device)
    x = torch.ones(3, 2, dtype=torch.bfloat16, device=device)
    w = torch.stack([a, b]).unsqueeze(0)  # [1, 2, 64]
    y = grouped_gemm(x, w, make_offsets([3], device))
    expected = (a.float() + b.float()).bfloat16().expand(3, 64)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


def test_random_partitions_fresh_each_time(device):
    for _ in range(4):
        n_experts = int(torch.randint(1, 9, ()))
        counts = torch.randint(0, 40, (n_experts,))
        counts[torch.rand(n_experts) < 0.3] = 0
        pad = int(torch.randint(0, 20, ()))
        x, w, offsets = problem(counts.tolist(), pad, 24, 16, device=device)
        torch.testing.assert_close(grouped_gemm(x, w, offsets),
                                   grouped_gemm_reference(x, w, offsets), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tiles", [(16, 16, 16), (64, 64, 32)], ids=["small", "compiled"])
def test_other_tile_sizes(monkeypatch: pytest.MonkeyPatch, tiles, device):
    # The interpreter picks large tiles; force small ones (several tiles per expert, several
    # K steps, several N tiles) and the compiled default.
    launched = force_small_tiles(monkeypatch, tiles)
    counts, pad = PARTITIONS["many_small"]
    x, w, offsets = problem(counts, pad, 48, 40, device=device)
    x.requires_grad_(), w.requires_grad_()
    y = grouped_gemm(x, w, offsets)
    grad_out = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), grad_out)
    expected, ref_grads = reference_grads(lambda a, b: grouped_gemm_reference(a, b, offsets),
                                          [x, w], grad_out)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    for mine, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    w2 = torch.randn(len(counts), 48, 2 * 24, device=device)
    torch.testing.assert_close(grouped_gemm_swiglu(x, w2, offsets),
                               swiglu(grouped_gemm_reference(x, w2, offsets)), rtol=1e-5, atol=1e-5)
    assert set(launched) == set(gg.TILE_SPACE)  # every wrapper took its tiles from launch_config


def test_non_contiguous_inputs_and_expanded_gradient(device):
    counts, pad = PARTITIONS["mixed"]
    m, k, n = sum(counts) + pad, 40, 24
    x = torch.randn(k, 2 * m, device=device)[:, ::2].t()  # [m, k], strides (2, 2m)
    w = torch.randn(len(counts), n, k, device=device).transpose(1, 2)  # [E, k, n], column-major
    offsets = make_offsets(counts, device).repeat_interleave(2)[::2]  # stride 2
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


def test_zero_total_rows_backward(device):
    x, w, offsets = problem([0, 0, 0], 0, 16, 16, device=device)
    x.requires_grad_(), w.requires_grad_()
    y = grouped_gemm(x, w, offsets)
    assert y.shape == (0, 16)
    dx, dw = torch.autograd.grad(y, (x, w), torch.randn_like(y))
    assert dx.shape == (0, 16) and torch.all(dw == 0)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm not in this build")
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_grouped_mm(dtype, device):
    # torch._grouped_mm takes the cumulative *end* offsets [E] (offsets[1:]) and row strides
    # that are multiples of 16 bytes (K and N multiples of 8 for bf16). Rows past
    # offs[-1] it leaves unwritten, so the comparison is on the experts' rows.
    if device.type == "cuda" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability() < (9, 0)):
        pytest.skip("torch._grouped_mm on CUDA takes bfloat16 on SM 9.0 and later only")
    counts = [9, 0, 31, 24]
    x, w, offsets = problem(counts, 0, 32, 24, dtype, device)
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


def test_sync_free_forward_and_backward(device):
    x, w, offsets = problem([5, 0, 70, 13], 12, 32, 16, device=device)
    x.requires_grad_(), w.requires_grad_()
    out = assert_sync_free(lambda x, w, off: grouped_gemm(x, w, off), x, w, offsets)
    assert out.shape == (100, 16)
    w2 = torch.randn(4, 32, 2 * 16, device=device, requires_grad=True)
    out = assert_sync_free(lambda x, w, off: grouped_gemm_swiglu(x, w, off), x, w2, offsets)
    assert out.shape == (100, 16)
    # ... and in a real run, nothing is counted either.
    def step(x, w, off):
        y = grouped_gemm_swiglu(x, w, off)
        return torch.autograd.grad(y, (x, w), torch.ones_like(y))

    _, counts = count_syncs(step, x, w2, offsets)
    assert sum(counts.values()) == 0, counts


def test_the_loop_reference_is_not_sync_free(device):
    x, w, offsets = problem([3, 4], 0, 16, 16, device=device)
    with pytest.raises(SyncError):
        assert_sync_free(grouped_gemm_reference, x, w, offsets)


def test_torch_compile_traces_the_custom_ops(device):
    x, w, offsets = problem([6, 0, 20], 4, 16, 32, device=device)
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
        (lambda x, w, o: (x, w, o.to("meta")), "offsets must be on .* \\(x's device\\)"),
        (lambda x, w, o: (x, w[:0], o[:1]), "at least one expert"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, match, device):
    x, w, offsets = problem([3, 4], 1, 16, 8, device=device)
    with pytest.raises(ValueError, match=match):
        grouped_gemm(*change(x, w, offsets))


def test_odd_swiglu_width(device):
    x, w, offsets = problem([3, 4], 1, 16, 8, device=device)
    with pytest.raises(ValueError, match="even last dim"):
        grouped_gemm_swiglu(x, w[..., :7], offsets)


# --------------------------------------------------------------------------------------
# The compiled path: bfloat16 tiles into tl.dot, launch configurations
# --------------------------------------------------------------------------------------


def small_integers(*shape: int, device: torch.device) -> torch.Tensor:
    """bfloat16 values in [-3, 3]: every product and every sum below is an integer exact in
    float32, so no order of summation and no bfloat16 arithmetic flaw can change a result."""
    return torch.randint(-3, 4, shape).to(device, torch.bfloat16)


def interpreter_widens_bf16_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter holds bfloat16 tiles as their raw 16 bits and its ``tl.dot``
    multiplies those bits as integers; make it widen them to float32 first (exact: a
    16-bit shift), so that a bfloat16 ``tl.dot`` can run on the CPU."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    dot = builder.create_dot

    def widened(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    monkeypatch.setattr(builder, "create_dot", lambda a, b, d, *args: dot(widened(a), widened(b), d, *args))


@pytest.mark.parametrize("tiles", [None, (16, 16, 16)], ids=["default_tiles", "small_tiles"])
def test_bf16_dot_branch_is_exact_on_small_integers(monkeypatch: pytest.MonkeyPatch, tiles, device,
                                                    interpreted):
    # Compiled, bf16 tiles go to tl.dot as bf16 (DOT_BF16); the interpreter never takes that
    # branch by itself (its bf16 dot is wrong), so here it is forced, with the interpreter's
    # dot fixed for bf16 tiles, on inputs whose products and sums are exact. Forward, dX,
    # dW: the fp32 reference rounded once, bit for bit; the fused SwiGLU (a sigmoid, not
    # exact) within one bf16 rounding.
    if interpreted:
        interpreter_widens_bf16_dots(monkeypatch)
    chosen = []

    def forced_dot_bf16(dtype: torch.dtype, interpreted: bool) -> bool:
        chosen.append(dtype == torch.bfloat16)
        return dtype == torch.bfloat16

    monkeypatch.setattr(gg, "dot_bf16", forced_dot_bf16)
    if tiles:
        force_small_tiles(monkeypatch, tiles)
    counts, pad = PARTITIONS["many_small"]
    m, k, n = sum(counts) + pad, 48, 40
    offsets = make_offsets(counts, device)
    x = small_integers(m, k, device=device).requires_grad_()
    w = small_integers(len(counts), k, n, device=device).requires_grad_()
    grad_out = small_integers(m, n, device=device)
    y = grouped_gemm(x, w, offsets)
    dx, dw = torch.autograd.grad(y, (x, w), grad_out)
    expected, (rdx, rdw) = reference_grads(lambda a, b: grouped_gemm_reference(a, b, offsets),
                                           [x, w], grad_out)
    for mine, exact in ((y, expected), (dx, rdx), (dw, rdw)):
        assert torch.equal(mine, exact.bfloat16())

    w2 = small_integers(len(counts), k, 2 * n, device=device)
    h = grouped_gemm_swiglu(x.detach(), w2, offsets)
    dh = small_integers(m, n, device=device)
    dpre = gg.grouped_gemm_swiglu_op(x.detach(), w2, offsets, dh)
    pre = grouped_gemm_reference(x.detach().float(), w2.float(), offsets)
    expected_h, (expected_dpre,) = reference_grads(swiglu, [pre], dh)
    one_rounding = {"rtol": 2**-7, "atol": 1e-6}
    torch.testing.assert_close(h.float(), expected_h.bfloat16().float(), **one_rounding)
    torch.testing.assert_close(dpre.float(), expected_dpre.bfloat16().float(), **one_rounding)
    assert chosen and all(chosen), "every launch must have taken the bf16 tl.dot branch"


def test_launch_config_compiled_and_interpreted():
    compiled = gg.launch_config("gemm", 65536, 7168, 2048, 256, interpreted=False)
    assert compiled.num_stages >= 2 and set(compiled.blocks) == {"BLOCK_M", "BLOCK_N", "BLOCK_K"}
    interpreted = gg.launch_config("dw", 100, 40, 48, 4, interpreted=True)
    assert interpreted.blocks == {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}
    assert dot_bf16(torch.bfloat16, interpreted=False)
    assert not dot_bf16(torch.bfloat16, interpreted=True)
    assert not dot_bf16(torch.float32, interpreted=False)


@pytest.mark.parametrize(("kernel", "m", "n", "k", "n_experts", "dtype", "expected"), [
    # bf16, DeepSeek-V3: 65536 rows / 256 experts = 256 rows per expert (few), N = 7168 (wide)
    ("gemm", 65536, 7168, 2048, 256, torch.bfloat16, (64, 128, 64, 4, 3)),
    ("gemm", 65536, 256, 2048, 256, torch.bfloat16, (64, 64, 32, 4, 3)),
    # bf16, GPT-OSS-20B: 32768 rows / 32 experts = 1024 rows per expert (many)
    ("gemm", 32768, 2880, 2880, 32, torch.bfloat16, (128, 128, 64, 8, 3)),
    ("gemm", 32768, 512, 2880, 32, torch.bfloat16, (128, 64, 64, 4, 3)),
    ("gemm", 32768, 2880, 2880, 32, torch.float32, (64, 64, 32, 4, 3)),
    ("swiglu", 65536, 2048, 7168, 256, torch.bfloat16, (64, 64, 32, 4, 3)),
    ("swiglu", 32768, 2880, 2880, 32, torch.bfloat16, (128, 64, 64, 8, 3)),
    ("swiglu", 32768, 2880, 2880, 32, torch.float32, (64, 64, 16, 8, 3)),
    ("dw", 65536, 7168, 2048, 256, torch.bfloat16, (64, 128, 64, 4, 3)),
    ("dw", 32768, 5760, 2880, 32, torch.bfloat16, (64, 128, 128, 8, 3)),
    ("dw", 32768, 5760, 2880, 32, torch.float32, (32, 64, 64, 4, 3)),
    # the thresholds: MANY_ROWS rows per expert, WIDE_N columns
    ("gemm", 511 * 8, 1023, 64, 8, torch.bfloat16, (64, 64, 32, 4, 3)),
    ("gemm", 512 * 8, 1024, 64, 8, torch.bfloat16, (128, 128, 64, 8, 3)),
])
def test_the_rule_picks_what_its_docstring_says(kernel, m, n, k, n_experts, dtype, expected):
    cfg = gg.launch_config(kernel, m, n, k, n_experts, interpreted=False, dtype=dtype)
    b = cfg.blocks
    assert (b["BLOCK_M"], b["BLOCK_N"], b["BLOCK_K"], cfg.num_warps, cfg.num_stages) == expected
    assert cfg in gg.TILE_SPACE[kernel]


def test_every_chosen_config_is_in_the_space_and_fits_the_tensor_cores():
    for kernel in gg.TILE_SPACE:
        space = gg.TILE_SPACE[kernel]
        assert 2 <= len(space) <= 6 and len(set(map(repr, space))) == len(space), kernel
        assert all(cfg.num_stages >= 2 for cfg in space), kernel  # the loads are pipelined
        for m, n, k, e in ((65536, 7168, 2048, 256), (32768, 2880, 2880, 32), (40, 24, 48, 6),
                           (1, 1, 1, 1), (1 << 20, 64, 64, 1)):
            for dtype in gg.KERNEL_DTYPES:
                cfg = gg.choose_config(kernel, m, n, k, e, dtype)
                assert cfg in space, (kernel, m, n, k, e, dtype)
                if dtype == torch.bfloat16:  # a warpgroup MMA: 64 output rows per 4 warps
                    rows = cfg.blocks["BLOCK_K" if kernel == "dw" else "BLOCK_M"]
                    assert rows >= 16 * cfg.num_warps, (kernel, cfg)


@pytest.mark.parametrize(("kernel", "index"), [
    (kernel, index) for kernel in gg.TILE_SPACE for index in range(len(gg.TILE_SPACE[kernel]))])
def test_wrappers_run_correctly_at_each_config_of_the_space(monkeypatch: pytest.MonkeyPatch,
                                                            kernel, index, device):
    # The interpreter normally sizes its own tiles; force one config of the space on every
    # launch of that kernel (others keep theirs): several tiles per expert at 128 rows too.
    config = gg.TILE_SPACE[kernel][index]
    real = gg.launch_config
    used = []

    def launch_config(name, m, n, k, n_experts, *, interpreted, dtype, device=None):
        if name == kernel:
            used.append(name)
            return config
        return real(name, m, n, k, n_experts, interpreted=interpreted, dtype=dtype)

    monkeypatch.setattr(gg, "launch_config", launch_config)
    counts, pad = [150, 0, 7, 70], 5
    x, w, offsets = problem(counts, pad, 72, 136, device=device)
    x.requires_grad_(), w.requires_grad_()
    if kernel == "swiglu":
        w = (torch.randn(len(counts), 72, 2 * 136) / 72**0.5).to(device).requires_grad_()
        fn, ref = grouped_gemm_swiglu, (lambda a, b: swiglu(grouped_gemm_reference(a, b, offsets)))
    else:
        fn, ref = grouped_gemm, (lambda a, b: grouped_gemm_reference(a, b, offsets))
    y = fn(x, w, offsets)
    grad_out = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), grad_out)
    expected, ref_grads = reference_grads(ref, [x, w], grad_out)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    for mine, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-4)
    assert used  # the forced config was launched
