"""1F1B merging: one micro-batch's forward hides another micro-batch's backward communication.

Chunk pipelining (`moe_lab.parallel.overlap`) hides one chunk's all-to-all behind another
chunk's experts *inside one micro-batch's layer*. It cannot hide the edges: the first
dispatch has nothing to compute under it but the shared expert, and the last dispatch⁻¹
only the delayed weight gradients. A pipeline-parallel job has something better at hand.
In the steady state of a 1F1B schedule (notebook 08) every stage alternates the forward of
micro-batch ``i+1`` with the backward of micro-batch ``i``: two *independent* streams of
work, each with four all-to-alls per MoE layer and plenty of compute between them.
Megatron-Core (``--overlap-moe-expert-parallel-comm --delay-wgrad-compute``) and DeepSeek's
DualPipe merge them layer by layer, so that each one's all-to-all travels while the other
computes.

`MergedStep` runs one MoE layer's part of such a merged step as an explicit *plan*: a list of
named stages of the two micro-batches, executed in order. A compute stage runs at once; a
communication stage starts an all-to-all (``async_op=True``) and returns; the first compute
stage that needs its result waits on the work handle. The stages, per chunk ``c`` of a
micro-batch (`stage_graph`; ``F`` is the micro-batch going forward, ``B`` the one going
backward)::

    F.route[c] → F.counts (one blocking count exchange for all chunks) → F.dispatch[c] (comm)
        → F.experts[c] → F.combine[c] (comm) → F.unpermute[c];   F.shared[c] after F.route[c]
    B.unpermute⁻¹[c] → B.combine⁻¹[c] (comm) → B.dgrad[c] → B.dispatch⁻¹[c] (comm)
        → B.permute⁻¹[c];   B.shared⁻¹[c] after B.unpermute⁻¹[c];   B.wgrad[c] after B.dgrad[c]

Stages that add into the same gradients (``wgrad``, ``shared⁻¹``, ``permute⁻¹``) keep chunk
order, so every plan sums the same numbers in the same order: the merged step's outputs and
gradients are *bitwise* those of the plain schedule with the same chunks (the tests check it,
and against autograd through `EPMoELayer` to float32 rounding).

Four plans (`plan`), all over the same stages:

- ``sequential``: the backward of ``B``, then the forward of ``F``, every collective waited
  for as soon as it starts (one chunk);
- ``chunked``: the same two halves one after the other, each chunk-pipelined (what
  `ChunkedStep` does, with delayed weight gradients);
- ``1f1b``: the two micro-batches merged, one chunk: ``F``'s dispatch and ``B``'s combine⁻¹
  travel under the two shared experts, ``B``'s combine⁻¹ under ``F``'s experts, ``F``'s
  combine under ``B``'s dgrad, ``B``'s dispatch⁻¹ under ``B``'s weight gradients;
- ``1f1b+chunked``: merged, and each half chunked as well.

**Streams.** On the CPU, gloo runs each collective on its own worker threads, so the work
handle is the whole story. On CUDA, `MergedStep` issues every collective from one
high-priority side stream (after that stream has waited for the data it sends) and makes
the compute stream wait for it only at the consuming stage; NCCL's own streams are made high
priority by `moe_lab.workbench.ranks.launch.init_from_env`. *That path is written but has not been run
on a GPU here (no GPU); treat it as untested.*

**Measuring.** `measure_schedules` times the unit of the steady state — ``F``'s forward and
``B``'s backward — under each plan, interleaved, the forward of ``B`` done untimed
beforehand (it belongs to the previous unit). Exposed communication is measured as in
`moe_lab.parallel.overlap`: the time the ranks spent outside compute in the step, and the step
minus a compute-only replay with the same chunks. They disagree where the transfers' own
processor work (gloo's copies, the kernel's TCP) slows the compute it overlaps: the first
does not see that cost, the second does. `two_microbatch_step` runs the whole
two-micro-batch step (warm-up forward, merged unit, cool-down backward), which the tests
compare with the plain schedule.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_lab.config import MoEConfig
from moe_lab.moe.layer import MoELayer
from moe_lab.parallel.ep import EPMoELayer, _all_to_all, exchange_counts, from_layer
from moe_lab.parallel.overlap import ChunkedStep, _Chunk, _Clock, summarise_runs
from moe_lab.parallel.timeline import Event, Timeline

Tensor = torch.Tensor

__all__ = [
    "Stage", "stage_graph", "plan", "check_plan", "simulate_plan", "MODEL_COSTS", "SCHEDULES",
    "MergedStep", "MicroBatch", "two_microbatch_step", "measure_schedules", "merged_rank_main",
    "merged_check_rank", "merged_fault_rank", "PlanError",
]

SCHEDULES = ("sequential", "chunked", "1f1b", "1f1b+chunked")
COMM_STAGES = ("counts", "dispatch", "combine", "combine⁻¹", "dispatch⁻¹")
# display names on the timeline (the colours of `moe_lab.parallel.timeline.plot_timeline`)
_DISPLAY = {"route": "route+permute", "shared": "shared expert", "experts": "experts",
            "unpermute": "unpermute", "unpermute⁻¹": "unpermute⁻¹", "shared⁻¹": "shared expert⁻¹",
            "dgrad": "experts dgrad", "wgrad": "experts wgrad", "permute⁻¹": "route+permute⁻¹",
            "counts": "counts", "dispatch": "dispatch", "combine": "combine",
            "combine⁻¹": "combine⁻¹", "dispatch⁻¹": "dispatch⁻¹"}


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
    mb: str  # "F" (going forward) or "B" (going backward)
    kind: str  # "dispatch", "experts", ...
    chunk: int
    lane: str
    deps: tuple[str, ...] = ()

    @property
    def phase(self) -> str:
        return "fwd" if self.mb == "F" else "bwd"


def _n(mb: str, kind: str, c: int | None = None) -> str:
    return f"{mb}.{kind}" if c is None else f"{mb}.{kind}[{c}]"


def stage_graph(n_chunks: int = 1, forward: bool = True, backward: bool = True) -> dict[str, Stage]:
    """The stages of one merged unit (``F``'s forward and/or ``B``'s backward of one MoE
    layer, ``n_chunks`` chunks each), by name, with their dependencies."""
    if not isinstance(n_chunks, int) or isinstance(n_chunks, bool) or n_chunks < 1:
        raise ValueError(f"n_chunks must be a positive integer, got {n_chunks!r}")
    if not (forward or backward):
        raise ValueError("stage_graph needs forward=True or backward=True (or both)")
    stages: list[Stage] = []

    def add(mb, kind, c, deps):
        lane = "comm" if kind in COMM_STAGES else "compute"
        stages.append(Stage(_n(mb, kind, c), mb, kind, -1 if c is None else c, lane, tuple(deps)))

    chunks = range(n_chunks)
    if forward:
        for c in chunks:
            add("F", "route", c, [])
        add("F", "counts", None, [_n("F", "route", c) for c in chunks])
        for c in chunks:
            add("F", "dispatch", c, [_n("F", "counts")])
            add("F", "shared", c, [_n("F", "route", c)] + ([_n("F", "shared", c - 1)] if c else []))
            add("F", "experts", c, [_n("F", "dispatch", c)])
            add("F", "combine", c, [_n("F", "experts", c)])
            add("F", "unpermute", c, [_n("F", "combine", c), _n("F", "shared", c)])
    if backward:
        for c in chunks:
            prev = (lambda kind, c=c: [_n("B", kind, c - 1)] if c else [])  # noqa: E731
            add("B", "unpermute⁻¹", c, [])
            add("B", "combine⁻¹", c, [_n("B", "unpermute⁻¹", c)])
            add("B", "shared⁻¹", c, [_n("B", "unpermute⁻¹", c)] + prev("shared⁻¹"))
            add("B", "dgrad", c, [_n("B", "combine⁻¹", c)])
            add("B", "dispatch⁻¹", c, [_n("B", "dgrad", c)])
            add("B", "wgrad", c, [_n("B", "dgrad", c)] + prev("wgrad"))
            add("B", "permute⁻¹", c, [_n("B", "dispatch⁻¹", c), _n("B", "unpermute⁻¹", c)]
                + prev("permute⁻¹"))
    return {s.name: s for s in stages}


def _fwd_natural(n: int) -> list[str]:
    order = [_n("F", "route", c) for c in range(n)] + [_n("F", "counts")]
    for c in range(n):
        order += [_n("F", k, c) for k in ("dispatch", "shared", "experts", "combine", "unpermute")]
    return order


def _bwd_natural(n: int) -> list[str]:
    return [_n("B", k, c) for c in range(n) for k in
            ("unpermute⁻¹", "combine⁻¹", "shared⁻¹", "dgrad", "dispatch⁻¹", "wgrad", "permute⁻¹")]


def _fwd_chunked(n: int) -> list[str]:
    order = [_n("F", "route", c) for c in range(n)] + [_n("F", "counts"), _n("F", "dispatch", 0)]
    order += [_n("F", "shared", c) for c in range(n)]
    for c in range(n):
        if c + 1 < n:
            order.append(_n("F", "dispatch", c + 1))
        order += [_n("F", "experts", c), _n("F", "combine", c)]
    return order + [_n("F", "unpermute", c) for c in range(n)]


def _bwd_chunked(n: int) -> list[str]:
    order = [_n("B", "unpermute⁻¹", c) for c in range(n)] + [_n("B", "combine⁻¹", 0)]
    order += [_n("B", "shared⁻¹", c) for c in range(n)]
    for c in range(n):
        if c + 1 < n:
            order.append(_n("B", "combine⁻¹", c + 1))
        order += [_n("B", "dgrad", c), _n("B", "dispatch⁻¹", c)]
    for c in range(n):  # delayed weight gradients fill the last dispatch⁻¹
        order += [_n("B", "wgrad", c), _n("B", "permute⁻¹", c)]
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
        if c + 1 < n:
            order.append(_n("F", "dispatch", c + 1))
        order += [_n("F", "experts", c), _n("F", "combine", c)]
        if c + 1 < n:
            order += [_n("B", "combine⁻¹", c + 1), _n("F", "shared", c + 1)]
        order += [_n("B", "dgrad", c), _n("B", "dispatch⁻¹", c)]
        if c + 1 < n:
            order.append(_n("B", "shared⁻¹", c + 1))
        if c:  # delayed by one chunk: fills the gap while the next collectives travel
            order.append(_n("B", "wgrad", c - 1))
    order.append(_n("B", "wgrad", n - 1))  # under the last dispatch⁻¹
    order += [_n("F", "unpermute", c) for c in range(n)]
    return order + [_n("B", "permute⁻¹", c) for c in range(n)]


def plan(schedule: str, n_chunks: int = 1, forward: bool = True, backward: bool = True) -> list[str]:
    """The order of the stages of `stage_graph(n_chunks, forward, backward)` under
    ``schedule`` (one of `SCHEDULES`). ``"sequential"`` and ``"1f1b"`` are meant for one
    chunk, the other two for several; any chunk count works with any plan. With only one
    half (the warm-up forward or the cool-down backward), the 1F1B plans fall back to the
    chunked order of that half: there is no other micro-batch to merge with."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    stage_graph(n_chunks, forward, backward)  # checks the arguments
    n = n_chunks
    if schedule == "sequential":
        return (_bwd_natural(n) if backward else []) + (_fwd_natural(n) if forward else [])
    if schedule == "chunked" or not (forward and backward):
        return (_bwd_chunked(n) if backward else []) + (_fwd_chunked(n) if forward else [])
    return _merged(n)


