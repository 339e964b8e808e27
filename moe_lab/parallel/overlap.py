"""Hiding the all-to-all behind compute: chunks, async work handles, delayed weight gradients.

The expert-parallel layer (`moe_lab.parallel.ep`) waits on the network twice in the forward
(dispatch, combine) and twice in the backward (their reverses); waiting in turn leaves the
processor idle for all of it. The remedy is a pipeline: cut the step's tokens into ``n``
chunks and, while chunk ``c``'s experts compute, let chunk ``c+1``'s dispatch and chunk
``c``'s combine travel. A collective started with ``async_op=True`` returns a *work handle*
at once; ``work.wait()`` blocks only when its result is needed. On CUDA, NCCL runs
collectives on its own streams, so the same handles overlap kernels.

`ChunkedStep` runs the forward and backward of one dropless `EPMoELayer` stage by stage
(`moe_lab.parallel.chunks`), so that the schedule is explicit:

forward   route+permute all chunks · one count exchange · dispatch(0) in flight while the
          shared expert runs · for each chunk: wait dispatch(c), start dispatch(c+1),
          experts(c), start combine(c) · then unpermute each chunk as its combine lands
backward  unpermute⁻¹ all chunks · combine⁻¹(0) in flight while the shared expert's
          backward runs · for each chunk: wait combine⁻¹(c), start combine⁻¹(c+1),
          expert dgrad(c), start dispatch⁻¹(c), [expert wgrad(c)] · then, for each chunk,
          [expert wgrad(c)] and permute⁻¹(c) as its dispatch⁻¹ lands

``schedule="sequential"`` runs the same stages but waits for every collective as soon as it
starts: the baseline. ``delay_wgrad=True`` postpones the experts' weight gradients, which
nothing waits for, to fill the last dispatch⁻¹, the one gap nothing else can fill.

**What is hidden.** ``exposed communication = step time − compute-only time`` (`exposed_time`),
where the compute-only step runs every stage on the same data with the collectives replaced by
the tensors they delivered last time (``ChunkedStep.run(..., replay=True)``). Each run also
records per-chunk events on a compute and a communication lane (`moe_lab.parallel.timeline`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from moe_lab.checks import one_of, positive_int
from moe_lab.parallel.chunks import Chunk, ChunkStages, StageClock, chunk_rows, mark_end_when_done
from moe_lab.parallel.ep import EPMoELayer, exchange_counts, exchange_rows
from moe_lab.parallel.timeline import Timeline

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

Tensor = torch.Tensor

__all__ = ["ChunkedStep", "SCHEDULES", "exposed_time"]

SCHEDULES = ("sequential", "overlap")


def exposed_time(step_s: float, compute_only_s: float) -> float:
    """Exposed communication: how much longer the step took than its compute alone."""
    return step_s - compute_only_s


class _Pending:
    def __init__(self, out: Tensor, work: Work | None, event: dict | None, clock: StageClock) -> None:
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

    def __init__(self, group: ProcessGroup | None, schedule: str, replay: bool, clock: StageClock,
                 cache: dict, events: list[dict], rank: int, row_bytes: int) -> None:
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
            out = exchange_rows(x, output_splits, input_splits, self.group)
            event["end"] = self.clock.now()
            self.cache[key] = out
            return _Pending(out, None, event, self.clock)
        out, work = exchange_rows(x, output_splits, input_splits, self.group, async_op=True)
        if not self.clock.cuda:
            mark_end_when_done(work, event)
        self.cache[key] = out
        return _Pending(out, work, event, self.clock)


class ChunkedStep:
    """Forward + backward of ``layer`` (an `EPMoELayer` in ``dropless`` mode) in ``n_chunks``
    chunks of this rank's tokens, on an explicit schedule.

    ``run(x, grad_out, schedule=..., delay_wgrad=..., replay=...)`` returns ``(y, dx,
    Timeline)``; parameter gradients accumulate into ``layer``'s ``.grad`` as ``backward()``
    would (see `ChunkStages` for ``ops.aux_scale``).
    """

    def __init__(self, layer: EPMoELayer, n_chunks: int) -> None:
        self.ops = ChunkStages(layer)  # checks the layer
        self.layer, self.n_chunks = layer, positive_int(n_chunks, "n_chunks")
        self.cache: dict = {}

    def run(self, x: Tensor, grad_out: Tensor, schedule: str = "overlap", delay_wgrad: bool = False,
            replay: bool = False, label: str | None = None,
            lookahead: int = 1) -> tuple[Tensor, Tensor, Timeline]:
        """One forward + backward. ``replay=True`` skips every collective and uses what the
        previous real run received (the compute-only reference; same data, same shapes).
        ``lookahead``: how many chunks' dispatch (and combine⁻¹) are kept in flight ahead
        of the chunk being computed; more absorbs more jitter, at the cost of buffers."""
        positive_int(lookahead, "lookahead")
        one_of(schedule, "schedule", SCHEDULES)
        if x.dim() != 2 or x.shape[1] != self.layer.cfg.d_model or grad_out.shape != x.shape:
            raise ValueError(f"x and grad_out must be [tokens, d_model={self.layer.cfg.d_model}], "
                             f"got {tuple(x.shape)} and {tuple(grad_out.shape)}")
        if replay and not self.cache:
            raise ValueError("replay=True needs a real run first (nothing to replay)")
        layer, ops, n = self.layer, self.ops, self.n_chunks
        clock = StageClock(x.device)
        events: list[dict] = []
        ex = _Exchange(layer.group, schedule, replay, clock, self.cache, events, layer.ep_rank,
                       x.shape[1] * x.element_size())

        def compute(chunk: int, name: str, phase: str, fn: Callable, *args: Any) -> Any:
            start = clock.now()
            result = fn(*args)
            events.append({"chunk": chunk, "lane": "compute", "name": name, "phase": phase,
                           "start": start, "end": clock.now(), "nbytes": 0})
            return result

        # forward ----------------------------------------------------------------
        chunks: list[Chunk] = [compute(i, "route+permute", "fwd", ops.route, x, rows)
                               for i, rows in enumerate(chunk_rows(x.shape[0], n))]
        # One count exchange for every chunk (a sync: the split sizes go to the host).
        if replay:
            recv_all = self.cache[("counts",)]
        else:
            start = clock.now()
            recv_all = exchange_counts(ops.send_counts(chunks), layer.group)
            events.append({"chunk": -1, "lane": "comm", "name": "counts", "phase": "fwd",
                           "start": start, "end": clock.now(), "nbytes": 0})
            self.cache[("counts",)] = recv_all
        ops.take_counts(chunks, recv_all)

        def dispatch(i: int) -> _Pending:
            c = chunks[i]
            return ex.start(("dispatch", i), c.send.detach(), c.recv_splits, c.send_splits,
                            i, "dispatch", "fwd")

        pending = {i: dispatch(i) for i in range(min(lookahead, n))}
        for i, c in enumerate(chunks):
            compute(i, "shared expert", "fwd", ops.shared_fwd, c)
        combines = {}
        for i, c in enumerate(chunks):
            x_recv = pending.pop(i).wait()
            if i + lookahead < n:
                pending[i + lookahead] = dispatch(i + lookahead)
            y_recv = compute(i, "experts", "fwd", ops.experts_fwd, c, x_recv)
            combines[i] = ex.start(("combine", i), y_recv, c.send_splits, c.recv_splits,
                                   i, "combine", "fwd")
        # Nothing in the forward waits for a combine but its own unpermute: keep the
        # experts busy first, and gather the results at the end.
        for i, c in enumerate(chunks):
            compute(i, "unpermute", "fwd", ops.unpermute, c, combines.pop(i).wait())
        y = torch.cat([c.out.detach() for c in chunks])

        # backward ---------------------------------------------------------------
        for i, c in enumerate(chunks):
            compute(i, "unpermute⁻¹", "bwd", ops.unpermute_bwd, c, grad_out[c.rows])

        def combine_bwd(i: int) -> _Pending:
            c = chunks[i]
            return ex.start(("combine_bwd", i), c.y_back.grad, c.recv_splits, c.send_splits,
                            i, "combine⁻¹", "bwd")

        pending = {i: combine_bwd(i) for i in range(min(lookahead, n))}
        for i, c in enumerate(chunks):
            compute(i, "shared expert⁻¹", "bwd", ops.shared_bwd, c)
        dispatches = {}
        for i, c in enumerate(chunks):
            dy_recv = pending.pop(i).wait()
            if i + lookahead < n:
                pending[i + lookahead] = combine_bwd(i + lookahead)
            dx_recv = compute(i, "experts dgrad", "bwd", ops.experts_dgrad, c, dy_recv)
            dispatches[i] = ex.start(("dispatch_bwd", i), dx_recv, c.send_splits, c.recv_splits,
                                     i, "dispatch⁻¹", "bwd")
            if not delay_wgrad:
                compute(i, "experts wgrad", "bwd", ops.experts_wgrad, c)
        # Delayed, the weight gradients run while the last dispatch⁻¹ travels.
        for i, c in enumerate(chunks):
            if delay_wgrad:
                compute(i, "experts wgrad", "bwd", ops.experts_wgrad, c)
            compute(i, "route+permute⁻¹", "bwd", ops.route_bwd, c, dispatches.pop(i).wait())
        dx = torch.cat([c.x.grad for c in chunks])
        name = label or (("compute only" if replay else schedule)
                         + (" + delayed wgrad" if delay_wgrad else ""))
        return y, dx, clock.timeline(layer.ep_rank, name, events)
