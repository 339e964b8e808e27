"""Benchmark: one whole training step — naive loop, sync-free eager, compiled, CUDA-graphed.

Providers, all on the same preset, batch and initial weights:

- ``naive`` — the naive loop's step (`moe_lab.training.steps.EagerStep`: naive dispatcher,
  statistics read every step, the stock AdamW): the starting point;
- ``eager`` — `moe_lab.training.steps.SyncFreeStep`;
- ``compiled`` — the same step with the model under ``torch.compile`` (skipped with
  ``--no-compile``: on a CPU, compiling costs far more than the steps it times);
- ``graphed`` — `moe_lab.training.graphs.GraphedStep`, only where CUDA exists.

Per provider: median iteration time, tokens/s, speed-up over ``eager``, ATen operators per
iteration (`moe_lab.workbench.measure.host_overhead.count_ops`) and host syncs per iteration
(`moe_lab.training.sync.count_syncs`). Memory of the experts' saved activations with a paged stash
(`moe_lab.moe.stash.PagedStash`) against their exact size and against the worst-case static
buffer; on CUDA also the peak memory of a step with and without the stash. Everything goes
into the ledger.
"""

from __future__ import annotations

import argparse
import time

import torch

from moe_lab.config import ModelConfig
from moe_lab.config import preset as get_preset
from moe_lab.moe.stash import PagedStash
from moe_lab.perf.capabilities import capabilities
from moe_lab.training.build import build_model, random_batch
from moe_lab.training.graphs import GraphedStep
from moe_lab.training.steps import StepConfig, SyncFreeStep
from moe_lab.training.sync import count_syncs
from moe_lab.workbench.cli import positive_int
from moe_lab.workbench.demos.ladder import ladder_step
from moe_lab.workbench.measure import ledger
from moe_lab.workbench.measure.host_overhead import count_ops
from moe_lab.workbench.measure.timing import compare

DESCRIPTION = "one training step: naive / sync-free eager / compiled / CUDA-graphed; syncs, ops, memory"

MIN_TIME = {"smoke": 0.3, "full": 2.0}
# The ledger's figures: (metric, key of the result's row or memory, unit).
ROW_FIGURES = (("iteration_ms", "median_ms", "ms"), ("tokens_per_s", "tokens_per_s", "tok/s"),
               ("vs_eager", "vs_eager", "x"), ("syncs_per_step", "syncs_per_iter", "syncs"),
               ("ops_per_step", "ops_per_iter", "ops"))
MEMORY_FIGURES = (("stash_saving_vs_worst_case", "saving_vs_worst", "fraction"),
                  ("stash_pool_mb", "pool_mb", "MiB"), ("worst_case_mb", "worst_case_mb", "MiB"),
                  ("peak_mb_no_stash", "peak_mb_no_stash", "MiB"), ("peak_mb_stash", "peak_mb_stash", "MiB"))
# The paged stash: rows per page, and the pool's size against the mean expert load.
PAGE_ROWS = 32
CAPACITY_FACTOR = 1.25


def stash_memory(model_cfg: ModelConfig, batch_size: int, device: torch.device) -> dict:
    """Bytes of the experts' saved activations for one step: exact (eager), the paged pool,
    and the worst-case static buffer; and the saving of the pool against the worst case."""
    model, _ = build_model(model_cfg, device=device)
    batch = random_batch(model_cfg, batch_size, device)
    stash = PagedStash(PAGE_ROWS, CAPACITY_FACTOR).attach(model, batch)
    return {"exact_mb": stash.exact_bytes / 2**20, "pool_mb": stash.pool_bytes / 2**20,
            "worst_case_mb": stash.worst_case_bytes / 2**20,
            "saving_vs_worst": 1 - stash.pool_bytes / stash.worst_case_bytes,
            "page_rows": PAGE_ROWS, "capacity_factor": CAPACITY_FACTOR,
            "stashed_tensors": len(stash.plan)}


