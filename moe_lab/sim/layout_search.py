"""Balanced pipeline layouts: what each layer costs, what each stage and rank carries, and
the search for the cut that evens it out.

The pipeline runs at the pace of its slowest rank, so where the layers are cut decides the
step time (:mod:`moe_lab.sim.schedule` simulates it). Costs per layer come from the FLOPs
model (:func:`moe_lab.perf.flops.layer_flops_per_token`): the simulator's time unit is
"GFLOP per token of forward work", which is proportional to time for a rank running at a
fixed rate. The search (:func:`search_layout`) cuts the layer sequence into contiguous
stages minimising the slowest rank; layers are indivisible, so the best layout is only as
balanced as the layer granularity allows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_lab.checks import positive_int
from moe_lab.config import ModelConfig
from moe_lab.sim.layout import (
    LAYER_KINDS,
    Layout,
    check_layout,
    format_layout,
    model_layer_chars,
    model_layer_kinds,
)
from moe_lab.sim.schedule import PipelineResult, simulate, stage_imbalance


@dataclass(frozen=True)
class LayerCosts:
    """Forward work of one micro-batch through one layer of each kind.

    Backward is split into the input gradient B and the weight gradient W; for a GEMM each
    is about one forward, so the simulations take each equal to the forward (the familiar
    "backward = 2 × forward").
    """

    embedding: float
    dense: float
    moe: float
    mtp: float
    logits: float
    unit: str = "GFLOP/token"

    def forward(self, kind: str) -> float:
        """Forward cost of one layer of ``kind`` (one of ``LAYER_KINDS``)."""
        return float(getattr(self, kind))


def layer_costs(cfg: ModelConfig, seq_len: int | None = None, *, logits_scale: float = 1.0) -> LayerCosts:
    """Forward GFLOP per token of one layer of each kind, from the FLOPs model.

    ``moe_lab.perf.flops.layer_flops_per_token`` gives *training* FLOPs (forward +
    backward = 3 × forward for GEMMs); a third of it is the forward. ``logits_scale``
    multiplies the cost of the logits GEMM — 0.5 models running it in MXFP8 at twice the
    bf16 rate. The MTP layer's own output head is the same GEMM, so its share of the MTP
    layer is scaled too.
    """
    if not (isinstance(logits_scale, (int, float)) and 0 < logits_scale <= 10):
        raise ValueError(f"logits_scale must be in (0, 10], got {logits_scale!r}")
    # Here, not at the top: importing moe_lab.perf loads torch, which the simulators never need.
    from moe_lab.perf.flops import layer_flops_per_token

    flops = layer_flops_per_token(cfg, seq_len if seq_len is not None else cfg.seq_len)
    fwd = {kind: float(flops[kind]) / 3e9 for kind in LAYER_KINDS}
    if cfg.mtp_layers and fwd["mtp"] > fwd["logits"]:
        # The MTP block holds a transformer layer, a projection and its own output head.
        fwd["mtp"] = fwd["mtp"] - fwd["logits"] + fwd["logits"] * logits_scale
    fwd["logits"] *= logits_scale
    return LayerCosts(**fwd)


def stage_forward_costs(layout: Layout, cfg: ModelConfig, costs: LayerCosts) -> np.ndarray:
    """Forward work of each virtual stage of ``layout``: ``[n_ranks * n_chunks]``."""
    check_layout(layout, cfg)
    kinds = iter(model_layer_kinds(cfg))
    return np.array([sum(costs.forward(next(kinds)) for _ in stage) for stage in layout.stages], dtype=float)


def rank_loads(layout: Layout, stage_costs: Sequence[float]) -> np.ndarray:
    """Work per rank: the sum of its chunks' costs, ``[n_ranks]``."""
    costs = np.asarray(stage_costs, dtype=float)
    return costs.reshape(layout.n_chunks, layout.n_ranks).sum(axis=0)


def _check_stage_counts(cfg: ModelConfig, n_ranks: int, n_chunks: int) -> None:
    positive_int(n_ranks, "n_ranks")
    positive_int(n_chunks, "n_chunks")
    n_items = len(model_layer_chars(cfg))
    if n_ranks * n_chunks > n_items:
        raise ValueError(f"n_ranks x n_chunks = {n_ranks * n_chunks} virtual stages is impossible for "
                         f"{cfg.name!r}: it has only {n_items} layers including E, m and L")


