"""The 1F1B-merged step (`moe_lab.parallel.merged`) computes exactly what the plain schedule does.

On 2 and 4 gloo ranks, with uneven routing and an expert that receives nothing: the
two-micro-batch step (warm-up forward, merged unit, cool-down backward) under every plan
gives outputs, input gradients and every parameter gradient *bitwise* equal to the plain
(sequential) schedule with the same chunks, and equal to autograd through `EPMoELayer` on
the two micro-batches up to float32 rounding (≤ 1e-6 relative to each tensor's largest
entry). The plans themselves are checked as data: every stage once, after its
dependencies, and the merged plans leave no collective waited on before it could have
finished on the model machine of `simulate_plan`.
"""

from __future__ import annotations

import pytest

from moe_lab.parallel.merged import (
    SCHEDULES,
    PlanError,
    check_plan,
    merged_check_rank,
    plan,
    simulate_plan,
    stage_graph,
)
from moe_lab.parallel.merged_model import merged_model_check_rank
from moe_lab.workbench.ranks.launch import run_ranks

CFG = dict(d_model=32, n_experts=8, top_k=2, d_expert=48, n_shared_experts=1)
REL_TOL = 1e-6


def _check(results: list[dict], n_chunks: int, starved: int) -> None:
    for r in results:
        # uneven routing: the skewed expert gets far more than its share, the starved one nothing
        received = r["received_per_expert"]
        assert received[starved] == 0, received
        assert received[0] > 2 * sum(received) / len(received) / 2, received
        assert set(r["schedules"]) == {f"{s}/{c}" for s in SCHEDULES for c in {1, n_chunks}}
        for label, res in r["schedules"].items():
            assert res["bitwise"], (label, res)
            assert res["rel"] <= REL_TOL, (label, res)
            assert res["events"] > 0


@pytest.mark.timeout(90)
def test_merged_equals_plain_on_2_ranks():
    results = run_ranks(merged_check_rank, 2, CFG, 40, 3, 0, 2.0, 5, timeout_s=80, threads_per_rank=1)
    _check(results, 3, starved=5)


@pytest.mark.timeout(120)
def test_merged_equals_plain_on_4_ranks():
    results = run_ranks(merged_check_rank, 4, CFG, 24, 2, 1, 2.0, 6, timeout_s=110, threads_per_rank=1)
    _check(results, 2, starved=6)


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preset_name, n_chunks", [("tiny", 1), ("small", 1), ("small", 2)])
def test_a_whole_model_on_merged_1f1b_units_equals_the_plain_step(preset_name, n_chunks):
    # blocks paired forward k with backward L-1-k, two micro-batches; the small preset has a
    # dense block and a shared expert
    results = run_ranks(merged_model_check_rank, 2, preset_name, 2, 2, n_chunks, 0, timeout_s=110,
                        threads_per_rank=1)
    for r in results:
        assert r["bitwise"], r  # against the same pieces run one micro-batch after the other
        if n_chunks == 1:  # with chunks the auxiliary losses are per chunk: another loss
            assert r["rel"] <= REL_TOL, r  # against autograd through the model, per micro-batch
            assert r["loss"] == pytest.approx(r["plain_loss"], rel=1e-6)


@pytest.mark.timeout(90)
def test_benchmark_reports_the_four_schedules(tmp_path, monkeypatch):
    # loopback and tiny sizes: the figures mean nothing here, the report's shape does
    from moe_lab.parallel.merged import merged_rank_main
    from moe_lab.workbench.benchmarks import ep as ep_bench
    from moe_lab.workbench.measure import ledger

    monkeypatch.setenv("MOE_LAB_RESULTS_DIR", str(tmp_path))
    spec = {"cfg": CFG, "tokens": 32, "n_chunks": 2, "repeats": 1, "warmup": 1, "seed": 0,
            "bandwidth_rows": 0}
    reports = run_ranks(merged_rank_main, 2, spec, timeout_s=80, threads_per_rank=1)
    report = reports[0]
    assert report["merged_equals_plain"] is True
    assert set(SCHEDULES) <= set(report["exposed_s"]) and set(SCHEDULES) <= set(report["timelines"])
    report.update(link="loopback (not emulated)", rate_mbit=None, threads_per_rank=1)
    summary = ep_bench.summarize(report)
    assert [r["schedule"] for r in summary["rows"]][:4] == list(SCHEDULES)
    ep_bench.record(report, notebook="test:ep")
    best = ep_bench.record_sweep([dict(n_chunks=n, threads_per_rank=1, schedule="1f1b+chunked",
                                       buffer_bytes=1, step_ms=10.0 / n, exposed_ms=1.0,
                                       exposed_vs_sequential=0.1, sequential_step_ms=20.0, link="x",
                                       tokens_per_rank=32) for n in (1, 2)], 2, notebook="test:ep")
    assert best["n_chunks"] == 2
    steps = {r["step"] for r in ledger.read() if r["notebook"] == "test:ep"}
    assert set(SCHEDULES) | {"tuned dispatch"} <= steps
