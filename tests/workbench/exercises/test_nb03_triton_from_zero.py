"""Notebook 03's exercises (a masked row softmax, the grouped matmul's offset lookup): each
check passes the reference, reports the stub as not done, and rejects plausible wrong
answers with a message naming the slip. The kernels run under Triton's interpreter here
(compiled on a GPU); the notebook itself runs in tests/workbench/lab/test_notebooks.py."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from moe_lab.kernels.common import jit
from moe_lab.kernels.grouped_gemm import grouped_gemm_reference
from moe_lab.workbench.exercises import ExerciseError, NotDoneError, solution
from moe_lab.workbench.exercises import nb03_triton_from_zero as ex

# ------------------------------------------------------------------- row softmax answers


@jit
def _softmax_stub(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    tl.static_assert(False, "exercise not solved yet")


@jit
def _softmax_zero_padding(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    # Masked lanes loaded as 0, not -inf: they count in the sum.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, num / tl.sum(num, axis=0), mask=mask)


@jit
def _softmax_no_max(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    # Right on small logits; exp overflows on large ones.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=float("-inf"))
    num = tl.exp(x)
    tl.store(out_ptr + row * out_row_stride + cols, num / tl.sum(num, axis=0), mask=mask)


@jit
def _softmax_rows_n_apart(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    # Right on contiguous rows only.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=float("-inf"))
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * N + cols, num / tl.sum(num, axis=0), mask=mask)


@jit
def _softmax_out_stride_of_x(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    # x's row stride used for out too.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=float("-inf"))
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * x_row_stride + cols, num / tl.sum(num, axis=0), mask=mask)


@jit
def _softmax_unmasked_store(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=float("-inf"))
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, num / tl.sum(num, axis=0))


@jit
def _softmax_unmasked_load(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + row * x_row_stride + cols)
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, num / tl.sum(num, axis=0), mask=cols < N)


# ------------------------------------------------------------------- offset lookup answers


@jit
def _rows_stub(offsets_ptr, e, t, BLOCK_M: tl.constexpr):
    tl.static_assert(False, "exercise not solved yet")


@jit
def _rows_unmasked(offsets_ptr, e, t, BLOCK_M: tl.constexpr):
    rows = tl.load(offsets_ptr + e).to(tl.int64) + t * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, rows >= 0


@jit
def _rows_one_past_the_end(offsets_ptr, e, t, BLOCK_M: tl.constexpr):
    rows = tl.load(offsets_ptr + e).to(tl.int64) + t * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, rows <= tl.load(offsets_ptr + e + 1)


@jit
def _rows_every_tile_the_first(offsets_ptr, e, t, BLOCK_M: tl.constexpr):
    rows = tl.load(offsets_ptr + e).to(tl.int64) + tl.arange(0, BLOCK_M)
    return rows, rows < tl.load(offsets_ptr + e + 1)


@jit
def _rows_from_zero(offsets_ptr, e, t, BLOCK_M: tl.constexpr):
    # Tiles counted from row 0, not from offsets[e].
    rows = (t * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return rows, rows < tl.load(offsets_ptr + e + 1)


CASES = [
    (ex.check_row_softmax, _softmax_zero_padding, "load them as -inf"),
    (ex.check_row_softmax, _softmax_no_max, "Subtract the row's max"),
    (ex.check_row_softmax, _softmax_rows_n_apart, r"row r of x starts at x_ptr \+ r · x_row_stride"),
    (ex.check_row_softmax, _softmax_out_stride_of_x, r"out_ptr \+ r · out_row_stride"),
    (ex.check_row_softmax, _softmax_unmasked_store, "wrote past the end of row .*store with mask"),
    (ex.check_row_softmax, _softmax_unmasked_load, "past the row's N columns were read"),
    (ex.check_expert_rows, _rows_unmasked, r"stop at offsets\[e \+ 1\]"),
    (ex.check_expert_rows, _rows_one_past_the_end, r"stop at offsets\[e \+ 1\]"),
    (ex.check_expert_rows, _rows_every_tile_the_first, "claimed by [0-9]+ of its programs"),
    (ex.check_expert_rows, _rows_from_zero, r"tiles start at offsets\[e\]"),
]


@pytest.mark.parametrize("name, check, stub", [
    ("row_softmax_kernel", ex.check_row_softmax, _softmax_stub),
    ("expert_rows", ex.check_expert_rows, _rows_stub),
])
def test_the_reference_passes_and_the_stub_is_not_done(name, check, stub, capsys):
    assert check.exercise_name == name
    check(solution(name))
    with pytest.raises(NotDoneError):
        check(stub)
    assert check(stub, solutions=False) is solution(name)
    assert "is not done yet" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")  # _softmax_no_max's
@pytest.mark.parametrize("check, wrong, hint", CASES, ids=[wrong.fn.__name__ for _, wrong, _ in CASES])
def test_a_plausible_wrong_answer_fails_naming_the_slip(check, wrong, hint):
    with pytest.raises(ExerciseError, match=hint) as err:
        check(wrong)
    assert not isinstance(err.value, NotDoneError)
    with pytest.raises(ExerciseError, match=hint):  # and the learner's cell stops on it
        check(wrong, solutions=False)


def test_the_grouped_matmul_with_the_reference_lookup_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    for counts, pad in (([0, 17, 0, 3, 33], 5), ([20], 0), ([0, 0], 4)):
        offsets = ex._offsets(counts)
        total = sum(counts)
        x, w = torch.randn(total + pad, 40, generator=g), torch.randn(len(counts), 40, 24, generator=g)
        y = ex.run_grouped_matmul(ex.expert_rows, x, w, offsets, {"BLOCK_M": 16, "BLOCK_K": 32})
        torch.testing.assert_close(y[:total], grouped_gemm_reference(x, w, offsets)[:total],
                                   rtol=1e-5, atol=1e-5)
        assert torch.isnan(y[total:]).all()  # no program owns the padding rows


def test_bad_launcher_arguments_name_the_argument():
    x = torch.randn(3, 10)
    with pytest.raises(ValueError, match="x must be a 2-d float32"):
        ex.run_row_softmax(ex.row_softmax_kernel, x.double())
    with pytest.raises(ValueError, match="out must be a float32 tensor of shape"):
        ex.run_row_softmax(ex.row_softmax_kernel, x, torch.empty(3, 11))
    with pytest.raises(ValueError, match="block_n must be at least the row width 10"):
        ex.run_row_softmax(ex.row_softmax_kernel, x, block_n=8)


def test_the_claims_check_names_a_claimed_padding_row_and_a_row_nobody_claims():
    offsets = ex._offsets([3, 2])  # rows 0-2 expert 0, 3-4 expert 1, 5-6 padding
    right = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0]], dtype=torch.int32)
    ex._check_claims(right, offsets, "here")
    spilled = right.clone()
    spilled[1, 5] = 1  # the last expert's tile runs on into the padding
    with pytest.raises(ExerciseError, match=r"row 5 is padding \(past offsets\[E\] = 5\), yet expert 1"):
        ex._check_claims(spilled, offsets, "here")
    missing = right.clone()
    missing[1, 4] = 0
    with pytest.raises(ExerciseError, match="row 4 .* is claimed by no program"):
        ex._check_claims(missing, offsets, "here")
