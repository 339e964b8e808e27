"""All timing in moe_lab goes through here.

A single timestamp around one call tells you very little: the first call pays for
allocation, kernel compilation and cold caches, and any later call can be hit by another
process. So `bench` warms up first, then times many calls *one at a time* and reports the
median with its spread (min, max, inter-quartile range). On the CPU each call is wrapped in
``time.perf_counter()``; on CUDA, where work is asynchronous, each call is bracketed by a
pair of CUDA events and the device is synchronised before the times are read.

`compare` times several implementations ("providers") of the same thing on the same
inputs in one run. It interleaves them round by round (and flips the order every other
round), so a burst of background noise lands on all of them rather than on whichever
happened to run at that moment; it reports ratios against the first.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves

from moe_lab.checks import non_negative_int, non_negative_number, positive_int

# Adaptive runs (repeat=None) time at least this many calls, however slow each one is,
# so the median and IQR are never computed from one or two samples, and at most the other.
MIN_ADAPTIVE_REPEAT = 5
MAX_ADAPTIVE_REPEAT = 1000


@dataclass(frozen=True)
class BenchResult:
    """Timings of one function: ``n`` calls, each timed on its own.

    ``times`` holds the ``n`` per-call durations in seconds; ``median_s``, ``min_s``,
    ``max_s`` and ``iqr_s`` (75th minus 25th percentile) summarise them. ``device`` is
    ``"cuda"`` (CUDA-event timing) or ``"cpu"`` (wall clock).
    """

    median_s: float
    min_s: float
    max_s: float
    iqr_s: float
    n: int
    device: str
    times: list[float] = field(repr=False)

    @classmethod
    def from_times(cls, times: list[float], device: str) -> BenchResult:
        """Summarise a non-empty list of per-call durations (seconds)."""
        times = [float(t) for t in times]
        if len(times) >= 2:
            q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
            iqr = q3 - q1
        else:
            iqr = 0.0
        return cls(
            median_s=statistics.median(times), min_s=min(times), max_s=max(times),
            iqr_s=iqr, n=len(times), device=device, times=times,
        )

    def per_second(self, items: float) -> float:
        """Throughput: ``items`` processed per call divided by the median time per call."""
        if not items >= 0:
            raise ValueError(f"items must be a non-negative number, got {items!r}")
        return items / self.median_s if self.median_s > 0 else math.inf

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    def __str__(self) -> str:
        return (
            f"{_fmt_time(self.median_s)} median (min {_fmt_time(self.min_s)}, "
            f"max {_fmt_time(self.max_s)}, IQR {_fmt_time(self.iqr_s)}; "
            f"n={self.n}, {self.device})"
        )


def _fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def infer_device(args: tuple, kwargs: dict) -> str:
    """``"cuda"`` when any tensor argument is on a CUDA device, ``"cpu"`` when the tensor
    arguments are all on the CPU; with no tensor arguments (a closure), ``"cuda"`` when a
    CUDA device is present, since a closure on a GPU machine is assumed to launch GPU work.
    """
    devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    if devices:
        return "cuda" if "cuda" in devices else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _call(fn: Callable, args: tuple, kwargs: dict, device: str) -> tuple[float, object]:
    """Run ``fn`` once: the host seconds it took (on CUDA only to drive the adaptive loop) and
    its timing, the seconds on the CPU, a pair of CUDA events on CUDA (read once all calls are done)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()  # queued work must not spill into this call's window
        t0 = time.perf_counter()
        start.record()
        fn(*args, **kwargs)
        end.record()
        end.synchronize()
        return time.perf_counter() - t0, (start, end)
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    elapsed = time.perf_counter() - t0
    return elapsed, elapsed


def bench(fn: Callable, *args, warmup: int = 3, repeat: int | None = None, min_time_s: float = 0.2,
          **kwargs) -> BenchResult:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then calls timed one by one.

    With ``repeat`` given, exactly that many timed calls; with ``repeat=None`` (adaptive),
    calls continue until their total reaches ``min_time_s`` and at least
    ``MIN_ADAPTIVE_REPEAT`` were made, never more than ``MAX_ADAPTIVE_REPEAT``. Returns a
    `BenchResult` (median and spread). Never time on all-zero inputs: hardware and
    libraries take shortcuts on zeros that real data does not allow.
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    return compare({"fn": fn}, *args, warmup=warmup, repeat=repeat, min_time_s=min_time_s, **kwargs)["fn"]


class Comparison(dict):
    """``name -> BenchResult`` for providers timed in one run; the first is the baseline."""

    def ratios(self) -> dict[str, float]:
        """Speed-up of each provider over the first: its median time / the provider's median time
        (> 1 means faster)."""
        base = next(iter(self.values())).median_s
        return {name: base / r.median_s if r.median_s > 0 else math.inf for name, r in self.items()}

    def __str__(self) -> str:
        width = max(len(name) for name in self)
        baseline = next(iter(self))
        return "\n".join(f"{name:<{width}}  {self[name]}  x{ratio:.2f} vs {baseline}"
                         for name, ratio in self.ratios().items())


def compare(fns: dict[str, Callable], *args, warmup: int = 3, repeat: int | None = None,
            min_time_s: float = 0.2, **kwargs) -> Comparison:
    """Time several providers of the same computation on the same ``args`` in one run.

    ``fns`` maps a provider name to a callable; every callable gets ``*args, **kwargs``.
    Each round calls every provider once (the order reversed every other round) so that
    noise is shared. Rounds follow `bench`'s rule: ``repeat`` rounds, or adaptive until the
    slowest provider has run ``min_time_s`` in total (at least ``MIN_ADAPTIVE_REPEAT``, at
    most ``MAX_ADAPTIVE_REPEAT`` rounds), so every provider gets the same number of timed
    calls. Returns a `Comparison` (a dict of `BenchResult`) whose ``ratios()`` are speed-ups
    over the first provider.
    """
    if not isinstance(fns, dict) or not fns:
        raise ValueError(f"fns must be a non-empty dict of name -> callable, got {fns!r}")
    for name, fn in fns.items():
        if not callable(fn):
            raise ValueError(f"fns[{name!r}] must be callable, got {type(fn).__name__}")
    non_negative_int(warmup, "warmup")
    positive_int(repeat, "repeat (None: adaptive)", or_none=True)
    non_negative_number(min_time_s, "min_time_s")
    device = infer_device(args, kwargs)
    names = list(fns)
    marks: dict[str, list] = {name: [] for name in names}
    for _ in range(warmup):
        for name in names:
            fns[name](*args, **kwargs)
    totals = dict.fromkeys(names, 0.0)
    rounds = 0
    # Adaptive: the slowest provider sets the pace (waiting for the fastest to reach
    # min_time_s would run a slow one thousands of times).
    while rounds < (MAX_ADAPTIVE_REPEAT if repeat is None else repeat) and not (
            repeat is None and rounds >= MIN_ADAPTIVE_REPEAT and max(totals.values()) >= min_time_s):
        order = names if rounds % 2 == 0 else names[::-1]
        for name in order:
            host_s, mark = _call(fns[name], args, kwargs, device)
            totals[name] += host_s
            marks[name].append(mark)
        rounds += 1
    if device == "cuda":
        torch.cuda.synchronize()
        marks = {name: [s.elapsed_time(e) / 1e3 for s, e in pairs] for name, pairs in marks.items()}
    return Comparison((name, BenchResult.from_times(marks[name], device)) for name in names)