def check_plan(order, stages: dict[str, Stage]) -> None:
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


def simulate_plan(order, stages: dict[str, Stage], costs: dict[str, float] | None = None,
                  label: str = "model") -> tuple[list[dict], Timeline]:
    """Execute ``order`` on a model machine and return its event log and `Timeline`.

    The model: one processor runs the compute stages in order; one link carries the
    collectives one after another, in the order they were started (a collective starts
    when it is issued or when the link frees up, whichever is later); a compute stage
    that needs a collective's result *waits* until that collective has finished.
    ``costs`` (default `MODEL_COSTS`): seconds per stage kind, divided by the chunk count.
    The log lists, in order, ``{"op": "run" | "start" | "wait", "stage", "t", "end"}``;
    a ``wait`` entry has ``"finish"`` (when its collective ends) and ``"idle"`` (how long
    the processor stood still for it).
    """
    check_plan(order, stages)
    costs = dict(MODEL_COSTS, **(costs or {}))
    n_chunks = max(1, max(s.chunk for s in stages.values()) + 1)
    now = link_free = 0.0
    finish: dict[str, float] = {}
    log: list[dict] = []
    events: list[Event] = []
    waited: set[str] = set()
    for name in order:
        s = stages[name]
        cost = costs[s.kind] / (1 if s.kind == "counts" else n_chunks)
        if s.lane == "comm":
            start = max(now, link_free)
            link_free = finish[name] = start + cost
            log.append({"op": "start", "stage": name, "t": now, "end": finish[name]})
            events.append(Event(s.chunk, "comm", _DISPLAY[s.kind], s.phase, start, finish[name]))
            if s.kind == "counts":  # blocking: its sizes go to the host at once
                log.append({"op": "wait", "stage": name, "t": now, "end": finish[name],
                            "finish": finish[name], "idle": finish[name] - now})
                now = finish[name]
                waited.add(name)
            continue
        for dep in s.deps:
            if stages[dep].lane == "comm" and dep not in waited:
                idle = max(0.0, finish[dep] - now)
                log.append({"op": "wait", "stage": dep, "t": now, "end": now + idle,
                            "finish": finish[dep], "idle": idle})
                now += idle
                waited.add(dep)
        log.append({"op": "run", "stage": name, "t": now, "end": now + cost})
        events.append(Event(s.chunk, "compute", _DISPLAY[s.kind], s.phase, now, now + cost))
        now += cost
    return log, Timeline(0, label, max(now, link_free), events)