def cuda_peak_memory(model_cfg: ModelConfig, batch_size: int) -> dict:
    """Peak CUDA memory of one eager sync-free step, without and with the paged stash."""
    out = {}
    for name in ("no_stash", "stash"):
        model, optimizer = build_model(model_cfg, device="cuda")
        batch = random_batch(model_cfg, batch_size, "cuda")
        stash = PagedStash(PAGE_ROWS, CAPACITY_FACTOR).attach(model, batch) if name == "stash" else None
        step = SyncFreeStep(model, optimizer, batch, StepConfig(), stash=stash)
        step.launch(batch)  # optimizer state allocated
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step.launch(batch)
        torch.cuda.synchronize()
        out[f"peak_mb_{name}"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del step, model, optimizer, stash
        torch.cuda.empty_cache()
    return out


def run_step_bench(preset: str, batch_size: int, min_time_s: float, compile: bool, seed: int = 0) -> dict:
    """Time every provider on this machine; returns ``{"rows": [...], "memory": {...},
    "notes": [...], ...}``."""
    caps = capabilities()
    device = torch.device("cuda" if caps.device == "cuda" else "cpu")
    model_cfg = get_preset(preset)
    batch = random_batch(model_cfg, batch_size, device, torch.Generator().manual_seed(seed))
    notes: list[str] = []
    providers: dict[str, object] = {}
    if device.type == "cpu":
        providers["naive"] = ladder_step(model_cfg, batch, 0)
    else:
        notes.append("naive: not timed on CUDA (its per-expert syncs dominate; see notebook 01)")
    model, optimizer = build_model(model_cfg, device=device, seed=seed)
    eager = SyncFreeStep(model, optimizer, batch)
    providers["eager"] = lambda: eager.launch(batch)
    compile_s = None
    if compile:
        twin, twin_opt = build_model(model_cfg, device=device, seed=seed)
        compiled = SyncFreeStep(twin, twin_opt, batch, forward=torch.compile(twin))
        t0 = time.perf_counter()
        compiled.launch(batch)
        compile_s = time.perf_counter() - t0
        providers["compiled"] = lambda: compiled.launch(batch)
    else:
        notes.append("compiled: skipped (--no-compile)")
    graphed = None
    if device.type == "cuda":
        g_model, g_opt = build_model(model_cfg, device=device, seed=seed)
        graphed = GraphedStep(g_model, g_opt, batch, quiet=True)
        providers["graphed"] = lambda: graphed.launch(batch)
    else:
        notes.append("graphed: no CUDA device here — the step is certified capturable "
                     "(assert_sync_free) but cannot be captured or timed")
    # Not counted: "compiled" (Inductor's fused loops are not ATen operators, and counting
    # under a dispatch mode would change what is compiled), the ops of "graphed" (one graph
    # launch; the kernels are those of "eager").
    ops, syncs = dict.fromkeys(providers), dict.fromkeys(providers)
    for name, fn in providers.items():
        if name not in ("compiled", "graphed"):
            fn()  # the first step also creates the optimizer state: not counted
            ops[name] = count_ops(fn)[1]["ops"]
        if name != "compiled":
            syncs[name] = sum(count_syncs(fn)[1].values())
    eager.certify()
    timings = compare(providers, min_time_s=min_time_s)
    tokens = batch_size * model_cfg.seq_len
    rows = [{"provider": name, "median_ms": t.median_s * 1e3, "iqr_ms": t.iqr_s * 1e3,
             "tokens_per_s": tokens / t.median_s, "vs_eager": timings["eager"].median_s / t.median_s,
             "ops_per_iter": ops[name], "syncs_per_iter": syncs[name]} for name, t in timings.items()]
    memory = stash_memory(model_cfg, batch_size, device=device)
    if device.type == "cuda":
        memory.update(cuda_peak_memory(model_cfg, batch_size))
    else:
        notes.append("memory: counted bytes of the experts' saved activations (no CUDA "
                     "allocator here to measure a peak)")
    return {"preset": preset, "batch_size": batch_size, "tokens_per_step": tokens,
            "device": device.type, "hardware": caps.hardware_label(), "compile_s": compile_s,
            "certified_sync_free": True, "rows": rows, "memory": memory, "notes": notes}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--batch-size", type=positive_int, default=2,
                        help="sequences per step (small = launch-bound on a GPU)")
    parser.add_argument("--profile", default="smoke", choices=list(MIN_TIME))
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    parser.add_argument("--notebook", default="bench:step", help="ledger 'notebook' field")


def run(args: argparse.Namespace) -> dict:
    # --batch-size is checked at the door (its argparse type).
    result = run_step_bench(args.preset, args.batch_size, MIN_TIME[args.profile], compile=not args.no_compile)
    extra = {"preset": args.preset, "batch_size": args.batch_size}
    for row in result["rows"]:  # a figure not counted for a provider is None
        for metric, key, unit in ROW_FIGURES:
            if row[key] is not None:
                step = f"{args.preset}:{row['provider']}"
                ledger.record(args.notebook, step, metric, row[key], unit, **extra)
    for metric, key, unit in MEMORY_FIGURES:  # the peaks only where CUDA measured them
        if key in result["memory"]:
            ledger.record(args.notebook, f"{args.preset}:paged stash", metric, result["memory"][key], unit,
                          **extra)
    return result
