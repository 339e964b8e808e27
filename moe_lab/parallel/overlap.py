"""Hiding the all-to-all behind compute: chunks, async work handles, delayed weight gradients.

In the expert-parallel layer (``moe_lab.parallel.ep``) every step waits twice on the network
in the forward (dispatch, combine) and twice in the backward (their reverses). Waiting in
turn — send, wait, compute, send, wait — leaves the processor idle for all of it. The
remedy is a pipeline: cut the step's tokens into ``n`` chunks and, while chunk ``c``'s experts
compute, let chunk ``c+1``'s dispatch and chunk ``c``'s combine travel. A collective started
with ``async_op=True`` returns a *work handle* at once; ``work.wait()`` blocks only when its
result is needed. On CUDA, NCCL already runs collectives on its own streams (created with
high priority by `moe_lab.workbench.ranks.launch.init_from_env`), so the same handles overlap kernels.

`ChunkedStep` runs the forward and backward of one `EPMoELayer` (dropless) by hand, stage
by stage, so that the schedule is explicit:

forward   route+permute all chunks · one count exchange · dispatch(0) in flight while the
          shared expert runs · for each chunk: wait dispatch(c), start dispatch(c+1),
          experts(c), start combine(c) · then unpermute each chunk as its combine lands
backward  unpermute⁻¹ all chunks · combine⁻¹(0) in flight while the shared expert's
          backward runs · for each chunk: wait combine⁻¹(c), start combine⁻¹(c+1),
          expert dgrad(c), start dispatch⁻¹(c), [expert wgrad(c)] · then, for each chunk,
          [expert wgrad(c)] and permute⁻¹(c) as its dispatch⁻¹ lands

``schedule="sequential"`` runs the same stages but waits for every collective as soon as
it is started: the baseline. ``delay_wgrad=True`` (Megatron-Core's
``--delay-wgrad-compute``) splits the experts' backward in two: the *dgrad* (gradient of the
input, which the next all-to-all needs) runs at once, the *wgrad* (gradient of the weights,
which nothing waits for) is postponed to fill the last dispatch⁻¹, the one gap nothing else
can fill. The expert backward is written out for that (two grouped GEMMs for dgrad, two
for wgrad, the SwiGLU derivative between) and checked against autograd in the tests.

**Measuring what is hidden.** ``exposed communication = step time − compute-only time``,
where the compute-only step runs every stage on the same data with the collectives
replaced by the tensors they delivered last time (`ChunkedStep.run(..., replay=True)`).
`measure_overlap` times the schedules interleaved, takes every run's slowest rank, and
reports medians; each run also records per-chunk events (start and end of every stage
on a compute or a communication lane, `moe_lab.parallel.timeline`) for a Gantt chart. On the
CPU a collective's end is taken from its future's completion callback, so a transfer that
finished while the processor computed shows where it really ended.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_lab.config import MoEConfig
from moe_lab.moe.dispatch import sort_by_expert
from moe_lab.moe.experts import grouped_mm, grouped_mm_wgrad, swiglu
from moe_lab.moe.layer import MoELayer
from moe_lab.parallel.ep import EPMoELayer, _all_to_all, _local_order, exchange_counts, from_layer
from moe_lab.parallel.timeline import Event, Timeline

Tensor = torch.Tensor

__all__ = [
    "ChunkedStep", "SCHEDULES", "measure_overlap", "exposed_time", "a2a_bandwidth",
    "overlap_rank_main", "overlap_check_rank", "RUNS",
]

SCHEDULES = ("sequential", "overlap")


def exposed_time(step_s: float, compute_only_s: float) -> float:
    """Exposed communication: how much longer the step took than its compute alone."""
    return step_s - compute_only_s


class _Clock:
    """Stage timestamps: the wall clock on the CPU; CUDA events on a GPU (resolved at the end)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()
        else:
            self.origin = time.perf_counter()

    def now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, mark) -> float:
        if self.cuda:
            return self.origin.elapsed_time(mark) / 1e3
        return mark - self.origin


