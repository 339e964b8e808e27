"""1F1B merging on real ranks: one micro-batch's forward hides another's backward communication.

`MergedStep` runs one MoE layer's part of a merged 1F1B unit as an explicit *plan*
(`moe_lab.parallel.plan`): a list of named stages of the two micro-batches, executed in order.
A compute stage runs at once (`moe_lab.parallel.chunks.ChunkStages`); a communication stage
starts an all-to-all (``async_op=True``) and returns; the first compute stage that needs its
result waits on the work handle. Every plan sums the gradients in the same order, so the
merged step's outputs and gradients are *bitwise* those of the plain schedule with the same
chunks, and equal autograd through `EPMoELayer` to float32 rounding.

**Streams.** On the CPU, gloo runs each collective on its own worker threads, so the work
handle is the whole story. On CUDA, `MergedStep` issues every collective from one
high-priority side stream and makes the compute stream wait for it only at the consuming
stage. The contract, per collective (`_PlanRun.comm` and ``got``; a unit test checks
its order with stand-in streams): the side stream waits for the compute stream
(``wait_stream``) before the collective is issued on it; the tensor sent is marked as used
on the side stream (``record_stream``); at the consuming stage the work is waited, the
compute stream waits for the side stream, and the output, allocated on the side stream, is
marked as used on the compute stream. No GPU has run that path yet.

`two_microbatch_step` runs a whole two-micro-batch step (warm-up forward, merged unit,
cool-down backward), which the tests compare with the plain schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_lab.checks import positive_int
from moe_lab.parallel.chunks import Chunk, ChunkStages, StageClock, chunk_rows
from moe_lab.parallel.ep import EPMoELayer, exchange_counts, exchange_rows
from moe_lab.parallel.plan import DISPLAY_NAMES, Stage, check_plan, plan, stage_graph
from moe_lab.parallel.plan import stage_name as _n
from moe_lab.parallel.timeline import Timeline

Tensor = torch.Tensor


@dataclass
class MicroBatch:
    """One micro-batch's tokens ``x: [tokens, d_model]`` and output gradient (may be set
    after its forward, before its backward), and the state its forward leaves for its
    backward. ``key`` names it in the replay cache; ``aux_scale``: see `ChunkStages`."""

    x: Tensor
    grad_out: Tensor | None
    key: str
    owner: MergedStep | None = None  # the step (hence the layer) whose stages it runs
    aux_scale: float | None = None
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def y(self) -> Tensor:
        return torch.cat([c.out.detach() for c in self.chunks])

    @property
    def dx(self) -> Tensor:
        return torch.cat([c.x.grad for c in self.chunks])


class MergedStep:
    """Runs plans of `stage_graph` stages for one `EPMoELayer` (``dropless``), ``n_chunks``
    chunks per micro-batch (the stages' arithmetic: `ChunkStages`); `run` executes a plan over
    a forward and/or a backward micro-batch. Every rank of the layer's group must run the same
    plans in the same order. ``keep_for_replay``: keep what the collectives delivered, for
    ``run(..., replay=True)``.
    """

    def __init__(self, layer: EPMoELayer, n_chunks: int, keep_for_replay: bool = True) -> None:
        self.ops = ChunkStages(layer)  # checks the layer
        self.layer, self.n_chunks = layer, positive_int(n_chunks, "n_chunks")
        self.cache: dict = {}
        self.keep_for_replay = keep_for_replay
        w = layer.experts.w_gate_up  # on CUDA, the collectives' side stream (not yet run on a GPU)
        self.comm_stream = torch.cuda.Stream(device=w.device, priority=-1) if w.is_cuda else None

    def microbatch(self, x: Tensor, grad_out: Tensor | None, key: str,
                   aux_scale: float | None = None) -> MicroBatch:
        """A micro-batch of this step's layer; ``grad_out`` may be None until its backward."""
        d, n = self.layer.cfg.d_model, self.n_chunks
        if (x.dim() != 2 or x.shape[1] != d or x.shape[0] < n
                or (grad_out is not None and grad_out.shape != x.shape)):
            raise ValueError(f"x and grad_out must be [tokens >= n_chunks={n}, d_model={d}], got "
                             f"{tuple(x.shape)} and {None if grad_out is None else tuple(grad_out.shape)}")
        return MicroBatch(x, grad_out, key, owner=self, aux_scale=aux_scale)

    # ----------------------------------------------------------------- running a plan
    def run(self, order: list[str], fwd: MicroBatch | None = None, bwd: MicroBatch | None = None,
            replay: bool = False, sequential: bool = False, label: str = "") -> Timeline:
        """Execute ``order`` (a `plan`, or any order `check_plan` accepts) over the forward of
        ``fwd`` and the backward of ``bwd`` (whose forward must have run, or run earlier in
        ``order`` when ``bwd is fwd``). Each micro-batch
        runs the stages of its own step's layer (`microbatch`): in a model, ``F`` and ``B``
        are usually at different layers; their steps must have the same ``n_chunks`` and
        process group. ``sequential``:
        wait for every collective as soon as it starts. ``replay``: no collectives, the
        tensors the last real run received instead (the compute-only reference).
        Parameter gradients accumulate into the layer's ``.grad``. Returns this rank's
        `Timeline` (events on a compute and a comm lane; the step's wall time)."""
        stages = stage_graph(self.n_chunks, forward=fwd is not None, backward=bwd is not None)
        check_plan(order, stages)
        return _PlanRun(fwd, bwd, replay, sequential).execute(order, stages, label)


class _PlanRun:
    """One execution of a plan: the stage actions (`ACTIONS`, one method per stage kind),
    the collectives in flight, and the events recorded."""

    def __init__(self, fwd: MicroBatch | None, bwd: MicroBatch | None, replay: bool,
                 sequential: bool) -> None:
        self.f, self.b = fwd, bwd
        self.fops, self.bops = (mb.owner.ops if mb is not None else None for mb in (fwd, bwd))
        self.replay, self.sequential = replay, sequential
        self.layer = (fwd or bwd).owner.layer
        self.clock = StageClock(self.layer.experts.w_gate_up.device)
        self.events: list[dict] = []
        self.handles: dict[str, tuple] = {}  # started collectives: (output, work, event, side stream)
        self.results: dict[tuple, Tensor] = {}  # what a compute stage leaves for the next collective
        if fwd is not None:
            self.rows = chunk_rows(fwd.x.shape[0], fwd.owner.n_chunks)
            fwd.chunks = [None] * len(self.rows)

    def execute(self, order: list[str], stages: dict[str, Stage], label: str) -> Timeline:
        for name in order:
            stage = stages[name]
            start = self.clock.now()
            self.ACTIONS[stage.kind](self, stage.chunk)
            if stage.lane == "compute":  # a collective records its own event
                self.events.append({"chunk": stage.chunk, "lane": "compute",
                                    "name": DISPLAY_NAMES.get(stage.kind, stage.kind), "phase": stage.phase,
                                    "start": start, "end": self.clock.now(), "nbytes": 0})
        return self.clock.timeline(self.layer.ep_rank, label, self.events)

    def comm(self, side: str, kind: str, c: int, send: Tensor, out_splits: list[int],
             in_splits: list[int]) -> None:
        """Start a collective (``replay``: take what it delivered last time); on CUDA, from the
        side stream of the micro-batch's step."""
        mb = self.f if side == "F" else self.b
        step, key, name = mb.owner, (mb.key, kind, c), _n(side, kind, c)
        if self.replay:
            self.handles[name] = (step.cache[key], None, None, None)
            return
        nbytes = (sum(in_splits) - in_splits[self.layer.ep_rank]) * send.shape[1] * send.element_size()
        event = {"chunk": c, "lane": "comm", "name": DISPLAY_NAMES.get(kind, kind),
                 "phase": "fwd" if side == "F" else "bwd", "start": self.clock.now(), "end": None,
                 "nbytes": nbytes}
        self.events.append(event)
        stream = step.comm_stream
        if stream is None:
            out, work = exchange_rows(send, out_splits, in_splits, step.layer.group, async_op=True)
            self.clock.mark_end_when_done(work, event)
        else:
            # 1. The side stream waits for everything the compute stream queued so far, the
            #    kernels that wrote ``send`` among them (NCCL's own stream waits for the side one).
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out, work = exchange_rows(send, out_splits, in_splits, step.layer.group, async_op=True)
            # 2. ``send`` was allocated on the compute stream and is read on the side stream: the
            #    allocator must not hand its memory out again before the side stream is done.
            send.record_stream(stream)
        if step.keep_for_replay:
            step.cache[key] = out
        self.handles[name] = (out, work, event, stream)
        if self.sequential:
            self.got(side, kind, c)

    def got(self, side: str, kind: str, c: int) -> Tensor:
        """Wait for a started collective (once) and stamp its event's end; returns its output."""
        name = _n(side, kind, c)
        out, work, event, stream = self.handles[name]
        if work is not None:
            work.wait()  # NCCL: the current (compute) stream waits for the collective
        if stream is not None:
            # 3. The compute stream waits for the side stream before it reads ``out`` (also
            #    with no work handle: a group of one rank copies on the side stream), and
            #    ``out``, allocated on the side stream, is marked as used on the compute one.
            compute = torch.cuda.current_stream()
            compute.wait_stream(stream)
            out.record_stream(compute)
        self.handles[name] = (out, None, event, None)
        if event is not None and event["end"] is None:
            event["end"] = self.clock.now()
        return out

    # the stages of F, the micro-batch going forward
    def route(self, c: int) -> None:
        self.f.chunks[c] = self.fops.route(self.f.x, self.rows[c])

    def counts(self, _c: int) -> None:
        f, key = self.f, (self.f.key, "counts")
        if not self.replay:  # blocking: the split sizes go to the host next
            start = self.clock.now()
            f.owner.cache[key] = exchange_counts(self.fops.send_counts(f.chunks), f.owner.layer.group)
            self.events.append({"chunk": -1, "lane": "comm", "name": "counts", "phase": "fwd",
                                "start": start, "end": self.clock.now(), "nbytes": 0})
        self.fops.take_counts(f.chunks, f.owner.cache[key])

    def dispatch(self, c: int) -> None:
        ch = self.f.chunks[c]
        self.comm("F", "dispatch", c, ch.send.detach(), ch.recv_splits, ch.send_splits)

    def shared(self, c: int) -> None:
        self.fops.shared_fwd(self.f.chunks[c])

    def experts(self, c: int) -> None:
        self.results[("F", c)] = self.fops.experts_fwd(self.f.chunks[c], self.got("F", "dispatch", c))

    def combine(self, c: int) -> None:
        ch = self.f.chunks[c]
        self.comm("F", "combine", c, self.results.pop(("F", c)), ch.send_splits, ch.recv_splits)

    def unpermute(self, c: int) -> None:
        self.fops.unpermute(self.f.chunks[c], self.got("F", "combine", c))

    # the stages of B, the micro-batch going backward
    def unpermute_bwd(self, c: int) -> None:
        self.bops.unpermute_bwd(self.b.chunks[c], self.b.grad_out[self.b.chunks[c].rows])

    def combine_bwd(self, c: int) -> None:
        ch = self.b.chunks[c]
        self.comm("B", "combine⁻¹", c, ch.y_back.grad, ch.recv_splits, ch.send_splits)

    def shared_bwd(self, c: int) -> None:
        self.bops.shared_bwd(self.b.chunks[c])

    def dgrad(self, c: int) -> None:
        self.results[("B", c)] = self.bops.experts_dgrad(self.b.chunks[c], self.got("B", "combine⁻¹", c))

    def dispatch_bwd(self, c: int) -> None:
        ch = self.b.chunks[c]
        self.comm("B", "dispatch⁻¹", c, self.results.pop(("B", c)), ch.send_splits, ch.recv_splits)

    def wgrad(self, c: int) -> None:
        self.bops.experts_wgrad(self.b.chunks[c])

    def permute_bwd(self, c: int) -> None:
        self.bops.route_bwd(self.b.chunks[c], self.got("B", "dispatch⁻¹", c), self.b.aux_scale)

    ACTIONS = {"route": route, "counts": counts, "dispatch": dispatch, "shared": shared,
               "experts": experts, "combine": combine, "unpermute": unpermute,
               "unpermute⁻¹": unpermute_bwd, "combine⁻¹": combine_bwd, "shared⁻¹": shared_bwd,
               "dgrad": dgrad, "dispatch⁻¹": dispatch_bwd, "wgrad": wgrad, "permute⁻¹": permute_bwd}


def two_microbatch_step(step: MergedStep, xs: tuple[Tensor, Tensor], grads: tuple[Tensor, Tensor],
                        schedule: str = "1f1b") -> tuple[list[Tensor], list[Tensor], list[Timeline]]:
    """Forward and backward of two micro-batches as one pipeline stage runs them in 1F1B:
    the forward of 0 (warm-up), the unit [forward of 1 + backward of 0] under ``schedule``,
    the backward of 1 (cool-down). Gradients accumulate into the layer. Returns the outputs,
    the input gradients and the three timelines. With ``schedule="sequential"`` every
    collective is waited for at once: the plain schedule the merged one must equal."""
    seq = schedule == "sequential"
    n = step.n_chunks
    mb0, mb1 = step.microbatch(xs[0], grads[0], "mb0"), step.microbatch(xs[1], grads[1], "mb1")
    timelines = [
        step.run(plan(schedule, n, backward=False), fwd=mb0, sequential=seq, label="warm-up F0"),
        step.run(plan(schedule, n), fwd=mb1, bwd=mb0, sequential=seq, label=f"{schedule}: F1 + B0"),
        step.run(plan(schedule, n, forward=False), bwd=mb1, sequential=seq, label="cool-down B1"),
    ]
    return [mb0.y, mb1.y], [mb0.dx, mb1.dx], timelines
