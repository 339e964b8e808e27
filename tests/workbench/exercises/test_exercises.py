"""The exercises' machinery and the Triton / capturable-step exercises.

Learner mode (`moe_lab.workbench.exercises.exercise`): a check called with ``solutions=False``
returns a right answer, raises `ExerciseError` on a wrong one, and for a stub not written
yet reports it and hands back the reference solution; ``solutions=True`` checks the
reference. Each new exercise's stub is reported as not done (`NotDoneError`); that every
reference passes its check and plausible wrong answers fail it naming the slip is
test_wrong_answers.py's. The Triton ones run under Triton's interpreter here (compiled on a
GPU).
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import triton
import triton.language as tl

from moe_lab.config import preset
from moe_lab.perf import flops
from moe_lab.training.sync import SyncError
from moe_lab.workbench.exercises import (
    SOLUTIONS,
    ExerciseError,
    NotDoneError,
    call_answer,
    exercise,
    not_done,
)
from moe_lab.workbench.exercises import nb00_lab_bench as ex00
from moe_lab.workbench.exercises import nb04_dropless_sync_free_triton as ex04t
from moe_lab.workbench.exercises import nb05_fused_router as ex04
from moe_lab.workbench.exercises import nb05_fused_router_triton as ex05t
from moe_lab.workbench.exercises import nb06_mxfp8_attention_triton as ex06t
from moe_lab.workbench.exercises import nb08_cuda_graphs as ex06
from moe_lab.workbench.exercises import nb12_time_to_train as ex10
from moe_lab.workbench.lab.notebook_files import NOTEBOOK_PATTERN

# ------------------------------------------------------------------------ learner mode


@pytest.fixture
def toy_exercise():
    def _toy_double(x):
        return 2 * x

    @exercise(_toy_double)
    def check_double(fn):
        if call_answer(fn, 3) != 6:
            raise ExerciseError("double(3) should be 6")

    assert SOLUTIONS["_toy_double"] is _toy_double
    yield check_double, _toy_double
    del SOLUTIONS["_toy_double"]


def test_unsolved_exercise_is_reported_and_the_reference_returned(toy_exercise, capsys):
    check, double = toy_exercise

    def stub(x):
        return not_done()

    assert check(stub, solutions=False) is double
    out = capsys.readouterr().out
    assert "'_toy_double' is not done yet" in out and "reference solution" in out
    with pytest.raises(NotDoneError):
        check(stub)  # without `solutions`: only checks


def test_right_answer_is_kept_wrong_answer_raises_and_solutions_use_the_reference(toy_exercise):
    check, double = toy_exercise

    def mine(x):
        return x + x

    assert check(mine, solutions=False) is mine
    with pytest.raises(ExerciseError, match="should be 6") as err:
        check(lambda x: x, solutions=False)
    assert not isinstance(err.value, NotDoneError)
    assert check(lambda x: not_done(), solutions=True) is double
    assert check.exercise_name == "_toy_double"


@pytest.mark.parametrize("bad", ["false", "False", 0, 1])
def test_solutions_must_be_a_bool(toy_exercise, bad):
    """``papermill -p SOLUTIONS false`` injects the string "false": truthy, it replaced the
    learner's answer by the reference without a word."""
    check, _ = toy_exercise
    with pytest.raises(ValueError, match=f"solutions must be True, False or None, got {bad!r}"):
        check(lambda x: x + x, solutions=bad)


def test_a_learners_own_not_implemented_error_is_a_wrong_answer(toy_exercise):
    check, _ = toy_exercise

    def mine(x):
        raise NotImplementedError("half way")

    with pytest.raises(ExerciseError, match="half way") as err:
        check(mine, solutions=False)
    assert not isinstance(err.value, NotDoneError)


# ------------------------------------------------------------------- the new exercises