# --------------------------------------------------------------------------------------
# Executing a plan on real ranks
# --------------------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """One micro-batch's tokens ``x: [tokens, d_model]`` and output gradient (may be set
    after its forward, before its backward), and the state its forward leaves for its
    backward. ``key`` names it in the replay cache."""

    x: Tensor
    grad_out: Tensor | None
    key: str
    owner: MergedStep | None = None  # the step (hence the layer) whose stages it runs
    chunks: list[_Chunk] = field(default_factory=list)
    forward_done: bool = False
    backward_done: bool = False

    @property
    def y(self) -> Tensor:
        return torch.cat([c.out.detach() for c in self.chunks])

    @property
    def dx(self) -> Tensor:
        return torch.cat([c.x.grad for c in self.chunks])


class _Handle:
    """A started collective: its output, its work handle, its timeline event."""

    def __init__(self, out: Tensor, work, event: dict | None, stream=None) -> None:
        self.out, self.work, self.event, self.stream = out, work, event, stream


class MergedStep:
    """Runs plans of `stage_graph` stages for one `EPMoELayer` (``dropless``), ``n_chunks``
    chunks per micro-batch. The stage arithmetic is `ChunkedStep`'s (the experts' forward,
    dgrad and wgrad written out); `run` executes a plan over a forward and/or a backward
    micro-batch. Every rank of the layer's group must run the same plans in the same order.
    """

    def __init__(self, layer: EPMoELayer, n_chunks: int) -> None:
        self.ops = ChunkedStep(layer, n_chunks)  # checks layer and n_chunks
        self.layer, self.n_chunks = layer, n_chunks
        self.cache: dict = {}
        self.keep_for_replay = True  # keep what the collectives delivered (for replay=True)
        self.comm_stream = None
        w = layer.experts.w_gate_up
        if w.is_cuda:  # UNTESTED: no GPU has run this path
            self.comm_stream = torch.cuda.Stream(device=w.device, priority=-1)

    def microbatch(self, x: Tensor, grad_out: Tensor | None, key: str) -> MicroBatch:
        """A micro-batch of this step's layer; ``grad_out`` may be None until its backward."""
        d = self.layer.cfg.d_model
        if x.dim() != 2 or x.shape[1] != d or (grad_out is not None and grad_out.shape != x.shape):
            raise ValueError(f"x and grad_out must be [tokens, d_model={d}], got {tuple(x.shape)} "
                             f"and {tuple(grad_out.shape)}")
        if x.shape[0] < self.n_chunks:
            raise ValueError(f"x has {x.shape[0]} tokens, fewer than n_chunks={self.n_chunks}")
        return MicroBatch(x, grad_out, key, owner=self)

    # ----------------------------------------------------------------- collectives
    def _start(self, key: tuple, x: Tensor, out_splits, in_splits, event: dict | None,
               replay: bool, wait_now: bool, clock: _Clock) -> _Handle:
        if replay:
            return _Handle(self.cache[key], None, None)
        layer = self.layer
        if self.comm_stream is not None:  # UNTESTED on a GPU: comm on a high-priority side stream
            self.comm_stream.wait_stream(torch.cuda.current_stream())
            x.record_stream(self.comm_stream)  # not reused while the side stream still reads it
            with torch.cuda.stream(self.comm_stream):
                out, work = _all_to_all(x, out_splits, in_splits, layer.group, async_op=True)
            handle = _Handle(out, work, event, self.comm_stream)
        else:
            out, work = _all_to_all(x, out_splits, in_splits, layer.group, async_op=True)
            handle = _Handle(out, work, event)
            if work is not None and event is not None:
                def done(_future, event=event) -> None:  # gloo's thread: the transfer's real end
                    if event.get("end") is None:
                        event["end"] = time.perf_counter()

                work.get_future().add_done_callback(done)
        if self.keep_for_replay:
            self.cache[key] = out
        if wait_now:
            self._wait(handle, clock)
        return handle

    def _wait(self, handle: _Handle, clock: _Clock) -> Tensor:
        if handle.work is not None:
            handle.work.wait()
            if handle.stream is not None:  # UNTESTED on a GPU
                torch.cuda.current_stream().wait_stream(handle.stream)
                handle.out.record_stream(torch.cuda.current_stream())
            handle.work = None
        if handle.event is not None and handle.event.get("end") is None:
            handle.event["end"] = clock.now()
        return handle.out

    # ----------------------------------------------------------------- running a plan
    def run(self, order: list[str], fwd: MicroBatch | None = None, bwd: MicroBatch | None = None,
            replay: bool = False, sequential: bool = False, label: str = "",
            before_stage=None) -> Timeline:
        """Execute ``order`` (a `plan`, or any order `check_plan` accepts) over the forward of
        ``fwd`` and the backward of ``bwd`` (whose forward must have run). Each micro-batch
        runs the stages of its own step's layer (`microbatch`): in a model, ``F`` and ``B``
        are usually at different layers; their steps must have the same ``n_chunks`` and
        process group. ``sequential``:
        wait for every collective as soon as it starts. ``replay``: no collectives, the
        tensors the last real run received instead (the compute-only reference).
        ``before_stage(name)``, if given, is called before each stage (the fault tests use
        it). Parameter gradients accumulate into the layer's ``.grad``. Returns this rank's
        `Timeline` (events on a compute and a comm lane; the step's wall time)."""
        stages = stage_graph(self.n_chunks, forward=fwd is not None, backward=bwd is not None)
        check_plan(order, stages)
        if fwd is not None and fwd.forward_done:
            raise ValueError(f"micro-batch {fwd.key!r} has already run its forward")
        if bwd is not None and (not bwd.forward_done or bwd.backward_done or bwd.grad_out is None):
            raise ValueError(f"micro-batch {bwd.key!r} must have run its forward and not its backward, "
                             "and have its grad_out")
        for mb in (fwd, bwd):
            if mb is not None and (mb.owner is None or mb.owner.n_chunks != self.n_chunks):
                raise ValueError(f"micro-batch {mb.key!r} must come from a MergedStep with "
                                 f"n_chunks={self.n_chunks} (use step.microbatch)")
        if replay and not (fwd or bwd).owner.cache:
            raise ValueError("replay=True needs a real run first (nothing to replay)")
        n = self.n_chunks
        fops = fwd.owner.ops if fwd is not None else None
        bops = bwd.owner.ops if bwd is not None else None
        layer = (fwd or bwd).owner.layer
        clock = _Clock(layer.experts.w_gate_up.device)
        events: list[dict] = []
        handles: dict[str, _Handle] = {}
        results: dict[tuple, Tensor] = {}  # what a compute stage leaves for the next collective
        row_bytes = layer.cfg.d_model * (fwd or bwd).x.element_size()
        rank = layer.ep_rank
        if fwd is not None:
            bounds = torch.linspace(0, fwd.x.shape[0], n + 1).round().long().tolist()
            rows = [slice(bounds[i], bounds[i + 1]) for i in range(n)]
            fwd.chunks = [None] * n

        def comm(mb: MicroBatch, kind: str, c: int, send: Tensor, out_splits, in_splits) -> None:
            nbytes = (sum(in_splits) - in_splits[rank]) * row_bytes
            event = None if replay else {"chunk": c, "lane": "comm", "name": _DISPLAY[kind],
                                         "phase": "fwd" if mb is fwd else "bwd",
                                         "start": clock.now(), "end": None, "nbytes": nbytes}
            if event is not None:
                events.append(event)
            handles[_n("F" if mb is fwd else "B", kind, c)] = mb.owner._start(
                (mb.key, kind, c), send, out_splits, in_splits, event, replay, sequential, clock)

        def got(name: str) -> Tensor:
            return self._wait(handles[name], clock)  # the same for every owner

        def counts() -> None:
            chunks, flayer, cache = fwd.chunks, fwd.owner.layer, fwd.owner.cache
            if replay:
                recv_all = cache[(fwd.key, "counts")]
            else:
                start = clock.now()
                recv_all = exchange_counts(torch.stack([c.counts for c in chunks], 1).reshape(
                    flayer.ep_size, -1), flayer.group)
                events.append({"chunk": -1, "lane": "comm", "name": "counts", "phase": "fwd",
                               "start": start, "end": clock.now(), "nbytes": 0})
                cache[(fwd.key, "counts")] = recv_all
            recv_all = recv_all.view(flayer.ep_size, n, flayer.n_local)
            sizes = torch.stack([torch.stack([c.counts.sum(1) for c in chunks]),
                                 recv_all.sum(2).t()]).tolist()  # [2, n, W]: the host sync
            for i, c in enumerate(chunks):
                c.recv_counts = recv_all[:, i]
                c.send_splits, c.recv_splits = sizes[0][i], sizes[1][i]

        def execute(stage: Stage) -> None:
            c, kind = stage.chunk, stage.kind
            if stage.mb == "F":
                ops = fops
                ch = fwd.chunks[c] if c >= 0 else None
                if kind == "route":
                    fwd.chunks[c] = ops._route(fwd.x, rows[c])
                elif kind == "counts":
                    counts()
                elif kind == "dispatch":
                    comm(fwd, kind, c, ch.send.detach(), ch.recv_splits, ch.send_splits)
                elif kind == "shared":
                    ops._shared_fwd(ch)
                elif kind == "experts":
                    results[("F", c)] = ops._experts_fwd(ch, got(_n("F", "dispatch", c)))
                elif kind == "combine":
                    comm(fwd, kind, c, results.pop(("F", c)), ch.send_splits, ch.recv_splits)
                elif kind == "unpermute":
                    ops._unpermute(ch, got(_n("F", "combine", c)))
                return
            ops, ch = bops, bwd.chunks[c]
            if kind == "unpermute⁻¹":
                ops._unpermute_bwd(ch, bwd.grad_out[ch.rows])
            elif kind == "combine⁻¹":
                comm(bwd, kind, c, ch.y_back.grad, ch.recv_splits, ch.send_splits)
            elif kind == "shared⁻¹":
                ops._shared_bwd(ch)
            elif kind == "dgrad":
                results[("B", c)] = ops._experts_dgrad(ch, got(_n("B", "combine⁻¹", c)))
            elif kind == "dispatch⁻¹":
                comm(bwd, kind, c, results.pop(("B", c)), ch.send_splits, ch.recv_splits)
            elif kind == "wgrad":
                ops._experts_wgrad(ch)
            elif kind == "permute⁻¹":
                ops._route_bwd(ch, got(_n("B", "dispatch⁻¹", c)))

        t0 = time.perf_counter()
        for name in order:
            stage = stages[name]
            if before_stage is not None:
                before_stage(name)
            if stage.lane == "comm":
                execute(stage)
                continue
            start = clock.now()
            execute(stage)
            events.append({"chunk": stage.chunk, "lane": "compute", "name": _DISPLAY[stage.kind],
                           "phase": stage.phase, "start": start, "end": clock.now(), "nbytes": 0})
        if fwd is not None:
            fwd.forward_done = True
        if bwd is not None:
            bwd.backward_done = True
        if clock.cuda:
            end = clock.now()
            torch.cuda.synchronize()
            step_s = clock.seconds(end)
        else:
            step_s = time.perf_counter() - t0
        return Timeline(rank, label, step_s, [
            Event(e["chunk"], e["lane"], e["name"], e["phase"], clock.seconds(e["start"]),
                  clock.seconds(e["end"] if e["end"] is not None else e["start"]), e["nbytes"])
            for e in events])


