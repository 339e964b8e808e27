"""Pipeline schedules, simulated: GPipe, 1F1B and interleaved 1F1B, bubbles and imbalance.

Pipeline parallelism cuts the model's layers into *stages*, one per group of GPUs (a
*rank* of the pipeline), and streams micro-batches through them: rank 0 runs the forward
pass of micro-batch 0 and hands the activations to rank 1, then starts micro-batch 1, and
so on; backward passes flow the other way. Two things waste time. The **bubble**: at the
start and the end of a step some ranks have nothing to do yet (or any more); for the 1F1B
schedule with ``p`` equal stages and ``m`` micro-batches it is the fraction
``(p - 1) / (m + p - 1)`` of the step. **Imbalance**: the pipeline runs at the pace of its
slowest stage, so a stage with more work than the others stalls everyone; we measure it
as ``(max - mean) / mean`` of the per-rank work. Interleaving (each rank holds ``v``
*virtual* stages, "chunks") divides the bubble by about ``v``; splitting the backward pass
into the input gradient (B, on the critical path) and the weight gradient (W, which
nothing downstream waits for) lets W fill the holes, as zero-bubble schedules do.

This module is an honest discrete-event simulation, not a formula: every rank executes
its operations in its schedule's order, and an operation starts when its rank is free and
its dependency is done (the previous stage's forward of the same micro-batch, the next
stage's backward). The closed forms above come *out* of the simulation and the tests hold
it to them.

The simulation takes one cost per virtual stage, the forward's; the input gradient B and the
weight gradient W each take as long (as they do for a GEMM: backward = 2 × forward). Virtual
stage ``k`` lives on rank ``k % p`` as its chunk ``k // p`` (Megatron's convention,
:mod:`moe_lab.sim.layout`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_lab.checks import non_negative_int, one_of, positive_int

SCHEDULES = ("gpipe", "1f1b", "interleaved")
OP_KINDS = ("F", "B", "W")


def bubble_1f1b(n_ranks: int, n_microbatches: int) -> float:
    """Closed-form bubble fraction of 1F1B (and GPipe) with equal stages: (p-1)/(m+p-1)."""
    return (n_ranks - 1) / (n_microbatches + n_ranks - 1)


def bubble_interleaved(n_ranks: int, n_microbatches: int, n_chunks: int) -> float:
    """Closed-form bubble fraction of interleaved 1F1B: (p-1)/(v·m+p-1)."""
    return (n_ranks - 1) / (n_chunks * n_microbatches + n_ranks - 1)


Op = tuple[str, int, int]  # (kind "F"/"B"/"W", micro-batch, chunk)


def schedule_order(schedule: str, n_ranks: int, n_microbatches: int, n_chunks: int = 1) -> list[list[Op]]:
    """Each rank's forward/backward operations in execution order.

    ``gpipe``: all forwards, then all backwards. ``1f1b``: rank ``r`` runs ``p - r - 1``
    warm-up forwards, then alternates one forward and one backward, then drains the
    backwards. ``interleaved``: Megatron's interleaved 1F1B over ``n_chunks`` chunks per
    rank; micro-batches go in groups of ``p`` through chunk 0, then chunk 1, ...;
    warm-up ``2(p - r - 1) + (v - 1)p`` forwards. (W operations, when the weight gradient is
    delayed, are not in these lists: the simulator slots them in.)
    """
    one_of(schedule, "schedule", SCHEDULES)
    for name, value in (("n_ranks", n_ranks), ("n_microbatches", n_microbatches), ("n_chunks", n_chunks)):
        positive_int(value, name)
    if schedule != "interleaved" and n_chunks != 1:
        raise ValueError(f"schedule {schedule!r} runs one chunk per rank, got n_chunks={n_chunks} "
                         "(use schedule='interleaved')")
    if schedule == "interleaved" and n_chunks > 1 and n_microbatches % n_ranks:
        raise ValueError(f"interleaved 1F1B takes micro-batches in groups of n_ranks={n_ranks}; "
                         f"n_microbatches={n_microbatches} must be a multiple of it")
    p, m, v = n_ranks, n_microbatches, n_chunks
    # micro-batches in groups of p through chunk 0, then chunk 1, ... (one chunk: in order)
    fwd = [(i, c) for g in range(0, m, p) for c in range(v) for i in range(g, min(g + p, m))]
    bwd = [(i, v - 1 - c) for i, c in fwd]
    orders: list[list[Op]] = []
    for r in range(p):
        warm = {"gpipe": m, "1f1b": min(p - r - 1, m),
                "interleaved": m * v if m == p else min((p - r - 1) * 2 + (v - 1) * p, m * v)}[schedule]
        ops = [("F", *op) for op in fwd[:warm]]
        for f_op, b_op in zip(fwd[warm:], bwd, strict=False):
            ops += [("F", *f_op), ("B", *b_op)]
        orders.append(ops + [("B", *op) for op in bwd[len(fwd) - warm:]])
    return orders


def stage_imbalance(loads: Sequence[float]) -> float:
    """``(max - mean) / mean`` of the per-rank work: 0 is perfect balance."""
    arr = np.asarray(loads, dtype=float)
    if arr.size == 0 or arr.mean() <= 0:
        raise ValueError(f"loads must be non-empty with a positive mean, got {arr.tolist()}")
    return float((arr.max() - arr.mean()) / arr.mean())


@dataclass(frozen=True)
class PipelineResult:
    """One simulated step: the timeline and its figures.

    ``ops`` holds one row per operation: rank, kind ("F", "B" or "W"), micro-batch, chunk,
    start, end. ``busy[r]`` is rank ``r``'s total compute time; the bubble is the idle
    share of ``n_ranks × makespan``.
    """

    schedule: str
    n_ranks: int
    n_chunks: int
    n_microbatches: int
    rank: np.ndarray
    kind: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    start: np.ndarray
    end: np.ndarray
    makespan: float
    busy: np.ndarray

    @property
    def bubble_fraction(self) -> float:
        """Idle share of ``n_ranks × makespan`` (warm-up, drain and waiting on slow stages)."""
        return float(1.0 - self.busy.sum() / (self.n_ranks * self.makespan))

    @property
    def imbalance(self) -> float:
        """``(max - mean) / mean`` of the ranks' busy time."""
        return stage_imbalance(self.busy)


