"""Notebook 00's exercises: counting FLOPs and reading a roofline (the notebook itself
runs in tests/workbench/lab/test_notebooks.py)."""

from __future__ import annotations

import pytest

from moe_lab.workbench.exercises import NotDoneError, not_done
from moe_lab.workbench.exercises import nb00_lab_bench as ex

# ------------------------------------------------------------------------------ exercises


def test_the_stubs_are_not_done():
    """The reference passing and the wrong answers failing: test_wrong_answers.py."""
    with pytest.raises(NotDoneError, match="not solved"):
        ex.check_matmul_attainable_flops(not_done)
