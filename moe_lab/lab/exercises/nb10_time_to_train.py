"""Exercises of notebook 10 (time to train): reading the clock off a loss curve, and the
bound Amdahl's law puts on a speed-up."""

from __future__ import annotations

import math
import random

from moe_lab.lab.exercises import ExerciseError, call_answer, reference_solution


@reference_solution("time_to_target")
def time_to_target(curve: list[dict], target: float) -> float | None:
    """``curve``: evaluations in order, each ``{"step", "time_s", "eval_loss"}``. The time of
    the *first* evaluation at or below ``target``, or ``None`` when none reaches it."""
    for point in curve:
        if point["eval_loss"] <= target:
            return point["time_s"]
    return None


@reference_solution("amdahl_speedup")
def amdahl_speedup(fractions: list[float], speedups: list[float]) -> float:
    """A step whose parts take ``fractions`` of its time (summing to 1) gets part ``i``
    ``speedups[i]`` times faster: the whole step's speed-up, ``1 / Σ fᵢ / sᵢ``."""
    return 1.0 / sum(f / s for f, s in zip(fractions, speedups))


def _curve(rng: random.Random, n: int) -> list[dict]:
    loss, t, out = 5.0, 0.0, []
    for i in range(n):
        loss = max(0.5, loss * rng.uniform(0.85, 1.08))  # mostly falling, sometimes up
        t += rng.uniform(0.5, 2.0)
        out.append({"step": 10 * (i + 1), "time_s": t, "eval_loss": loss})
    return out


def check_time_to_target(fn) -> None:
    """Raises ExerciseError unless ``fn(curve, target)`` returns the time of the first
    evaluation at or below the target (not the best one), or ``None``."""
    rng = random.Random(10)
    cases = [(_curve(rng, 30), None) for _ in range(20)]
    flat = [{"step": 10, "time_s": 1.0, "eval_loss": 2.0}, {"step": 20, "time_s": 2.0, "eval_loss": 1.5},
            {"step": 30, "time_s": 3.0, "eval_loss": 1.7}, {"step": 40, "time_s": 4.0, "eval_loss": 1.2}]
    for curve, _ in cases:
        losses = sorted(p["eval_loss"] for p in curve)
        for target in (losses[len(losses) // 2], losses[0] - 0.1, curve[0]["eval_loss"]):
            got = call_answer(fn, [dict(p) for p in curve], target)
            want = time_to_target(curve, target)
            if got != want:
                raise ExerciseError(f"target {target:.3f}: got {got!r}, expected {want!r}. The "
                                    "clock stops at the first evaluation at or below the target; "
                                    "None if no evaluation reaches it")
    if call_answer(fn, flat, 1.5) != 2.0:
        raise ExerciseError("a loss exactly equal to the target reaches it (<=, not <)")
    if call_answer(fn, flat, 1.6) != 2.0:
        raise ExerciseError("the first evaluation below the target counts, even if the loss "
                            "rises again afterwards")
    if call_answer(fn, [], 1.0) is not None:
        raise ExerciseError("an empty curve never reaches the target: return None")
    print("✓ time_to_target reads the clock like MLPerf does")


def check_amdahl_speedup(fn) -> None:
    """Raises ExerciseError unless ``fn(fractions, speedups)`` is Amdahl's law."""
    rng = random.Random(11)
    for _ in range(50):
        n = rng.randint(1, 5)
        raw = [rng.uniform(0.05, 1.0) for _ in range(n)]
        fractions = [r / sum(raw) for r in raw]
        speedups = [rng.choice([1.0, rng.uniform(0.5, 10.0), 1e6]) for _ in range(n)]
        got = call_answer(fn, list(fractions), list(speedups))
        want = amdahl_speedup(fractions, speedups)
        if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-9):
            raise ExerciseError(f"fractions {[round(f, 3) for f in fractions]}, speed-ups "
                                f"{[round(s, 3) for s in speedups]}: got {got!r}, expected "
                                f"{want:.6g}. Each part's new time is f / s; add them up")
    if not math.isclose(call_answer(fn, [0.5, 0.5], [1.0, 1e12]), 2.0, rel_tol=1e-6):
        raise ExerciseError("half the step made infinitely fast leaves the other half: 2x")
    print("✓ amdahl_speedup is correct")
