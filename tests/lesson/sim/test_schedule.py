"""The pipeline schedule simulator against closed forms: bubbles, dependencies, pace."""

from __future__ import annotations

import numpy as np
import pytest

from moe_lab.sim.schedule import PipelineResult, bubble_1f1b, bubble_interleaved, schedule_order, simulate


@pytest.mark.parametrize("n_ranks", [2, 4, 8, 16])
@pytest.mark.parametrize("n_microbatches", [1, 3, 8, 32])
def test_1f1b_and_gpipe_bubble_is_the_closed_form(n_ranks, n_microbatches):
    want = bubble_1f1b(n_ranks, n_microbatches)
    for schedule in ("1f1b", "gpipe"):
        result = simulate([1.0] * n_ranks, n_microbatches=n_microbatches, schedule=schedule)
        assert result.bubble_fraction == pytest.approx(want, abs=1e-9), schedule
        # F = 1 and B + W = 2 per stage: the step is (m + p - 1) * 3.
        assert result.makespan == pytest.approx((n_microbatches + n_ranks - 1) * 3.0)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 4, 2), (8, 16, 2),
                                          (8, 16, 4), (4, 12, 3)])
def test_interleaved_bubble_is_about_p_minus_1_over_vm_plus_p_minus_1(p, m, v):
    # Each rank holds v chunks of 1/v of its layers, so its total work is unchanged.
    result = simulate([1.0 / v] * (p * v), n_ranks=p, n_microbatches=m)
    assert result.schedule == "interleaved"
    assert result.bubble_fraction == pytest.approx(bubble_interleaved(p, m, v), rel=0.02)
    assert result.bubble_fraction < bubble_1f1b(p, m)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 16), (8, 32)])
def test_delayed_weight_gradient_fills_the_bubble(p, m):
    plain = simulate([1.0] * p, n_microbatches=m)
    delayed = simulate([1.0] * p, n_microbatches=m, delay_wgrad=True, max_deferred_wgrad=p - 1)
    assert delayed.bubble_fraction < plain.bubble_fraction
    # Zero-bubble H1's figure with F = B = W: the bubble shrinks to (p-1)(F+B-W) = p-1.
    assert delayed.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-9)
    assert delayed.busy.sum() == pytest.approx(plain.busy.sum())


def _check_dependencies(result: PipelineResult) -> None:
    p, v = result.n_ranks, result.n_chunks
    end = {}
    start = {}
    for r, k, mb, c, s, e in zip(result.rank, result.kind, result.microbatch, result.chunk,
                                 result.start, result.end, strict=True):
        vs = int(c) * p + int(r)
        end[(str(k), int(mb), vs)] = e
        start[(str(k), int(mb), vs)] = s
    last = p * v - 1
    for (kind, mb, vs), s in start.items():
        if kind == "F" and vs > 0:
            assert s >= end[("F", mb, vs - 1)] - 1e-9
        if kind == "B":
            dep = ("B", mb, vs + 1) if vs < last else ("F", mb, vs)
            assert s >= end[dep] - 1e-9
        if kind == "W":
            assert s >= end[("B", mb, vs)] - 1e-9
    for r in range(p):
        rows = np.flatnonzero(result.rank == r)
        order = np.argsort(result.start[rows])
        starts, ends = result.start[rows][order], result.end[rows][order]
        assert np.all(starts[1:] >= ends[:-1] - 1e-9), f"rank {r} runs two ops at once"


@pytest.mark.parametrize("schedule,v,delay", [("gpipe", 1, False), ("1f1b", 1, False),
                                              ("1f1b", 1, True), ("interleaved", 2, False),
                                              ("interleaved", 2, True)])
def test_every_op_waits_for_its_dependency(schedule, v, delay):
    rng = np.random.default_rng(3)
    p, m = 4, 8
    fwd = rng.uniform(0.5, 1.5, size=p * v)
    result = simulate(fwd, n_ranks=p, n_microbatches=m, schedule=schedule, delay_wgrad=delay)
    n_kinds = 3 if delay else 2
    assert result.rank.size == p * v * m * n_kinds
    _check_dependencies(result)


