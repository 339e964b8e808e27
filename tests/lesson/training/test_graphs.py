"""GraphedStep: the eager fallback without CUDA (labelled, same numbers), the refusal that names
the operator, the capture gallery, graphed_vs_eager, and notebook 08's exercise checks.
The capture itself runs only where CUDA exists."""

from __future__ import annotations

import pytest
import torch

import moe_lab.training.graphs as graphs
from moe_lab import preset
from moe_lab.model import MoETransformer
from moe_lab.moe import experts
from moe_lab.training.build import build_model, random_batch
from moe_lab.training.graphs import EAGER_MODE, GraphedStep, NotCapturableError, capture_advice
from moe_lab.training.optim import make_optimizer
from moe_lab.training.steps import StepConfig, SyncFreeStep
from moe_lab.training.sync import SyncError
from moe_lab.workbench.demos.capture_breakers import CAPTURE_BREAKERS, capture_gallery
from moe_lab.workbench.demos.graphed_vs_eager import graphed_vs_eager
from moe_lab.workbench.exercises import ExerciseError, not_done
from moe_lab.workbench.exercises.nb08_cuda_graphs import (
    check_pool_pages,
    check_sync_free_dispatch,
)

TINY = preset("tiny")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_without_cuda_it_runs_eagerly_and_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(graphs, "_EAGER_NOTICE_SHOWN", False)
    batch = random_batch(TINY, 2)
    model, optimizer = build_model(TINY)
    graphed = GraphedStep(model, optimizer, batch, StepConfig(read_every=2))
    assert graphed.mode == EAGER_MODE == "eager (no CUDA)" and graphed.graph is None
    assert graphed.certified
    GraphedStep(*build_model(TINY), batch)
    out = capsys.readouterr().out
    assert out.count("GraphedStep:") == 1 and "no CUDA" in out
    twin, twin_opt = build_model(TINY)
    eager = SyncFreeStep(twin, twin_opt, batch, StepConfig(read_every=2))
    batches = [random_batch(TINY, 2, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    got = [graphed(b) for b in batches]
    want = [eager(b) for b in batches]
    assert got == want and got[1] is not None


def test_refuses_a_step_that_syncs_and_names_the_operator():
    torch.manual_seed(0)
    model = MoETransformer(TINY, dispatcher="naive")
    with pytest.raises(NotCapturableError) as err:
        GraphedStep(model, make_optimizer(model), random_batch(TINY, 2), quiet=True)
    assert isinstance(err.value, SyncError)
    assert err.value.op == "aten.nonzero.default"
    message = str(err.value)
    assert "cannot be captured" in message and "aten.nonzero" in message
    assert "dispatch.py" in message and "Fix:" in message and "dropless" in err.value.advice


def test_refuses_experts_that_sync_inside_an_op_before_the_certificate(monkeypatch):
    """The certificate runs on fake tensors and cannot see torch._grouped_mm's sync inside the
    op (CUDA, any dtype but bfloat16): the step refuses it before certifying. CUDA mocked."""
    batch = random_batch(TINY, 2)
    model, optimizer = build_model(TINY, expert_backend="torch")
    monkeypatch.setattr(experts, "_on_cuda", lambda device: True)
    with pytest.raises(ValueError, match=r"model: torch\._grouped_mm .* in torch\.float32 on CUDA"
                       r".*model\.bfloat16\(\) or expert_backend='triton'"):
        GraphedStep(model, optimizer, batch, quiet=True)
    model.bfloat16()
    graphed = GraphedStep(model, make_optimizer(model), batch, quiet=True)
    assert graphed.certified and graphed.mode == EAGER_MODE  # no CUDA here to capture on


def test_advice_for_each_kind_of_sync():
    assert "scatter_add_" in capture_advice(SyncError("aten.bincount.default"))
    assert "read_stats" in capture_advice(SyncError("Tensor.tolist"))
    assert "output_size" in capture_advice(SyncError("aten.repeat_interleave.Tensor"))
    assert "make_optimizer" in capture_advice(
        SyncError("aten._local_scalar_dense.default", where="x.py:1 in run: self.optimizer.step()"))
    assert capture_advice(SyncError("aten.something_new.default"))


def test_gallery_names_an_operator_for_every_breaker_and_every_fix_passes():
    rows = capture_gallery()
    assert len(rows) == len(CAPTURE_BREAKERS) >= 10
    for row in rows:
        assert row["op"], row["title"]
        assert row["fixed_passes"], row["title"]
        assert "def " in row["broken_source"]
    ops = {row["op"] for row in rows}
    assert {"aten.nonzero.default", "aten.bincount.default", "Tensor.__format__"} <= ops


def test_graphed_vs_eager_agrees_and_reports():
    result = graphed_vs_eager("tiny", batch_size=2, steps=3, min_time_s=0.02)
    assert result["loss_abs_diff"] == 0.0 and result["param_max_abs_diff"] == 0.0
    assert result["loss_rel_diff"] == 0.0
    assert result["syncs_per_step"] == 0 and result["certified"]
    assert result["speedup"] > 0 and result["eager_ms"] > 0
    if not torch.cuda.is_available():
        assert result["mode"] == EAGER_MODE


@cuda
def test_capture_replays_the_eager_step():
    result = graphed_vs_eager("small", batch_size=2, steps=8, min_time_s=0.2)
    assert result["mode"] == graphs.GRAPHED_MODE
    assert result["loss_rel_diff"] < 1e-4 and result["param_max_abs_diff"] < 1e-4
    assert result["speedup"] > 1.0


# ------------------------------------------------------------------------------ exercises


# The references passing and the wrong answers failing: tests/workbench/exercises/test_wrong_answers.py.


def test_dispatch_exercise_stub_is_not_done():
    with pytest.raises(ExerciseError, match="not solved"):
        check_sync_free_dispatch(lambda *args: not_done())


def test_pool_exercise_accepts_the_simple_bound():
    check_pool_pages(lambda t, k, e, p: -(-t * k // p) + e if t else 0)  # safe, one spare per expert
