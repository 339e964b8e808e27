"""Exercises of notebook 12 (time to train): the race's verdict from loss curves (reading
the clock off each run, then the speed-up of the medians over seeds), and the bound Amdahl's
law puts on a speed-up, from a profile."""

from __future__ import annotations

import math
import random
import statistics

from moe_lab.checks import one_of
from moe_lab.workbench.exercises import ExerciseError, call_answer, exercise


def time_to_target(curve: list[dict], target: float) -> float | None:
    """``curve``: evaluations in order, each ``{"step", "time_s", "eval_loss"}``. The time of
    the *first* evaluation at or below ``target``, or ``None`` when none reaches it."""
    return next((point["time_s"] for point in curve if point["eval_loss"] <= target), None)


def race_speedups(curves: dict[str, list[list[dict]]], target: float, baseline: str) -> dict:
    """``curves``: stack name -> one loss curve per seed (as `time_to_target` takes). Each
    stack's time to target is the median over its seeds that reached the target; its speed-up
    is the baseline's median over its own; ``None`` where either stack has no seed that
    reached the target. A ``baseline`` that is not a stack is a ``ValueError``."""
    one_of(baseline, "baseline", curves)

    def median_time(runs):
        times = [t for t in (time_to_target(curve, target) for curve in runs) if t is not None]
        return statistics.median(times) if times else None

    medians = {name: median_time(runs) for name, runs in curves.items()}
    base = medians[baseline]
    return {name: (base / t if base is not None and t is not None else None) for name, t in medians.items()}


def amdahl_bound(parts: dict[str, float], speedups: dict[str, float]) -> tuple[float, float]:
    """A step's ``parts`` (name -> time, any unit) after the parts named in ``speedups`` get
    that many times faster (``math.inf``: the part becomes free; a part not named keeps its
    time): ``(new step time, speed-up of the whole step)``. Amdahl's law, ``1 / Σ fᵢ / sᵢ``,
    with the bookkeeping a real profile needs: a name that is not a part, or a speed-up that
    is not positive, is a ``ValueError``; a step that becomes free has an infinite speed-up."""
    unknown = sorted(set(speedups) - set(parts))
    if unknown:
        raise ValueError(f"speedups names parts the step does not have: {unknown}")
    bad = {name: s for name, s in speedups.items() if not s > 0}
    if bad:
        raise ValueError(f"speed-ups must be > 0, got {bad}")
    old = sum(parts.values())
    new = sum(t / speedups.get(name, 1.0) for name, t in parts.items())
    return new, (old / new if new > 0 else math.inf)


def _curve(rng: random.Random, n: int) -> list[dict]:
    loss, t, out = 5.0, 0.0, []
    for i in range(n):
        loss = max(0.5, loss * rng.uniform(0.85, 1.08))  # mostly falling, sometimes up
        t += rng.uniform(0.5, 2.0)
        out.append({"step": 10 * (i + 1), "time_s": t, "eval_loss": loss})
    return out


def _require_value_error(fn, args: tuple, message: str) -> None:
    """Raise `ExerciseError` with ``message`` unless ``fn(*args)`` raises ``ValueError``."""
    try:
        call_answer(fn, *args)
    except ValueError:
        return
    raise ExerciseError(message)


