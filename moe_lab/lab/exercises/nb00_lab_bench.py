"""Exercises of notebook 00 (the lab bench): counting FLOPs and reading a roofline.

- ``expert_training_flops(d_model, d_expert)``: training FLOPs one token costs in one
  SwiGLU expert (three ``d_model x d_expert`` matrices; forward + backward).
- ``matmul_attainable_flops(m, n, k, bytes_per_element, peak_flops, bandwidth)``: the
  roofline's bound for ``[m, k] @ [k, n]`` on a machine with that peak and bandwidth.

Each ``check_…`` calls the learner's function on fresh random inputs and raises
`ExerciseError` when an answer differs from the reference.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from moe_lab.lab.exercises import ExerciseError, call_answer, reference_solution
from moe_lab.perf.flops import FLOPS_PER_MAC, TRAIN_MULTIPLIER
from moe_lab.perf.hardware import matmul_intensity, roofline


@reference_solution("expert_training_flops")
def expert_training_flops(d_model: int, d_expert: int) -> float:
    """Training FLOPs per token of one SwiGLU expert: 3 matrices of ``d_model x d_expert``
    MACs, 2 FLOPs per MAC, 3x for forward + backward."""
    return float(3 * d_model * d_expert * FLOPS_PER_MAC * TRAIN_MULTIPLIER)


@reference_solution("matmul_attainable_flops")
def matmul_attainable_flops(
    m: int, n: int, k: int, bytes_per_element: float, peak_flops: float, bandwidth: float
) -> float:
    """Roofline bound of ``[m, k] @ [k, n]``: ``min(peak, bandwidth * intensity)`` with
    intensity ``2mnk / ((mk + kn + mn) * bytes_per_element)`` FLOP/byte."""
    return roofline(peak_flops, bandwidth, matmul_intensity(m, n, k, bytes_per_element))


def _close(got: object, want: float, rel: float = 1e-6) -> bool:
    try:
        return math.isclose(float(got), want, rel_tol=rel)
    except (TypeError, ValueError):
        return False


def check_expert_training_flops(fn: Callable[[int, int], float], trials: int = 20) -> None:
    """Raise `ExerciseError` unless ``fn(d_model, d_expert)`` matches the reference."""
    rng = random.Random()
    for _ in range(trials):
        d_model, d_expert = rng.randint(1, 8192), rng.randint(1, 8192)
        want = expert_training_flops(d_model, d_expert)
        got = call_answer(fn, d_model, d_expert)
        if not _close(got, want):
            hint = ""
            if _close(got, want / TRAIN_MULTIPLIER):
                hint = " (that is the forward pass only: the backward pass costs twice as much)"
            elif _close(got, want / FLOPS_PER_MAC):
                hint = " (that counts MACs: one multiply-accumulate is 2 FLOPs)"
            elif _close(got, want * 2 / 3):
                hint = " (SwiGLU has three matrices: gate, up and down)"
            raise ExerciseError(
                f"expert_training_flops(d_model={d_model}, d_expert={d_expert}) returned "
                f"{got!r}, expected {want:.6g}{hint}"
            )


def check_matmul_attainable_flops(fn: Callable[..., float], trials: int = 20) -> None:
    """Raise `ExerciseError` unless ``fn`` matches the roofline bound on random shapes,
    covering memory-bound (a skinny matmul) and compute-bound (a square one) cases."""
    rng = random.Random()
    for trial in range(trials):
        bpe = (1.0, 2.0, 4.0)[trial % 3]
        bandwidth = rng.uniform(1e12, 8e12)
        if trial % 2 == 0:
            # Skinny: a few tokens through a big weight. At most 16 FLOP/byte, so with a
            # peak above 8 TB/s * 16 FLOP/B = 128 TFLOP/s it is always memory-bound.
            m, n, k = rng.randint(1, 8), rng.randint(1024, 8192), rng.randint(1024, 8192)
            peak = rng.uniform(200e12, 2500e12)
        else:
            m = n = k = rng.randint(2048, 8192)
            peak = rng.uniform(50e12, 2500e12)
        want = matmul_attainable_flops(m, n, k, bpe, peak, bandwidth)
        got = call_answer(fn, m, n, k, bpe, peak, bandwidth)
        if not _close(got, want):
            bound = "memory" if want < peak else "compute"
            raise ExerciseError(
                f"matmul_attainable_flops(m={m}, n={n}, k={k}, bytes_per_element={bpe}, "
                f"peak_flops={peak:.3g}, bandwidth={bandwidth:.3g}) returned {got!r}, "
                f"expected {want:.6g} ({bound}-bound)"
            )
