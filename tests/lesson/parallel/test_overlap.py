"""The hand-scheduled EP step equals autograd under every schedule; timelines add up."""

from __future__ import annotations

import pytest
import torch

from moe_lab.config import MoEConfig
from moe_lab.moe import experts
from moe_lab.moe.layer import MoELayer
from moe_lab.parallel.chunks import ChunkStages, chunk_rows
from moe_lab.parallel.ep import from_layer
from moe_lab.parallel.timeline import Event, Timeline
from moe_lab.workbench.ranks.equivalence import overlap_check_rank
from moe_lab.workbench.ranks.harness import OVERLAP_RUNS
from moe_lab.workbench.ranks.launch import run_ranks

CFG = dict(d_model=32, n_experts=8, top_k=2, d_expert=48, n_shared_experts=1)


@pytest.mark.timeout(60)
def test_every_schedule_equals_autograd():
    results = run_ranks(overlap_check_rank, 2, CFG, 40, 3, timeout_s=50, threads_per_rank=1)
    for rank_errors in results:
        assert set(rank_errors) == {"default", *OVERLAP_RUNS}
        # A fresh step with no options exchanges real data (its default is not the replay).
        assert rank_errors["default"]["comm_bytes"] > 0
        for label, errs in rank_errors.items():
            events = errs.pop("events")
            comm_bytes = errs.pop("comm_bytes")
            assert events > 0
            assert (comm_bytes == 0) == OVERLAP_RUNS.get(label, (None, None, False))[2], (label, comm_bytes)
            for name, value in errs.items():
                assert value <= 2e-5, (label, name, value)


def test_timeline_lanes():
    tl = Timeline(0, "t", 1.0, [
        Event(0, "compute", "experts", "fwd", 0.0, 0.3),
        Event(1, "compute", "experts", "fwd", 0.5, 0.9),
        Event(0, "comm", "dispatch", "fwd", 0.1, 0.4, nbytes=10),
        Event(1, "comm", "combine", "fwd", 0.35, 0.6, nbytes=5),
    ])
    assert tl.lane_time("compute") == pytest.approx(0.7)
    assert tl.lane_time("comm") == pytest.approx(0.5)  # overlapping events count once
    assert tl.wait_s == pytest.approx(0.3)
    assert tl.comm_bytes() == 15
    assert Timeline.from_dict(tl.to_dict()) == tl


def test_chunk_rows_cover_the_tokens():
    rows = chunk_rows(10, 3)
    assert [(r.start, r.stop) for r in rows] == [(0, 3), (3, 7), (7, 10)]
    # halves round to even, as torch.round does: 1.5 -> 2, 4.5 -> 4
    assert [(r.start, r.stop) for r in chunk_rows(6, 4)] == [(0, 2), (2, 3), (3, 4), (4, 6)]


def test_chunk_stages_refuse_a_layer_whose_grouped_mm_would_sync_on_cuda(one_rank_group, monkeypatch):
    """The stages run moe_lab::grouped_mm whatever the expert backend; on CUDA that syncs inside
    the op in any dtype but bfloat16, and the overlapped schedule would stall there. No GPU
    here: the experts' device check is mocked."""
    torch.manual_seed(0)
    layer = from_layer(MoELayer(MoEConfig(**CFG), "dropless", "loop"))
    ChunkStages(layer)  # fp32 on a CPU is fine
    monkeypatch.setattr(experts, "_on_cuda", lambda device: True)
    with pytest.raises(ValueError, match=r"layer \(.*not on its backend 'loop'\): torch\._grouped_mm "
                       r"\(expert backend 'torch'\) in torch\.float32 on CUDA.*model\.bfloat16\(\)"):
        ChunkStages(layer)
    ChunkStages(layer.bfloat16())  # bfloat16 takes the sync-free kernel
