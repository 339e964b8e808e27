"""Notebook 00's exercises: counting FLOPs and reading a roofline (the notebook itself
runs in tests/workbench/lab/test_notebooks.py)."""

from __future__ import annotations

import pytest

from moe_lab.workbench.exercises import ExerciseError, not_done, solution
from moe_lab.workbench.exercises import nb00_lab_bench as ex

# ------------------------------------------------------------------------------ exercises


def test_exercise_checks_accept_the_reference():
    ex.check_expert_training_flops(solution("expert_training_flops"))
    ex.check_matmul_attainable_flops(solution("matmul_attainable_flops"))
    assert solution("expert_training_flops") is ex.expert_training_flops


def test_exercise_checks_reject_wrong_answers():
    with pytest.raises(ExerciseError, match="not solved"):
        ex.check_expert_training_flops(not_done)
    with pytest.raises(ExerciseError, match="forward pass only"):
        ex.check_expert_training_flops(lambda d, f: 2 * 3 * d * f)
    with pytest.raises(ExerciseError, match="three matrices"):
        ex.check_expert_training_flops(lambda d, f: 2 * d * f * 6)
    with pytest.raises(ExerciseError, match="not solved"):
        ex.check_matmul_attainable_flops(not_done)
    # Forgetting the roofline's min: always the peak -> wrong on memory-bound shapes.
    with pytest.raises(ExerciseError, match="memory-bound"):
        ex.check_matmul_attainable_flops(lambda m, n, k, b, peak, bw: peak)
    # Forgetting bytes per element.
    with pytest.raises(ExerciseError):
        ex.check_matmul_attainable_flops(
            lambda m, n, k, b, peak, bw: min(peak, bw * 2 * m * n * k / (m * k + k * n + m * n)))
