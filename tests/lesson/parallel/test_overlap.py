"""The hand-scheduled EP step equals autograd; timelines add up; the emulated link works."""

from __future__ import annotations

import pytest

from moe_lab.parallel.overlap import RUNS, a2a_bandwidth, exposed_time, overlap_check_rank
from moe_lab.parallel.timeline import Event, Timeline, plot_timeline
from moe_lab.workbench.ranks import netem
from moe_lab.workbench.ranks.launch import run_ranks, whoami

CFG = dict(d_model=32, n_experts=8, top_k=2, d_expert=48, n_shared_experts=1)


@pytest.mark.timeout(60)
def test_every_schedule_equals_autograd():
    results = run_ranks(overlap_check_rank, 2, CFG, 40, 3, timeout_s=50, threads_per_rank=1)
    for rank_errors in results:
        assert set(rank_errors) == set(RUNS)
        for label, errs in rank_errors.items():
            events = errs.pop("events")
            assert events > 0
            for name, value in errs.items():
                assert value <= 2e-5, (label, name, value)


def test_timeline_lanes_and_exposed_time():
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
    assert exposed_time(1.2, 1.0) == pytest.approx(0.2)


def test_plot_timeline_draws_both_lanes():
    import matplotlib

    matplotlib.use("Agg")
    tl = Timeline(0, "t", 1.0, [Event(0, "compute", "experts", "fwd", 0.0, 0.3),
                                Event(0, "comm", "dispatch", "fwd", 0.1, 0.4)])
    ax = plot_timeline({"overlap": tl, "sequential": tl.to_dict()})
    assert len(ax.get_yticks()) == 4


@pytest.mark.timeout(60)
def test_emulated_link_carries_the_ranks_and_is_torn_down():
    ok, why = netem.available()
    if not ok:
        pytest.skip(f"emulated link unavailable here: {why}")
    with netem.EmulatedLink(2, rate_mbit=200) as link:
        names = [link.namespace(r) for r in range(2)] + [link.hub]
        assert set(names) <= set(netem._namespaces())
        results = run_ranks(whoami, 2, link=link, timeout_s=50, threads_per_rank=1)
    assert all(r["interface"] == netem.IFNAME for r in results)
    assert all(r["master"].startswith(netem.SUBNET + ".1:") for r in results)
    assert not set(names) & set(netem._namespaces())


@pytest.mark.timeout(90)
def test_emulated_link_enforces_its_rate_with_jumbo_frames():
    # A hard bound, not a timing race: whatever the machine's load, bytes cannot cross a
    # 100 Mbit/s link faster than 12.5 MB/s (plus one token bucket's burst per direction).
    ok, why = netem.available()
    if not ok:
        pytest.skip(f"emulated link unavailable here: {why}")
    with netem.EmulatedLink(2, rate_mbit=100) as link:
        assert link.mtu == 9000
        rows = 1024  # 1 MiB to the other rank per all-to-all
        results = run_ranks(a2a_bandwidth, 2, rows, 256, 3, link=link, timeout_s=80, threads_per_rank=1)
    sent = results[0]["bytes_per_rank"]
    burst = max(64 * 1024, 4 * link.mtu)
    assert results[0]["median_s"] >= (sent - burst) / 12.5e6


def test_link_arguments_are_checked():
    with pytest.raises(ValueError, match="rate_mbit"):
        netem.EmulatedLink(2, rate_mbit=0)
    with pytest.raises(ValueError, match="world_size"):
        netem.EmulatedLink(0)
    with pytest.raises(ValueError, match="mtu"):
        netem.EmulatedLink(2, mtu=100_000)
