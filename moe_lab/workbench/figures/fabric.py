"""Figures of the fabric simulator: the leaf-spine topology with its link loads, and the
explorer's figure (topology and flow completion times of one MoE dispatch)."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib import cm
from matplotlib.colors import Normalize

from moe_lab.sim.fabric import FabricResult, LeafSpine, simulate
from moe_lab.sim.traffic import moe_traffic
from moe_lab.workbench.figures.charts import ax_or_new


def plot_topology(result: FabricResult, ax: Any = None, *, title: str | None = None) -> Any:
    """Draw the leaf-spine fabric with each leaf-spine link coloured by its load.

    Line width and colour: bytes on the link over the mean uplink bytes (hot = red).
    Returns the matplotlib axes.
    """
    topo = result.topology
    ax = ax_or_new(ax, (9, 4))
    A, S = topo.n_leaf, topo.n_spine
    spine_x = np.linspace(0, 1, S + 2)[1:-1]
    leaf_x = np.linspace(0, 1, A + 2)[1:-1]
    up, down = result.uplink_bytes().reshape(2, A * S)  # leaf a -> spine s at a * S + s; down: s * A + a
    load = (up + down.reshape(S, A).T.ravel()) / 2  # per leaf-spine pair, in the order of ``up``
    rel = load / (load.mean() or 1.0)  # an idle fabric: every link at 0
    # Centred on the mean; the scale stretches to the largest deviation so hot links show.
    spread = max(0.25, float(np.abs(rel - 1.0).max()))
    norm = Normalize(vmin=1.0 - spread, vmax=1.0 + spread)
    cmap = plt.get_cmap("coolwarm")
    for idx in range(A * S):
        a, s = divmod(idx, S)
        ax.plot([leaf_x[a], spine_x[s]], [0.35, 0.9], color=cmap(norm(rel[idx])),
                linewidth=0.4 + 2.6 * max(rel[idx], 0.0) / norm.vmax, zorder=1)
    ax.scatter(spine_x, np.full(S, 0.9), s=160, marker="s", color="#444", zorder=2)
    ax.scatter(leaf_x, np.full(A, 0.35), s=120, marker="s", color="#777", zorder=2)
    hpl = topo.hosts_per_leaf
    for a in range(A):
        xs = leaf_x[a] + (np.arange(hpl) - (hpl - 1) / 2) * (0.8 / (A + 1)) / max(hpl, 1)
        ax.scatter(xs, np.full(hpl, 0.08), s=8, color="#2a9d8f", zorder=2)
        for x in xs:
            ax.plot([x, leaf_x[a]], [0.08, 0.35], color="#bbb", linewidth=0.4, zorder=0)
    for y, tier in ((0.9, "spines"), (0.35, "leaves"), (0.08, "GPUs")):
        ax.text(0.0, y, tier, va="center", fontsize=8)
    ax.set(xlim=(-0.02, 1.02), ylim=(0, 1))
    ax.axis("off")
    plt.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.03,
                 label="uplink load / mean")
    ax.set_title(title or f"{result.routing}: uplink loads (simulated)", fontsize=9)
    return ax


def fabric_figure(zipf_s: float = 0.0, oversubscription: float = 1.0, n_spine: int = 8, adaptive: int = 0,
                  pacing: int = 1, link_gbps: float = 400.0) -> Any:
    """The explorer's figure: one MoE dispatch all-to-all (Zipf skew ``zipf_s`` over the
    experts) on a leaf-spine fabric of 8 leaves of 8 GPUs — the topology with its uplink loads,
    and the distribution of flow completion times. ``adaptive`` and ``pacing`` are 0/1 switches.
    ``link_gbps``: every GPU's NIC rate, an illustrative default (GB300 systems ship 800 Gb/s
    NICs); the completion times scale with it, the fractions of line rate do not."""
    topo = LeafSpine(n_spine=n_spine, link_gbps=link_gbps, oversubscription=max(1.0, oversubscription))
    rng = np.random.default_rng(0)
    traffic = moe_traffic(topo.n_hosts, tokens_per_gpu=512, zipf_s=zipf_s, rng=rng)
    result = simulate(topo, traffic, routing="adaptive" if adaptive else "ecmp",
                      pacing=bool(pacing), rng=rng)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8),
                                      gridspec_kw={"width_ratios": [1.6, 1]})
    plot_topology(result, ax=left)
    fct_us = np.sort(result.fct) * 1e6
    right.plot(fct_us, np.arange(1, fct_us.size + 1) / fct_us.size, drawstyle="steps-post")
    right.axvline(result.fct_percentile(99), color="tab:red", ls="--", lw=1,
                  label=f"p99 {result.fct_percentile(99):,.0f} us")
    right.set(xscale="log", xlabel="flow completion time (us, simulated)", ylabel="fraction of flows")
    right.legend(fontsize=8)
    right.set_title(f"bandwidth {result.algbw_fraction:.0%} of link, efficiency "
                    f"{result.efficiency:.0%}", fontsize=9)
    fig.suptitle(f"{topo.n_hosts} GPUs at {topo.link_gbps:g} Gb/s (illustrative), {result.routing}, "
                 f"pacing {'on' if pacing else 'off'}, "
                 f"zipf s={zipf_s:g}, oversubscription {topo.oversubscription:g}:1", fontsize=10)
    fig.tight_layout()
    return fig
