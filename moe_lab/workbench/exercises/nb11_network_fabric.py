"""Exercises of notebook 11 (network fabric): ECMP collisions and fair sharing.

- ``expected_fullest_uplink(n_flows, n_spines)``: ECMP hashes ``n_flows`` flows of a leaf
  onto its ``n_spines`` uplinks uniformly at random; the exact expected number of flows on
  the fullest uplink — what an all-to-all waits for. No closed form: ``E[max] = Σ_k P(max >
  k)``, with ``P(max ≤ k)`` counted (a truncated generating function raised to the
  ``n_spines``-th power, or a recursion over uplinks). Checked against
  `moe_lab.sim.fabric.expected_max_load`.
- ``fair_share(demands, capacity)``: one link of ``capacity`` shared by flows that each
  want at most ``demands[i]``; the max-min fair rates (water-filling: every flow gets the
  same rate, except flows that want less, which get what they want).

Each ``check_…`` runs the learner's function on fresh random inputs against the reference
in :mod:`moe_lab.sim.fabric` / :mod:`moe_lab.sim.fair_share` and raises `ExerciseError` when an
answer is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from moe_lab.sim.fabric import expected_max_load
from moe_lab.sim.fair_share import max_min_rates
from moe_lab.workbench.exercises import ExerciseError, call_answer, close, exercise


def expected_fullest_uplink(n_flows: int, n_spines: int) -> float:
    """Exact expected load of the fullest of ``n_spines`` uplinks under ``n_flows`` hashed
    flows (balls into bins)."""
    return expected_max_load(n_flows, n_spines)


@exercise(expected_fullest_uplink)
def check_expected_fullest_uplink(fn: Callable[[int, int], float]) -> None:
    """Raise `ExerciseError` unless ``fn`` gives the exact expected fullest uplink on small,
    edge and random cases (to a relative 1e-6: sampling is not exact enough)."""
    rng = np.random.default_rng()
    cases = [(1, 8), (8, 1), (2, 2), (16, 8), (0, 4), (63, 8)]
    cases += [(int(rng.integers(1, 120)), int(rng.integers(1, 33))) for _ in range(12 - len(cases))]
    for n, s in cases:
        want = expected_fullest_uplink(n, s)
        got = call_answer(fn, n, s)
        if close(got, want, abs_tol=1e-9):
            continue
        hint = ""
        if close(got, want, rel=0.05):
            hint = (" (close: a sampled estimate is not exact — count P(max <= k) instead, "
                    "and sum P(max > k) over k)")
        elif s and close(got, n / s):
            hint = " (that is the mean load; the fullest uplink carries more)"
        raise ExerciseError(f"expected_fullest_uplink(n_flows={n}, n_spines={s}) returned {got!r}, "
                            f"expected {want:.8g}{hint}")
    print("✓ expected_fullest_uplink is exact")


def fair_share(demands: Sequence[float], capacity: float) -> list[float]:
    """Max-min fair rates on one link: each flow also crosses a private link of its demand,
    so the general progressive filling of :func:`moe_lab.sim.fair_share.max_min_rates` does it."""
    want = np.asarray(demands, dtype=float)
    n = want.size
    links = np.stack([np.zeros(n, dtype=np.int64), np.arange(1, n + 1)], axis=1)
    return max_min_rates(links, np.concatenate([[capacity], want])).tolist()


@exercise(fair_share)
def check_fair_share(fn: Callable[[Sequence[float], float], Sequence[float]]) -> None:
    """Raise `ExerciseError` unless ``fn`` water-fills random demands correctly."""
    rng = np.random.default_rng()
    for _ in range(30):
        n = int(rng.integers(1, 12))
        demands = np.round(rng.uniform(0.1, 10.0, size=n), 3)
        capacity = float(np.round(rng.uniform(0.2, 1.2) * demands.sum(), 3))
        want = np.asarray(fair_share(demands.tolist(), capacity))
        got = call_answer(fn, demands.tolist(), capacity)
        try:
            got_arr = np.asarray(got, dtype=float).reshape(-1)
        except (TypeError, ValueError):
            got_arr = None
        if got_arr is None or got_arr.shape != want.shape:
            raise ExerciseError(
                f"fair_share must return one rate per flow ({n}), got {got!r}"
            )
        if not np.allclose(got_arr, want, rtol=1e-6, atol=1e-9):
            hint = ""
            if np.allclose(got_arr, capacity / n):
                hint = " (an equal split wastes what the small flows do not use)"
            elif np.allclose(got_arr, demands * min(1.0, capacity / demands.sum())):
                hint = " (that is proportional sharing: max-min gives small flows all they want)"
            raise ExerciseError(
                f"fair_share({demands.tolist()}, capacity={capacity}) returned "
                f"{np.round(got_arr, 4).tolist()}, expected {np.round(want, 4).tolist()}{hint}"
            )
    print("✓ fair_share is correct")