class _Pending:
    def __init__(self, out: Tensor, work, event: dict | None, clock: _Clock) -> None:
        self.out, self.work, self.event, self.clock = out, work, event, clock

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
        if self.event is not None and self.event.get("end") is None:
            self.event["end"] = self.clock.now()
        return self.out


class _Exchange:
    """Starts all-to-alls for a schedule: asynchronously (``overlap``), waited at once
    (``sequential``), or not at all (``replay``: the tensors the last real run received)."""

    def __init__(self, group, schedule: str, replay: bool, clock: _Clock, cache: dict,
                 events: list[dict], rank: int, row_bytes: int) -> None:
        self.group, self.schedule, self.replay, self.clock = group, schedule, replay, clock
        self.cache, self.events, self.rank, self.row_bytes = cache, events, rank, row_bytes

    def start(self, key: tuple, x: Tensor, output_splits: list[int], input_splits: list[int],
              chunk: int, name: str, phase: str) -> _Pending:
        if self.replay:
            return _Pending(self.cache[key], None, None, self.clock)
        nbytes = (sum(input_splits) - input_splits[self.rank]) * self.row_bytes
        event = {"chunk": chunk, "lane": "comm", "name": name, "phase": phase,
                 "start": self.clock.now(), "end": None, "nbytes": nbytes}
        self.events.append(event)
        if self.schedule == "sequential":
            out = _all_to_all(x, output_splits, input_splits, self.group)
            event["end"] = self.clock.now()
            self.cache[key] = out
            return _Pending(out, None, event, self.clock)
        out, work = _all_to_all(x, output_splits, input_splits, self.group, async_op=True)
        if work is not None and not self.clock.cuda:
            # The transfer's real end, recorded by gloo's thread when it completes.
            def done(_future, event=event) -> None:
                if event.get("end") is None:
                    event["end"] = time.perf_counter()

            work.get_future().add_done_callback(done)
        self.cache[key] = out
        return _Pending(out, work, event, self.clock)


@dataclass
class _Chunk:
    rows: slice
    x: Tensor
    token_of: Tensor
    send: Tensor
    w_sorted: Tensor
    counts: Tensor
    recv_counts: Tensor | None = None
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    order: Tensor | None = None
    inverse: Tensor | None = None
    offs: Tensor | None = None
    saved: tuple = ()
    wgrad_inputs: tuple = ()
    shared_out: Tensor | None = None
    shared_leaf: Tensor | None = None
    y_back: Tensor | None = None
    w_leaf: Tensor | None = None
    out: Tensor | None = None
    aux: Tensor | None = None  # the chunk's weighted auxiliary + z losses (for aux_scale)


