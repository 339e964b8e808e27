"""The emulated network link: ranks talk over it, it enforces its rate, it is torn down."""

from __future__ import annotations

import pytest

from moe_lab.workbench.ranks import netem
from moe_lab.workbench.ranks.harness import a2a_bandwidth
from moe_lab.workbench.ranks.launch import run_ranks, whoami


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
        rows = 1024  # 1 MiB to the other rank per all-to-all
        results = run_ranks(a2a_bandwidth, 2, rows, 256, 3, link=link, timeout_s=80, threads_per_rank=1)
    sent = results[0]["bytes_per_rank"]
    burst = max(64 * 1024, 4 * netem.MTU)
    assert results[0]["median_s"] >= (sent - burst) / 12.5e6


def test_entering_a_namespace_that_is_not_there_names_it():
    with pytest.raises(netem.LinkUnavailable, match="network namespace 'moelab-0-gone-r0' not found"):
        netem.enter_namespace("moelab-0-gone-r0")
