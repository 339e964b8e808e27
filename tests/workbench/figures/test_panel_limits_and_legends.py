"""Figures that must show all of what they draw: Gantt panels sharing one x-axis (notebook 10)
each reach their own step's end, the stage legend of an expert-parallel timeline (notebook 09)
sits beside its lanes, not below them, and the fabric explorer (notebook 11) says which
illustrative link rate it drew."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from moe_lab.parallel.plan import plan, simulate_plan, stage_graph  # noqa: E402
from moe_lab.sim.schedule import simulate  # noqa: E402
from moe_lab.workbench.figures.pipeline import plot_gantt  # noqa: E402
from moe_lab.workbench.figures.timelines import plot_timeline  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _notebook_10_runs(p: int = 4, m: int = 8) -> dict:
    """Notebook 10's four schedules: GPipe and 1F1B take longest, delayed W least."""
    return {
        "GPipe": simulate([1.0] * p, n_microbatches=m, schedule="gpipe"),
        "1F1B": simulate([1.0] * p, n_microbatches=m),
        "interleaved": simulate([0.5] * (2 * p), n_ranks=p, n_microbatches=m),
        "W delayed": simulate([1.0] * p, n_microbatches=m, delay_wgrad=True,
                              max_deferred_wgrad=p - 1),
    }


@pytest.mark.parametrize("order", ["longest first", "longest last"])
def test_gantt_panels_sharing_an_x_axis_each_reach_their_own_makespan(order):
    runs = list(_notebook_10_runs().values())
    if order == "longest last":
        runs = runs[::-1]
    assert len({r.makespan for r in runs}) > 1  # otherwise the test shows nothing
    fig, axes = plt.subplots(len(runs), 1, sharex=True)
    for ax, run in zip(axes, runs, strict=True):
        plot_gantt(run, ax=ax)
    for ax, run in zip(axes, runs, strict=True):
        left, right = ax.get_xlim()
        assert left <= 0 and right >= run.makespan, (run.schedule, run.makespan, right)


def test_a_gantt_chart_on_its_own_axes_ends_at_its_own_makespan():
    run = _notebook_10_runs()["W delayed"]
    ax = plot_gantt(run)
    assert ax.get_xlim()[1] == pytest.approx(run.makespan * 1.01)


@pytest.mark.parametrize("figsize", [(12, 2.8), (12, 4.6)])
def test_the_timeline_legend_sits_beside_the_lanes(figsize):
    stages = stage_graph(4)
    timelines = {s: simulate_plan(plan(s, 4), stages, label=s)[1] for s in ("sequential", "chunked")}
    fig, ax = plt.subplots(figsize=figsize)
    plot_timeline(timelines, ax=ax, unit="model units")
    fig.tight_layout()
    fig.canvas.draw()
    lanes = ax.get_window_extent()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= lanes.x1  # to the right of the lanes...
    assert legend.y0 >= lanes.y0 - 1 and legend.y1 <= lanes.y1 + 1  # ...within their height
    assert legend.x1 <= fig.bbox.x1 + 1  # and on the figure


def test_the_fabric_explorer_draws_the_link_rate_it_is_given():
    from moe_lab.workbench.figures.fabric import fabric_figure

    p99 = {}
    for gbps in (400.0, 800.0):
        fig = fabric_figure(n_spine=4, link_gbps=gbps)
        assert f"at {gbps:g} Gb/s (illustrative)" in fig._suptitle.get_text()
        (legend,) = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        p99[gbps] = legend.get_texts()[0].get_text()
    assert p99[400.0] != p99[800.0]  # the completion times follow the rate
