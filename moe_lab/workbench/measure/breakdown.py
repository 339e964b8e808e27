"""Where a training step's time goes: one profiled run, its time split by phase and by kind.

An MFU says how far a step is from the matmul ceiling; it does not say what the rest of the
time is. `step_breakdown` runs a step under ``torch.profiler`` (CPU activity) and adds up
every recorded operation's *self* time — the time in it and not in an operation it called —
twice over:

- by **phase**: the forward, the backward and the optimizer (gradient clipping included),
  from the ranges the training steps open with `phase` (`moe_lab.training.steps`); anything
  else — copying the batch in, the running statistics — is ``"rest of the step"``;
- by **kind**: the matmuls (the BLAS/oneDNN GEMM calls), the attention core, the rest of
  moe_lab's expert kernel (SwiGLU, zeroing; its GEMMs count as matmuls), what a
  ``torch.compile``'d graph runs itself (Inductor's fused elementwise kernels and its
  wrapper), the other ATen operations, and the framework (Dynamo's guards, the autograd
  engine, the Python inside the ranges).

Self times are measured on the thread that calls each operation; an operation that fans out
over OpenMP threads counts its wall time once. What no recorded operation covers — the
Python between operations — is the wall time minus the sum, reported as ``"between ops"``.
The profiler adds a few microseconds per operation, so a stack made of many small ones looks
slower here than on the clock; compare kinds within a run, and time steps with the clock.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

from moe_lab.training.steps import PHASE_PREFIX, PHASES

REST = "rest of the step"

MATMUL = "matmuls"
ATTENTION = "attention core"
EXPERT = "expert kernel, besides its GEMMs"
COMPILED = "compiled graph (Inductor's kernels)"
ATEN = "other ATen ops"
FRAMEWORK = "framework (dispatch, autograd, Dynamo)"
BETWEEN = "between ops (Python)"
KINDS = (MATMUL, ATTENTION, EXPERT, COMPILED, ATEN, FRAMEWORK, BETWEEN)

_MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
                      "aten::_grouped_mm", "aten::_int_mm"})


def kind_of(name: str) -> str:
    """The kind (one of `KINDS`, but `BETWEEN`) of a profiler event called ``name``."""
    if name in _MATMULS:
        return MATMUL
    lowered = name.lower()
    if "attention" in lowered or "scaled_dot_product" in lowered or "flash" in lowered:
        return ATTENTION
    if name.startswith("moe_lab::openmp"):
        return EXPERT
    if name.startswith("## Call CompiledFxGraph") or "cpp_fused" in name:
        return COMPILED
    if name.startswith("aten::"):
        return ATEN
    return FRAMEWORK


def _phase_of(event) -> str:
    while event is not None:
        if event.name.startswith(PHASE_PREFIX):
            return event.name[len(PHASE_PREFIX):]
        event = event.cpu_parent
    return REST


def breakdown_from_events(events, wall_s: float, steps: int) -> dict:
    """Sum the self times of profiler ``events`` (``prof.events()``) over ``steps`` steps that
    took ``wall_s`` in all: ``{"wall_ms", "by_kind", "by_phase", "table"}``, in ms per step;
    ``table[phase][kind]``. `BETWEEN` (wall time no event covers) is put in `REST`."""
    table = {p: dict.fromkeys(KINDS, 0.0) for p in (*PHASES, REST)}
    covered = 0.0
    for event in events:
        ms = event.self_cpu_time_total / 1e3 / steps
        table[_phase_of(event)][kind_of(event.name)] += ms
        covered += ms
    wall_ms = wall_s * 1e3 / steps
    table[REST][BETWEEN] = max(wall_ms - covered, 0.0)
    by_kind = {k: sum(table[p][k] for p in table) for k in KINDS}
    by_phase = {p: sum(table[p].values()) for p in table}
    return {"wall_ms": wall_ms, "by_kind": by_kind, "by_phase": by_phase, "table": table}


def step_breakdown(step: Callable[[], None], steps: int = 5, warmup: int = 2) -> dict:
    """Run ``step()`` ``warmup`` times, then ``steps`` times under the profiler; the split of
    its time (`breakdown_from_events`). ``step`` must finish its work before it returns
    (on a CPU it does; on CUDA pass one that synchronizes — only CPU time is recorded)."""
    for _ in range(warmup):
        step()
    prof = profile(activities=[ProfilerActivity.CPU])
    with _quiet_stderr():  # the profiler's C++ side logs its start and stop on stderr
        prof.__enter__()
    try:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall_s = time.perf_counter() - start
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    return breakdown_from_events(prof.events(), wall_s, steps)


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 sent to the null device for the duration (C++ writes included);
    restored afterwards, so nothing the step itself writes is lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def format_breakdown(result: dict, title: str = "") -> str:
    """A text table: kinds down, phases across (``rest``: `REST`), ms per step."""
    cols = (*PHASES, REST)
    head = f"{title:<40}" + "".join(f"{c.split()[0]:>12}" for c in cols) + f"{'total':>10}"
    lines = [head]
    for kind in KINDS:
        row = [result["table"][p][kind] for p in cols]
        lines.append(f"{kind:<40}" + "".join(f"{v:12.1f}" for v in row)
                     + f"{result['by_kind'][kind]:10.1f}")
    lines.append(f"{'total (ms per step)':<40}" + "".join(f"{result['by_phase'][p]:12.1f}" for p in cols)
                 + f"{result['wall_ms']:10.1f}")
    return "\n".join(lines)
