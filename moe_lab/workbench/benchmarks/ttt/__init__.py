"""Time to train: one model, one data stream, one target loss — the naive stack against the
optimised stack (a mini MLPerf).

MLPerf Training does not rank systems by tokens per second. It ranks them by *time to
train*: the wall-clock minutes from the start of the run until an evaluation on a fixed
held-out set first reaches a target quality. Throughput only counts through that clock, and
so do evaluation, host stalls, and anything that changes how many steps the model needs.
This package runs the same contest on whatever machine the reader has:

- `moe_lab.workbench.benchmarks.ttt.stacks` — what races: a `Stack` of registered implementation names,
  `NAIVE`, `optimised_stack` (on a CPU with the CPU plug-in's kernels where they build),
  and the `ladder` between them;
- `moe_lab.workbench.benchmarks.ttt.contest` — the rules (`TTTConfig`, `PROFILES`): the model is a
  preset trained on the synthetic corpus or any UTF-8 text file, from the same seed, on the
  same batches in the same order, with the same warm-up + cosine schedule; every
  ``eval_every`` steps the eval loss on a fixed eval set is measured, and the clock stops
  after the first evaluation at or below ``target_loss``. `make_trainer` builds a stack's
  `moe_lab.workbench.training.loop.Trainer`, the object `moe_lab.workbench.training.loop.train` drives;
- `moe_lab.workbench.benchmarks.ttt.racing` — the race itself: the stacks' trainers advanced in lockstep,
  each on its own clock (`race`, `compare_stacks`), and single-step
  timings of the same trainers (`ladder_throughput`, `step_breakdowns`);
- `moe_lab.workbench.benchmarks.ttt.report` — statistics over seeds, MFU, the GB300 projection, the ledger;
- this module — the command line, ``python -m moe_lab bench time-to-train [--profile full]
  [--seeds 3] [--corpus FILE] [--json]``, and the names above that notebook 12 uses.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import asdict, replace
from pathlib import Path

from moe_lab.perf.capabilities import capabilities
from moe_lab.workbench.benchmarks.ttt.contest import PROFILES, TTTConfig, pick_router_impl
from moe_lab.workbench.benchmarks.ttt.contest import stack_model as stack_model
from moe_lab.workbench.benchmarks.ttt.racing import (
    compare_stacks,
    deterministic_algorithms,
    ladder_throughput,
)
from moe_lab.workbench.benchmarks.ttt.racing import step_breakdowns as step_breakdowns
from moe_lab.workbench.benchmarks.ttt.report import (
    NOTEBOOK,
    loss_gap,
    mfu_rows,
    record_ladder,
    record_summary,
    speedup_bound,
    stack_ceilings,
    summarise,
)
from moe_lab.workbench.benchmarks.ttt.stacks import NAIVE, device_of, ladder, optimised_stack
from moe_lab.workbench.cli import positive_float, positive_int
from moe_lab.workbench.measure import ledger

DESCRIPTION = "time to a target eval loss (a mini MLPerf): naive stack vs optimised stack"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="smoke", choices=list(PROFILES),
                        help="smoke: tiny preset, seconds; full: small preset, minutes")
    parser.add_argument("--seeds", type=positive_int, default=1, help="seeds 0..N-1 (median and spread)")
    parser.add_argument("--target", type=float, default=None,
                        help="target eval loss in nats per token (default: the profile's)")
    parser.add_argument("--max-steps", type=positive_int, default=None, help="schedule length and step cap")
    parser.add_argument("--batch-size", type=positive_int, default=None)
    parser.add_argument("--corpus", default="synthetic",
                        help="'synthetic' or a path to a UTF-8 text file (then give --target)")
    parser.add_argument("--no-compile", action="store_true",
                        help="CPU: leave torch.compile off in the optimised stack")
    parser.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"],
                        help="CPU: BF16 autocast in the optimised stack (auto: where the CPU has "
                             "bf16 matmul instructions)")
    parser.add_argument("--pick-router", action="store_true",
                        help="CPU: time the reference vs the compiled router and use the faster "
                             "in the eager rungs (under torch.compile the chain is compiled anyway)")
    parser.add_argument("--ladder", action="store_true",
                        help="also time one step of every rung of the ladder (for the waterfall)")
    parser.add_argument("--deterministic", action="store_true",
                        help="bit-reproducible runs: torch.use_deterministic_algorithms during the "
                             "race (see deterministic_algorithms; costs some throughput)")
    parser.add_argument("--max-seconds", type=positive_float, default=None,
                        help="give up on a run after this many timed seconds")
    parser.add_argument("--notebook", default=NOTEBOOK, help="ledger 'notebook' field")
    parser.add_argument("--progress", action="store_true", help="print every evaluation")


def config_from_args(args: argparse.Namespace) -> TTTConfig:
    changes = {"target_loss": args.target, "steps": args.max_steps, "batch_size": args.batch_size}
    if args.corpus != "synthetic":
        if not Path(args.corpus).is_file():
            raise ValueError(f"--corpus '{args.corpus}' is not a file; expected 'synthetic' or the "
                             "path of a UTF-8 text file")
        if args.target is None:
            raise ValueError("--corpus FILE needs --target (nats per byte): the synthetic "
                             "targets mean nothing on other text; a short run's final eval "
                             "loss is a good guide")
        changes["corpus"] = args.corpus
    return replace(PROFILES[args.profile], **{k: v for k, v in changes.items() if v is not None})


def run(args: argparse.Namespace) -> dict:
    cfg = config_from_args(args)
    device = device_of(None)
    notes: list[str] = []
    compile_ = not args.no_compile
    router = None
    if args.pick_router and device.type == "cpu":
        router, router_times = pick_router_impl(cfg)
        notes.append(f"router picked by measurement: {router} ({router_times})")
        for name, ms in router_times.items():
            ledger.record(args.notebook, f"router:{name}", "router_fwd_bwd_ms", ms, "ms",
                          tokens=cfg.tokens_per_step, preset=cfg.preset)
    amp = {"auto": None, "bf16": "bf16", "off": ""}[args.amp]
    best = optimised_stack(device, compile=compile_, router_impl=router, amp=amp)
    with deterministic_algorithms() if args.deterministic else contextlib.nullcontext():
        runs = compare_stacks([NAIVE, best], cfg, seeds=range(args.seeds), device=device,
                              max_seconds=args.max_seconds, progress=args.progress)
    summary = summarise(runs)
    record_summary(summary, cfg, args.notebook, profile=args.profile, deterministic=args.deterministic)
    gaps = loss_gap(runs)
    result: dict = {"hardware": capabilities().hardware_label(), "config": asdict(cfg),
                    "optimised": {"stack": best.describe(), "notes": list(best.notes)},
                    "notes": notes, "rows": summary, "loss_gap": gaps}
    if getattr(args, "json", False):  # the curves only where a program reads them
        result["runs"] = [asdict(r) for r in runs]
    else:
        result["loss_gap"] = [f"{g['stack']} - naive eval loss at step {g['step']}: "
                              f"{g['mean_gap']:+.4f} (standard error {g['se']:.4f}, {g['n']} seeds)"
                              for g in gaps]
        result["runs"] = [f"{r.stack} seed {r.seed}: " + (
            f"{r.time_to_target_s:.1f} s, {r.steps} steps" if r.reached else
            f"not reached in {r.steps} steps (eval loss {r.final_eval_loss:.3f})")
            + f", {r.tokens_per_s:,.0f} tok/s, init {r.init_s:.1f} s" for r in runs]
    peaks = stack_ceilings([NAIVE, best], n=1024 if args.profile == "smoke" else 2048)
    result["matmul_ceiling_gflops"] = peaks[NAIVE.name].giga
    result["mfu"] = mfu_rows(summary, cfg, {k: c.value for k, c in peaks.items()})
    for row in result["mfu"]:
        ledger.record(args.notebook, row["stack"], "mfu", row["mfu"], "fraction",
                      ceiling_gflops=row["ceiling_gflops"], ceiling=peaks[row["stack"]].name,
                      preset=cfg.preset, profile=args.profile)
    # At the naive stack's precision, no change can beat 1 / its MFU; a lower precision
    # moves the ceiling itself (the naive stack's FLOP rate against the faster ceiling).
    result["same_precision_speedup_bound"] = speedup_bound(result["mfu"][0]["mfu"])
    if best.amp:
        result["lower_precision_speedup_bound"] = speedup_bound(
            result["mfu"][0]["achieved_gflops"] * 1e9 / peaks[best.name].value)
    if args.ladder:
        rows = ladder_throughput(ladder(device, compile=compile_, router_impl=router, amp=best.amp),
                                 cfg, device=device)
        record_ladder(rows, cfg, args.notebook, profile=args.profile)
        result["ladder"] = rows
    return result
