"""Pipeline figures (notebook 10): a simulated schedule as a Gantt chart, and the layout
explorer's figure (work per rank of the even and searched layouts, and the searched one's step).
Every figure here draws a simulation, not a measurement."""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_lab.config import preset
from moe_lab.sim.layout import format_layout, model_layer_chars
from moe_lab.sim.layout_search import even_layout, layer_costs, layout_report, search_layout, simulate_layout
from moe_lab.sim.schedule import OP_KINDS, PipelineResult

_OP_COLOURS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452"}


def plot_gantt(
    result: PipelineResult, ax: Any = None, *, title: str | None = None, labels: bool = True
) -> Any:
    """Draw ``result`` as a Gantt chart: one row per rank, F blue, B green, W orange.

    Chunks after the first are drawn lighter; a dotted line marks the end of the step (its
    makespan). On axes that share their x-axis with others (``plt.subplots(..., sharex=True)``)
    the common limit covers the longest step drawn on any of them, so no panel is cut.
    Returns the matplotlib axes.
    """
    # matplotlib loads only to draw: the simulators (and the ``sim`` command) run on numpy.
    from matplotlib.patches import Patch

    from moe_lab.workbench.figures.charts import ax_or_new

    ax = ax_or_new(ax, (10, 0.45 * result.n_ranks + 1.2))
    for kind, colour in _OP_COLOURS.items():
        for c in range(result.n_chunks):
            sel = (result.kind == kind) & (result.chunk == c)
            alpha = 1.0 - 0.45 * c / max(result.n_chunks - 1, 1)
            for r in np.unique(result.rank[sel]):
                rs = sel & (result.rank == r)
                bars = list(zip(result.start[rs], result.end[rs] - result.start[rs], strict=True))
                ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=colour, alpha=alpha,
                               edgecolor="white", linewidth=0.5)
    if labels and result.rank.size <= 600:
        for r, mb, s, e in zip(result.rank, result.microbatch, result.start, result.end,
                               strict=True):
            if (e - s) > 0.012 * result.makespan:
                ax.text((s + e) / 2, r, str(mb), ha="center", va="center", fontsize=6,
                        color="white")
    ax.set_yticks(range(result.n_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(result.n_ranks)])
    ax.invert_yaxis()
    ax.axvline(result.makespan, color="gray", linewidth=0.8, linestyle=":")
    # One x-axis shared by several panels has one limit: the last panel drawn must not cut the
    # others, so it covers the longest step on any of them (their bars are in their data limits).
    others = [a for a in ax.get_shared_x_axes().get_siblings(ax) if a is not ax and a.has_data()]
    ax.set_xlim(0, max([result.makespan, *(a.dataLim.x1 for a in others)]) * 1.01)
    ax.set_xlabel("simulated time (work units)")
    kinds_present = [k for k in OP_KINDS if (result.kind == k).any()]
    ax.legend(handles=[Patch(color=_OP_COLOURS[k], label=k) for k in kinds_present],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or (
        f"{result.schedule}, p={result.n_ranks}, v={result.n_chunks}, m={result.n_microbatches}"
        f" — bubble {result.bubble_fraction:.1%} (simulated)"
    ), fontsize=9)
    return ax


def step_figure(n_ranks: int = 8, n_chunks: int = 1, microbatches: int = 16, mxfp8_logits: int = 0,
                delay_wgrad: int = 0, preset_name: str = "deepseek_v3") -> Any:
    """The explorer's figure: a preset's even and searched layouts on ``n_ranks`` ranks —
    the work per rank of each, and the Gantt chart of the searched one's simulated step.

    Slider-friendly: ``microbatches`` is rounded up to a multiple of ``n_ranks`` when
    ``n_chunks`` > 1; ``mxfp8_logits`` and ``delay_wgrad`` are 0/1 switches.
    """
    import matplotlib.pyplot as plt  # only to draw: the ``sim`` command never loads it

    cfg = preset(preset_name)
    costs = layer_costs(cfg, logits_scale=0.5 if mxfp8_logits else 1.0)
    n_chunks = max(1, min(n_chunks, len(model_layer_chars(cfg)) // n_ranks))
    if n_chunks > 1:
        microbatches = -(-microbatches // n_ranks) * n_ranks
    searched = search_layout(cfg, costs, n_ranks, n_chunks,
                             n_microbatches=microbatches if n_chunks > 1 else None)
    layouts = {"searched": searched}
    if n_ranks * n_chunks <= cfg.n_layers:
        layouts = {"even": even_layout(cfg, n_ranks, n_chunks), **layouts}
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 2.6 + 0.3 * n_ranks), gridspec_kw={"height_ratios": [1, 1.6]}
    )
    width = 0.8 / len(layouts)
    notes = []
    for i, (name, lay) in enumerate(layouts.items()):
        report = layout_report(lay, cfg, costs)
        step = simulate_layout(lay, cfg, costs, microbatches, delay_wgrad=bool(delay_wgrad))
        loads = np.asarray(report["rank_loads"])
        top.bar(np.arange(n_ranks) + (i - (len(layouts) - 1) / 2) * width, loads, width,
                label=f"{name}: imbalance {report['imbalance']:.1%}, step {step.makespan:,.0f}")
        notes.append(f"{name} {format_layout(lay)}")
    top.axhline(loads.mean(), color="k", ls=":", lw=1)
    top.set(xlabel="pipeline rank", ylabel=f"forward work ({costs.unit})")
    top.legend(fontsize=7, loc="lower right")
    top.set_title(f"{preset_name}, logits {'MXFP8 (x0.5)' if mxfp8_logits else 'bf16'} — "
                  "simulated, from the FLOPs model", fontsize=9)
    plot_gantt(step, ax=bottom, labels=n_ranks * microbatches * n_chunks <= 256)
    bottom.set_xlabel("simulated time (" + costs.unit + " of work)\n" + "\n".join(notes),
                      fontsize=8)
    fig.tight_layout()
    return fig