def two_microbatch_step(step: MergedStep, xs: tuple[Tensor, Tensor], grads: tuple[Tensor, Tensor],
                        schedule: str = "1f1b") -> tuple[list[Tensor], list[Tensor], list[Timeline]]:
    """Forward and backward of two micro-batches as one pipeline stage runs them in 1F1B:
    the forward of 0 (warm-up), the unit [forward of 1 + backward of 0] under ``schedule``,
    the backward of 1 (cool-down). Gradients accumulate into the layer. Returns the outputs,
    the input gradients and the three timelines. With ``schedule="sequential"`` every
    collective is waited for at once: the plain schedule the merged one must equal."""
    if len(xs) != 2 or len(grads) != 2:
        raise ValueError(f"xs and grads must hold two micro-batches each, got {len(xs)} and {len(grads)}")
    seq = schedule == "sequential"
    n = step.n_chunks
    mb0, mb1 = step.microbatch(xs[0], grads[0], "mb0"), step.microbatch(xs[1], grads[1], "mb1")
    timelines = [
        step.run(plan(schedule, n, backward=False), fwd=mb0, sequential=seq, label="warm-up F0"),
        step.run(plan(schedule, n), fwd=mb1, bwd=mb0, sequential=seq, label=f"{schedule}: F1 + B0"),
        step.run(plan(schedule, n, forward=False), bwd=mb1, sequential=seq, label="cool-down B1"),
    ]
    return [mb0.y, mb1.y], [mb0.dx, mb1.dx], timelines


