"""Notebook 03's exercises (a masked row softmax, the grouped matmul's offset lookup): each
check reports the stub as not done, and the launchers and the claims check behave (the
reference passing and the plausible wrong answers failing, naming the slip, are in
test_wrong_answers.py). The kernels run under Triton's interpreter here (compiled on a GPU);
the notebook itself runs in tests/workbench/lab/test_notebooks.py."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moe_lab.kernels.grouped_gemm import grouped_gemm_reference
from moe_lab.workbench.exercises import SOLUTIONS, ExerciseError, NotDoneError, offsets_of
from moe_lab.workbench.exercises import nb03_triton_from_zero as ex


@triton.jit
def _softmax_stub(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    tl.static_assert(False, "exercise not solved yet")


@triton.jit
def _rows_stub(offsets_ptr, e, t, BLOCK_M: tl.constexpr):
    tl.static_assert(False, "exercise not solved yet")


@pytest.mark.parametrize("name, check, stub", [
    ("row_softmax_kernel", ex.check_row_softmax, _softmax_stub),
    ("expert_rows", ex.check_expert_rows, _rows_stub),
])
def test_the_stub_is_not_done(name, check, stub, capsys):
    assert check.exercise_name == name
    with pytest.raises(NotDoneError):
        check(stub)
    assert check(stub, solutions=False) is SOLUTIONS[name]
    assert "is not done yet" in capsys.readouterr().out


def test_the_grouped_matmul_with_the_reference_lookup_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    for counts, pad in (([0, 17, 0, 3, 33], 5), ([20], 0), ([0, 0], 4)):
        offsets = offsets_of(counts)
        total = sum(counts)
        x, w = torch.randn(total + pad, 40, generator=g), torch.randn(len(counts), 40, 24, generator=g)
        y = ex.run_grouped_matmul(ex.expert_rows, x, w, offsets)
        torch.testing.assert_close(y[:total], grouped_gemm_reference(x, w, offsets)[:total],
                                   rtol=1e-5, atol=1e-5)
        assert torch.isnan(y[total:]).all()  # no program owns the padding rows


def test_bad_launcher_arguments_name_the_argument():
    x = torch.randn(3, 10)
    with pytest.raises(ValueError, match="x must be a 2-d float32"):
        ex.run_row_softmax(ex.row_softmax_kernel, x.double())


def test_the_claims_check_names_a_claimed_padding_row_and_a_row_nobody_claims():
    offsets = offsets_of([3, 2])  # rows 0-2 expert 0, 3-4 expert 1, 5-6 padding
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
