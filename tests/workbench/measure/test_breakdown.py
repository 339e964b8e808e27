"""Where a step's time goes: the kinds, the phases, the sums, a real profiled step."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from moe_lab.training.steps import PHASES, phase
from moe_lab.workbench.measure import breakdown
from moe_lab.workbench.measure.breakdown import (
    ATEN,
    ATTENTION,
    BETWEEN,
    COMPILED,
    EXPERT,
    FRAMEWORK,
    KINDS,
    MATMUL,
    REST,
    breakdown_from_events,
    kind_of,
    step_breakdown,
)


@dataclass
class Event:  # the three fields of torch.autograd.profiler_util.FunctionEvent that are read
    name: str
    self_cpu_time_total: float  # microseconds
    cpu_parent: Event | None = None


def test_kinds():
    assert kind_of("aten::mm") == kind_of("aten::addmm") == kind_of("aten::_grouped_mm") == MATMUL
    assert kind_of("aten::matmul") == ATEN  # a dispatcher: its self time is not the GEMM's
    assert kind_of("moe_lab::cpu_causal_attention_backward") == ATTENTION
    assert kind_of("aten::_scaled_dot_product_flash_attention_for_cpu") == ATTENTION
    assert kind_of("moe_lab::openmp_expert_mlp") == EXPERT
    assert kind_of("## Call CompiledFxGraph abc123 ##") == COMPILED
    assert kind_of("graph_0_cpp_fused_add_mul_3") == COMPILED
    assert kind_of("aten::index_add_") == ATEN
    assert kind_of("TorchDynamo Cache Lookup") == kind_of("Optimizer.step#AdamW.step") == FRAMEWORK
    assert set(KINDS) == {MATMUL, ATTENTION, EXPERT, COMPILED, ATEN, FRAMEWORK, BETWEEN}


def test_events_are_summed_by_phase_and_kind():
    fwd = Event("moe_lab.training.forward", 100.0)
    matmul = Event("aten::matmul", 10.0, fwd)
    events = [
        fwd, matmul,
        Event("aten::mm", 3000.0, matmul),  # two levels below its phase: still the forward's
        Event("moe_lab.training.backward", 50.0),
        Event("aten::mm", 1000.0, Event("autograd::engine", 0.0, Event("moe_lab.training.backward", 0.0))),
        Event("aten::_fused_adamw_", 400.0, Event("moe_lab.training.optimizer", 0.0)),
        Event("aten::copy_", 200.0),  # outside every phase: the rest of the step
    ]
    result = breakdown_from_events(events, wall_s=0.006, steps=2)  # 3 ms per step on the clock
    t = result["table"]
    assert t["forward"][MATMUL] == pytest.approx(1.5)  # 3000 us over 2 steps
    assert t["forward"][ATEN] == pytest.approx(0.005)
    assert t["forward"][FRAMEWORK] == pytest.approx(0.05)  # the range's own Python
    assert t["backward"][MATMUL] == pytest.approx(0.5)
    assert t["optimizer"][ATEN] == pytest.approx(0.2)
    assert t[REST][ATEN] == pytest.approx(0.1)
    covered = (100 + 10 + 3000 + 50 + 1000 + 400 + 200) / 1e3 / 2
    assert t[REST][BETWEEN] == pytest.approx(3.0 - covered)
    assert result["wall_ms"] == pytest.approx(3.0)
    assert sum(result["by_phase"].values()) == pytest.approx(3.0)
    assert sum(result["by_kind"].values()) == pytest.approx(3.0)
    assert result["by_kind"][MATMUL] == pytest.approx(2.0)
    assert set(result["by_phase"]) == {*PHASES, REST}
    # a profiler that counts more than the clock (overlapping threads) never gives a negative gap
    over = breakdown_from_events(events, wall_s=0.001, steps=2)
    assert over["table"][REST][BETWEEN] == 0.0
    empty = breakdown_from_events([], wall_s=0.01, steps=1)
    assert empty["by_kind"][BETWEEN] == pytest.approx(10.0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="phase"):
        phase("loading")


def test_a_profiled_step():
    a = torch.randn(256, 256, requires_grad=True)
    calls = []

    def step():
        calls.append(1)
        with phase("forward"):
            loss = (a @ a).relu().sum()
        with phase("backward"):
            loss.backward()
        with phase("optimizer"), torch.no_grad():
            a.sub_(1e-6 * a.grad)
            a.grad = None

    result = step_breakdown(step, steps=3, warmup=1)
    assert len(calls) == 4
    t = result["table"]
    assert t["forward"][MATMUL] > 0 and t["backward"][MATMUL] > 0  # a @ a, and its gradient
    assert t["optimizer"][ATEN] > 0 and t["optimizer"][MATMUL] == 0
    assert sum(result["by_phase"].values()) == pytest.approx(result["wall_ms"], rel=1e-6)
    text = breakdown.format_breakdown(result, "toy")
    assert all(kind in text for kind in KINDS) and "toy" in text


def test_both_stacks_of_the_contest():
    from moe_lab.workbench.benchmarks import ttt
    from moe_lab.workbench.benchmarks.ttt import NAIVE
    from moe_lab.workbench.benchmarks.ttt.contest import TTTConfig

    cfg = TTTConfig(preset="tiny", batch_size=2, steps=6, warmup_steps=1)
    best = ttt.optimised_stack("cpu", compile=False)
    results = ttt.step_breakdowns([NAIVE, best], cfg, steps=1, warmup=1)
    assert list(results) == ["naive", "optimised"]
    for name, result in results.items():
        for p in PHASES:  # every trainer opens the three ranges
            assert result["by_phase"][p] > 0, (name, p)
        assert result["by_kind"][MATMUL] > 0, name
