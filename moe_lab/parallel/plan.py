"""1F1B merging as data: the stages of a merged unit, the four plans, a model machine to run them.

Chunk pipelining (`chunked_plan`) hides one chunk's all-to-all behind another chunk's experts
inside one micro-batch's layer. A collective started with ``async_op=True`` returns a *work
handle* at once; ``work.wait()`` blocks only when its result is needed (on CUDA, NCCL runs
collectives on its own streams, so the same handles overlap kernels). Cut the step's tokens into
``n`` chunks and, while chunk ``c``'s experts compute, let chunk ``c+1``'s dispatch and chunk
``c``'s combine travel::

    forward   route+permute all chunks · one count exchange · dispatch(0) in flight while the
              shared expert runs · for each chunk: wait dispatch(c), start dispatch(c+1),
              experts(c), start combine(c) · then unpermute each chunk as its combine lands
    backward  unpermute⁻¹ all chunks · combine⁻¹(0) in flight while the shared expert's
              backward runs · for each chunk: wait combine⁻¹(c), start combine⁻¹(c+1),
              expert dgrad(c), start dispatch⁻¹(c), [expert wgrad(c)] · then, for each chunk,
              [expert wgrad(c)] and permute⁻¹(c) as its dispatch⁻¹ lands

``delay_wgrad=True`` postpones the experts' weight gradients, which nothing waits for, to fill
the last dispatch⁻¹. What is hidden is measured against a compute-only run of the same stages
with the collectives replaced by the tensors they delivered last time
(``MergedStep.run(..., replay=True)``): exposed communication = step time − compute-only time.

Chunk pipelining cannot hide the edges: the first dispatch
has only the shared expert under it, the last dispatch⁻¹ only the delayed weight gradients. In
the steady state of a 1F1B pipeline (notebook 10) every stage alternates the forward of
micro-batch ``i+1`` with the backward of micro-batch ``i``: two *independent* streams of work,
each with four all-to-alls per MoE layer. Megatron-Core (``--overlap-moe-expert-parallel-comm
--delay-wgrad-compute``) and DeepSeek's DualPipe merge them layer by layer, so that each one's
all-to-all travels while the other computes.

A merged unit is a set of named stages (`stage_graph`; ``F`` is the micro-batch going forward,
``B`` the one going backward), per chunk ``c``::

    F.route[c] → F.counts (one blocking count exchange for all chunks) → F.dispatch[c] (comm)
        → F.experts[c] → F.combine[c] (comm) → F.unpermute[c];   F.shared[c] after F.route[c]
    B.unpermute⁻¹[c] → B.combine⁻¹[c] (comm) → B.dgrad[c] → B.dispatch⁻¹[c] (comm)
        → B.permute⁻¹[c];   B.shared⁻¹[c] after B.unpermute⁻¹[c];   B.wgrad[c] after B.dgrad[c]

Stages that add into the same gradients (``wgrad``, ``shared⁻¹``, ``permute⁻¹``) keep chunk
order, so every plan sums the same numbers in the same order and gives *bitwise* the same
result. A plan is an order of the stages (`check_plan`); the four of `plan`:

- ``sequential``: the backward of ``B``, then the forward of ``F``, every collective waited
  for as soon as it starts;
- ``chunked``: the same two halves one after the other, each chunk-pipelined (`chunked_plan`,
  with delayed weight gradients);
- ``1f1b``: the two micro-batches merged: ``F``'s dispatch and ``B``'s combine⁻¹ travel under
  the two shared experts, ``B``'s combine⁻¹ under ``F``'s experts, ``F``'s combine under ``B``'s
  dgrad, ``B``'s dispatch⁻¹ under ``B``'s weight gradients;
- ``1f1b+chunked``: merged, and each half chunked as well.

`simulate_plan` runs a plan on a model machine (one processor, one link) and says where the
processor waits; `moe_lab.parallel.merged.MergedStep` runs it on real ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from moe_lab.checks import one_of, positive_int
from moe_lab.parallel.timeline import Event, Timeline

SCHEDULES = ("sequential", "chunked", "1f1b", "1f1b+chunked")
COMM_STAGES = ("counts", "dispatch", "combine", "combine⁻¹", "dispatch⁻¹")
# the names stages carry on a timeline, where not their kind (``DISPLAY_NAMES.get(kind, kind)``)
DISPLAY_NAMES = {"route": "route+permute", "shared": "shared expert", "shared⁻¹": "shared expert⁻¹",
                 "dgrad": "experts dgrad", "wgrad": "experts wgrad", "permute⁻¹": "route+permute⁻¹"}


class PlanError(ValueError):
    """A plan that is not an order of its stages respecting their dependencies."""


# --------------------------------------------------------------------------------------
# The stages as data: what the plans, the checks and the exercise reason about
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One stage of one chunk of one micro-batch: ``name`` like ``"F.dispatch[0]"``;
    ``lane`` ``"compute"`` or ``"comm"``; ``deps``: the stages whose results it uses (or
    whose gradient sums it must follow)."""

    name: str
    phase: str  # "fwd" (of ``F``, the micro-batch going forward) or "bwd" (of ``B``)
    kind: str  # "dispatch", "experts", ...
    chunk: int
    lane: str
    deps: tuple[str, ...] = ()


