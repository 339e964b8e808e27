"""The Gantt chart of an expert-parallel step's timelines."""

from __future__ import annotations

from moe_lab.parallel.timeline import Event, Timeline
from moe_lab.workbench.figures.timelines import plot_timeline


def test_plot_timeline_draws_both_lanes():
    import matplotlib

    matplotlib.use("Agg")
    tl = Timeline(0, "t", 1.0, [Event(0, "compute", "experts", "fwd", 0.0, 0.3),
                                Event(0, "comm", "dispatch", "fwd", 0.1, 0.4)])
    ax = plot_timeline({"overlap": tl, "sequential": tl.to_dict()})
    assert len(ax.get_yticks()) == 4