def even_layout(cfg: ModelConfig, n_ranks: int, n_chunks: int = 1) -> Layout:
    """The naive split: transformer layers spread as evenly as the counts allow (the first
    stages get the extra ones), the embedding on the first stage, MTP and loss on the last.
    """
    _check_stage_counts(cfg, n_ranks, n_chunks)
    n_vs = n_ranks * n_chunks
    if cfg.n_layers < n_vs:
        raise ValueError(f"even_layout needs at least one transformer layer per virtual stage: "
                         f"n_layers={cfg.n_layers} < n_ranks x n_chunks = {n_vs}")
    per = [len(a) for a in np.array_split(np.arange(cfg.n_layers), n_vs)]
    stages = ["t" * k for k in per]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * cfg.mtp_layers + "L"
    return Layout(tuple(stages), n_ranks)


def balanced_partition(costs: Sequence[float], n_parts: int) -> list[int]:
    """Cut ``costs`` into ``n_parts`` contiguous non-empty pieces minimising the largest
    piece; ties go to the smaller sum of squares. Returns the bounds ``[0, ..., n]``.

    Dynamic programme over (pieces used, items covered): O(n_parts · n²). The largest
    piece is optimal because a prefix cut with a smaller maximum is never worse.
    """
    arr = np.asarray(costs, dtype=float).reshape(-1)
    n = len(arr)
    prefix = np.concatenate([[0.0], np.cumsum(arr)])
    # best_max[k, i], best_sq[k, i]: the best (largest piece, sum of squares) of k pieces over
    # the first i items; back[k, i]: where its last piece starts.
    best_max = np.full((n_parts + 1, n + 1), math.inf)
    best_sq = np.full((n_parts + 1, n + 1), math.inf)
    back = np.zeros((n_parts + 1, n + 1), dtype=np.int64)
    best_max[0, 0] = best_sq[0, 0] = 0.0
    for k in range(1, n_parts + 1):
        for i in range(1, n + 1):
            seg = prefix[i] - prefix[:i]  # the last piece, for every start j < i
            cand_max = np.maximum(best_max[k - 1, :i], seg)
            cand_sq = best_sq[k - 1, :i] + seg * seg
            j = np.lexsort((cand_sq, cand_max))[0]  # the first of the smallest (max, squares)
            best_max[k, i], best_sq[k, i], back[k, i] = cand_max[j], cand_sq[j], j
    bounds = [n]
    for k in range(n_parts, 0, -1):
        bounds.append(int(back[k, bounds[-1]]))
    return bounds[::-1]


def _rank_objective(bounds: Sequence[int], prefix: np.ndarray, n_ranks: int) -> tuple:
    seg = prefix[np.asarray(bounds[1:])] - prefix[np.asarray(bounds[:-1])]
    loads = seg.reshape(-1, n_ranks).sum(axis=0)
    return (round(float(loads.max()), 12), round(float(seg.max()), 12), float((loads**2).sum()))


def _greedy_fill(item_costs: np.ndarray, n_ranks: int, n_vs: int, limit: float,
                 stage_limit: float = math.inf) -> list[int] | None:
    """Fill virtual stages in order, each up to what its rank has left under ``limit``
    (and at most ``stage_limit``) but at least one layer, leaving one for every later
    stage; the bounds, or None when the layers do not all fit."""
    loads = np.zeros(n_ranks)
    bounds, i, n = [0], 0, len(item_costs)
    slack = 1e-9 * max(limit, 1.0)
    for k in range(n_vs):
        room = min(limit - loads[k % n_ranks], stage_limit)
        taken = 0.0
        stop = n - (n_vs - k - 1)  # leave one layer for each later stage
        while i < stop and (taken == 0.0 and i == bounds[-1] or taken + item_costs[i] <= room + slack):
            taken += item_costs[i]
            i += 1
        loads[k % n_ranks] += taken
        bounds.append(i)
    return bounds if i == n else None


def _bisect(fill: Any, low: float, high: float) -> tuple[float, list[int]]:
    """The smallest limit in ``[low, high]`` (to 60 halvings) under which ``fill(limit)`` finds
    bounds, and those bounds (``fill(high)`` must find some)."""
    best = fill(high)
    for _ in range(60):
        mid = (low + high) / 2
        found = fill(mid)
        if found is None:
            low = mid
        else:
            high, best = mid, found
    return high, best


def _stage_objective(bounds: Sequence[int], prefix: np.ndarray, n_ranks: int) -> tuple:
    rank_max, stage_max, spread = _rank_objective(bounds, prefix, n_ranks)
    return (stage_max, rank_max, spread)


