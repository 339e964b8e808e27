"""The 1F1B plans as data (`moe_lab.parallel.plan`): every stage once, after its dependencies,
and the merged plans leave no collective waited on before it could have finished on the model
machine of `simulate_plan`."""

from __future__ import annotations

import pytest

from moe_lab.parallel.plan import SCHEDULES, PlanError, check_plan, plan, simulate_plan, stage_graph


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("n_chunks", [1, 3])
@pytest.mark.parametrize("halves", [(True, True), (True, False), (False, True)])
def test_every_plan_is_a_valid_order(schedule, n_chunks, halves):
    forward, backward = halves
    order = plan(schedule, n_chunks, forward=forward, backward=backward)
    check_plan(order, stage_graph(n_chunks, forward=forward, backward=backward))


@pytest.mark.parametrize("n_chunks", [1, 2, 4])
def test_merged_plan_never_waits_early_on_the_model_machine(n_chunks):
    stages = stage_graph(n_chunks)
    log, timeline = simulate_plan(plan("1f1b+chunked" if n_chunks > 1 else "1f1b", n_chunks), stages)
    waits = [e for e in log if e["op"] == "wait" and e["stage"] != "F.counts"]
    assert len(waits) == 4 * n_chunks
    assert all(e["idle"] == 0 for e in waits), [e for e in waits if e["idle"] > 0]
    # the sequential plan waits for every collective it starts
    log_seq, timeline_seq = simulate_plan(plan("sequential", n_chunks), stages)
    assert sum(e["idle"] for e in log_seq if e["op"] == "wait") > 0
    assert timeline.step_s < timeline_seq.step_s
    assert timeline.lane_time("compute") == pytest.approx(timeline_seq.lane_time("compute"))


def test_plan_errors_name_the_problem():
    stages = stage_graph(1)
    order = plan("1f1b", 1)
    with pytest.raises(PlanError, match="twice"):
        check_plan(order + [order[0]], stages)
    with pytest.raises(PlanError, match="needs"):
        check_plan([order[1], order[0], *order[2:]], stages)
    with pytest.raises(PlanError, match="leaves out"):
        check_plan(order[:-1], stages)
    with pytest.raises(PlanError, match="do not exist"):
        check_plan(order + ["F.nothing[0]"], stages)
    with pytest.raises(PlanError, match="list of stage names"):
        check_plan("F.route[0]", stages)
    with pytest.raises(ValueError, match="schedule"):
        plan("2f2b")
    with pytest.raises(ValueError, match="n_chunks"):
        stage_graph(0)