def stage_name(mb: str, kind: str, c: int | None = None) -> str:
    """``"F.dispatch[0]"``: micro-batch, kind and chunk (none for the one count exchange)."""
    return f"{mb}.{kind}" if c is None else f"{mb}.{kind}[{c}]"


_n = stage_name  # the plans below spell many names


# Per stage kind, in the order the plain schedule runs a chunk: the stages of the same chunk it
# needs (``route`` needs nothing; ``counts``, one stage for all chunks, needs every ``route``).
_FORWARD = {"dispatch": ("counts",), "shared": ("route",), "experts": ("dispatch",), "combine": ("experts",),
            "unpermute": ("combine", "shared")}
_BACKWARD = {"unpermute⁻¹": (), "combine⁻¹": ("unpermute⁻¹",), "shared⁻¹": ("unpermute⁻¹",),
             "dgrad": ("combine⁻¹",), "dispatch⁻¹": ("dgrad",), "wgrad": ("dgrad",),
             "permute⁻¹": ("dispatch⁻¹", "unpermute⁻¹")}
# The shared expert and the gradient sums keep chunk order: each follows the previous chunk's.
_CHUNK_ORDERED = ("shared", "shared⁻¹", "wgrad", "permute⁻¹")


def stage_graph(n_chunks: int = 1, forward: bool = True, backward: bool = True) -> dict[str, Stage]:
    """The stages of one merged unit (``F``'s forward and/or ``B``'s backward of one MoE
    layer, ``n_chunks`` chunks each), by name, with their dependencies, in the order of the
    plain schedule (each half chunk after chunk)."""
    chunks = range(positive_int(n_chunks, "n_chunks"))
    keys = []  # (micro-batch, kind, chunk)
    if forward:
        keys += [("F", "route", c) for c in chunks] + [("F", "counts", None)]
        keys += [("F", kind, c) for c in chunks for kind in _FORWARD]
    if backward:
        keys += [("B", kind, c) for c in chunks for kind in _BACKWARD]
    stages = {}
    for mb, kind, c in keys:
        if c is None:
            deps = [_n(mb, "route", i) for i in chunks]
        else:
            needs = {**_FORWARD, **_BACKWARD}.get(kind, ())
            deps = [_n(mb, need, None if need == "counts" else c) for need in needs]
            deps += [_n(mb, kind, c - 1)] if c and kind in _CHUNK_ORDERED else []
        lane = "comm" if kind in COMM_STAGES else "compute"
        phase, name = "fwd" if mb == "F" else "bwd", _n(mb, kind, c)
        stages[name] = Stage(name, phase, kind, -1 if c is None else c, lane, tuple(deps))
    return stages


