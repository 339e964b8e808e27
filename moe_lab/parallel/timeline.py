"""What a scheduled step did, and when: per-chunk events on a compute and a communication lane.

A scheduled step (`moe_lab.parallel.merged`, the model machine of
`moe_lab.parallel.plan.simulate_plan`) records one `Event` per stage of every chunk and returns
them as one rank's `Timeline`. A timeline says how long each lane was busy (overlapping events
count once) and how long the step waited outside compute. Plain data: no torch needed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
        total, covered = 0.0, float("-inf")
        for s, e in sorted((e.start, e.end) for e in self.events if e.lane == lane):
            total += max(0.0, e - max(s, covered))  # the part not yet covered
            covered = max(covered, e)
        return total

    @property
    def wait_s(self) -> float:
        """Time the step spent outside compute: waiting for the network (or for a peer)."""
        return self.step_s - self.lane_time("compute")

    def comm_bytes(self) -> int:
        """Bytes this rank sent to other ranks during the step."""
        return sum(e.nbytes for e in self.events if e.lane == "comm")

    def to_dict(self) -> dict:
        return asdict(self)  # the events as dicts too

    @classmethod
    def from_dict(cls, d: dict) -> Timeline:
        return cls(d["rank"], d["label"], d["step_s"], [Event(**e) for e in d["events"]])
