"""The 1F1B-merged step (`moe_lab.parallel.merged`) computes exactly what the plain schedule does.

On 2 and 4 gloo ranks, with uneven routing and an expert that receives nothing: the
two-micro-batch step (warm-up forward, merged unit, cool-down backward) under every plan
gives outputs, input gradients and every parameter gradient *bitwise* equal to the plain
(sequential) schedule with the same chunks, and equal to autograd through `EPMoELayer` on
the two micro-batches up to float32 rounding (≤ 1e-6 relative to each tensor's largest
entry). The bytes its timelines record as sent are what the routing says each rank sends.
"""

from __future__ import annotations

import pytest

from moe_lab.parallel.plan import SCHEDULES
from moe_lab.workbench.ranks.equivalence import merged_check_rank
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
            assert res["a2a_bytes"] == r["a2a_bytes"] > 0, (label, res)  # the timeline's bytes


@pytest.mark.timeout(90)
def test_merged_equals_plain_on_2_ranks():
    results = run_ranks(merged_check_rank, 2, CFG, 40, 3, 0, 2.0, 5, timeout_s=80, threads_per_rank=1)
    _check(results, 3, starved=5)


@pytest.mark.timeout(120)
def test_merged_equals_plain_on_4_ranks():
    results = run_ranks(merged_check_rank, 4, CFG, 24, 2, 1, 2.0, 6, timeout_s=110, threads_per_rank=1)
    _check(results, 2, starved=6)