# --------------------------------------------------------------------------------------
# Measuring the four schedules
# --------------------------------------------------------------------------------------

# label: (schedule, chunked?, replay)
RUNS = {
    "sequential": ("sequential", False, False),
    "chunked": ("chunked", True, False),
    "1f1b": ("1f1b", False, False),
    "1f1b+chunked": ("1f1b+chunked", True, False),
    "compute only": ("sequential", False, True),
    "compute only (chunked)": ("chunked", True, True),
}


def measure_schedules(layer: EPMoELayer, xa: Tensor, ga: Tensor, xb: Tensor, gb: Tensor,
                      n_chunks: int = 4, repeats: int = 5, warmup: int = 1,
                      runs: tuple[str, ...] = tuple(RUNS)) -> dict:
    """Time the steady-state unit [forward of ``xb`` + backward of ``xa``] under each plan
    of `RUNS`, interleaved (call on every rank together). Each timed unit is preceded by
    the untimed forward of ``xa`` and a barrier; a run's time is its slowest rank's.

    Returns ``{"median_s", "runs_s", "exposed_s" (in-step waiting, mean over ranks),
    "exposed_vs_sequential", "exposed_fraction", "exposed_replay_s" (step − compute-only
    with the same chunks), "exposed_replay_vs_sequential", "timelines" (this rank's median
    run per label), "a2a_bytes", "a2a_s" (comm lane time of the sequential unit),
    "compute_s" (compute lane time of the compute-only unit), "n_chunks", "repeats",
    "world_size"}``.
    """
    unknown = set(runs) - set(RUNS)
    if unknown:
        raise ValueError(f"runs must be among {list(RUNS)}, got {sorted(unknown)}")
    if "sequential" not in runs or "compute only" not in runs:
        raise ValueError(f"runs must include 'sequential' and 'compute only', got {runs}")
    steps = {False: MergedStep(layer, 1), True: MergedStep(layer, n_chunks)}
    real = [r for r in runs if not RUNS[r][2]]
    replays = [r for r in runs if RUNS[r][2]]
    if "compute only (chunked)" in replays and not any(RUNS[r][1] for r in real):
        raise ValueError("'compute only (chunked)' needs a chunked schedule to replay")

    def one(label: str) -> Timeline:
        schedule, chunked, replay = RUNS[label]
        step = steps[chunked]
        layer.zero_grad(set_to_none=True)
        a = step.microbatch(xa, ga, "A")
        step.run(plan(schedule, step.n_chunks, backward=False), fwd=a, replay=replay)
        b = step.microbatch(xb, gb, "B")
        dist.barrier(group=layer.group)
        return step.run(plan(schedule, step.n_chunks), fwd=b, bwd=a, replay=replay,
                        sequential=schedule == "sequential", label=label)

    for _ in range(warmup):  # allocations, first calls; fills the replay caches
        for label in real:
            one(label)
    timelines: dict[str, list[Timeline]] = {label: [] for label in real + replays}
    for r in range(repeats):
        seq = real + replays
        for label in (seq if r % 2 == 0 else seq[::-1]):
            timelines[label].append(one(label))
    reference = {k: "compute only (chunked)" if RUNS[k][1] and "compute only (chunked)" in timelines
                 else "compute only" for k in real}
    summary = summarise_runs(layer, timelines, reference, n_chunks, repeats)
    summary["compute_s"] = statistics.median(t.lane_time("compute") for t in timelines["compute only"])
    return summary


