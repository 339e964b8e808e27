"""Max-min fair rates and fluid completion times against textbook cases and exact runs."""

from __future__ import annotations

import numpy as np
import pytest

from moe_lab.sim.fabric import LeafSpine, route
from moe_lab.sim.fair_share import fluid_completion_times, max_min_rates
from moe_lab.sim.traffic import moe_traffic


def test_max_min_rates_on_the_textbook_example():
    # Links of capacity 1 and 2; flow 0 crosses both, flow 1 only link 0, flow 2 only link 1.
    links = np.array([[0, 1], [0, -1], [1, -1]])
    rates = max_min_rates(links, np.array([1.0, 2.0]))
    np.testing.assert_allclose(rates, [0.5, 0.5, 1.5])


@pytest.mark.parametrize("seed", range(5))
def test_max_min_rates_are_feasible_and_every_flow_has_a_bottleneck(seed):
    rng = np.random.default_rng(seed)
    n_links, n_flows = 12, 40
    cap = rng.uniform(1.0, 5.0, n_links)
    links = np.stack([rng.choice(n_links, size=3, replace=False) for _ in range(n_flows)])
    links[rng.random(n_flows) < 0.3, 2] = -1
    rates = max_min_rates(links, cap)
    load = np.zeros(n_links)
    for f in range(n_flows):
        for link in links[f][links[f] >= 0]:
            load[link] += rates[f]
    assert np.all(load <= cap * (1 + 1e-9))
    for f in range(n_flows):
        # Max-min: some link on the flow's path is full and no flow on it is faster.
        ok = False
        for link in links[f][links[f] >= 0]:
            full = load[link] >= cap[link] * (1 - 1e-9)
            others = [rates[g] for g in range(n_flows) if link in links[g]]
            if full and rates[f] >= max(others) - 1e-9:
                ok = True
        assert ok, f"flow {f} has no bottleneck"


def test_one_link_fluid_completion_is_processor_sharing():
    sizes = np.array([5.0, 1.0, 3.0, 3.0, 8.0])
    links = np.zeros((sizes.size, 1), dtype=np.int64)
    got = fluid_completion_times(sizes, links, np.array([2.0]), rel_tol=1e-12,
                                    step_quantile=0.0)
    order = np.sort(sizes)
    n = sizes.size
    expect_sorted = [(order[:i].sum() + (n - i) * order[i]) / 2.0 for i in range(n)]
    np.testing.assert_allclose(np.sort(got), expect_sorted, rtol=1e-9)


def test_epoch_stepping_stays_close_to_the_exact_fluid_simulation():
    topo = LeafSpine(4, 4, 4)
    traffic = moe_traffic(16, zipf_s=1.0, tokens_per_gpu=256, rng=np.random.default_rng(1))
    flows = route(topo, traffic, "ecmp", np.random.default_rng(1))
    exact = fluid_completion_times(flows.nbytes, flows.rate_links, flows.rate_capacity,
                                      rel_tol=1e-9, step_quantile=0.0)
    fast = fluid_completion_times(flows.nbytes, flows.rate_links, flows.rate_capacity)
    for q in (50, 90, 99, 100):
        assert np.percentile(fast, q) == pytest.approx(np.percentile(exact, q), rel=0.05)
    assert np.mean(np.abs(fast - exact) / exact) < 0.05
