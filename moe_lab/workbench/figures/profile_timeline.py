"""A `torch.profiler` recording drawn as a timeline, with every host sync marked (notebook 01).

`torch.profiler.profile` records each operator the host runs (``aten::mm``,
``aten::nonzero``, ...) with its start and end, the spans opened by
``torch.profiler.record_function`` (``forward``, ``backward``, ...) and, on a GPU, every kernel
the device ran. `profile_timeline` turns that recording into rows of bars: the named spans, the
host's top-level operators (one row per host thread) and, when there are any, the device's
kernels. An operator is a *host sync* when it, or an operator it calls, is one of
`SYNC_EVENT_NAMES`: reading a value (``aten::item`` → ``aten::_local_scalar_dense``) or sizing an
output from the data (``aten::nonzero``, which ``torch.where(mask)`` calls). Those are drawn in
red with a line through every row: on a GPU the host stops there until the device has drained
its queue, so the device row shows a gap after each one. On a CPU the host is the device and
the line marks where that wait would be.

The same recording, saved with ``prof.export_chrome_trace(path)``, opens in Perfetto
(https://ui.perfetto.dev) or ``chrome://tracing``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from matplotlib.axes import Axes

from moe_lab.training.sync import ALWAYS_SYNCS
from moe_lab.workbench.figures.charts import ax_or_new

#: Profiler event names counted as host syncs: the ATen entries of
#: `moe_lab.training.sync.SYNC_OPS` that sync in every form (index / index_put_ / copies /
#: repeat_interleave / histc sync only with some arguments, which a profiler event does not
#: carry), ``aten::item`` (which calls ``_local_scalar_dense``) and the CUDA runtime's waits.
SYNC_EVENT_NAMES: frozenset[str] = frozenset(
    {"aten::" + op.__name__ for op in ALWAYS_SYNCS}
    | {"aten::item", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}
)


@dataclass(frozen=True)
class Span:
    """One bar: ``name``, ``start_us`` and ``end_us`` from the start of the recording,
    ``sync``: whether it (or an operator it called) waits for the device."""

    name: str
    start_us: float
    end_us: float
    sync: bool = False


@dataclass(frozen=True)
class TimelineRows:
    """What `plot_profile_timeline` draws: ``rows`` maps a row label to its spans, top row
    first; ``syncs`` lists the sync operators in time order."""

    rows: dict[str, list[Span]]
    syncs: list[Span]

    @property
    def end_us(self) -> float:
        return max((s.end_us for spans in self.rows.values() for s in spans), default=0.0)


def _is_sync(event: Any) -> bool:
    return event.name in SYNC_EVENT_NAMES or any(_is_sync(c) for c in event.cpu_children)


def _top_level_op(event: Any) -> bool:
    """An operator called from Python: no parent, or only named spans above it."""
    return not getattr(event, "is_user_annotation", False) and all(
        getattr(p, "is_user_annotation", False) for p in _parents(event))


def profile_timeline(prof: Any) -> TimelineRows:
    """The rows of a finished ``torch.profiler.profile`` recording ``prof``.

    Rows: ``"spans"`` (the ``record_function`` spans that no other span contains), then
    ``"host"`` (top-level operators; ``"host, thread N"`` per thread when the backward ran on
    threads of its own), then ``"device"`` (GPU kernels, only if the recording has any).
    Times are in µs from the first event.
    """
    # In time order once, so every row below comes out in time order too.
    events = sorted(prof.events() if hasattr(prof, "events") else prof, key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start

    def span(e: Any, sync: bool = False) -> Span:
        return Span(e.name, e.time_range.start - t0, e.time_range.end - t0, sync)

    cpu = [e for e in events if str(e.device_type).endswith("CPU")]
    named = [span(e) for e in cpu if getattr(e, "is_user_annotation", False)
             and not any(getattr(p, "is_user_annotation", False) for p in _parents(e))]
    rows = {"spans": named}
    threads = sorted({e.thread for e in cpu})
    for thread in threads:
        label = "host" if len(threads) == 1 else f"host, thread {thread}"
        rows[label] = [span(e, _is_sync(e)) for e in cpu if e.thread == thread and _top_level_op(e)]
    rows["device"] = [span(e) for e in events if not str(e.device_type).endswith("CPU")]
    syncs = sorted((s for spans in rows.values() for s in spans if s.sync), key=lambda s: s.start_us)
    return TimelineRows({label: spans for label, spans in rows.items() if spans}, syncs)


def _parents(event: Any) -> Iterable[Any]:
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def plot_profile_timeline(timeline: TimelineRows, ax: Axes | None = None, title: str | None = None,
                          window_us: tuple[float, float] | None = None) -> Axes:
    """Draw a `profile_timeline`: one row of bars per row, host syncs in red with a red
    line through every row, the named spans labelled. ``window_us``, a ``(start, end)`` in µs
    from the start of the recording, limits the time axis (operators far shorter than the
    whole step are too thin to see at its scale). Returns the Axes."""
    labels = list(timeline.rows)
    ax = ax_or_new(ax, (12, 0.8 + 0.7 * len(labels)))
    window = (0.0, timeline.end_us) if window_us is None else (float(window_us[0]), float(window_us[1]))
    width_us = window[1] - window[0]
    scale, unit = (1e3, "ms") if width_us > 5e3 else (1.0, "µs")
    n = len(labels)
    for row, label in enumerate(labels):
        y = n - 1 - row
        spans = timeline.rows[label]
        if label == "spans":
            colors = [f"C{i % 10}" for i in range(len(spans))]
            for s in spans:
                visible = (max(s.start_us, window[0]), min(s.end_us, window[1]))
                if visible[1] - visible[0] < 0.06 * width_us:
                    continue  # too narrow (in this window) to hold its name
                middle = (visible[0] + visible[1]) / 2
                ax.text(middle / scale, y + 0.5, s.name, ha="center",
                        va="center", fontsize=8, clip_on=True)
        elif label == "device":
            colors = ["tab:blue"] * len(spans)
        else:
            colors = ["tab:red" if s.sync else "0.55" for s in spans]
        ax.broken_barh([(s.start_us / scale, max(s.end_us - s.start_us, 0.0) / scale)
                        for s in spans], (y + 0.1, 0.8), facecolors=colors, edgecolor="white",
                       linewidth=0.3)
    in_window = [s for s in timeline.syncs if window[0] <= s.start_us <= window[1]]
    for s in in_window:
        ax.axvline(s.start_us / scale, color="tab:red", lw=1.0, alpha=0.7, zorder=3)
    ax.plot([s.start_us / scale for s in in_window], [n] * len(in_window), "v",
            color="tab:red", ms=7, clip_on=False, zorder=4)
    ax.set_yticks([n - 1 - i + 0.5 for i in range(n)], labels)
    ax.set_ylim(0, n)
    ax.set_xlim(window[0] / scale, (window[0] + width_us * 1.01) / scale)
    ax.set_xlabel(f"time ({unit}) from the start of the recording; red: host syncs "
                  f"({len(in_window)}), grey: other operators")
    if title is not None:
        ax.set_title(title, fontsize=10, loc="left", pad=12)  # room for the sync markers
    return ax
