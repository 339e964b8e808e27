"""Pipeline parallelism, simulated: layouts, schedules, bubbles and stage imbalance.

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
stage's backward, plus an optional point-to-point latency between ranks). The closed
forms above come *out* of the simulation and the tests hold it to them.

Layouts are written the way Megatron-Core's ``--pipeline-model-parallel-layout`` writes
them. The grammar (a superset of Megatron's: groups may nest, ``*`` may follow any item)::

    layout := item*                 # whitespace and ',' are cosmetic and ignored
    item   := atom ('*' count)?     # count >= 1: repeat the atom count times
    atom   := 'E' | 't' | 'm' | 'L' | '|' | '(' item+ ')'

``E`` is the embedding, ``t`` a transformer layer (the first ``n_dense_layers`` are dense,
the rest MoE), ``m`` a multi-token-prediction layer, ``L`` the loss with its logits GEMM,
``|`` ends a stage. After expansion the string splits at ``|`` into ``p * v`` virtual
stages in pipeline order; virtual stage ``k`` lives on rank ``k % p`` as its chunk
``k // p`` (Megatron's convention). ``"Et*3|(tt|)*29,m|L"`` is DeepSeek-V3 on 16 ranks
with 2 chunks each: ``Ettt``, 29 stages of ``tt``, then ``m`` and ``L`` on their own.

Costs per layer come from the FLOPs model (:func:`moe_lab.perf.flops.layer_flops_per_token`):
the simulator's time unit is "GFLOP per token of forward work", which is proportional to
time for a rank running at a fixed rate. The search (:func:`search_layout`) cuts the layer
sequence into contiguous stages minimising the slowest rank; layers are indivisible, so
the best layout is only as balanced as the layer granularity allows.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from moe_lab.config import ModelConfig

LAYER_CHARS = {"E": "embedding", "t": "transformer", "m": "mtp", "L": "logits"}
LAYER_KINDS = ("embedding", "dense", "moe", "mtp", "logits")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
OP_KINDS = ("F", "B", "W")
MAX_LAYOUT_ITEMS = 100_000  # a typo like "t*99999999" fails fast instead of eating memory

# ---------------------------------------------------------------------------- layouts


class _LayoutParser:
    """Recursive descent over the grammar in the module docstring; positions are 0-based."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, pos: int, problem: str) -> NoReturn:
        shown = self.text[:pos] + " <here> " + self.text[pos:]
        raise ValueError(f"layout {self.text!r}: {problem} at position {pos} ({shown!r})")

    def skip_cosmetic(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in ", \t\n":
            self.pos += 1

    def parse(self) -> list[str]:
        return self.items(open_pos=None)

    def items(self, open_pos: int | None) -> list[str]:
        out: list[str] = []
        while True:
            self.skip_cosmetic()
            if self.pos >= len(self.text):
                if open_pos is not None:
                    self.fail(open_pos, "'(' is never closed")
                return out
            ch = self.text[self.pos]
            if ch == ")":
                if open_pos is None:
                    self.fail(self.pos, "')' without a matching '('")
                if not out:
                    self.fail(self.pos, "empty group '()'")
                return out
            start = self.pos
            atom = self.atom()
            out.extend(atom * self.count())
            if len(out) > MAX_LAYOUT_ITEMS:
                self.fail(start, f"the layout expands to more than {MAX_LAYOUT_ITEMS} items")

    def atom(self) -> list[str]:
        ch = self.text[self.pos]
        if ch in LAYER_CHARS or ch == "|":
            self.pos += 1
            return [ch]
        if ch == "(":
            open_pos = self.pos
            self.pos += 1
            inner = self.items(open_pos)
            self.pos += 1  # the ')' that items() stopped at
            return inner
        if ch == "*":
            self.fail(self.pos, "'*' must follow a layer, '|' or a ')'")
        self.fail(
            self.pos,
            f"unknown character {ch!r} (expected one of E t m L | ( ) * digits ,)",
        )

    def count(self) -> int:
        if self.pos >= len(self.text) or self.text[self.pos] != "*":
            return 1
        star = self.pos
        self.pos += 1
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isdigit():
            self.pos += 1
        if start == self.pos:
            self.fail(start, "expected a repeat count (digits) after '*'")
        value = int(self.text[start : self.pos])
        if value < 1:
            self.fail(star, f"repeat count must be >= 1, got {value}")
        return value


@dataclass(frozen=True)
class Layout:
    """Layers cut into pipeline stages.

    ``stages[k]`` is virtual stage ``k`` in pipeline order, written as its layer characters
    (``"Ettt"``); it lives on rank ``k % n_ranks`` as that rank's chunk ``k // n_ranks``.
    """

    stages: tuple[str, ...]
    n_ranks: int

    def __post_init__(self) -> None:
        if not isinstance(self.n_ranks, int) or self.n_ranks < 1:
            raise ValueError(f"Layout.n_ranks must be a positive integer, got {self.n_ranks!r}")
        if not self.stages or len(self.stages) % self.n_ranks:
            raise ValueError(
                f"Layout has {len(self.stages)} virtual stages; that must be a positive "
                f"multiple of n_ranks={self.n_ranks}"
            )
        for k, stage in enumerate(self.stages):
            bad = set(stage) - set(LAYER_CHARS)
            if bad:
                raise ValueError(
                    f"Layout stage {k} {stage!r} holds {sorted(bad)}; expected only "
                    f"{sorted(LAYER_CHARS)}"
                )

    @property
    def n_chunks(self) -> int:
        """Virtual stages per rank (Megatron's VPP size)."""
        return len(self.stages) // self.n_ranks

    def rank_of(self, stage: int) -> int:
        """The rank that runs virtual stage ``stage``."""
        return stage % self.n_ranks

    def rank_stages(self, rank: int) -> list[int]:
        """The virtual stages of ``rank``, chunk 0 first."""
        return [c * self.n_ranks + rank for c in range(self.n_chunks)]

    def layers(self) -> str:
        """All layer characters in pipeline order (the stages concatenated)."""
        return "".join(self.stages)

    def __str__(self) -> str:
        return format_layout(self)


def parse_layout(text: str, n_ranks: int | None = None) -> Layout:
    """Parse a Megatron-style layout string (grammar in the module docstring).

    ``n_ranks`` is the pipeline size; the number of virtual stages must be a multiple of
    it. Default: one chunk per rank (``n_ranks`` = number of stages).

    Raises:
        ValueError: naming the position of a syntax error, or a stage count that
            ``n_ranks`` does not divide.
    """
    if not isinstance(text, str):
        raise ValueError(f"layout must be a string, got {type(text).__name__}")
    tokens = _LayoutParser(text).parse()
    if not tokens:
        raise ValueError(f"layout {text!r} holds no layers")
    stages = tuple("".join(tokens).split("|"))
    if n_ranks is None:
        n_ranks = len(stages)
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise ValueError(f"n_ranks must be a positive integer, got {n_ranks!r}")
    if len(stages) % n_ranks:
        raise ValueError(
            f"layout {text!r} has {len(stages)} stages, which n_ranks={n_ranks} does not "
            f"divide (expected a multiple of {n_ranks}: n_ranks x virtual stages per rank)"
        )
    return Layout(stages, n_ranks)


def _format_stage(stage: str) -> str:
    out = []
    i = 0
    while i < len(stage):
        j = i
        while j < len(stage) and stage[j] == stage[i]:
            j += 1
        run = j - i
        literal = stage[i] * run
        starred = f"{stage[i]}*{run}"
        out.append(starred if len(starred) < len(literal) else literal)
        i = j
    return "".join(out)


def format_layout(layout: Layout | Sequence[str]) -> str:
    """The compact layout string: ``parse_layout(format_layout(x)).stages == x.stages``.

    Runs of a layer become ``t*4`` where that is shorter; runs of identical stages
    become ``(tt|)*29`` followed by a cosmetic comma, as in Megatron's documentation.
    """
    stages = list(layout.stages if isinstance(layout, Layout) else layout)
    if not stages:
        raise ValueError("format_layout needs at least one stage, got none")
    runs: list[tuple[str, int]] = []
    for stage in stages:
        if runs and runs[-1][0] == stage:
            runs[-1] = (stage, runs[-1][1] + 1)
        else:
            runs.append((stage, 1))
    out = ""
    for index, (stage, n) in enumerate(runs):
        text = _format_stage(stage)
        last = index == len(runs) - 1
        # n copies, each followed by '|' except after the very last stage of the layout.
        n_sep = n if not last else n - 1
        plain = "|".join([text] * n) + ("|" if not last else "")
        grouped = None
        if n_sep >= 2:
            grouped = f"({text}|)*{n_sep}"
            if last:
                grouped += f",{text}" if text else ""
            else:
                grouped += ","
        if grouped is not None and len(grouped) < len(plain):
            out += grouped
        else:
            out += plain
    return out


def model_layer_kinds(cfg: ModelConfig) -> list[str]:
    """The layer kinds of ``cfg`` in pipeline order: embedding, dense…, moe…, mtp…, logits."""
    return (
        ["embedding"]
        + ["dense"] * cfg.n_dense_layers
        + ["moe"] * cfg.n_moe_layers
        + ["mtp"] * cfg.mtp_layers
        + ["logits"]
    )


def model_layer_chars(cfg: ModelConfig) -> str:
    """``cfg``'s layers as layout characters: ``"E" + "t" * n_layers + "m" * mtp + "L"``."""
    return "E" + "t" * cfg.n_layers + "m" * cfg.mtp_layers + "L"


def check_layout(layout: Layout, cfg: ModelConfig) -> None:
    """Raise ``ValueError`` unless ``layout`` places every layer of ``cfg`` exactly once.

    Expected: ``E`` first, ``L`` last, ``n_layers`` transformer layers, ``mtp_layers``
    MTP layers after the last transformer layer.
    """
    layers = layout.layers()
    expected = model_layer_chars(cfg)
    counts = {c: layers.count(c) for c in LAYER_CHARS}
    wanted = {c: expected.count(c) for c in LAYER_CHARS}
    problems = [
        f"{counts[c]} × {c!r} ({LAYER_CHARS[c]}), expected {wanted[c]}"
        for c in LAYER_CHARS
        if counts[c] != wanted[c]
    ]
    if problems:
        raise ValueError(
            f"layout {format_layout(layout)!r} does not cover the layers of "
            f"{cfg.name!r}: " + "; ".join(problems)
        )
    if layers != expected:
        raise ValueError(
            f"layout {format_layout(layout)!r} has the right layers in the wrong order: "
            f"expected 'E' first, then the transformer layers, then 'm', then 'L' last"
        )


# ---------------------------------------------------------------------------- costs


@dataclass(frozen=True)
class LayerCosts:
    """Forward work of one micro-batch through one layer of each kind.

    Backward is split into the input gradient B (``backward_ratio`` × forward) and the
    weight gradient W (``wgrad_ratio`` × forward); for a GEMM each is about one forward,
    which gives the familiar "backward = 2 × forward".
    """

    embedding: float
    dense: float
    moe: float
    mtp: float
    logits: float
    backward_ratio: float = 1.0
    wgrad_ratio: float = 1.0
    unit: str = "GFLOP/token"

    def __post_init__(self) -> None:
        for name in (*LAYER_KINDS, "backward_ratio", "wgrad_ratio"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"LayerCosts.{name} must be a finite number >= 0, got {value!r}")

    def forward(self, kind: str) -> float:
        """Forward cost of one layer of ``kind`` (one of ``LAYER_KINDS``)."""
        if kind not in LAYER_KINDS:
            raise ValueError(f"layer kind must be one of {LAYER_KINDS}, got {kind!r}")
        return float(getattr(self, kind))

    def replace(self, **changes: Any) -> LayerCosts:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The costs as a plain dict."""
        return dataclasses.asdict(self)


def layer_costs(
    cfg: ModelConfig,
    seq_len: int | None = None,
    *,
    logits_scale: float = 1.0,
) -> LayerCosts:
    """Forward GFLOP per token of one layer of each kind, from the FLOPs model.

    ``moe_lab.perf.flops.layer_flops_per_token`` gives *training* FLOPs (forward +
    backward = 3 × forward for GEMMs); a third of it is the forward. ``logits_scale``
    multiplies the cost of the logits GEMM — 0.5 models running it in MXFP8 at twice the
    bf16 rate. The MTP layer's own output head is the same GEMM, so its share of the MTP
    layer is scaled too.
    """
    if not (isinstance(logits_scale, (int, float)) and 0 < logits_scale <= 10):
        raise ValueError(f"logits_scale must be in (0, 10], got {logits_scale!r}")
    from moe_lab.perf.flops import layer_flops_per_token

    flops = layer_flops_per_token(cfg, seq_len if seq_len is not None else cfg.seq_len)
    fwd = {kind: float(flops[kind]) / 3e9 for kind in LAYER_KINDS}
    logits = fwd["logits"]
    mtp = fwd["mtp"]
    if cfg.mtp_layers and mtp > logits:
        # The MTP block holds a transformer layer, a projection and its own output head.
        mtp = mtp - logits + logits * logits_scale
    return LayerCosts(
        embedding=fwd["embedding"],
        dense=fwd["dense"],
        moe=fwd["moe"],
        mtp=mtp,
        logits=logits * logits_scale,
    )


def stage_forward_costs(layout: Layout, cfg: ModelConfig, costs: LayerCosts) -> np.ndarray:
    """Forward work of each virtual stage of ``layout``: ``[n_ranks * n_chunks]``."""
    check_layout(layout, cfg)
    kinds = iter(model_layer_kinds(cfg))
    out = np.zeros(len(layout.stages))
    for k, stage in enumerate(layout.stages):
        out[k] = sum(costs.forward(next(kinds)) for _ in stage)
    return out


def rank_loads(layout: Layout, stage_costs: Sequence[float]) -> np.ndarray:
    """Work per rank: the sum of its chunks' costs, ``[n_ranks]``."""
    costs = np.asarray(stage_costs, dtype=float)
    return costs.reshape(layout.n_chunks, layout.n_ranks).sum(axis=0)


def stage_imbalance(loads: Sequence[float]) -> float:
    """``(max - mean) / mean`` of the per-rank work: 0 is perfect balance."""
    arr = np.asarray(loads, dtype=float)
    if arr.size == 0 or arr.mean() <= 0:
        raise ValueError(f"loads must be non-empty with a positive mean, got {arr.tolist()}")
    return float((arr.max() - arr.mean()) / arr.mean())


def _layout_from_bounds(chars: str, bounds: Sequence[int], n_ranks: int) -> Layout:
    return Layout(tuple(chars[bounds[k] : bounds[k + 1]] for k in range(len(bounds) - 1)), n_ranks)


def _check_stage_counts(cfg: ModelConfig, n_ranks: int, n_chunks: int) -> None:
    for name, value in (("n_ranks", n_ranks), ("n_chunks", n_chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    n_items = len(model_layer_chars(cfg))
    if n_ranks * n_chunks > n_items:
        raise ValueError(
            f"n_ranks x n_chunks = {n_ranks * n_chunks} virtual stages is impossible for "
            f"{cfg.name!r}: it has only {n_items} layers including E, m and L"
        )


def even_layout(cfg: ModelConfig, n_ranks: int, n_chunks: int = 1) -> Layout:
    """The naive split: transformer layers spread as evenly as the counts allow (the first
    stages get the extra ones), the embedding on the first stage, MTP and loss on the last.
    """
    _check_stage_counts(cfg, n_ranks, n_chunks)
    n_vs = n_ranks * n_chunks
    if cfg.n_layers < n_vs:
        raise ValueError(
            f"even_layout needs at least one transformer layer per virtual stage: "
            f"n_layers={cfg.n_layers} < n_ranks x n_chunks = {n_vs}"
        )
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
    if not isinstance(n_parts, int) or not 1 <= n_parts <= n:
        raise ValueError(f"n_parts must be an integer in [1, {n}] (one item each), got {n_parts!r}")
    prefix = np.concatenate([[0.0], np.cumsum(arr)])
    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(n_parts + 1)]
    back = [[0] * (n + 1) for _ in range(n_parts + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, n_parts + 1):
        for i in range(n + 1):
            row_best, row_j = inf, 0
            for j in range(i):
                prev = best[k - 1][j]
                if prev[0] == math.inf:
                    continue
                seg = prefix[i] - prefix[j]
                cand = (max(prev[0], seg), prev[1] + seg * seg)
                if cand < row_best:
                    row_best, row_j = cand, j
            best[k][i] = row_best
            back[k][i] = row_j
    bounds = [n]
    for k in range(n_parts, 0, -1):
        bounds.append(back[k][bounds[-1]])
    return bounds[::-1]


def _rank_objective(bounds: Sequence[int], prefix: np.ndarray, n_ranks: int) -> tuple:
    seg = prefix[np.asarray(bounds[1:])] - prefix[np.asarray(bounds[:-1])]
    loads = seg.reshape(-1, n_ranks).sum(axis=0)
    return (round(float(loads.max()), 12), round(float(seg.max()), 12), float((loads**2).sum()))


def _greedy_fill(
    item_costs: np.ndarray,
    n_ranks: int,
    n_vs: int,
    limit: float,
    stage_limit: float = math.inf,
) -> list[int] | None:
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


def _greedy_rank_bounds(item_costs: np.ndarray, n_ranks: int, n_vs: int) -> list[list[int]]:
    """Two greedy fills: under the smallest per-rank limit the greedy can meet, and under
    that limit with the smallest per-stage limit it can then meet (bisections)."""
    low, high = float(item_costs.max()), float(item_costs.sum())
    best = _greedy_fill(item_costs, n_ranks, n_vs, high)
    for _ in range(60):
        mid = (low + high) / 2
        found = _greedy_fill(item_costs, n_ranks, n_vs, mid)
        if found is None:
            low = mid
        else:
            high, best = mid, found
    assert best is not None  # the whole sum always fits in the first stage
    limit = high
    low, stage_high = 0.0, limit
    balanced = best
    for _ in range(60):
        mid = (low + stage_high) / 2
        found = _greedy_fill(item_costs, n_ranks, n_vs, limit, mid)
        if found is None:
            low = mid
        else:
            stage_high, balanced = mid, found
    return [best, balanced]


def _stage_objective(bounds: Sequence[int], prefix: np.ndarray, n_ranks: int) -> tuple:
    rank_max, stage_max, spread = _rank_objective(bounds, prefix, n_ranks)
    return (stage_max, rank_max, spread)


def _local_search(
    bounds: Sequence[int], prefix: np.ndarray, n_ranks: int, objective: Any
) -> list[int]:
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


def search_layout(
    cfg: ModelConfig,
    costs: LayerCosts,
    n_ranks: int,
    n_chunks: int = 1,
    *,
    n_microbatches: int | None = None,
) -> Layout:
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
        starts = [bounds, *_greedy_rank_bounds(item_costs, n_ranks, n_vs)]
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
                result = simulate(fwd, fwd * costs.backward_ratio, fwd * costs.wgrad_ratio,
                                  n_microbatches=n_microbatches, n_ranks=n_ranks)
                return (round(result.makespan, 9), _rank_objective(b, prefix, n_ranks))

            bounds = min(candidates, key=step_time)
    return _layout_from_bounds(chars, bounds, n_ranks)


def layout_report(layout: Layout, cfg: ModelConfig, costs: LayerCosts) -> dict[str, Any]:
    """The figures of one layout: stage and rank work, slowest rank, imbalance."""
    stage = stage_forward_costs(layout, cfg, costs)
    loads = rank_loads(layout, stage)
    return {
        "layout": format_layout(layout),
        "n_ranks": layout.n_ranks,
        "n_chunks": layout.n_chunks,
        "stage_costs": stage.tolist(),
        "rank_loads": loads.tolist(),
        "max_rank_load": float(loads.max()),
        "mean_rank_load": float(loads.mean()),
        "imbalance": stage_imbalance(loads),
        "unit": costs.unit,
    }


# ---------------------------------------------------------------------------- schedules


def bubble_1f1b(n_ranks: int, n_microbatches: int) -> float:
    """Closed-form bubble fraction of 1F1B (and GPipe) with equal stages: (p-1)/(m+p-1)."""
    return (n_ranks - 1) / (n_microbatches + n_ranks - 1)


def bubble_interleaved(n_ranks: int, n_microbatches: int, n_chunks: int) -> float:
    """Closed-form bubble fraction of interleaved 1F1B: (p-1)/(v·m+p-1)."""
    return (n_ranks - 1) / (n_chunks * n_microbatches + n_ranks - 1)


Op = tuple[str, int, int]  # (kind "F"/"B"/"W", micro-batch, chunk)


def schedule_order(
    schedule: str, n_ranks: int, n_microbatches: int, n_chunks: int = 1
) -> list[list[Op]]:
    """Each rank's forward/backward operations in execution order.

    ``gpipe``: all forwards, then all backwards. ``1f1b``: rank ``r`` runs ``p - r - 1``
    warm-up forwards, then alternates one forward and one backward, then drains the
    backwards. ``interleaved``: Megatron's interleaved 1F1B over ``n_chunks`` chunks per
    rank; micro-batches go in groups of ``p`` through chunk 0, then chunk 1, ...;
    warm-up ``2(p - r - 1) + (v - 1)p`` forwards. (W operations, when the weight gradient is
    delayed, are not in these lists: the simulator slots them in.)
    """
    _check_schedule_args(schedule, n_ranks, n_microbatches, n_chunks)
    p, m, v = n_ranks, n_microbatches, n_chunks
    orders: list[list[Op]] = []
    for r in range(p):
        if schedule == "gpipe":
            ops = [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
        elif schedule == "1f1b":
            warm = min(p - r - 1, m)
            ops = [("F", i, 0) for i in range(warm)]
            for i in range(m - warm):
                ops += [("F", warm + i, 0), ("B", i, 0)]
            ops += [("B", i, 0) for i in range(m - warm, m)]
        else:
            fwd = [
                (i, c)
                for g in range(0, m, p)
                for c in range(v)
                for i in range(g, min(g + p, m))
            ]
            bwd = [
                (i, v - 1 - c)
                for g in range(0, m, p)
                for c in range(v)
                for i in range(g, min(g + p, m))
            ]
            total = m * v
            warm = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
            ops = [("F", i, c) for i, c in fwd[:warm]]
            for k in range(total - warm):
                ops += [("F", *fwd[warm + k]), ("B", *bwd[k])]
            ops += [("B", i, c) for i, c in bwd[total - warm :]]
        orders.append(ops)
    return orders


def _check_schedule_args(schedule: str, n_ranks: int, n_microbatches: int, n_chunks: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for name, value in (
        ("n_ranks", n_ranks),
        ("n_microbatches", n_microbatches),
        ("n_chunks", n_chunks),
    ):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if schedule != "interleaved" and n_chunks != 1:
        raise ValueError(
            f"schedule {schedule!r} runs one chunk per rank, got n_chunks={n_chunks} "
            "(use schedule='interleaved')"
        )
    if schedule == "interleaved" and n_chunks > 1 and n_microbatches % n_ranks:
        raise ValueError(
            f"interleaved 1F1B takes micro-batches in groups of n_ranks={n_ranks}; "
            f"n_microbatches={n_microbatches} must be a multiple of it"
        )


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
    delay_wgrad: bool
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

    def to_dict(self) -> dict[str, Any]:
        """The figures (not the timeline) as plain JSON-able values."""
        return {
            "schedule": self.schedule,
            "n_ranks": self.n_ranks,
            "n_chunks": self.n_chunks,
            "n_microbatches": self.n_microbatches,
            "delay_wgrad": self.delay_wgrad,
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "imbalance": self.imbalance,
            "busy": self.busy.tolist(),
            "n_ops": int(self.rank.size),
        }


def _as_costs(name: str, values: Sequence[float] | None, n: int, default: np.ndarray) -> np.ndarray:
    if values is None:
        return default.copy()
    arr = np.asarray(values, dtype=float).reshape(-1)
    if arr.size != n:
        raise ValueError(f"{name} must hold one cost per virtual stage ({n}), got {arr.size}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and >= 0, got {arr.tolist()}")
    return arr


def simulate(
    forward: Sequence[float],
    backward: Sequence[float] | None = None,
    wgrad: Sequence[float] | None = None,
    *,
    n_microbatches: int,
    n_ranks: int | None = None,
    schedule: str | None = None,
    delay_wgrad: bool = False,
    p2p_latency: float = 0.0,
    max_deferred_wgrad: int | None = None,
) -> PipelineResult:
    """Simulate one training step of a pipeline, event by event.

    Args:
        forward: forward time of one micro-batch on each virtual stage, ``[p * v]`` in
            pipeline order (virtual stage ``k`` on rank ``k % p``).
        backward: input-gradient time B per virtual stage; default = ``forward``.
        wgrad: weight-gradient time W per virtual stage; default = ``forward``.
        n_microbatches: micro-batches per step, ``m`` >= 1.
        n_ranks: pipeline ranks ``p``; default ``len(forward)`` (one chunk each).
        schedule: "gpipe", "1f1b" or "interleaved"; default "1f1b" for one chunk per
            rank, "interleaved" otherwise.
        delay_wgrad: split each backward into B then W and defer W: a rank runs a pending
            W whenever its next F/B is not ready yet (or the backlog exceeds
            ``max_deferred_wgrad``), and drains the rest at the end. Without it, B and W
            run as one backward operation.
        p2p_latency: added to a dependency that crosses ranks (send/recv time).
        max_deferred_wgrad: with ``delay_wgrad``, the most W operations a rank may hold
            back (each keeps a layer's activations and output gradient alive); ``p - 1``
            matches zero-bubble H1's memory, ``None`` is unlimited.

    Every rank executes its schedule's operations in order; an operation starts at the
    first moment its rank is free and its dependency has arrived.
    """
    f = np.asarray(forward, dtype=float).reshape(-1)
    n_vs = f.size
    if n_vs == 0:
        raise ValueError("forward must hold at least one virtual stage, got none")
    if n_ranks is None:
        n_ranks = n_vs
    if not isinstance(n_ranks, int) or n_ranks < 1 or n_vs % n_ranks:
        raise ValueError(
            f"n_ranks must be a positive integer dividing the {n_vs} virtual stages, "
            f"got {n_ranks!r}"
        )
    f = _as_costs("forward", f, n_vs, f)
    b = _as_costs("backward", backward, n_vs, f)
    w = _as_costs("wgrad", wgrad, n_vs, f)
    p, v = n_ranks, n_vs // n_ranks
    if schedule is None:
        schedule = "1f1b" if v == 1 else "interleaved"
    if not (isinstance(p2p_latency, (int, float)) and p2p_latency >= 0):
        raise ValueError(f"p2p_latency must be a number >= 0, got {p2p_latency!r}")
    if max_deferred_wgrad is not None and (
        not isinstance(max_deferred_wgrad, int) or max_deferred_wgrad < 0
    ):
        raise ValueError(
            f"max_deferred_wgrad must be None or an integer >= 0, got {max_deferred_wgrad!r}"
        )
    order = schedule_order(schedule, p, n_microbatches, v)
    m = n_microbatches
    last = n_vs - 1

    end: dict[tuple[str, int, int], float] = {}

    def arrival(kind: str, mb: int, vs: int) -> float:
        if kind == "F":
            dep = ("F", mb, vs - 1) if vs > 0 else None
        elif kind == "B":
            dep = ("B", mb, vs + 1) if vs < last else ("F", mb, vs)
        else:
            dep = ("B", mb, vs)
        if dep is None:
            return 0.0
        done = end.get(dep)
        if done is None:
            return math.inf
        crosses = dep[2] % p != vs % p
        return done + (p2p_latency if crosses else 0.0)

    free_at = [0.0] * p
    ptr = [0] * p
    pending: list[deque[Op]] = [deque() for _ in range(p)]
    rows: list[tuple[int, str, int, int, float, float]] = []
    events = [0.0]
    scale = float(f.sum() + b.sum() + w.sum()) * m + 1.0
    eps = 1e-12 * scale
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
                choice: Op | None = None
                if max_deferred_wgrad is not None and len(pending[r]) > max_deferred_wgrad:
                    choice = pending[r].popleft()
                elif ptr[r] < len(order[r]):
                    kind, mb, c = order[r][ptr[r]]
                    if arrival(kind, mb, c * p + r) <= t + eps:
                        choice = (kind, mb, c)
                        ptr[r] += 1
                    elif pending[r]:
                        choice = pending[r].popleft()
                elif pending[r]:
                    choice = pending[r].popleft()
                if choice is None:
                    continue
                kind, mb, c = choice
                vs = c * p + r
                if kind == "F":
                    duration = f[vs]
                elif kind == "B":
                    duration = b[vs] if delay_wgrad else b[vs] + w[vs]
                else:
                    duration = w[vs]
                stop = t + float(duration)
                end[(kind, mb, vs)] = stop
                free_at[r] = stop
                rows.append((r, kind, mb, c, t, stop))
                if kind == "B" and delay_wgrad:
                    pending[r].append(("W", mb, c))
                heapq.heappush(events, stop)
                if p2p_latency:
                    heapq.heappush(events, stop + p2p_latency)
                progressed = True
    unfinished = [r for r in range(p) if ptr[r] < len(order[r]) or pending[r]]
    if unfinished:
        raise RuntimeError(
            f"schedule {schedule!r} deadlocked with p={p}, v={v}, m={m}: ranks {unfinished} "
            "wait for operations that never run"
        )
    arr = np.array([row[4:] for row in rows], dtype=float)
    ranks = np.array([row[0] for row in rows], dtype=np.int64)
    busy = np.bincount(ranks, weights=arr[:, 1] - arr[:, 0], minlength=p)
    return PipelineResult(
        schedule=schedule,
        n_ranks=p,
        n_chunks=v,
        n_microbatches=m,
        delay_wgrad=delay_wgrad,
        rank=ranks,
        kind=np.array([row[1] for row in rows]),
        microbatch=np.array([row[2] for row in rows], dtype=np.int64),
        chunk=np.array([row[3] for row in rows], dtype=np.int64),
        start=arr[:, 0],
        end=arr[:, 1],
        makespan=float(arr[:, 1].max()),
        busy=busy,
    )


def simulate_layout(
    layout: Layout,
    cfg: ModelConfig,
    costs: LayerCosts,
    n_microbatches: int,
    *,
    schedule: str | None = None,
    delay_wgrad: bool = False,
    p2p_latency: float = 0.0,
) -> PipelineResult:
    """:func:`simulate` with per-stage costs taken from ``layout`` and ``costs``."""
    fwd = stage_forward_costs(layout, cfg, costs)
    return simulate(
        fwd,
        fwd * costs.backward_ratio,
        fwd * costs.wgrad_ratio,
        n_microbatches=n_microbatches,
        n_ranks=layout.n_ranks,
        schedule=schedule,
        delay_wgrad=delay_wgrad,
        p2p_latency=p2p_latency,
    )


# ---------------------------------------------------------------------------- figures

_OP_COLOURS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452"}


def plot_gantt(
    result: PipelineResult, ax: Any = None, *, title: str | None = None, labels: bool = True
) -> Any:
    """Draw ``result`` as a Gantt chart: one row per rank, F blue, B green, W orange.

    Chunks after the first are drawn lighter. Returns the matplotlib axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * result.n_ranks + 1.2))
    for kind, colour in _OP_COLOURS.items():
        for c in range(result.n_chunks):
            sel = (result.kind == kind) & (result.chunk == c)
            if not sel.any():
                continue
            alpha = 1.0 - 0.45 * c / max(result.n_chunks - 1, 1)
            for r in np.unique(result.rank[sel]):
                rs = sel & (result.rank == r)
                bars = list(zip(result.start[rs], result.end[rs] - result.start[rs], strict=True))
                ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=colour, alpha=alpha,
                               edgecolor="white", linewidth=0.5)
    if labels and result.rank.size <= 600:
        width = result.makespan
        for r, mb, s, e in zip(result.rank, result.microbatch, result.start, result.end,
                               strict=True):
            if (e - s) > 0.012 * width:
                ax.text((s + e) / 2, r, str(mb), ha="center", va="center", fontsize=6,
                        color="white")
    ax.set_yticks(range(result.n_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(result.n_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan * 1.01)
    ax.set_xlabel("simulated time (work units)")
    kinds_present = [k for k in OP_KINDS if (result.kind == k).any()]
    ax.legend(handles=[Patch(color=_OP_COLOURS[k], label=k) for k in kinds_present],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or (
        f"{result.schedule}, p={result.n_ranks}, v={result.n_chunks}, m={result.n_microbatches}"
        f" — bubble {result.bubble_fraction:.1%} (simulated)"
    ), fontsize=9)
    return ax


def step_figure(
    n_ranks: int = 8,
    n_chunks: int = 1,
    microbatches: int = 16,
    mxfp8_logits: int = 0,
    delay_wgrad: int = 0,
    preset_name: str = "deepseek_v3",
) -> Any:
    """The explorer's figure: a preset's even and searched layouts on ``n_ranks`` ranks —
    the work per rank of each, and the Gantt chart of the searched one's simulated step.

    Slider-friendly: ``microbatches`` is rounded up to a multiple of ``n_ranks`` when
    ``n_chunks`` > 1; ``mxfp8_logits`` and ``delay_wgrad`` are 0/1 switches.
    """
    import matplotlib.pyplot as plt

    from moe_lab.config import preset

    cfg = preset(preset_name)
    costs = layer_costs(cfg, logits_scale=0.5 if mxfp8_logits else 1.0)
    n_chunks = max(1, min(n_chunks, len(model_layer_chars(cfg)) // n_ranks))
    if n_chunks > 1:
        microbatches = -(-microbatches // n_ranks) * n_ranks
    searched = search_layout(cfg, costs, n_ranks, n_chunks,
                             n_microbatches=microbatches if n_chunks > 1 else None)
    layouts = {"searched": searched}
    if n_ranks * n_chunks <= cfg.n_layers:
        layouts = {"even": even_layout(cfg, n_ranks, n_chunks), **layouts}
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 2.6 + 0.3 * n_ranks), gridspec_kw={"height_ratios": [1, 1.6]}
    )
    width = 0.8 / len(layouts)
    notes = []
    for i, (name, lay) in enumerate(layouts.items()):
        report = layout_report(lay, cfg, costs)
        step = simulate_layout(lay, cfg, costs, microbatches, delay_wgrad=bool(delay_wgrad))
        loads = np.asarray(report["rank_loads"])
        top.bar(np.arange(n_ranks) + (i - (len(layouts) - 1) / 2) * width, loads, width,
                label=f"{name}: imbalance {report['imbalance']:.1%}, step {step.makespan:,.0f}")
        notes.append(f"{name} {format_layout(lay)}")
    top.axhline(loads.mean(), color="k", ls=":", lw=1)
    top.set_xlabel("pipeline rank")
    top.set_ylabel(f"forward work ({costs.unit})")
    top.legend(fontsize=7, loc="lower right")
    top.set_title(f"{preset_name}, logits {'MXFP8 (x0.5)' if mxfp8_logits else 'bf16'} — "
                  "simulated, from the FLOPs model", fontsize=9)
    plot_gantt(step, ax=bottom, labels=n_ranks * microbatches * n_chunks <= 256)
    bottom.set_xlabel("simulated time (" + costs.unit + " of work)\n" + "\n".join(notes),
                      fontsize=8)
    fig.tight_layout()
    return fig