def _layer_and_batches(spec: dict) -> tuple[EPMoELayer, list[Tensor]]:
    cfg = MoEConfig(**spec["cfg"])
    torch.manual_seed(spec.get("seed", 0))
    ep = from_layer(MoELayer(cfg, "dropless", "torch"))
    g = torch.Generator().manual_seed(spec.get("seed", 0) * 1000 + dist.get_rank() + 1)
    tensors = [torch.randn(spec["tokens"], cfg.d_model, generator=g) for _ in range(4)]
    return ep, tensors


def merged_rank_main(spec: dict) -> dict:
    """A rank's part of the schedule benchmark (for ``run_ranks``; used by ``bench ep`` and
    notebook 07). ``spec``: ``cfg`` (MoEConfig fields), ``tokens`` (per rank and
    micro-batch), ``n_chunks``, ``repeats``, ``warmup``, ``seed``, ``runs`` (labels of
    `RUNS`), ``bandwidth_rows`` (0: skip the bandwidth probe), ``check`` (default True:
    compare the merged step with the plain one first). Returns the
    `measure_schedules` report (timelines as dicts), the probe, and whether the merged
    two-micro-batch step equalled the plain one bitwise."""
    from moe_lab.parallel.overlap import a2a_bandwidth

    ep, (xa, ga, xb, gb) = _layer_and_batches(spec)
    # The merged step computes exactly what the plain one computes.
    outs = {}
    for schedule in ("sequential", "1f1b") if spec.get("check", True) else ():
        ep.zero_grad(set_to_none=True)
        ys, dxs, _ = two_microbatch_step(MergedStep(ep, 1), (xa, xb), (ga, gb), schedule)
        outs[schedule] = ys + dxs + [p.grad.clone() for p in ep.parameters()]
    identical = (all(torch.equal(a, b) for a, b in zip(outs["sequential"], outs["1f1b"], strict=True))
                 if outs else None)
    report = measure_schedules(ep, xa, ga, xb, gb, spec["n_chunks"], spec.get("repeats", 5),
                               spec.get("warmup", 1), tuple(spec.get("runs", RUNS)))
    report["timelines"] = {k: t.to_dict() for k, t in report["timelines"].items()}
    report["merged_equals_plain"] = identical
    report["rank"] = dist.get_rank()
    report["tokens_per_rank"] = spec["tokens"]
    if spec.get("bandwidth_rows"):
        report["bandwidth"] = a2a_bandwidth(spec["bandwidth_rows"], ep.cfg.d_model, group=None)
    return report


