"""Exercises of notebook 10 (pipeline layout): a 1F1B order and a balanced cut.

- ``one_f_one_b_order(rank, n_ranks, n_microbatches)``: the operations one rank runs
  under 1F1B, as ``[("F", 0), ("F", 1), ..., ("B", 0), ...]`` — warm-up forwards, then
  one forward / one backward alternating, then the remaining backwards.
- ``balanced_cut(costs, n_stages)``: the stage boundaries ``[0, b1, ..., n]`` cutting a
  sequence of layer costs into ``n_stages`` contiguous, non-empty stages so that the most
  expensive stage is as cheap as it can be.

Each ``check_…`` runs the learner's function on fresh random inputs against the reference
in :mod:`moe_lab.sim.schedule` / :mod:`moe_lab.sim.layout_search` and raises `ExerciseError`
when an answer is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from moe_lab.sim.layout_search import balanced_partition
from moe_lab.sim.schedule import schedule_order
from moe_lab.workbench.exercises import ExerciseError, call_answer, exercise


def one_f_one_b_order(rank: int, n_ranks: int, n_microbatches: int) -> list[tuple[str, int]]:
    """1F1B on ``rank``: ``min(p - rank - 1, m)`` warm-up forwards, then alternate one
    forward and one backward, then drain the backwards."""
    return _with_warmup(n_ranks - rank - 1, n_microbatches)


def _with_warmup(warm: int, n_microbatches: int) -> list[tuple[str, int]]:
    """1F1B's shape with ``warm`` warm-up forwards (the right number or not; clamped to
    ``[0, n_microbatches]``)."""
    warm = max(0, min(warm, n_microbatches))
    ops = [("F", i) for i in range(warm)]
    for i in range(n_microbatches - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", i) for i in range(n_microbatches - warm, n_microbatches)]


@exercise(one_f_one_b_order)
def check_one_f_one_b_order(fn: Callable[[int, int, int], list]) -> None:
    """Raise `ExerciseError` unless ``fn`` gives every rank's 1F1B order on random sizes."""
    rng = np.random.default_rng()
    for _ in range(30):
        p, m = int(rng.integers(1, 9)), int(rng.integers(1, 13))
        for rank in range(p):
            want = [(k, i) for k, i, _ in schedule_order("1f1b", p, m)[rank]]
            got = call_answer(fn, rank, p, m)
            try:
                got_list = [(str(k), int(i)) for k, i in got]
            except (TypeError, ValueError):
                raise ExerciseError(
                    f"one_f_one_b_order({rank}, {p}, {m}) must return a list of "
                    f"(kind, micro-batch) pairs like ('F', 0), got {got!r}"
                ) from None
            if got_list != want:
                first = next(
                    (i for i, (a, b) in enumerate(zip(got_list, want, strict=False)) if a != b),
                    min(len(got_list), len(want)),
                )
                hints = []
                # Forwards before the first backward: the warm-up ones and the first of the
                # steady phase, which pairs a forward with a backward (fewer when m is small).
                warm = min(p - rank - 1, m)
                before_b0 = next((i for i, (kind, _) in enumerate(want) if kind == "B"), len(want))
                gpipe = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
                if got_list == gpipe:
                    hints.append(f"that is GPipe: under 1F1B rank {rank} of {p} starts its backwards after "
                                 f"{before_b0} forwards (min(p - rank - 1, m) = {warm} warm-up forwards, "
                                 "then forward and backward alternate)")
                for extra, what in ((1, "one warm-up forward too many"), (-1, "one warm-up forward too few")):
                    if got_list == _with_warmup(warm + extra, m):
                        then = (f"then its steady phase starts with a forward, so {before_b0} forwards come "
                                "before its first backward" if warm < m else
                                f"which are all {m} of its forwards")
                        hints.append(f"{what}: rank {rank} of {p} runs min(p - rank - 1, m) = {warm} "
                                     f"warm-up forwards, {then}")
                hint = f" ({'; or '.join(hints)})" if hints else ""
                raise ExerciseError(
                    f"one_f_one_b_order(rank={rank}, n_ranks={p}, n_microbatches={m}) "
                    f"differs at position {first}: got {got_list[first:first + 3]}, "
                    f"expected {want[first:first + 3]}{hint}"
                )
    print("✓ one_f_one_b_order is correct")


def balanced_cut(costs: Sequence[float], n_stages: int) -> list[int]:
    """Bounds of the contiguous cut minimising the largest stage (dynamic programme)."""
    return balanced_partition(np.asarray(costs, dtype=float), n_stages)


@exercise(balanced_cut)
def check_balanced_cut(fn: Callable[[Sequence[float], int], list]) -> None:
    """Raise `ExerciseError` unless ``fn`` cuts random cost lists optimally."""
    rng = np.random.default_rng()
    for _ in range(30):
        n = int(rng.integers(2, 30))
        k = int(rng.integers(1, min(n, 8) + 1))
        costs = np.round(rng.uniform(0.1, 3.0, size=n), 3)
        if rng.random() < 0.3:  # a heavy tail, like the loss layer of a real model
            costs[-1] *= 4
        got = call_answer(fn, costs.tolist(), k)
        try:
            bounds = [int(b) for b in got]
        except (TypeError, ValueError):
            raise ExerciseError(
                f"balanced_cut must return a list of {k + 1} integer bounds, got {got!r}"
            ) from None
        if len(bounds) != k + 1 or bounds[0] != 0 or bounds[-1] != n or any(
            b >= c for b, c in zip(bounds, bounds[1:], strict=False)
        ):
            raise ExerciseError(
                f"balanced_cut({costs.tolist()}, {k}) returned {bounds}: expected {k + 1} "
                f"strictly increasing bounds from 0 to {n} (every stage non-empty)"
            )
        worst = max(costs[a:b].sum() for a, b in zip(bounds, bounds[1:], strict=False))
        best_bounds = balanced_cut(costs, k)
        best = max(costs[a:b].sum() for a, b in zip(best_bounds, best_bounds[1:], strict=False))
        if worst > best * (1 + 1e-9):
            raise ExerciseError(
                f"balanced_cut({costs.tolist()}, {k}) returned {bounds}, whose slowest stage "
                f"costs {worst:.3f}; the best cut {best_bounds} gets {best:.3f}"
            )
    print("✓ balanced_cut is correct")
