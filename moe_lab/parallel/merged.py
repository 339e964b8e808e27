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

import time
from dataclasses import dataclass, field

import torch

from moe_lab.checks import positive_int
from moe_lab.parallel.chunks import Chunk, ChunkStages, chunk_rows
from moe_lab.parallel.ep import EPMoELayer, exchange_rows, received_order
from moe_lab.parallel.plan import DISPLAY_NAMES, Stage, check_plan, plan, stage_graph
from moe_lab.parallel.timeline import Event, Timeline

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


# The compute stages' `ChunkStages` methods. Each is given the output of the collective its stage
# depends on (if any); what it returns is what the collective depending on it sends.
_METHODS = {"shared": "shared_fwd", "experts": "experts_fwd", "unpermute": "unpermute",
            "unpermute⁻¹": "unpermute_bwd", "shared⁻¹": "shared_bwd", "dgrad": "experts_dgrad",
            "wgrad": "experts_wgrad", "permute⁻¹": "route_bwd"}
_OUTBOUND = ("dispatch", "combine⁻¹")  # they carry a chunk's rows to the experts' ranks


class _PlanRun:
    """One execution of a plan: the stages run from the stage graph (a compute stage waits for
    the collectives it depends on, a collective sends what the stage before it returned), the
    collectives in flight, and the events recorded. Stage times are taken from the start of the
    run: the wall clock on the CPU; CUDA events on a GPU (resolved at the end, after one
    synchronize)."""

    def __init__(self, fwd: MicroBatch | None, bwd: MicroBatch | None, replay: bool,
                 sequential: bool) -> None:
        self.f, self.b = fwd, bwd
        self.replay, self.sequential = replay, sequential
        self.layer = (fwd or bwd).owner.layer
        self.cuda = self.layer.experts.w_gate_up.is_cuda
        self.origin = self.now()
        self.events: list[dict] = []
        self.handles: dict[str, tuple] = {}  # started collectives: (output, work, event, side stream)
        self.results: dict[str, Tensor] = {}  # what a compute stage leaves for the next collective
        if fwd is not None:
            self.rows = chunk_rows(fwd.x.shape[0], fwd.owner.n_chunks)
            fwd.chunks = [None] * len(self.rows)

    def now(self) -> float | torch.cuda.Event:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, mark: float | torch.cuda.Event) -> float:
        return self.origin.elapsed_time(mark) / 1e3 if self.cuda else mark - self.origin

    def execute(self, order: list[str], stages: dict[str, Stage], label: str) -> Timeline:
        """Run the stages of ``order``; returns this rank's `Timeline` (an event never ended lasts 0)."""
        for name in order:
            stage = stages[name]
            mb = self.f if stage.phase == "fwd" else self.b
            start = self.now()
            if stage.kind == "counts":
                self.counts(mb, stage)
            elif stage.lane == "comm":
                self.comm(mb, stage)
            else:
                self.compute(mb, stage, [self.got(d) for d in stage.deps if stages[d].lane == "comm"])
                self.event(stage, start)["end"] = self.now()
        end = self.now()
        if self.cuda:
            torch.cuda.synchronize()
        return Timeline(self.layer.ep_rank, label, self.seconds(end), [
            Event(e["chunk"], e["lane"], e["name"], e["phase"], self.seconds(e["start"]),
                  self.seconds(e["end"] if e["end"] is not None else e["start"]), e["nbytes"])
            for e in self.events])

    def event(self, stage: Stage, start: float | torch.cuda.Event, nbytes: int = 0) -> dict:
        """Record an event of ``stage`` from ``start``; its end is stamped later."""
        event = {"chunk": stage.chunk, "lane": stage.lane, "name": DISPLAY_NAMES.get(stage.kind, stage.kind),
                 "phase": stage.phase, "start": start, "end": None, "nbytes": nbytes}
        self.events.append(event)
        return event

    def compute(self, mb: MicroBatch, stage: Stage, received: list[Tensor]) -> None:
        ops, c = mb.owner.ops, stage.chunk
        if stage.kind == "route":
            mb.chunks[c] = ops.route(mb.x, self.rows[c])
            return
        if stage.kind == "unpermute⁻¹":
            received = [mb.grad_out[mb.chunks[c].rows]]
        extra = [mb.aux_scale] if stage.kind == "permute⁻¹" else []
        self.results[stage.name] = getattr(ops, _METHODS[stage.kind])(mb.chunks[c], *received, *extra)

    def counts(self, mb: MicroBatch, stage: Stage) -> None:
        """The one count exchange of a forward, blocking: each chunk gets its split sizes (the
        host sync: ``all_to_all_single`` takes them as Python ints) and the order that regroups
        the rows it will receive by local expert."""
        layer, chunks, key = mb.owner.layer, mb.chunks, (mb.key, "counts")
        if not self.replay:
            start = self.now()
            send_all = torch.stack([c.counts for c in chunks], 1).reshape(layer.ep_size, -1)  # [W, n·E_local]
            mb.owner.cache[key] = exchange_rows(send_all, None, None, layer.group)  # equal blocks
            self.event(stage, start)["end"] = self.now()
        recv_all = mb.owner.cache[key].view(layer.ep_size, len(chunks), layer.n_local)
        sizes = torch.stack([torch.stack([c.counts.sum(1) for c in chunks]),
                             recv_all.sum(2).t()]).tolist()  # [2, n, W]
        for i, c in enumerate(chunks):
            c.send_splits, c.recv_splits = sizes[0][i], sizes[1][i]
            c.order, c.inverse, c.offs = received_order(recv_all[:, i], sum(c.recv_splits))

    def comm(self, mb: MicroBatch, stage: Stage) -> None:
        """Start a collective (``replay``: take what it delivered last time); on CUDA, from the
        side stream of the micro-batch's step."""
        step, kind, c = mb.owner, stage.kind, stage.chunk
        ch, key = mb.chunks[c], (mb.key, kind, c)
        send = ch.send.detach() if kind == "dispatch" else self.results.pop(stage.deps[0])
        if self.replay:
            self.handles[stage.name] = (step.cache[key], None, None, None)
            return
        out_splits, in_splits = ((ch.recv_splits, ch.send_splits) if kind in _OUTBOUND
                                 else (ch.send_splits, ch.recv_splits))
        nbytes = (sum(in_splits) - in_splits[self.layer.ep_rank]) * send.shape[1] * send.element_size()
        event = self.event(stage, self.now(), nbytes)
        stream = step.comm_stream
        if stream is None:
            out, work = exchange_rows(send, out_splits, in_splits, step.layer.group, async_op=True)
            if work is not None:
                # On the CPU, stamp the end when gloo's thread completes the work: a transfer
                # that finished while the processor computed shows where it really ended.
                def done(_future: object, event: dict = event) -> None:
                    if event["end"] is None:
                        event["end"] = self.now()

                work.get_future().add_done_callback(done)
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
        self.handles[stage.name] = (out, work, event, stream)
        if self.sequential:
            self.got(stage.name)

    def got(self, name: str) -> Tensor:
        """Wait for a started collective (once) and stamp its event's end; returns its output."""
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
            event["end"] = self.now()
        return out


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