def chunked_plan(n_chunks: int, forward: bool = True, backward: bool = True,
                 delay_wgrad: bool = True) -> list[str]:
    """The chunk-pipelined order of one micro-batch's forward, then its backward: the next
    chunk's dispatch (and combine⁻¹) in flight while a chunk computes, the shared expert under
    the first; ``delay_wgrad`` moves the weight gradients to the end, under the last
    dispatch⁻¹."""
    n = n_chunks
    order = []
    if forward:
        order += [_n("F", "route", c) for c in range(n)] + [_n("F", "counts"), _n("F", "dispatch", 0)]
        order += [_n("F", "shared", c) for c in range(n)]
        for c in range(n):
            order += [_n("F", "dispatch", c + 1)] if c + 1 < n else []
            order += [_n("F", "experts", c), _n("F", "combine", c)]
        order += [_n("F", "unpermute", c) for c in range(n)]
    if backward:
        order += [_n("B", "unpermute⁻¹", c) for c in range(n)] + [_n("B", "combine⁻¹", 0)]
        order += [_n("B", "shared⁻¹", c) for c in range(n)]
        wgrad = [[] if delay_wgrad else [_n("B", "wgrad", c)] for c in range(n)]
        for c in range(n):
            order += [_n("B", "combine⁻¹", c + 1)] if c + 1 < n else []
            order += [_n("B", "dgrad", c), _n("B", "dispatch⁻¹", c)] + wgrad[c]
        for c in range(n):
            order += [_n("B", "wgrad", c)] if delay_wgrad else []
            order.append(_n("B", "permute⁻¹", c))
    return order


def _merged(n: int) -> list[str]:
    """F's forward and B's backward interleaved so that each one's all-to-all travels while
    the other computes: per chunk, F's experts cover B's combine⁻¹, B's dgrad covers F's
    combine, the next chunk's shared experts and the previous chunk's weight gradients cover
    the next dispatches."""
    order = [_n("F", "route", c) for c in range(n)]
    order.append(_n("F", "counts"))  # blocking: issued while nothing else is on the link
    order += [_n("B", "unpermute⁻¹", c) for c in range(n)]
    # Under the first two collectives: the first chunk's shared experts of both micro-batches.
    order += [_n("F", "dispatch", 0), _n("B", "combine⁻¹", 0), _n("F", "shared", 0), _n("B", "shared⁻¹", 0)]
    for c in range(n):
        more = c + 1 < n  # a next chunk
        order += [_n("F", "dispatch", c + 1)] if more else []
        order += [_n("F", "experts", c), _n("F", "combine", c)]
        order += [_n("B", "combine⁻¹", c + 1), _n("F", "shared", c + 1)] if more else []
        order += [_n("B", "dgrad", c), _n("B", "dispatch⁻¹", c)]
        order += [_n("B", "shared⁻¹", c + 1)] if more else []
        # delayed by one chunk: fills the gap while the next collectives travel
        order += [_n("B", "wgrad", c - 1)] if c else []
    order.append(_n("B", "wgrad", n - 1))  # under the last dispatch⁻¹
    order += [_n("F", "unpermute", c) for c in range(n)]
    return order + [_n("B", "permute⁻¹", c) for c in range(n)]


def plan(schedule: str, n_chunks: int = 1, forward: bool = True, backward: bool = True) -> list[str]:
    """The order of the stages of `stage_graph(n_chunks, forward, backward)` under
    ``schedule`` (one of `SCHEDULES`). ``"sequential"`` and ``"1f1b"`` are meant for one
    chunk, the other two for several; any chunk count works with any plan. With only one
    half (the warm-up forward or the cool-down backward), the 1F1B plans fall back to the
    chunked order of that half: there is no other micro-batch to merge with."""
    one_of(schedule, "schedule", SCHEDULES)
    n = positive_int(n_chunks, "n_chunks")
    if schedule == "sequential":
        return list(stage_graph(n, False, backward)) + list(stage_graph(n, forward, False))
    if schedule == "chunked" or not (forward and backward):
        return chunked_plan(n, False, backward) + chunked_plan(n, forward, False)
    return _merged(n)