class ChunkedStep:
    """Forward + backward of ``layer`` (an `EPMoELayer` in ``dropless`` mode) in ``n_chunks``
    chunks of this rank's tokens, on an explicit schedule.

    ``run(x, grad_out, schedule=..., delay_wgrad=..., replay=...)`` returns ``(y, dx,
    Timeline)``; parameter gradients accumulate into ``layer``'s ``.grad`` as
    ``backward()`` would (the output's gradient only, unless ``aux_scale`` is set: then the
    chunk's auxiliary losses too). The experts run on ``moe_lab::grouped_mm`` whatever the layer's
    expert backend (on CUDA that means bf16, ``torch._grouped_mm``'s restriction there).
    """

    def __init__(self, layer: EPMoELayer, n_chunks: int) -> None:
        if not isinstance(layer, EPMoELayer):
            raise ValueError(f"layer must be an EPMoELayer, got {type(layer).__name__}")
        if layer.mode != "dropless":
            raise ValueError(f"ChunkedStep schedules the dropless exchange; layer.mode is {layer.mode!r}")
        if layer.experts.quant is not None:
            raise ValueError("ChunkedStep writes the expert backward for unquantised experts; "
                             f"layer.experts.quant is {layer.experts.quant!r}")
        if not isinstance(n_chunks, int) or n_chunks < 1:
            raise ValueError(f"n_chunks must be a positive integer, got {n_chunks!r}")
        self.layer, self.n_chunks = layer, n_chunks
        self.cache: dict = {}
        # None: only the output's gradient is back-propagated. A number: the chunk's
        # auxiliary and z losses (weighted by the config's coefficients) are also part of
        # the loss, with this factor (a training step: 1 / micro-batches).
        self.aux_scale: float | None = None

    # ------------------------------------------------------------------ stages
    def _route(self, x: Tensor, rows: slice) -> _Chunk:
        layer = self.layer
        k = layer.cfg.top_k
        with torch.enable_grad():
            xc = x[rows].detach().requires_grad_()
            routing = layer.router(xc)
            order, _ = sort_by_expert(routing.topk_ids, layer.cfg.n_experts)
            token_of = order // k
            send = xc.index_select(0, token_of)
            w_sorted = routing.topk_weights.reshape(-1).index_select(0, order)
            aux = None
            if self.aux_scale is not None:
                aux = routing.aux_loss * layer.cfg.aux_loss_coef + routing.z_loss * layer.cfg.z_loss_coef
        counts = routing.tokens_per_expert.view(layer.ep_size, layer.n_local)
        return _Chunk(rows, xc, token_of, send, w_sorted, counts, aux=aux)

    def _shared_fwd(self, c: _Chunk) -> None:
        if self.layer.shared is not None:
            with torch.enable_grad():
                c.shared_out = self.layer.shared(c.x)

    def _experts_fwd(self, c: _Chunk, x_recv: Tensor) -> Tensor:
        ex = self.layer.experts
        world, n_local = c.recv_counts.shape
        segment_expert = torch.arange(n_local, device=x_recv.device).repeat(world)
        row_expert = torch.repeat_interleave(segment_expert, c.recv_counts.reshape(-1),
                                             output_size=x_recv.shape[0])
        c.order, c.inverse = _local_order(row_expert)
        c.offs = c.recv_counts.sum(0).cumsum(0).to(torch.int32)  # cumulative row ends
        w1, w2 = ex.w_gate_up.detach().to(x_recv.dtype), ex.w_down.detach().to(x_recv.dtype)
        xs = x_recv.index_select(0, c.order)
        h = grouped_mm(xs, w1, c.offs)
        a = swiglu(h)
        ys = grouped_mm(a, w2, c.offs)
        c.saved = (xs, h, a)
        return ys.index_select(0, c.inverse)

    def _unpermute(self, c: _Chunk, y_back: Tensor) -> None:
        with torch.enable_grad():
            c.y_back = y_back.detach().requires_grad_()
            c.w_leaf = c.w_sorted.detach().requires_grad_()
            weight = c.w_leaf.unsqueeze(1).to(c.y_back.dtype)
            out = torch.zeros_like(c.x).index_add_(0, c.token_of, c.y_back * weight)
            if c.shared_out is not None:
                c.shared_leaf = c.shared_out.detach().requires_grad_()
                out = out + c.shared_leaf
            c.out = out

    def _unpermute_bwd(self, c: _Chunk, dout: Tensor) -> None:
        torch.autograd.backward([c.out], [dout])

    def _shared_bwd(self, c: _Chunk) -> None:
        if c.shared_out is not None:
            torch.autograd.backward([c.shared_out], [c.shared_leaf.grad])

    def _experts_dgrad(self, c: _Chunk, dy_recv: Tensor) -> Tensor:
        ex = self.layer.experts
        xs, h, a = c.saved
        w1, w2 = ex.w_gate_up.detach().to(h.dtype), ex.w_down.detach().to(h.dtype)
        dys = dy_recv.index_select(0, c.order)
        da = grouped_mm(dys, w2.transpose(-1, -2).contiguous(), c.offs)
        gate, up = h.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        dh = torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * silu], dim=-1)
        dxs = grouped_mm(dh, w1.transpose(-1, -2).contiguous(), c.offs)
        c.wgrad_inputs = (xs, dh, a, dys)
        return dxs.index_select(0, c.inverse)

    def _experts_wgrad(self, c: _Chunk) -> None:
        ex = self.layer.experts
        xs, dh, a, dys = c.wgrad_inputs
        for param, grad in ((ex.w_gate_up, grouped_mm_wgrad(xs, dh, c.offs)),
                            (ex.w_down, grouped_mm_wgrad(a, dys, c.offs))):
            grad = grad.to(param.dtype)
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad
        c.wgrad_inputs = ()

    def _route_bwd(self, c: _Chunk, dsend: Tensor) -> None:
        tensors, grads = [c.send, c.w_sorted], [dsend, c.w_leaf.grad]
        if c.aux is not None and c.aux.requires_grad:
            tensors.append(c.aux)
            grads.append(torch.full_like(c.aux, self.aux_scale))
        torch.autograd.backward(tensors, grads)

    # ---------------------------------------------------------------- the step
    def run(self, x: Tensor, grad_out: Tensor, schedule: str = "overlap", delay_wgrad: bool = False,
            replay: bool = False, label: str | None = None,
            lookahead: int = 1) -> tuple[Tensor, Tensor, Timeline]:
        """One forward + backward. ``replay=True`` skips every collective and uses what the
        previous real run received (the compute-only reference; same data, same shapes).
        ``lookahead``: how many chunks' dispatch (and combine⁻¹) are kept in flight ahead
        of the chunk being computed; more absorbs more jitter, at the cost of buffers."""
        if not isinstance(lookahead, int) or lookahead < 1:
            raise ValueError(f"lookahead must be a positive integer, got {lookahead!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if x.dim() != 2 or x.shape[1] != self.layer.cfg.d_model or grad_out.shape != x.shape:
            raise ValueError(f"x and grad_out must be [tokens, d_model={self.layer.cfg.d_model}], "
                             f"got {tuple(x.shape)} and {tuple(grad_out.shape)}")
        if replay and not self.cache:
            raise ValueError("replay=True needs a real run first (nothing to replay)")
        layer, n = self.layer, self.n_chunks
        group, rank = layer.group, layer.ep_rank
        clock = _Clock(x.device)
        events: list[dict] = []
        ex = _Exchange(group, schedule, replay, clock, self.cache, events, rank,
                       x.shape[1] * x.element_size())

        def compute(chunk: int, name: str, phase: str, fn, *args):
            start = clock.now()
            result = fn(*args)
            events.append({"chunk": chunk, "lane": "compute", "name": name, "phase": phase,
                           "start": start, "end": clock.now(), "nbytes": 0})
            return result

        bounds = torch.linspace(0, x.shape[0], n + 1).round().long().tolist()
        chunks_rows = [slice(bounds[i], bounds[i + 1]) for i in range(n)]
        t0 = time.perf_counter()

        # forward ----------------------------------------------------------------
        chunks = [compute(i, "route+permute", "fwd", self._route, x, rows)
                  for i, rows in enumerate(chunks_rows)]
        # One count exchange for every chunk (a sync: the split sizes go to the host).
        if replay:
            recv_all = self.cache[("counts",)]
        else:
            start = clock.now()
            recv_all = exchange_counts(torch.stack([c.counts for c in chunks], 1).reshape(
                layer.ep_size, -1), group)
            events.append({"chunk": -1, "lane": "comm", "name": "counts", "phase": "fwd",
                           "start": start, "end": clock.now(), "nbytes": 0})
            self.cache[("counts",)] = recv_all
        recv_all = recv_all.view(layer.ep_size, n, layer.n_local)
        sizes = torch.stack([torch.stack([c.counts.sum(1) for c in chunks]),
                             recv_all.sum(2).t()]).tolist()  # [2, n, W]
        for i, c in enumerate(chunks):
            c.recv_counts = recv_all[:, i]
            c.send_splits, c.recv_splits = sizes[0][i], sizes[1][i]

        def dispatch(i: int) -> _Pending:
            c = chunks[i]
            return ex.start(("dispatch", i), c.send.detach(), c.recv_splits, c.send_splits,
                            i, "dispatch", "fwd")

        pending = {i: dispatch(i) for i in range(min(lookahead, n))}
        for i, c in enumerate(chunks):
            compute(i, "shared expert", "fwd", self._shared_fwd, c)
        combines = {}
        for i, c in enumerate(chunks):
            x_recv = pending.pop(i).wait()
            if i + lookahead < n:
                pending[i + lookahead] = dispatch(i + lookahead)
            y_recv = compute(i, "experts", "fwd", self._experts_fwd, c, x_recv)
            combines[i] = ex.start(("combine", i), y_recv, c.send_splits, c.recv_splits,
                                   i, "combine", "fwd")
        # Nothing in the forward waits for a combine but its own unpermute: keep the
        # experts busy first, and gather the results at the end.
        for i, c in enumerate(chunks):
            compute(i, "unpermute", "fwd", self._unpermute, c, combines.pop(i).wait())
        y = torch.cat([c.out.detach() for c in chunks])

        # backward ---------------------------------------------------------------
        for i, c in enumerate(chunks):
            compute(i, "unpermute⁻¹", "bwd", self._unpermute_bwd, c, grad_out[c.rows])

        def combine_bwd(i: int) -> _Pending:
            c = chunks[i]
            return ex.start(("combine_bwd", i), c.y_back.grad, c.recv_splits, c.send_splits,
                            i, "combine⁻¹", "bwd")

        pending = {i: combine_bwd(i) for i in range(min(lookahead, n))}
        for i, c in enumerate(chunks):
            compute(i, "shared expert⁻¹", "bwd", self._shared_bwd, c)
        dispatches = {}
        for i, c in enumerate(chunks):
            dy_recv = pending.pop(i).wait()
            if i + lookahead < n:
                pending[i + lookahead] = combine_bwd(i + lookahead)
            dx_recv = compute(i, "experts dgrad", "bwd", self._experts_dgrad, c, dy_recv)
            dispatches[i] = ex.start(("dispatch_bwd", i), dx_recv, c.send_splits, c.recv_splits,
                                     i, "dispatch⁻¹", "bwd")
            if not delay_wgrad:
                compute(i, "experts wgrad", "bwd", self._experts_wgrad, c)
        # The weight gradients wait for nothing: delayed, they run while the last
        # dispatch⁻¹ travels, the gap nothing else can fill.
        for i, c in enumerate(chunks):
            if delay_wgrad:
                compute(i, "experts wgrad", "bwd", self._experts_wgrad, c)
            compute(i, "route+permute⁻¹", "bwd", self._route_bwd, c, dispatches.pop(i).wait())
        dx = torch.cat([c.x.grad for c in chunks])
        if clock.cuda:
            end = clock.now()
            torch.cuda.synchronize()
            step_s = clock.seconds(end)
        else:
            step_s = time.perf_counter() - t0
        timeline = Timeline(rank, label or (("compute only" if replay else schedule)
                                            + (" + delayed wgrad" if delay_wgrad else "")),
                            step_s, [Event(e["chunk"], e["lane"], e["name"], e["phase"],
                                           clock.seconds(e["start"]), clock.seconds(e["end"]),
                                           e["nbytes"]) for e in events])
        return y, dx, timeline


# ------------------------------------------------------------------------------ measuring

RUNS = {
    # label: (schedule, delay_wgrad, replay)
    "sequential": ("sequential", False, False),
    "overlap": ("overlap", False, False),
    "overlap + delayed wgrad": ("overlap", True, False),
    "compute only": ("sequential", False, True),
}


def measure_overlap(layer: EPMoELayer, x: Tensor, grad_out: Tensor, n_chunks: int = 4,
                    repeats: int = 5, warmup: int = 1, runs: tuple[str, ...] = tuple(RUNS),
                    lookahead: int = 1) -> dict:
    """Time the schedules of `RUNS` interleaved (call on every rank together).

    Every run is preceded by a barrier; a run's time is its slowest rank's. Returns
    ``{"median_s": {label: s}, "exposed_s": {label: s}, "exposed_fraction": {label: exposed /
    step}, "exposed_vs_sequential", "exposed_replay_s", "exposed_replay_vs_sequential",
    "timelines": {label: this rank's Timeline of the median run}, "a2a_bytes": per step,
    "a2a_s": comm lane time of the sequential run, "runs_s", "n_chunks", "repeats",
    "world_size"}`` (`summarise_runs`).
    """
    if "compute only" not in runs or "sequential" not in runs:
        raise ValueError(f"runs must include 'sequential' and 'compute only', got {runs}")
    unknown = set(runs) - set(RUNS)
    if unknown:
        raise ValueError(f"runs must be among {list(RUNS)}, got {sorted(unknown)}")
    step = ChunkedStep(layer, n_chunks)
    order = ["sequential"] + [r for r in runs if r != "sequential"]  # a real run before replay

    def one(label: str) -> Timeline:
        schedule, delay, replay = RUNS[label]
        layer.zero_grad(set_to_none=True)
        dist.barrier(group=layer.group)
        return step.run(x, grad_out, schedule=schedule, delay_wgrad=delay, replay=replay, label=label,
                        lookahead=lookahead)[2]

    for _ in range(warmup):  # allocations, first calls; also fills the replay cache
        one("sequential")
    timelines: dict[str, list[Timeline]] = {label: [] for label in order}
    for r in range(repeats):
        # alternate the order (the first real run stays first: replay reuses its data)
        rest = order[1:] if r % 2 == 0 else order[1:][::-1]
        for label in [order[0], *rest]:
            timelines[label].append(one(label))
    real = [label for label in order if label != "compute only"]
    return summarise_runs(layer, timelines, {k: "compute only" for k in real}, n_chunks, repeats)


def summarise_runs(layer: EPMoELayer, timelines: dict[str, list[Timeline]], reference: dict[str, str],
                   n_chunks: int, repeats: int) -> dict:
    """What `measure_overlap` and `moe_lab.parallel.merged.measure_schedules` report from the
    interleaved runs of each label (call on every rank together, ``timelines`` in the same
    order on each): a run's time is its slowest rank's; ``reference`` maps each real
    (non-replay) label, "sequential" among them, to the compute-only replay it is measured
    against.

    Exposed communication, two ways: within each run as the time its ranks spent outside
    compute (averaged over ranks), which a busy shared machine disturbs less, and against
    the compute-only (replay) run. Returns the dict both document."""
    order = list(timelines)
    steps = torch.tensor([[t.step_s for t in timelines[label]] for label in order], dtype=torch.float64)
    waits = torch.tensor([[t.wait_s for t in timelines[label]] for label in order], dtype=torch.float64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=layer.group)
    dist.all_reduce(waits, group=layer.group)
    waits /= layer.ep_size
    slowest = dict(zip(order, steps.tolist(), strict=True))
    median = {label: statistics.median(v) for label, v in slowest.items()}
    exposed = {k: statistics.median(w) for k, w in zip(order, waits.tolist(), strict=True) if k in reference}
    exposed_replay = {k: exposed_time(median[k], median[ref]) for k, ref in reference.items()}

    def versus_sequential(values: dict) -> dict:
        base = values["sequential"]
        return {k: (v / base if base > 0 else float("nan")) for k, v in values.items()}

    seq = timelines["sequential"]
    return {
        "n_chunks": n_chunks, "repeats": repeats, "world_size": layer.ep_size,
        "median_s": median, "runs_s": slowest,
        "exposed_s": exposed, "exposed_vs_sequential": versus_sequential(exposed),
        "exposed_fraction": {k: v / median[k] for k, v in exposed.items()},
        "exposed_replay_s": exposed_replay,
        "exposed_replay_vs_sequential": versus_sequential(exposed_replay),
        # this rank's Timeline of the median run of each label
        "timelines": {k: sorted(ts, key=lambda t: t.step_s)[len(ts) // 2] for k, ts in timelines.items()},
        "a2a_bytes": seq[0].comm_bytes(),
        "a2a_s": statistics.median(t.lane_time("comm") for t in seq),
    }


def a2a_bandwidth(rows_per_rank: int, d_model: int, repeats: int = 5, group=None,
                  dtype: torch.dtype = torch.float32) -> dict:
    """Time one all-to-all of ``rows_per_rank`` rows of ``d_model`` per destination (equal
    splits, on every rank together): median seconds and the bandwidth per rank (bytes each
    rank sends to the others / time)."""
    world = dist.get_world_size(group)
    x = torch.randn(world * rows_per_rank, d_model, dtype=dtype)
    _all_to_all(x, None, None, group)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        _all_to_all(x, None, None, group)
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    median = statistics.median(t.tolist())
    sent = (world - 1) * rows_per_rank * d_model * x.element_size()
    return {"bytes_per_rank": sent, "median_s": median, "bytes_per_s": sent / median}


def overlap_rank_main(spec: dict) -> dict:
    """A rank's part of the overlap benchmark (for ``run_ranks``; used by ``bench ep`` and
    notebook 07). ``spec``: ``cfg`` (MoEConfig fields), ``tokens`` (per rank), ``n_chunks``,
    ``repeats``, ``seed``, ``runs`` (labels of `RUNS`), ``bandwidth_rows`` (0: skip the
    bandwidth probe). Returns the `measure_overlap` report with timelines as dicts, plus
    the all-to-all probe, and whether ``ChunkedStep`` matched the autograd layer.
    """
    rank = dist.get_rank()
    cfg = MoEConfig(**spec["cfg"])
    torch.manual_seed(spec.get("seed", 0))
    ep = from_layer(MoELayer(cfg, "dropless", "torch"))
    g = torch.Generator().manual_seed(spec.get("seed", 0) * 1000 + rank + 1)
    x = torch.randn(spec["tokens"], cfg.d_model, generator=g)
    grad = torch.randn(spec["tokens"], cfg.d_model, generator=g)
    # The hand-scheduled step computes what autograd computes.
    y_ref, _ = ep(x.detach().requires_grad_())
    y, _, _ = ChunkedStep(ep, spec["n_chunks"]).run(x, grad, schedule="overlap", delay_wgrad=True)
    matches = bool(torch.allclose(y, y_ref.detach(), rtol=1e-4, atol=1e-5))
    report = measure_overlap(ep, x, grad, spec["n_chunks"], spec.get("repeats", 5),
                             spec.get("warmup", 1), tuple(spec.get("runs", RUNS)),
                             spec.get("lookahead", 1))
    report["timelines"] = {k: t.to_dict() for k, t in report["timelines"].items()}
    report["matches_autograd"] = matches
    report["rank"] = rank
    report["tokens_per_rank"] = spec["tokens"]
    if spec.get("bandwidth_rows"):
        report["bandwidth"] = a2a_bandwidth(spec["bandwidth_rows"], cfg.d_model, group=None)
    return report


def overlap_check_rank(cfg_fields: dict, tokens: int, n_chunks: int, seed: int = 0) -> dict:
    """A rank function for the tests: every schedule of `ChunkedStep` against autograd
    through `EPMoELayer` (output, input gradient, expert/router/shared weight gradients);
    returns the largest absolute difference per quantity and schedule."""
    cfg = MoEConfig(**cfg_fields)
    torch.manual_seed(seed)
    ep = from_layer(MoELayer(cfg, "dropless", "torch"))
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank() + 1)
    x = torch.randn(tokens, cfg.d_model, generator=g)
    grad = torch.randn(tokens, cfg.d_model, generator=g)
    xr = x.detach().requires_grad_()
    y_ref, _ = ep(xr)
    y_ref.backward(grad)
    ref = {name: p.grad.clone() for name, p in ep.named_parameters()}
    step = ChunkedStep(ep, n_chunks)
    errors = {}
    for label, (schedule, delay, replay) in RUNS.items():
        ep.zero_grad(set_to_none=True)
        y, dx, timeline = step.run(x, grad, schedule=schedule, delay_wgrad=delay, replay=replay)
        errs = {"y": float((y - y_ref.detach()).abs().max()), "dx": float((dx - xr.grad).abs().max())}
        for name, p in ep.named_parameters():
            errs[name] = float((p.grad - ref[name]).abs().max())
        errs["events"] = len(timeline.events)
        errors[label] = errs
    return errors
