"""The waterfall: how each optimisation moved throughput, drawn from the results ledger.

NVIDIA tells the software side of its MLPerf Training v6.0 DeepSeek-V3 result as one number
climbing — 1,298 to 1,648 TFLOPS per GB300 in three months, with no new hardware. A
waterfall chart draws such a climb: the first bar is the baseline, every later bar floats
from where the previous one ended to where the next optimisation took the figure (up in
green, down in red, labelled with the ratio), and the last bar is the total.

The rules this module keeps:

- **One waterfall, one machine.** A ladder is only meaningful when every rung ran on the
  same hardware, the same model and the same batch, in one measurement.
  `waterfalls_from_ledger` makes one `Waterfall` per hardware label and never stacks gains
  measured on different machines.
- **Only the ledger.** Every measured bar is a ledger record; nothing is typed by hand. A
  ladder is a set of records with the metric `LADDER_METRIC` and the extra fields ``rung``
  (its position), ``ladder`` (its name) and ``run`` (one id per measurement, so rungs of
  two measurements are never mixed); `moe_lab.workbench.benchmarks.ttt.record_ladder`
  writes them.
- **Say what kind of figure it is.** ``kind`` is ``"measured"`` (solid bars) or
  ``"reported"`` (outlined bars, with the source in the title: a figure someone else
  published, e.g. `reported_waterfall`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt

from moe_lab.workbench import mlperf
from moe_lab.workbench.figures.charts import ax_or_new
from moe_lab.workbench.measure.ledger import format_value

LADDER_METRIC = "step_tokens_per_s"
# A measurement whose rung spread (inter-quartile range) exceeds this share of its median is
# passed over for a steadier one (`waterfalls_from_ledger`).
MAX_REL_IQR = 0.5

_UP, _DOWN, _BASE, _TOTAL = "tab:green", "tab:red", "0.55", "tab:blue"


@dataclass(frozen=True)
class Waterfall:
    """A ladder measured (or reported) on one hardware, in one unit: ``rungs`` holds
    ``(label, value)`` per bar, the figure after the optimisation ``label`` (the first rung: the
    baseline), and at least one more rung."""

    title: str
    hardware: str
    unit: str
    rungs: tuple[tuple[str, float], ...]
    kind: str = "measured"  # "measured" or "reported"

    @property
    def total(self) -> float:
        """Last rung over the first."""
        return self.rungs[-1][1] / self.rungs[0][1]

    def table_markdown(self) -> str:
        lines = [f"**{self.title}** — {self.hardware} ({self.kind})", "",
                 f"| step | {self.unit} | × previous | × baseline |", "|---|---:|---:|---:|"]
        base = prev = self.rungs[0][1]
        for label, value in self.rungs:
            lines.append(f"| {label} | {format_value(value)} | {value / prev:.2f} | {value / base:.2f} |")
            prev = value
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# From the ledger
# --------------------------------------------------------------------------------------


def waterfalls_from_ledger(records: Iterable[dict], *,
                           notebook: Sequence[str] | None = None) -> list[Waterfall]:
    """Every ladder in ``records`` with `LADDER_METRIC`, newest measurement per (notebook,
    ladder, hardware), one `Waterfall` each, ordered by notebook, ladder and hardware.

    A ladder record carries ``rung`` (int), ``ladder`` (str) and ``run`` (one id per
    measurement; `moe_lab.workbench.benchmarks.ttt.record_ladder` writes them, so every rung
    is a measurement); records without them are not ladders and are skipped. ``notebook``, the
    notebooks' names, filters. A measurement in which some rung's inter-quartile range
    exceeds `MAX_REL_IQR` of its median is passed over for the newest steadier one; when
    every measurement is that noisy, the newest is drawn with "NOISY" in its title.
    """
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for rec in records:
        if rec.get("metric") != LADDER_METRIC or not isinstance(rec.get("rung"), int):
            continue
        if notebook is not None and rec.get("notebook") not in notebook:
            continue
        key = (str(rec.get("notebook")), str(rec.get("ladder", "")), str(rec.get("hardware")))
        groups.setdefault(key, {}).setdefault(str(rec.get("run", "")), []).append(rec)
    out = []
    for key in sorted(groups):
        runs = groups[key]
        # A rung spread more than `MAX_REL_IQR` of its median (``iqr_ms`` and ``median_ms``, as
        # `record_ladder` writes them): a machine busy with other work, not a property of the code.
        steady = [recs for recs in runs.values()
                  if all(rec["iqr_ms"] <= MAX_REL_IQR * rec["median_ms"] for rec in recs)]
        newest = max(steady or list(runs.values()),
                     key=lambda recs: max(str(r.get("time", "")) for r in recs))
        by_rung = {rec["rung"]: rec for rec in newest}  # a repeated rung within a run: the later record
        if len(by_rung) < 2:
            continue
        nb, name, hw = key
        recs = [rec for _, rec in sorted(by_rung.items())]
        rungs = tuple((str(rec.get("step", "")).removeprefix("ladder:"), float(rec["value"]))
                      for rec in recs)
        date = max(str(rec.get("time", ""))[:10] for rec in recs)
        title = f"{nb}: {name}" if name else nb
        title = f"{title} ({date})" if date else title
        if not steady:
            title += f" — NOISY: a rung's IQR > {MAX_REL_IQR:.0%} of its median"
        out.append(Waterfall(title, hw, str(recs[0].get("unit", "")), rungs))
    return out


def reported_waterfall() -> Waterfall:
    """NVIDIA's DeepSeek-V3 climb on GB300 as reported (`moe_lab.workbench.mlperf`): before and
    after three months of software work, TFLOPS per GPU. Only the two endpoints are
    published as figures; the per-technique gains are quoted in the text, not stacked here."""
    seed = mlperf.DEEPSEEK_V3_GB300
    return Waterfall("DeepSeek-V3 671B, software only (three months)",
                     f"{seed['gpu']} (NVIDIA, MLPerf Training v6.0)", "TFLOPS/GPU",
                     (("before", seed["tflops_per_gpu_before"]), ("after", seed["tflops_per_gpu"])),
                     "reported")


# --------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------


def plot_waterfall(wf: Waterfall, ax=None):
    """Draw ``wf`` on ``ax`` (created if not given) and return it: the baseline bar, one
    floating bar per optimisation labelled with its ratio, and the total; a reported figure's
    bars are outlined, a measured one's filled."""
    ax = ax_or_new(ax, (1.3 * (len(wf.rungs) + 2), 3.8))
    (first, base), last = wf.rungs[0], wf.rungs[-1][1]
    # (label, bottom, height, colour, note) of each bar: the baseline, one per optimisation, the total
    bars = [(first, 0.0, base, _BASE, format_value(base))]
    for (_, before), (label, value) in zip(wf.rungs, wf.rungs[1:]):
        low, high = sorted((before, value))
        ratio = value / before
        bars.append((label, low, max(high - low, 1e-12), _UP if ratio >= 1 else _DOWN, f"×{ratio:.2f}"))
    bars.append(("total", 0.0, last, _TOTAL, f"{format_value(last)}\n×{wf.total:.2f}"))
    for x, (_, bottom, height, color, note) in enumerate(bars):
        style = ({"facecolor": "white", "edgecolor": color, "linewidth": 1.6} if wf.kind == "reported"
                 else {"facecolor": color, "edgecolor": "black", "linewidth": 0.6})
        ax.bar(x, height, bottom=bottom, width=0.7, **style)
        ax.text(x, bottom + height, note, ha="center", va="bottom", fontsize=8)
    for x, (_, value) in enumerate(wf.rungs[:-1]):  # connectors from the top of one rung to the next
        ax.plot([x + 0.35, x + 0.65], [value, value], color="0.3", lw=0.8, ls=":")
    ax.set_xticks(list(range(len(bars))))
    ax.set_xticklabels([bar[0] for bar in bars], rotation=20, ha="right", fontsize=8)
    ax.set(ylabel=wf.unit, ylim=(0, max(bar[1] + bar[2] for bar in bars) * 1.22))
    ax.set_title(f"{wf.title}\n{wf.hardware} — {wf.kind}", fontsize=9)
    return ax


def plot_waterfalls(waterfalls: Sequence[Waterfall], *, ncols: int = 2):
    """One panel per waterfall (so per hardware and kind), 6.5 x 4 inches each; returns the
    figure."""
    ncols = max(1, min(ncols, len(waterfalls)))
    nrows = -(-len(waterfalls) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.0 * nrows), squeeze=False)
    for ax, wf in zip(axes.flat, waterfalls):
        plot_waterfall(wf, ax)
    for ax in list(axes.flat)[len(waterfalls):]:
        ax.axis("off")
    fig.tight_layout()
    return fig
