"""Host overhead: what each operator costs the host, and when that is the whole iteration.

Every PyTorch operator call costs the host a roughly fixed amount of work before any
arithmetic happens: the Python call, argument parsing, the dispatcher (autograd, then the
backend), allocating the output — and, on a GPU, the kernel launch. A training step of a
small MoE transformer dispatches hundreds of operators (forward, backward, optimizer), so
the host needs ``ops × cost per op`` whatever the sizes. While the arithmetic is large that
hides behind it; shrink the model and the iteration time stops falling — it lands on the
host's floor. On a GPU that floor is the launch-bound regime a CUDA graph removes; on a CPU
the same floor exists, and ``torch.compile`` is the CPU's way through it: Inductor fuses
many operators into a few generated loops, so fewer dispatches per step.

- `count_ops` counts the ATen operators one call dispatches (views — which launch no
  kernel — separately);
- `dispatch_cost` measures the host's cost of one trivial operator on this machine;
- `overhead_sweep` trains one step of ever smaller models and sets the iteration time
  against ``ops × cost per op``;
- `compiled_vs_eager` times the step with the model under ``torch.compile``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lab.config import preset as get_preset
from moe_lab.training.build import build_model, build_sync_free, random_batch
from moe_lab.training.optim import make_optimizer
from moe_lab.training.steps import SyncFreeStep
from moe_lab.workbench.measure.timing import bench, compare


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        if func.is_view:
            self.views += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable, *args, **kwargs) -> tuple[object, dict]:
    """Run ``fn(*args, **kwargs)`` and count the ATen operators it dispatches (forward, and
    backward and optimizer if ``fn`` runs them). Returns ``(result, summary)`` with
    ``summary = {"ops": total, "views": metadata-only ops, "compute": ops - views,
    "by_op": Counter}``. On a GPU each compute op is about one kernel launch."""
    counter = _OpCounter()
    with counter:
        result = fn(*args, **kwargs)
    total = sum(counter.counts.values())
    return result, {"ops": total, "views": counter.views, "compute": total - counter.views,
                    "by_op": counter.counts}


def dispatch_cost(n_ops: int = 2000, min_time_s: float = 0.2) -> float:
    """Seconds the host spends on one trivial operator (``t.add_(1)`` on a one-element
    tensor, no allocation, no autograd): the least any operator costs here. The median of
    loops of ``n_ops`` calls, over ``moe_lab.workbench.measure.timing``."""
    t = torch.zeros(1)

    def loop() -> None:
        for _ in range(n_ops):
            t.add_(1.0)

    return bench(loop, warmup=1, min_time_s=min_time_s).median_s / n_ops


def shrunk_config(preset: str, d_model: int):
    """The preset with width ``d_model`` everywhere (experts ``d_model`` wide, dense FFN
    ``4 · d_model``) and everything else — layers, experts, top-k, heads, sequence — kept,
    so the number of operators per step stays the same while the arithmetic shrinks (``d_model``
    a multiple of the preset's ``n_heads``: `moe_lab.config.ModelConfig` checks it)."""
    return get_preset(preset).replace(d_model=d_model, d_ff=4 * d_model, moe={"d_expert": d_model})


def overhead_sweep(widths: Sequence[int] = (256, 128, 64, 32, 16), preset: str = "tiny",
                   batch_size: int = 2, min_time_s: float = 0.2, *, per_op_s: float) -> list[dict]:
    """One sync-free training step (forward, backward, optimizer) of the preset shrunk to
    each width, on the CPU: ``iteration_ms`` (median, `moe_lab.workbench.measure.timing`), ``ops`` and
    ``compute_ops`` per iteration, and ``floor_ms = ops × per_op_s`` (``per_op_s``: the host's cost
    of one operator, `dispatch_cost`) with ``floor_frac = floor_ms / iteration_ms``."""
    rows = []
    for width in widths:
        cfg = shrunk_config(preset, width)
        step = build_sync_free(cfg, batch_size)
        batch = random_batch(cfg, batch_size)
        step.launch(batch)  # the first step also creates the optimizer state: not counted
        _, ops = count_ops(step.launch, batch)
        t = bench(step.launch, batch, warmup=2, min_time_s=min_time_s)
        rows.append({
            "d_model": width, "params": sum(p.numel() for p in step.model.parameters()),
            "tokens": batch_size * cfg.seq_len, "ops": ops["ops"], "compute_ops": ops["compute"],
            "iteration_ms": t.median_s * 1e3, "iqr_ms": t.iqr_s * 1e3,
            "floor_ms": ops["ops"] * per_op_s * 1e3,
            "floor_frac": ops["ops"] * per_op_s / t.median_s,
            "us_per_op": t.median_s / ops["ops"] * 1e6,
        })
    return rows


def compiled_vs_eager(preset: str = "tiny", batch_size: int = 2, min_time_s: float = 0.3) -> dict:
    """The sync-free step with the model eager and under ``torch.compile`` (optimizer
    unchanged: one fused operator already), same weights and batch, timed interleaved.
    Compilation happens once, on the first call, and is reported separately
    (``compile_s``): on a CPU it takes far longer than a step, so it stays out of the timings.
    Returns ``{"eager_ms", "compiled_ms", "speedup", "compile_s"}``."""
    cfg = get_preset(preset)
    model, optimizer = build_model(cfg)
    batch = random_batch(cfg, batch_size)
    eager = SyncFreeStep(model, optimizer, batch)
    twin, _ = build_model(cfg)
    compiled = SyncFreeStep(twin, make_optimizer(twin), batch, forward=torch.compile(twin))
    t0 = time.perf_counter()
    compiled.launch(batch)
    compile_s = time.perf_counter() - t0
    timings = compare({"eager": lambda: eager.launch(batch),
                       "compiled": lambda: compiled.launch(batch)}, min_time_s=min_time_s)
    e, c = timings["eager"], timings["compiled"]
    return {"eager_ms": e.median_s * 1e3, "compiled_ms": c.median_s * 1e3,
            "speedup": e.median_s / c.median_s, "compile_s": compile_s}


def plot_overhead(rows: list[dict], title: str | None = None):
    """Iteration time against model width, with the host floor ``ops × cost per op``; returns the
    axes."""
    import matplotlib.pyplot as plt  # here, not at the top: the CLI imports this module

    _, ax = plt.subplots(figsize=(6.5, 3.8))
    widths = [r["d_model"] for r in rows]
    ax.plot(widths, [r["iteration_ms"] for r in rows], "o-", label="iteration (measured)")
    ax.plot(widths, [r["floor_ms"] for r in rows], "k--",
            label=f"host floor: {rows[0]['ops']} ops × cost of a trivial op")
    for r in rows:
        ax.annotate(f"{r['floor_frac']:.0%}", (r["d_model"], r["iteration_ms"]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("d_model (layers, experts and ops per step unchanged)")
    ax.set_ylabel("ms per training step")
    ax.set_title(title or "as the model shrinks, the host's per-op cost is what is left")
    ax.legend(fontsize=8)
    return ax
