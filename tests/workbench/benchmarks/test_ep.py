"""``bench ep``: the rank report's shape, its summary, and what goes to the ledger."""

from __future__ import annotations

import pytest

from moe_lab.parallel.plan import SCHEDULES
from moe_lab.workbench.benchmarks import ep as ep_bench
from moe_lab.workbench.measure import ledger
from moe_lab.workbench.ranks.harness import merged_rank_main
from moe_lab.workbench.ranks.launch import run_ranks

CFG = dict(d_model=32, n_experts=8, top_k=2, d_expert=48, n_shared_experts=1)


@pytest.mark.timeout(90)
def test_benchmark_reports_the_four_schedules(tmp_path, monkeypatch):
    # loopback and tiny sizes: the figures mean nothing here, the report's shape does
    monkeypatch.setenv("MOE_LAB_RESULTS_DIR", str(tmp_path))
    spec = {"cfg": CFG, "tokens": 32, "n_chunks": 2, "repeats": 1, "seed": 0,
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


def test_bench_ep_passes_gloo_explicitly_over_the_emulated_link(monkeypatch):
    # A machine with GPUs (pretended), where the launcher's own default would be NCCL, which
    # the emulated link cannot carry: the benchmark must choose gloo and say so.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)

    class FakeLink:
        def __init__(self, ranks: int, rate_mbit: float) -> None:
            self.ranks = ranks

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            pass

        def describe(self) -> str:
            return "fake link"

    seen = {}

    def fake_run_ranks(fn, world_size, *args, **kwargs):
        seen.update(kwargs)
        return [{"exposed_s": {}, "timelines": {}, "backend": kwargs.get("backend"), "device": "cpu"}
                for _ in range(world_size)]

    monkeypatch.setattr(ep_bench.netem, "available", lambda: (True, "tbf"))
    monkeypatch.setattr(ep_bench.netem, "EmulatedLink", FakeLink)
    monkeypatch.setattr(ep_bench, "run_ranks", fake_run_ranks)
    report = ep_bench.run_ep_benchmark(2, 100.0, ep_bench.spec_for("smoke", 2))
    assert seen["link"] is not None and seen.get("backend") == "gloo"
    assert report["link_emulated"] and "emulated link" in report["backend_reason"]