def merged_check_rank(cfg_fields: dict, tokens: int, n_chunks: int, seed: int = 0,
                      skew: float = 0.0, starve: int | None = None) -> dict:
    """A rank function for the tests: the two-micro-batch step under every schedule
    against the plain one (``sequential``, same chunks: must be bitwise equal) and against
    autograd through `EPMoELayer` on the two micro-batches (float32 rounding).

    ``skew`` biases expert 0's selection (uneven routing); ``starve`` is an expert made
    never to be chosen (it receives nothing). Returns, per schedule, ``"bitwise"`` (all
    outputs, input gradients and parameter gradients equal to the plain schedule's) and
    ``"rel"`` (the largest ``max|a − b| / max|b|`` against autograd over every
    quantity), plus the tokens each local expert received."""
    cfg = MoEConfig(**cfg_fields)
    torch.manual_seed(seed)
    ref_layer = MoELayer(cfg, "dropless", "torch")
    with torch.no_grad():
        ref_layer.router.expert_bias[0] = skew
        if starve is not None:
            ref_layer.router.expert_bias[starve] = -1e4
    ep = from_layer(ref_layer)
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank() + 1)
    xs = [torch.randn(tokens, cfg.d_model, generator=g) for _ in range(2)]
    gs = [torch.randn(tokens, cfg.d_model, generator=g) for _ in range(2)]
    # Autograd through the layer: two micro-batches, gradients accumulated.
    ep.zero_grad(set_to_none=True)
    ys_ref, dxs_ref, received = [], [], torch.zeros(cfg.n_experts, dtype=torch.int64)
    for x, gr in zip(xs, gs, strict=True):
        xr = x.detach().requires_grad_()
        y, stats = ep(xr)
        y.backward(gr)
        ys_ref.append(y.detach())
        dxs_ref.append(xr.grad)
        received += stats.tokens_per_expert.cpu()
    dist.all_reduce(received)
    autograd = ys_ref + dxs_ref + [p.grad.clone() for p in ep.parameters()]

    def rel(a: Tensor, b: Tensor) -> float:
        if not b.numel():
            return 0.0
        diff, scale = float((a - b).abs().max()), float(b.abs().max())
        return diff / scale if scale > 0 else diff

    result: dict = {"received_per_expert": received.tolist(), "schedules": {}}
    for chunks in sorted({1, n_chunks}):
        step = MergedStep(ep, chunks)
        got = {}
        for schedule in SCHEDULES:
            ep.zero_grad(set_to_none=True)
            ys, dxs, tls = two_microbatch_step(step, xs, gs, schedule)
            got[schedule] = ys + dxs + [p.grad.clone() for p in ep.parameters()]
            result["schedules"][f"{schedule}/{chunks}"] = {
                "rel": max(rel(a, b) for a, b in zip(got[schedule], autograd, strict=True)),
                "events": sum(len(t.events) for t in tls)}
        for schedule in SCHEDULES:
            result["schedules"][f"{schedule}/{chunks}"]["bitwise"] = all(
                torch.equal(a, b) for a, b in zip(got[schedule], got["sequential"], strict=True))
    return result


