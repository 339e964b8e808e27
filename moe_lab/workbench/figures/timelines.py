"""Timelines: a schematic of eager against graphed kernel launches (notebook 08), and the
Gantt chart of an expert-parallel step's stages (`moe_lab.parallel.timeline`, notebook 09)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Patch

from moe_lab.parallel.timeline import Timeline
from moe_lab.workbench.figures.charts import ax_or_new


def plot_launch_timeline(n_kernels: int = 10, launch_us: float = 5.0, kernel_us: float = 2.0,
                         graph_launch_us: float = 8.0) -> Sequence[Axes]:
    """A schematic (not a measurement) of one step's host launches and device kernels,
    eager and graphed: when each kernel takes less time than a launch, the device idles
    between kernels in eager mode; a graph launches them all at once."""
    _, axes = plt.subplots(2, 1, figsize=(9, 3.4), sharex=True)
    eager_end = n_kernels * launch_us + kernel_us
    graph_end = graph_launch_us + n_kernels * kernel_us
    # Eager: kernel i starts once launched (at (i + 1) launches) and once kernel i - 1 is done; with
    # equal kernels that is the later of its launch and the first launch followed by i kernels.
    eager = ([(i * launch_us, launch_us * 0.9) for i in range(n_kernels)],
             [(max((i + 1) * launch_us, launch_us + i * kernel_us), kernel_us * 0.95)
              for i in range(n_kernels)])
    graphed = ([(0, graph_launch_us * 0.95)],
               [(graph_launch_us + i * kernel_us, kernel_us * 0.95) for i in range(n_kernels)])
    titles = ("eager: the host launches every kernel", "graphed: one launch replays them all")
    for ax, title, (host, device) in zip(axes, titles, (eager, graphed), strict=True):
        ax.set_yticks([0.5, 1.5], ["device", "host"])
        ax.set_ylim(0, 2)
        ax.set_title(title, fontsize=10, loc="left")
        ax.broken_barh(host, (1.1, 0.8), color="tab:orange")
        ax.broken_barh(device, (0.1, 0.8), color="tab:blue")
    axes[1].set_xlabel(f"time (µs), schematic: launch {launch_us:g} µs, kernel {kernel_us:g} µs "
                       f"→ eager {eager_end:g} µs, graphed {graph_end:g} µs")
    axes[1].set_xlim(0, max(eager_end, graph_end) * 1.02)
    return axes


_COLORS = {
    "route+permute": "#9ecae1", "shared expert": "#c7e9c0", "experts": "#3182bd",
    "unpermute": "#6baed6", "unpermute⁻¹": "#6baed6", "shared expert⁻¹": "#a1d99b",
    "experts dgrad": "#e6550d", "experts wgrad": "#fdae6b", "route+permute⁻¹": "#9ecae1",
    "dispatch": "#756bb1", "combine": "#bcbddc", "dispatch⁻¹": "#756bb1", "combine⁻¹": "#bcbddc",
    "counts": "#636363",
}


def plot_timeline(timelines: dict[str, Timeline | dict], ax: Axes | None = None,
                  title: str | None = None, unit: str = "ms") -> Axes:
    """A Gantt chart: for each labelled step, a compute lane and a communication lane; each
    bar is one stage of one chunk (numbered), backward stages hatched (in a 1F1B-merged
    step: the other micro-batch), the stages' legend to the right of the lanes. Events drawn
    to the same time scale; ``timelines`` may hold `Timeline`s or their ``to_dict()`` form
    (what a rank returns)."""
    k = 1e3 if unit == "ms" else 1.0

    items = [(label, t if isinstance(t, Timeline) else Timeline.from_dict(t))
             for label, t in timelines.items()]
    ax = ax_or_new(ax, (11, 1.1 + 0.9 * len(items)))
    yticks, ylabels, used = [], [], {}
    for row, (label, tl) in enumerate(items):
        for lane_index, lane in enumerate(("compute", "comm")):
            y = (len(items) - 1 - row) * 3 + (1 - lane_index)
            yticks.append(y)
            ylabels.append(f"{label} · {lane}")
            for e in tl.events:
                if e.lane != lane:
                    continue
                color = _COLORS.get(e.name, "#999999")
                used[e.name] = color
                ax.barh(y, e.duration * k, left=e.start * k, height=0.8, color=color,
                        edgecolor="black", linewidth=0.3, hatch="///" if e.phase == "bwd" else None)
                if e.chunk >= 0 and e.duration > tl.step_s / 60:
                    ax.text((e.start + e.duration / 2) * k, y, str(e.chunk), ha="center",
                            va="center", fontsize=7)
        ax.axvline(tl.step_s * k, ymin=0, ymax=1, color="gray", linewidth=0.5, linestyle=":")
    ax.set_yticks(yticks, ylabels)
    ax.set_xlabel(f"time since the step began ({unit})")
    # Beside the lanes it names, top-aligned; a second column when a single one would run past
    # the lanes' height (about five entries per inch of axes at this font size).
    height_in = ax.get_position().height * ax.figure.get_figheight()
    ncol = max(1, -(-len(used) // max(1, int(5 * height_in))))
    ax.legend(handles=[Patch(color=c, label=n) for n, c in used.items()], fontsize=7, ncol=ncol,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    if title:
        ax.set_title(title)
    return ax