def check_plan(order: Iterable[str], stages: dict[str, Stage]) -> None:
    """Raises `PlanError` unless ``order`` runs every stage exactly once, each after its
    dependencies."""
    if isinstance(order, str) or not hasattr(order, "__iter__"):
        raise PlanError(f"order must be a list of stage names, got {order!r}")
    order = list(order)
    unknown = [s for s in order if s not in stages]
    if unknown:
        raise PlanError(f"order names stages that do not exist: {unknown[:5]} (stages: {list(stages)})")
    seen: set[str] = set()
    for name in order:
        if name in seen:
            raise PlanError(f"stage {name!r} appears twice in the order")
        missing = [d for d in stages[name].deps if d not in seen]
        if missing:
            raise PlanError(f"stage {name!r} runs before {missing}, which it needs")
        seen.add(name)
    left = [s for s in stages if s not in seen]
    if left:
        raise PlanError(f"order leaves out stages {left}")


# Illustrative costs for reasoning about a plan without a clock: the compute stages in units
# of one chunk's expert forward, the all-to-alls at "communication as long as the experts'
# compute" (the case 1F1B merging is meant for). The count exchange is a few bytes.
MODEL_COSTS = {"route": 0.25, "shared": 0.5, "experts": 1.0, "unpermute": 0.25,
               "unpermute⁻¹": 0.25, "shared⁻¹": 1.0, "dgrad": 1.0, "wgrad": 1.0, "permute⁻¹": 0.25,
               "counts": 0.0, "dispatch": 1.0, "combine": 1.0, "combine⁻¹": 1.0, "dispatch⁻¹": 1.0}


def simulate_plan(order: Iterable[str], stages: dict[str, Stage],
                  label: str = "model") -> tuple[list[dict], Timeline]:
    """Execute ``order`` on a model machine and return its event log and `Timeline`.

    The model: one processor runs the compute stages in order; one link carries the
    collectives one after another, in the order they were started (a collective starts
    when it is issued or when the link frees up, whichever is later); a compute stage
    that needs a collective's result *waits* until that collective has finished.
    Stage costs: `MODEL_COSTS` (seconds per stage kind), divided by the chunk count.
    The log lists, in order, ``{"op": "run" | "start" | "wait", "stage", "t", "end"}``;
    a ``wait`` entry has ``"finish"`` (when its collective ends) and ``"idle"`` (how long
    the processor stood still for it).
    """
    check_plan(order, stages)
    n_chunks = max(1, max(s.chunk for s in stages.values()) + 1)
    now = link_free = 0.0
    finish: dict[str, float] = {}  # the collectives started and not yet waited for
    log: list[dict] = []
    events: list[Event] = []
    for name in order:
        s = stages[name]
        shown = DISPLAY_NAMES.get(s.kind, s.kind)
        cost = MODEL_COSTS[s.kind] / (1 if s.kind == "counts" else n_chunks)
        if s.lane == "comm":
            start = max(now, link_free)
            link_free = finish[name] = start + cost
            log.append({"op": "start", "stage": name, "t": now, "end": finish[name]})
            events.append(Event(s.chunk, "comm", shown, s.phase, start, finish[name]))
            waits = [name] if s.kind == "counts" else []  # blocking: its sizes go to the host at once
        else:
            waits = s.deps  # a compute stage waits for the collectives it needs
        for dep in waits:
            if dep in finish:
                idle = max(0.0, finish[dep] - now)
                log.append({"op": "wait", "stage": dep, "t": now, "end": now + idle,
                            "finish": finish.pop(dep), "idle": idle})
                now += idle
        if s.lane == "compute":
            log.append({"op": "run", "stage": name, "t": now, "end": now + cost})
            events.append(Event(s.chunk, "compute", shown, s.phase, now, now + cost))
            now += cost
    return log, Timeline(0, label, max(now, link_free), events)