def merged_fault_rank(kind: str, victim: int = 1, at_stage: str = "B.dgrad[0]",
                      steps: int = 1000) -> int:
    """A rank function for the fault tests: every rank runs merged steps in a loop; rank
    ``victim``, on reaching ``at_stage`` of its second step (collectives of both
    micro-batches in flight), dies (``kind="crash"``: SIGKILL), raises (``"raise"``) or
    stops answering (``"hang"``). Returns the number of steps done (never, for the others:
    they must fail)."""
    if kind not in ("crash", "raise", "hang"):
        raise ValueError(f"kind must be 'crash', 'raise' or 'hang', got {kind!r}")
    cfg = dict(d_model=32, n_experts=8, top_k=2, d_expert=48, n_shared_experts=1)
    ep, (xa, ga, xb, gb) = _layer_and_batches({"cfg": cfg, "tokens": 32, "seed": 0})
    step = MergedStep(ep, 2)
    count = {"steps": 0}

    def before(name: str) -> None:
        if dist.get_rank() == victim and count["steps"] == 1 and name == at_stage:
            if kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "raise":
                raise RuntimeError(f"rank {victim} failed on purpose at {name}")
            time.sleep(3600)

    for i in range(steps):
        a = step.microbatch(xa, ga, f"A{i}")
        step.run(plan("1f1b+chunked", 2, backward=False), fwd=a)
        b = step.microbatch(xb, gb, f"B{i}")
        step.run(plan("1f1b+chunked", 2), fwd=b, bwd=a, before_stage=before)
        step.cache.clear()
        count["steps"] += 1
    return count["steps"]