def simulate(forward: Sequence[float], *, n_microbatches: int, n_ranks: int | None = None,
             schedule: str | None = None, delay_wgrad: bool = False,
             max_deferred_wgrad: int | None = None) -> PipelineResult:
    """Simulate one training step of a pipeline, event by event.

    Args:
        forward: forward time of one micro-batch on each virtual stage, ``[p * v]`` in
            pipeline order (virtual stage ``k`` on rank ``k % p``); the input gradient B and
            the weight gradient W each take as long.
        n_microbatches: micro-batches per step, ``m`` >= 1.
        n_ranks: pipeline ranks ``p``; default ``len(forward)`` (one chunk each).
        schedule: "gpipe", "1f1b" or "interleaved"; default "1f1b" for one chunk per
            rank, "interleaved" otherwise.
        delay_wgrad: split each backward into B then W and defer W: a rank runs a pending
            W whenever its next F/B is not ready yet (or the backlog exceeds
            ``max_deferred_wgrad``), and drains the rest at the end. Without it, B and W
            run as one backward operation.
        max_deferred_wgrad: with ``delay_wgrad``, the most W operations a rank may hold
            back (each keeps a layer's activations and output gradient alive); ``p - 1``
            matches zero-bubble H1's memory, ``None`` is unlimited.

    Every rank executes its schedule's operations in order; an operation starts at the
    first moment its rank is free and its dependency has arrived.
    """
    f = np.asarray(forward, dtype=float).reshape(-1)
    n_vs = f.size
    n_ranks = n_vs if n_ranks is None else n_ranks
    if n_vs == 0 or not isinstance(n_ranks, int) or n_ranks < 1 or n_vs % n_ranks:
        raise ValueError(f"n_ranks must be a positive integer dividing the {n_vs} virtual stages "
                         f"(at least one), got {n_ranks!r}")
    if not np.all(np.isfinite(f)) or np.any(f < 0):
        raise ValueError(f"forward must be finite and >= 0, got {f.tolist()}")
    if max_deferred_wgrad is not None:
        non_negative_int(max_deferred_wgrad, "max_deferred_wgrad")
    p, v = n_ranks, n_vs // n_ranks
    schedule = schedule or ("1f1b" if v == 1 else "interleaved")
    order = schedule_order(schedule, p, n_microbatches, v)
    costs = {"F": f, "B": f if delay_wgrad else 2 * f, "W": f}  # without delay, B and W run as one
    eps = 1e-12 * (3 * float(f.sum()) * n_microbatches + 1.0)
    rows = _run_ranks(order, costs, delay_wgrad, max_deferred_wgrad, eps)
    rank, kind, mb, chunk, start, end = (np.array(column) for column in zip(*rows))
    return PipelineResult(schedule, p, v, n_microbatches, rank, kind, mb, chunk, start, end,
                          makespan=float(end.max()),
                          busy=np.bincount(rank, weights=end - start, minlength=p))


def _run_ranks(order: list[list[Op]], costs: dict[str, np.ndarray], delay_wgrad: bool,
               max_deferred_wgrad: int | None, eps: float) -> list[tuple]:
    """The event loop of `simulate`: rows ``(rank, kind, micro-batch, chunk, start, end)``."""
    p, last = len(order), costs["F"].size - 1
    end: dict[tuple[str, int, int], float] = {}

    def arrival(kind: str, mb: int, vs: int) -> float:
        """When the input of F or B of micro-batch ``mb`` on virtual stage ``vs`` is there."""
        if kind == "F":
            return end.get(("F", mb, vs - 1), math.inf) if vs > 0 else 0.0
        return end.get(("B", mb, vs + 1) if vs < last else ("F", mb, vs), math.inf)

    free_at, ptr = [0.0] * p, [0] * p
    pending: list[deque[Op]] = [deque() for _ in range(p)]  # deferred W operations
    rows: list[tuple[int, str, int, int, float, float]] = []
    events = [0.0]
    while events:
        t = heapq.heappop(events)
        while events and events[0] <= t + eps:
            heapq.heappop(events)
        progressed = True
        while progressed:
            progressed = False
            for r in range(p):
                if free_at[r] > t + eps:
                    continue
                nxt = order[r][ptr[r]] if ptr[r] < len(order[r]) else None
                backlog = max_deferred_wgrad is not None and len(pending[r]) > max_deferred_wgrad
                if nxt is not None and not backlog and arrival(nxt[0], nxt[1], nxt[2] * p + r) <= t + eps:
                    choice = nxt
                    ptr[r] += 1
                elif pending[r]:
                    choice = pending[r].popleft()
                else:
                    continue
                kind, mb, c = choice
                stop = t + float(costs[kind][c * p + r])
                end[(kind, mb, c * p + r)] = free_at[r] = stop
                rows.append((r, kind, mb, c, t, stop))
                if kind == "B" and delay_wgrad:
                    pending[r].append(("W", mb, c))
                heapq.heappush(events, stop)
                progressed = True
    return rows