def test_a_slow_stage_sets_the_pace():
    p, m = 4, 16
    fwd = np.array([1.0, 1.0, 2.0, 1.0])
    result = simulate(fwd, n_microbatches=m)
    # The slow stage cannot start before the forwards upstream of it, must then do all its
    # work, and its last backward still has to flow back through the stages before it.
    slow = int(fwd.argmax())
    bound = fwd[:slow].sum() + m * 3 * fwd[slow] + 2 * fwd[:slow].sum()
    assert result.makespan >= bound - 1e-9
    assert result.busy[slow] == pytest.approx(m * 3 * fwd[slow])
    assert result.imbalance == pytest.approx((2.0 - 1.25) / 1.25)
    balanced = simulate([1.25] * p, n_microbatches=m)
    assert result.makespan > balanced.makespan


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"n_microbatches": 0}, "n_microbatches must be a positive integer"),
        ({"n_microbatches": 4, "schedule": "zigzag"}, "schedule must be one of"),
        ({"n_microbatches": 4, "n_ranks": 3}, "n_ranks must be a positive integer dividing"),
        ({"n_microbatches": 6, "n_ranks": 4}, "must be a multiple"),
        ({"n_microbatches": 4, "n_ranks": 4, "schedule": "1f1b"}, "one chunk per rank"),
    ],
)
def test_bad_schedule_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        simulate([1.0] * 8, **kwargs)


def test_negative_costs_are_rejected():
    with pytest.raises(ValueError, match="forward must be finite and >= 0"):
        simulate([1.0, -1.0], n_microbatches=2)


def test_1f1b_order_is_the_hand_worked_one():
    """p = 4 ranks, m = 6 micro-batches, written out by hand from the definition: rank r runs
    p - r - 1 warm-up forwards, then one forward and one backward in turn, then drains. An
    off-by-one warm-up leaves the makespan and bubble unchanged, so only the order shows it."""
    orders = schedule_order("1f1b", 4, 6)
    f = lambda i: ("F", i, 0)  # noqa: E731
    b = lambda i: ("B", i, 0)  # noqa: E731
    assert orders[0] == [f(0), f(1), f(2), f(3), b(0), f(4), b(1), f(5), b(2), b(3), b(4), b(5)]
    assert orders[2] == [f(0), f(1), b(0), f(2), b(1), f(3), b(2), f(4), b(3), f(5), b(4), b(5)]
    assert orders[3] == [f(0), b(0), f(1), b(1), f(2), b(2), f(3), b(3), f(4), b(4), f(5), b(5)]


@pytest.mark.parametrize("p, m", [(2, 2), (4, 3), (4, 8), (8, 16)])
def test_1f1b_keeps_at_most_p_minus_r_microbatches_in_flight(p, m):
    """What 1F1B is for: rank r holds the activations of at most min(p - r, m) micro-batches
    (GPipe holds all m)."""
    for r, ops in enumerate(schedule_order("1f1b", p, m)):
        live = peak = 0
        for kind, _, _ in ops:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(p - r, m), (r, peak)


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 12, 2), (8, 16, 2)])
def test_interleaved_warm_up_is_megatrons(p, m, v):
    """Megatron-Core's interleaved 1F1B runs ``(p - r - 1)·2 + (v - 1)·p`` warm-up forwards on
    rank r (all ``m·v`` when ``m == p``), then alternates a forward and a backward, so the
    forwards before each rank's first backward are the warm-up and one more
    (``num_warmup_microbatches`` in Megatron-Core's
    ``forward_backward_pipelining_with_interleaving``,
    https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/pipeline_parallel/schedules.py)."""
    for r, ops in enumerate(schedule_order("interleaved", p, m, v)):
        leading = next(i for i, (kind, _, _) in enumerate(ops) if kind == "B")
        warm = m * v if m == p else min((p - r - 1) * 2 + (v - 1) * p, m * v)
        want = warm if warm == m * v else warm + 1
        assert leading == want, (r, leading, want)
        assert sum(kind == "F" for kind, _, _ in ops) == sum(kind == "B" for kind, _, _ in ops) == m * v