@exercise(time_to_target)
def check_time_to_target(fn) -> None:
    """Raises ExerciseError unless ``fn(curve, target)`` returns the time of the first
    evaluation at or below the target (not the best one), or ``None``."""
    rng = random.Random(10)
    flat = [{"step": 10, "time_s": 1.0, "eval_loss": 2.0}, {"step": 20, "time_s": 2.0, "eval_loss": 1.5},
            {"step": 30, "time_s": 3.0, "eval_loss": 1.7}, {"step": 40, "time_s": 4.0, "eval_loss": 1.2}]
    for curve in [_curve(rng, 30) for _ in range(20)]:
        losses = sorted(p["eval_loss"] for p in curve)
        for target in (losses[len(losses) // 2], losses[0] - 0.1, curve[0]["eval_loss"]):
            got = call_answer(fn, [dict(p) for p in curve], target)
            want = time_to_target(curve, target)
            if got != want:
                below = next((p["time_s"] for p in curve if p["eval_loss"] < target), None)
                best = min(curve, key=lambda p: p["eval_loss"])
                hint = ""
                if got == below:
                    hint = " (a loss equal to the target reaches it: <=, not <)"
                elif got == best["time_s"]:
                    hint = (" (that is the time of the best evaluation, not of the first that "
                            "reaches the target)")
                raise ExerciseError(f"target {target:.3f}: got {got!r}, expected {want!r}{hint}. The "
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


@exercise(race_speedups)
def check_race_speedups(fn) -> None:
    """Raises ExerciseError unless ``fn(curves, target, baseline)`` gives each stack's speed-up
    over the baseline as the ratio of median times to target over the seeds that reached it."""
    rng = random.Random(12)
    for trial in range(20):
        curves = {name: [_curve(rng, rng.randint(5, 30)) for _ in range(rng.randint(1, 5))]
                  for name in ("naive", "optimised", "other")[: rng.randint(2, 3)]}
        losses = sorted(p["eval_loss"] for runs in curves.values() for c in runs for p in c)
        target = losses[len(losses) // 3] if trial % 4 else losses[0] - 1.0  # some never reach it
        copies = {k: [[dict(p) for p in c] for c in v] for k, v in curves.items()}
        got = call_answer(fn, copies, target, "naive")
        want = race_speedups(curves, target, "naive")
        if not isinstance(got, dict) or set(got) != set(want):
            raise ExerciseError(f"return one speed-up per stack {sorted(want)}, got {got!r}")
        for name, w in want.items():
            g = got[name]
            if (g is None) != (w is None) or (w is not None and not math.isclose(g, w, rel_tol=1e-9)):
                raise ExerciseError(
                    f"stack {name!r}, target {target:.3f}: got {g!r}, expected {w!r}. Read each seed's "
                    "clock with time_to_target, take the median over the seeds that reached the target "
                    "(None if none did), and divide the baseline's median by the stack's")
    def run(time_s, loss):
        return [{"step": 1, "time_s": time_s, "eval_loss": loss}]

    two = {"naive": [run(4.0, 1.0), run(6.0, 1.0)], "fast": [run(1.0, 1.0), run(9.0, 2.0)]}
    if call_answer(fn, two, 1.0, "naive").get("fast") != 5.0:
        raise ExerciseError("a seed that never reaches the target does not count: the fast stack's "
                            "median is over its one seed that did (1.0), the naive's is 5.0: 5.0x")
    _require_value_error(fn, (two, 1.0, "nobody"),
                         "a baseline that is not one of the stacks must raise ValueError")
    print("✓ race_speedups gives the race's verdict")


PROFILE_PARTS = ["matmul", "attention", "router", "permute", "optimizer", "host"]


@exercise(amdahl_bound)
def check_amdahl_bound(fn) -> None:
    """Raises ExerciseError unless ``fn(parts, speedups)`` applies Amdahl's law to a profile."""
    rng = random.Random(11)
    for _ in range(50):
        names = rng.sample(PROFILE_PARTS, rng.randint(1, len(PROFILE_PARTS)))
        parts = {name: rng.choice([0.0, rng.uniform(0.1, 5.0)]) for name in names}
        parts[names[0]] += 0.5  # a step takes some time
        chosen = rng.sample(names, rng.randint(0, len(names)))
        speedups = {name: rng.choice([rng.uniform(0.5, 10.0), 1.0, math.inf]) for name in chosen}
        try:
            got = call_answer(fn, dict(parts), dict(speedups))
        except ZeroDivisionError:
            raise ExerciseError(f"parts {parts}, speed-ups {speedups}: division by zero. When every "
                                "part becomes free the new time is 0 and the speed-up math.inf") from None
        want = amdahl_bound(parts, speedups)
        same = isinstance(got, tuple) and len(got) == 2 and all(
            g == w or math.isclose(g, w, rel_tol=1e-9) for g, w in zip(got, want, strict=True))
        if not same:
            raise ExerciseError(f"parts {parts}, speed-ups {speedups}: got {got!r}, expected {want!r} "
                                "(new time, speed-up). Each part's new time is t / s (t for a part "
                                "without a speed-up); the speed-up is old total / new total")
    new, speedup = call_answer(fn, {"a": 1.0, "b": 1.0}, {"b": math.inf})
    if new != 1.0 or speedup != 2.0:
        raise ExerciseError("half the step made free leaves the other half: (1.0, 2.0)")
    if call_answer(fn, {"a": 1.0}, {"a": math.inf})[1] != math.inf:
        raise ExerciseError("a step whose every part is free has an infinite speed-up (math.inf)")
    for bad in ({"c": 2.0}, {"a": 0.0}, {"a": -1.0}):
        _require_value_error(fn, ({"a": 1.0, "b": 1.0}, bad), f"speedups={bad} must raise ValueError: a "
                             "part the profile does not have, or a speed-up that is not positive, is a "
                             "mistake to report")
    print("✓ amdahl_bound is correct")
