"""What a scheduled step did, and when: per-chunk events on a compute and a communication lane.

`moe_lab.parallel.overlap.ChunkedStep` records one `Event` per stage of every chunk — its lane
(``"compute"`` or ``"comm"``), its name, its start and end in seconds from the start of the
step, and for communication the bytes sent to other ranks — and returns them as one rank's
`Timeline` of the step. A timeline says how long each lane was busy (overlapping events
count once) and how long the step waited outside compute; `plot_timeline` draws several
timelines as a Gantt chart on one time scale. Plain data: no torch needed to read or draw one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Event", "Timeline", "plot_timeline"]


@dataclass
class Event:
    """One stage of one chunk: ``lane`` ``"compute"`` or ``"comm"``; times in seconds from the
    start of the step; ``nbytes``: bytes this rank sent to other ranks (comm only)."""

    chunk: int
    lane: str
    name: str
    phase: str
    start: float
    end: float
    nbytes: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """The events of one step on one rank, and the step's wall time."""

    rank: int
    label: str
    step_s: float
    events: list[Event] = field(default_factory=list)

    def lane_time(self, lane: str) -> float:
        """Time during which ``lane`` was busy (the union of its events)."""
        spans = sorted((e.start, e.end) for e in self.events if e.lane == lane)
        total, cur_start, cur_end = 0.0, None, None
        for s, e in spans:
            if cur_end is None or s > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        if cur_end is not None:
            total += cur_end - cur_start
        return total

    @property
    def wait_s(self) -> float:
        """Time the step spent outside compute: waiting for the network (or for a peer)."""
        return self.step_s - self.lane_time("compute")

    def comm_bytes(self) -> int:
        return sum(e.nbytes for e in self.events if e.lane == "comm")

    def to_dict(self) -> dict:
        return {"rank": self.rank, "label": self.label, "step_s": self.step_s,
                "events": [asdict(e) for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict) -> Timeline:
        return cls(d["rank"], d["label"], d["step_s"], [Event(**e) for e in d["events"]])

_COLORS = {
    "route+permute": "#9ecae1", "shared expert": "#c7e9c0", "experts": "#3182bd",
    "unpermute": "#6baed6", "unpermute⁻¹": "#6baed6", "shared expert⁻¹": "#a1d99b",
    "experts dgrad": "#e6550d", "experts wgrad": "#fdae6b", "route+permute⁻¹": "#9ecae1",
    "dispatch": "#756bb1", "combine": "#bcbddc", "dispatch⁻¹": "#756bb1", "combine⁻¹": "#bcbddc",
    "counts": "#636363",
}


def plot_timeline(timelines: dict[str, Timeline | dict], ax=None, title: str | None = None,
                  unit: str = "ms"):
    """A Gantt chart: for each labelled step, a compute lane and a communication lane; each
    bar is one stage of one chunk (numbered), backward stages hatched (in a 1F1B-merged
    step: the other micro-batch). Events drawn to the same time scale."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    k = 1e3 if unit == "ms" else 1.0

    items = [(label, t if isinstance(t, Timeline) else Timeline.from_dict(t))
             for label, t in timelines.items()]
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.1 + 0.9 * len(items)))
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
    ax.legend(handles=[Patch(color=c, label=n) for n, c in used.items()], fontsize=7, ncol=4,
              loc="upper center", bbox_to_anchor=(0.5, -0.25))
    if title:
        ax.set_title(title)
    return ax