@triton.jit
def _stub_unpermute(y_ptr, map_ptr, w_ptr, out_ptr, T, D, N_ROWS, TOP_K,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    for _j in range(TOP_K):
        tl.static_assert(False, "exercise not solved yet")


@triton.jit
def _stub_schedule(offsets_ptr, tile, E, M_ROWS, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    tl.static_assert(False, "exercise not solved yet")


@triton.jit
def _stub_topk(sel, BLOCK_T: tl.constexpr, G: tl.constexpr, EG: tl.constexpr, TOP_K: tl.constexpr,
               TOPK_GROUPS: tl.constexpr):
    tl.static_assert(False, "exercise not solved yet")


@triton.jit
def _stub_scale(x):
    tl.static_assert(False, "exercise not solved yet")


@triton.jit
def _stub_softmax(m_i, l_i, acc, s, v):
    tl.static_assert(False, "exercise not solved yet")


STUBS = {
    "group_limited_selection": (ex04.check_group_limited_selection, lambda *args: not_done()),
    "unpermute_kernel": (ex04t.check_unpermute_kernel, _stub_unpermute),
    "tile_schedule": (ex04t.check_tile_schedule, _stub_schedule),
    "group_limited_topk": (ex05t.check_group_limited_topk, _stub_topk),
    "e8m0_block_scale": (ex06t.check_e8m0_block_scale, _stub_scale),
    "online_softmax_step": (ex06t.check_online_softmax_step, _stub_softmax),
    "capturable_step": (ex06.check_capturable_step, lambda *args: not_done()),
    "race_speedups": (ex10.check_race_speedups, lambda curves, target, baseline: not_done()),
    "amdahl_bound": (ex10.check_amdahl_bound, lambda parts, speedups: not_done()),
    "moe_layer_training_flops": (ex00.check_moe_layer_training_flops, lambda moe: not_done()),
}


@pytest.mark.parametrize("name", sorted(STUBS))
def test_the_stub_is_not_done_and_learner_mode_returns_the_reference(name, capsys):
    """The reference passing and the wrong answers failing: test_wrong_answers.py."""
    check, stub = STUBS[name]
    assert check.exercise_name == name
    with pytest.raises(NotDoneError):
        check(stub)
    assert check(stub, solutions=False) is SOLUTIONS[name]
    assert "is not done yet" in capsys.readouterr().out


def test_a_triton_answer_that_does_not_run_is_a_wrong_answer_with_tritons_message():
    @triton.jit
    def broken(x):
        return tl.max(x, 3)  # x is 2-d: no axis 3

    with pytest.raises(ExerciseError, match="failed to run") as err:
        ex06t.check_e8m0_block_scale(broken)
    assert not isinstance(err.value, NotDoneError)


def test_the_step_with_syncs_is_flagged_by_the_certificate():
    model, optimizer, batch = ex06.step_setup(0)
    with pytest.raises(SyncError, match="step_with_syncs"):
        ex06.certify_step(ex06.step_with_syncs, model, optimizer, batch, ex06.new_stats())
    ex06.certify_step(ex06.capturable_step, model, optimizer, batch, ex06.new_stats())


def test_moe_layer_flops_reference_agrees_with_the_flops_model():
    for name in ("deepseek_v3", "gpt_oss_20b", "small", "tiny"):
        cfg = preset(name)
        macs = flops.router_macs(cfg) + flops.moe_mlp_macs(cfg)
        want = macs * flops.FLOPS_PER_MAC * flops.TRAIN_MULTIPLIER
        assert ex00.moe_layer_training_flops(cfg.moe) == pytest.approx(want)


# ------------------------------------------------------------- the committed notebooks

NOTEBOOKS_DIR = Path(__file__).resolve().parents[3] / "notebooks"
NOTEBOOKS = sorted(p for p in NOTEBOOKS_DIR.glob("*.ipynb") if NOTEBOOK_PATTERN.match(p.name))
CHECK_CALL = re.compile(r"^(\w+) = (check_\w+)\(\1, solutions=SOLUTIONS\)$", re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_in_learner_mode(path):
    """``SOLUTIONS = False`` in the parameters cell; every exercise cell (tagged ``exercise``)
    hands its answer to its check with ``solutions=SOLUTIONS`` and keeps what comes back, and
    every cell that does so is tagged."""
    nb = nbformat.read(path, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and re.search(r"^SOLUTIONS\s*=\s*False\b", params[0].source, re.M), (
        f"{path.name}: the parameters cell must say SOLUTIONS = False (learner mode)")
    exercises = [c for c in nb.cells if "exercise" in c.metadata.get("tags", [])]
    assert len(exercises) >= 2, f"{path.name}: at least two exercise cells"
    for cell in nb.cells:
        calls = CHECK_CALL.findall(cell.source) if cell.cell_type == "code" else []
        tagged = cell in exercises
        assert tagged == bool(calls), (
            f"{path.name}: {'an exercise cell without' if tagged else 'an untagged cell with'} "
            f"`answer = check_…(answer, solutions=SOLUTIONS)`:\n{cell.source[:300]}")
        assert "if SOLUTIONS:" not in cell.source, f"{path.name}: the old pattern is left:\n{cell.source}"
