"""A whole model on merged 1F1B units (`moe_lab.parallel.merged_model`) equals the plain step."""

from __future__ import annotations

import pytest

from moe_lab.workbench.ranks.equivalence import merged_model_check_rank
from moe_lab.workbench.ranks.launch import run_ranks

REL_TOL = 1e-6


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
