"""The overlap harness on 2 ranks: the report ``bench ep`` and notebook 09 read, and its checks."""

from __future__ import annotations

import pytest

from moe_lab.workbench.ranks.harness import OVERLAP_RUNS, overlap_rank_main
from moe_lab.workbench.ranks.launch import run_ranks

CFG = dict(d_model=32, n_experts=8, top_k=2, d_expert=48, n_shared_experts=1)


@pytest.mark.timeout(60)
def test_overlap_rank_main_reports_every_schedule():
    # loopback and tiny sizes: the figures mean nothing here, the report's shape does
    spec = {"cfg": CFG, "tokens": 32, "n_chunks": 2, "repeats": 1, "warmup": 1, "seed": 0,
            "bandwidth_rows": 16}
    reports = run_ranks(overlap_rank_main, 2, spec, timeout_s=50, threads_per_rank=1)
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["world_size"] == 2
        assert report["matches_autograd"] is True
        assert set(report["median_s"]) == set(report["timelines"]) == set(OVERLAP_RUNS)
        real = set(OVERLAP_RUNS) - {"compute only"}
        assert set(report["exposed_s"]) == set(report["exposed_replay_s"]) == real
        assert report["exposed_vs_sequential"]["sequential"] == pytest.approx(1.0)
        assert report["a2a_bytes"] > 0 and report["bandwidth"]["bytes_per_rank"] > 0
        assert all(t["events"] for t in report["timelines"].values())
    # every rank reports the slowest rank's time per run
    assert reports[0]["runs_s"] == reports[1]["runs_s"]