def _local_search(bounds: Sequence[int], prefix: np.ndarray, n_ranks: int, objective: Any) -> list[int]:
    """Move layers across stage boundaries while ``objective`` (a tuple) goes down.

    A move shifts the boundaries ``k .. K-1`` together by one layer, which hands one layer
    from virtual stage ``k-1`` to stage ``K-1`` through the stages between (a single
    boundary move is ``K = k + 1``); stages never become empty.
    """
    bounds = np.asarray(bounds)
    n_vs = len(bounds) - 1
    current = objective(bounds, prefix, n_ranks)
    improved = True
    while improved:
        improved = False
        for k in range(1, n_vs):
            for stop in range(k + 1, n_vs + 1):
                for step in (-1, 1):
                    moved = bounds.copy()
                    moved[k:stop] += step
                    if np.any(np.diff(moved) < 1):
                        continue
                    score = objective(moved, prefix, n_ranks)
                    if score < current:
                        bounds, current, improved = moved, score, True
    return [int(x) for x in bounds]


def search_layout(cfg: ModelConfig, costs: LayerCosts, n_ranks: int, n_chunks: int = 1, *,
                  n_microbatches: int | None = None) -> Layout:
    """A contiguous layout of ``cfg`` on ``n_ranks`` ranks that balances the work.

    One chunk per rank: exact. A dynamic programme over the contiguous cuts of
    ``E t… m L`` (the embedding, MTP and loss may sit alone or with their neighbours)
    minimises the slowest stage; ties go to the smaller spread.

    ``n_chunks`` > 1 (interleaved): a rank's work is the sum of ``n_chunks`` pieces far
    apart in the sequence, and two goals pull apart — the slowest *rank* sets the pace
    of the steady state, the largest *chunk* sets the interleaved schedule's warm-up and
    drain. Candidates come from the programme above (minimising the largest chunk) and
    from greedy fills under the smallest per-rank limit; each is improved by a local
    search that moves layers across boundaries, once for each goal. Without
    ``n_microbatches`` the candidate with the slowest rank lowest wins (the imbalance
    figure); with it, the one whose simulated step is shortest.
    """
    _check_stage_counts(cfg, n_ranks, n_chunks)
    chars = model_layer_chars(cfg)
    item_costs = np.array([costs.forward(k) for k in model_layer_kinds(cfg)])
    n_vs = n_ranks * n_chunks
    bounds = balanced_partition(item_costs, n_vs)
    if n_chunks > 1:
        prefix = np.concatenate([[0.0], np.cumsum(item_costs)])
        # Greedy fills under the smallest per-rank limit they meet, then under that limit with
        # the smallest per-stage limit they can then meet (bisections).
        limit, by_rank = _bisect(lambda mid: _greedy_fill(item_costs, n_ranks, n_vs, mid),
                                 float(item_costs.max()), float(item_costs.sum()))
        _, by_stage = _bisect(lambda mid: _greedy_fill(item_costs, n_ranks, n_vs, limit, mid), 0.0, limit)
        starts = [bounds, by_rank, by_stage]
        candidates: list[list[int]] = []
        for start in starts:
            for objective in (_rank_objective, _stage_objective):
                found = _local_search(start, prefix, n_ranks, objective)
                if found not in candidates:
                    candidates.append(found)
        if n_microbatches is None:
            bounds = min(candidates, key=lambda b: _rank_objective(b, prefix, n_ranks))
        else:
            def step_time(b: list[int]) -> tuple:
                fwd = prefix[np.asarray(b[1:])] - prefix[np.asarray(b[:-1])]
                result = simulate(fwd, n_microbatches=n_microbatches, n_ranks=n_ranks)
                return (round(result.makespan, 9), _rank_objective(b, prefix, n_ranks))

            bounds = min(candidates, key=step_time)
    return Layout(tuple(chars[bounds[k] : bounds[k + 1]] for k in range(len(bounds) - 1)), n_ranks)


def layout_report(layout: Layout, cfg: ModelConfig, costs: LayerCosts) -> dict[str, Any]:
    """The figures of one layout: stage and rank work, slowest rank, imbalance."""
    stage = stage_forward_costs(layout, cfg, costs)
    loads = rank_loads(layout, stage)
    return {"layout": format_layout(layout), "n_ranks": layout.n_ranks, "n_chunks": layout.n_chunks,
            "stage_costs": stage.tolist(), "rank_loads": loads.tolist(), "max_rank_load": float(loads.max()),
            "mean_rank_load": float(loads.mean()), "imbalance": stage_imbalance(loads), "unit": costs.unit}


def simulate_layout(layout: Layout, cfg: ModelConfig, costs: LayerCosts, n_microbatches: int, *,
                    delay_wgrad: bool = False) -> PipelineResult:
    """:func:`simulate` with per-stage costs taken from ``layout`` and ``costs`` (backward and
    weight gradient each as long as the forward), in the layout's default schedule."""
    fwd = stage_forward_costs(layout, cfg, costs)
    return simulate(fwd, n_microbatches=n_microbatches, n_ranks=layout.n_ranks, delay_wgrad=delay_wgrad)
