"""The fabric simulator: topology, traffic, routing, balls into bins, incast, the CLI."""

from __future__ import annotations

import argparse
import itertools
import json
import math

import numpy as np
import pytest

from moe_lab.sim.fabric import (
    BurstModel,
    LeafSpine,
    expected_empty_bins,
    expected_max_load,
    expected_pair_collisions,
    route,
    simulate,
)
from moe_lab.sim.traffic import (
    check_traffic,
    incast_traffic,
    moe_traffic,
    uniform_traffic,
)
from moe_lab.workbench.cli.sim import register

# ---------------------------------------------------------------------------- topology, traffic


def test_uplinks_carry_the_leaf_bandwidth_over_the_oversubscription():
    for oversub in (1.0, 2.0, 3.0):
        topo = LeafSpine(8, 4, 4, link_gbps=400.0, oversubscription=oversub)
        assert topo.n_spine * topo.uplink_bytes_per_s * oversub == pytest.approx(
            topo.hosts_per_leaf * topo.link_bytes_per_s
        )
        assert topo.capacities().size == topo.n_links == 2 * 32 + 2 * 4 * 4


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [({"hosts_per_leaf": 0}, "hosts_per_leaf"), ({"oversubscription": 0.5}, "oversubscription"),
     ({"link_gbps": -1.0}, "link_gbps"), ({"link_gbps": float("inf")}, "link_gbps must be a finite"),
     ({"oversubscription": float("nan")}, "oversubscription must be a finite"),
     ({"link_gbps": "400"}, "link_gbps")],
)
def test_bad_topology(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        LeafSpine(**kwargs)


def test_negative_traffic_is_rejected_naming_the_entry():
    traffic = uniform_traffic(16, 1e6)
    traffic[3, 5] = -2.0
    with pytest.raises(ValueError, match=r"-2\.0 at \[3, 5\]"):
        simulate(LeafSpine(4, 4, 4), traffic)
    with pytest.raises(ValueError, match="square"):
        check_traffic(np.ones((4, 5)))
    with pytest.raises(ValueError, match="finite"):
        check_traffic(np.full((4, 4), np.nan))
    with pytest.raises(ValueError, match="16 hosts"):
        simulate(LeafSpine(4, 4, 4), uniform_traffic(8, 1e6))


def test_moe_traffic_conserves_token_bytes_and_skew_heats_one_receiver():
    n, tokens, k, width = 32, 512, 8, 100.0
    rng = np.random.default_rng(0)
    flat = moe_traffic(n, tokens_per_gpu=tokens, top_k=k, bytes_per_token=width, rng=rng)
    skewed = moe_traffic(n, tokens_per_gpu=tokens, top_k=k, bytes_per_token=width,
                            zipf_s=1.2, rng=rng)
    for matrix in (flat, skewed):
        np.testing.assert_allclose(matrix.sum(axis=1), tokens * k * width)
    assert skewed.sum(axis=0).max() > 3 * flat.sum(axis=0).max()


# ---------------------------------------------------------------------------- routing


def test_ecmp_paths_go_up_and_down_the_same_spine():
    topo = LeafSpine(4, 4, 4)
    flows = route(topo, uniform_traffic(16, 1.0), "ecmp", np.random.default_rng(1))
    inter = flows.spine >= 0
    assert inter.sum() == 16 * 12  # every pair on different leaves
    dst = flows.rate_links[:, 3] - 16  # the last hop: the downlink of host dst, link H + dst
    np.testing.assert_array_equal(
        flows.rate_links[inter, 1], topo.leaf_up(topo.leaf_of(flows.src[inter]), flows.spine[inter])
    )
    np.testing.assert_array_equal(
        flows.rate_links[inter, 2], topo.spine_down(flows.spine[inter], topo.leaf_of(dst[inter]))
    )
    # Bytes are conserved at every tier.
    up = flows.link_bytes[2 * 16 : 2 * 16 + 16]
    assert up.sum() == pytest.approx(flows.nbytes[inter].sum())
    assert flows.link_bytes[:16].sum() == pytest.approx(flows.nbytes.sum())


def test_adaptive_routing_loads_every_uplink_of_a_leaf_equally():
    topo = LeafSpine(4, 4, 4)
    traffic = moe_traffic(16, zipf_s=1.0, tokens_per_gpu=64, rng=np.random.default_rng(2))
    flows = route(topo, traffic, "adaptive")
    up = flows.link_bytes[2 * 16 : 2 * 16 + 16].reshape(4, 4)  # [leaf, spine]
    np.testing.assert_allclose(up, up[:, :1] * np.ones((1, 4)))
    ecmp = route(topo, traffic, "ecmp", np.random.default_rng(2))
    assert up.sum() == pytest.approx(ecmp.link_bytes[2 * 16 : 2 * 16 + 16].sum())


# ---------------------------------------------------------------------------- balls into bins


def _brute_force_balls(n_balls: int, n_bins: int) -> tuple[float, float]:
    maxima, empties = [], []
    for outcome in itertools.product(range(n_bins), repeat=n_balls):
        counts = np.bincount(outcome, minlength=n_bins)
        maxima.append(counts.max())
        empties.append((counts == 0).sum())
    return float(np.mean(maxima)), float(np.mean(empties))


@pytest.mark.parametrize(("n", "m"), [(1, 3), (4, 3), (5, 4), (6, 2), (3, 5)])
def test_balls_into_bins_closed_forms_are_exact(n, m):
    mean_max, mean_empty = _brute_force_balls(n, m)
    assert expected_max_load(n, m) == pytest.approx(mean_max, rel=1e-9)
    assert expected_empty_bins(n, m) == pytest.approx(mean_empty, rel=1e-9)


@pytest.mark.parametrize(("hosts_per_leaf", "n_spine"), [(2, 8), (4, 8), (8, 8)])
def test_ecmp_collisions_match_balls_into_bins(hosts_per_leaf, n_spine):
    """Two leaves: leaf 0's flows to leaf 1 are balls, its uplinks bins."""
    topo = LeafSpine(hosts_per_leaf, 2, n_spine)
    traffic = uniform_traffic(topo.n_hosts, 1.0)
    n_balls = hosts_per_leaf * hosts_per_leaf
    trials = 600
    maxima, empties, pairs = [], [], []
    for seed in range(trials):
        flows = route(topo, traffic, "ecmp", np.random.default_rng(seed))
        from_leaf0 = (flows.spine >= 0) & (topo.leaf_of(flows.src) == 0)
        counts = np.bincount(flows.spine[from_leaf0], minlength=n_spine)
        assert counts.sum() == n_balls
        maxima.append(counts.max())
        empties.append((counts == 0).sum())
        pairs.append((counts * (counts - 1) / 2).sum())
    for sample, want in (
        (maxima, expected_max_load(n_balls, n_spine)),
        (empties, expected_empty_bins(n_balls, n_spine)),
        (pairs, expected_pair_collisions(n_balls, n_spine)),
    ):
        sample = np.asarray(sample, dtype=float)
        stderr = sample.std(ddof=1) / math.sqrt(trials) + 1e-12
        assert abs(sample.mean() - want) < 4.5 * stderr + 1e-9, (sample.mean(), want)


# ---------------------------------------------------------------------------- the figures


def test_adaptive_routing_reaches_line_rate_on_uniform_traffic_and_ecmp_does_not():
    topo = LeafSpine(8, 8, 8)
    traffic = uniform_traffic(64, 2**20)
    adaptive = simulate(topo, traffic, routing="adaptive")
    assert adaptive.algbw_fraction >= 0.9
    assert adaptive.efficiency == pytest.approx(1.0, rel=0.01)
    for seed in range(3):
        ecmp = simulate(topo, traffic, routing="ecmp", rng=np.random.default_rng(seed))
        assert ecmp.algbw_fraction < adaptive.algbw_fraction - 0.05
        assert ecmp.uplink_max_over_mean > 1.1


def test_oversubscribed_uplinks_set_the_pace():
    topo = LeafSpine(8, 8, 8, oversubscription=2.0)
    traffic = uniform_traffic(64, 2**20)
    result = simulate(topo, traffic, routing="adaptive")
    # Each leaf sends 8 x 56 MiB over uplinks of half its NIC capacity.
    want_time = 8 * 56 * 2**20 / (8 * topo.link_bytes_per_s / 2)
    assert result.makespan == pytest.approx(want_time, rel=0.02)
    assert result.algbw_fraction == pytest.approx(63 / 112, rel=0.02)


def test_pacing_removes_incast_drops_and_cuts_the_tail():
    topo = LeafSpine(8, 8, 8)
    traffic = incast_traffic(64, 32, 256 * 1024, rng=np.random.default_rng(0))
    for routing in ("ecmp", "adaptive"):
        paced = simulate(topo, traffic, routing=routing, pacing=True)
        unpaced = simulate(topo, traffic, routing=routing, pacing=False)
        assert paced.dropped_bytes.sum() == 0 and unpaced.dropped_bytes.sum() > 0
        assert unpaced.fct_percentile(99) > paced.fct_percentile(99) * 2
        assert unpaced.to_dict()["flows_with_timeout"] == 32


def test_a_deep_enough_buffer_absorbs_the_burst():
    topo = LeafSpine(8, 8, 8)
    traffic = incast_traffic(64, 8, 256 * 1024, rng=np.random.default_rng(0))
    deep = BurstModel(buffer_kb=64 * 1024)
    unpaced = simulate(topo, traffic, routing="adaptive", pacing=False, burst=deep)
    paced = simulate(topo, traffic, routing="adaptive", pacing=True, burst=deep)
    assert unpaced.dropped_bytes.sum() == 0
    # No drops: only the queue's draining time separates the two.
    assert 0 < unpaced.fct_percentile(99) - paced.fct_percentile(99) < deep.rto_us


# ---------------------------------------------------------------------------- CLI


def test_cli_fabric_json(capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sim", "fabric", "--leaves", "4", "--hosts-per-leaf", "4",
                              "--spines", "4", "--json"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "simulated"
    runs = {(r["routing"], r["pacing"]): r for r in report["runs"]}
    assert set(runs) == {("ecmp", True), ("ecmp", False), ("adaptive", True),
                         ("adaptive", False)}
    assert runs[("adaptive", True)]["algbw_fraction"] >= 0.9


def test_an_overflowing_uplink_times_out_the_flows_that_cross_it():
    topo = LeafSpine(8, 4, 8, oversubscription=4.0)
    traffic = uniform_traffic(32, 2**20)
    tight = BurstModel(buffer_kb=16)
    for routing in ("ecmp", "adaptive"):
        result = simulate(topo, traffic, routing=routing, pacing=False, burst=tight)
        inter = result.flows.rate_links[:, 1] >= 0  # the flows between leaves: they have a leaf-up hop
        assert result.dropped_bytes[2 * 32 :].sum() > 0  # the uplinks overflow
        assert result.dropped_bytes[: 2 * 32].sum() == 0  # the NICs do not
        assert result.timed_out[inter].all() and not result.timed_out[~inter].any()
