"""The report of the contest: statistics over seeds, MFU, the GB300 projection, the ledger.

`summarise` gives each stack's median time to target, its spread and the speed-up over the
naive stack; `loss_gap` compares the stacks' eval losses at the same step, paired by seed;
`mfu_rows` and `stack_ceilings` put the training throughput against this machine's
measured matmul ceiling, `speedup_bound` says what that leaves; `gb300_from_reported`
projects DeepSeek-V3 on GB300 from the FLOPs model and NVIDIA's reported figures alone (a
CPU's MFU says little about a GB300, so nothing measured here enters it). The
`record_*` functions write the figures to the ledger (`moe_lab.workbench.measure.ledger`), the ladder in
the form `moe_lab.workbench.figures.waterfall` draws.
"""

from __future__ import annotations

import math
import statistics
import uuid
from collections.abc import Sequence

from moe_lab.config import preset
from moe_lab.perf.flops import mfu, training_flops_per_token
from moe_lab.perf.hardware import gpu_spec
from moe_lab.workbench import mlperf
from moe_lab.workbench.benchmarks.ttt.contest import TTTConfig, TTTRun
from moe_lab.workbench.benchmarks.ttt.stacks import Stack
from moe_lab.workbench.measure import ceilings, ledger
from moe_lab.workbench.measure.timing import BenchResult

NOTEBOOK = "bench:time-to-train"
LADDER_METRIC = "step_tokens_per_s"


def _spread(values: Sequence[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "iqr": None, "n": 0}
    r = BenchResult.from_times(list(values), "n/a")
    return {"median": r.median_s, "min": r.min_s, "max": r.max_s, "iqr": r.iqr_s, "n": r.n}


def summarise(runs: Sequence[TTTRun], baseline: str = "naive") -> list[dict]:
    """One row per stack: median and spread of the time to target over the seeds that
    reached it, steps to target, training tokens/s, and the speed-up over ``baseline`` —
    the ratio of the medians, and the range of the per-seed ratios."""
    names = list(dict.fromkeys(r.stack for r in runs))
    base = {r.seed: r for r in runs if r.stack == baseline}
    base_time = _spread([r.time_to_target_s for r in base.values() if r.reached])["median"]
    rows = []
    for name in names:
        mine = [r for r in runs if r.stack == name]
        reached = [r for r in mine if r.reached]
        t = _spread([r.time_to_target_s for r in reached])
        per_seed = [base[r.seed].time_to_target_s / r.time_to_target_s for r in reached
                    if r.seed in base and base[r.seed].reached]
        rows.append({
            "stack": name, "description": mine[0].description, "hardware": mine[0].hardware,
            "seeds": len(mine), "reached": len(reached), "target_loss": mine[0].target_loss,
            "time_to_target_s": t["median"], "time_min_s": t["min"], "time_max_s": t["max"],
            "time_iqr_s": t["iqr"],
            "steps_to_target": (statistics.median(r.steps for r in reached) if reached else None),
            "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
            "init_s": statistics.median(r.init_s for r in mine),
            "eval_s": statistics.median(r.eval_s for r in mine),
            "speedup": (base_time / t["median"] if base_time and t["median"] else None),
            "speedup_min": min(per_seed) if per_seed else None,
            "speedup_max": max(per_seed) if per_seed else None,
        })
    return rows


def loss_gap(runs: Sequence[TTTRun], baseline: str = "naive") -> list[dict]:
    """The same-step comparison of each stack with ``baseline``: at every evaluated step that
    the baseline's run of the same seed evaluated too, the mean over seeds of (this stack's
    eval loss − the baseline's), its standard error and the number of seeds ``n``.

    Steps to target is a coarse, noisy statistic: near the target the loss falls by about a
    thousandth per step while a run's eval loss at a given step moves by a few hundredths from
    run to run, so the crossing lands tens of steps either way. The loss at the same step,
    paired by seed, tells a systematic difference (a gap that stays away from 0 by several
    standard errors, step after step) from that noise. Runs stop at the target, so the late
    steps have fewer seeds; steps with fewer than two are left out."""
    base = {r.seed: {p["step"]: p["eval_loss"] for p in r.curve} for r in runs if r.stack == baseline}
    rows = []
    for name in dict.fromkeys(r.stack for r in runs if r.stack != baseline):
        gaps: dict[int, list[float]] = {}
        for r in runs:
            if r.stack != name or r.seed not in base:
                continue
            for p in r.curve:
                theirs = base[r.seed].get(p["step"])
                if theirs is not None and math.isfinite(theirs) and math.isfinite(p["eval_loss"]):
                    gaps.setdefault(p["step"], []).append(p["eval_loss"] - theirs)
        for step in sorted(gaps):
            d = gaps[step]
            if len(d) >= 2:
                rows.append({"stack": name, "step": step, "n": len(d), "mean_gap": statistics.fmean(d),
                             "se": statistics.stdev(d) / math.sqrt(len(d)),
                             "sd": statistics.stdev(d)})
    return rows


def record_ladder(rows: Sequence[dict], cfg: TTTConfig, notebook: str = NOTEBOOK,
                  **extra: object) -> list[dict]:
    """Write the ladder to the ledger as `moe_lab.workbench.figures.waterfall` reads it: metric
    ``step_tokens_per_s``, one record per rung with ``rung``, ``ladder`` (the preset and batch)
    and one ``run`` id."""
    run_id = uuid.uuid4().hex[:12]
    ladder_name = f"{cfg.preset}, batch {cfg.batch_size}"
    return [ledger.record(notebook, f"ladder:{row['label']}", LADDER_METRIC, row["tokens_per_s"],
                          "tok/s", rung=row["rung"], ladder=ladder_name, run=run_id,
                          median_ms=row["median_ms"], iqr_ms=row["iqr_ms"], n_repeats=row["n"],
                          stack=row["stack"], preset=cfg.preset, batch=cfg.batch_size, **extra)
            for row in rows]


# --------------------------------------------------------------------------------------
# MFU and the projection to GB300
# --------------------------------------------------------------------------------------


def mfu_rows(summary: Sequence[dict], cfg: TTTConfig, peak_flops: dict[str, float]) -> list[dict]:
    """Model FLOPs utilisation of each stack's training throughput against ``peak_flops``
    (this machine's measured matmul ceiling, FLOP/s, of each stack's precision, e.g.
    ``{"naive": fp32, "optimised": bf16}``): the FLOPs
    model of `moe_lab.perf.flops` (matmuls only, 6 FLOPs per weight per token plus
    attention)."""
    per_token = training_flops_per_token(preset(cfg.preset))
    return [{"stack": row["stack"], "tokens_per_s": row["tokens_per_s"],
             "achieved_gflops": row["tokens_per_s"] * per_token / 1e9,
             "ceiling_gflops": peak_flops[row["stack"]] / 1e9,
             "mfu": mfu(row["tokens_per_s"] * per_token, peak_flops[row["stack"]])}
            for row in summary]


def stack_ceilings(stacks: Sequence[Stack], n: int = 2048, min_time_s: float = 0.3) -> dict:
    """Each stack's measured matmul ceiling (`moe_lab.workbench.measure.ceilings.Ceiling`), in the precision
    its matmuls run in: fp32, or its ``amp`` dtype; each precision measured once."""
    dtypes = [stack.amp or "fp32" for stack in stacks]
    measured = {dtype: ceilings.matmul_peak(dtype, n=n, min_time_s=min_time_s)
                for dtype in dict.fromkeys(dtypes)}
    return {stack.name: measured[dtype] for stack, dtype in zip(stacks, dtypes)}


def speedup_bound(mfu_value: float) -> float:
    """The most any change that keeps the arithmetic (same FLOPs, same precision) can speed
    up a step running at ``mfu_value`` of the machine's measured ceiling: at best the step
    becomes pure matmul at the ceiling, so ``1 / mfu``."""
    return 1.0 / mfu_value


def gb300_from_reported(gpu: str = "GB300") -> list[dict]:
    """DeepSeek-V3 (seq 4096) on ``gpu``, from the FLOPs model and NVIDIA's reported figures.

    Nothing measured here enters: the FLOPs per training token come from
    `moe_lab.perf.flops` (DeepSeek-V3's published config), the TFLOPS per GPU before and
    after three months of software work and the 2.02 minutes on 8,192 GB300 from NVIDIA's
    MLPerf Training v6.0 blog post (`moe_lab.workbench.mlperf`), the peaks from the datasheet table
    (`moe_lab.perf.hardware`, third-party figures). Each row: its TFLOPS per GPU, that as a
    share of the BF16 and of the FP8 peak (``of_bf16_peak``, ``of_fp8_peak``: MFU against
    either; the reported run used MXFP8 for its linear layers, so neither alone is its
    ceiling), the tokens/s per GPU the FLOPs model gives for it, the minutes the same tokens
    on the same 8,192 GPUs would take (scaled from the reported time), and ``kind``:
    ``"reported"``, ``"derived"`` (a reported figure passed through the FLOPs model) or
    ``"projected bound"`` (a datasheet peak: unreachable).
    """
    spec = gpu_spec(gpu)
    peak, fp8_peak = spec.peak_flops("bf16"), spec.peak_flops("mxfp8")
    seed = mlperf.DEEPSEEK_V3_GB300
    per_token = training_flops_per_token(preset("deepseek_v3"), seed["seq_len"])
    reported = mlperf.result("DeepSeek-V3 671B")
    reported_tps = seed["tokens_per_s_per_gpu"]

    def row(name: str, kind: str, flops: float, tps: float | None = None) -> dict:
        tps = flops / per_token if tps is None else tps
        return {"name": name, "kind": kind, "tflops_per_gpu": flops / 1e12,
                "of_bf16_peak": flops / peak, "of_fp8_peak": flops / fp8_peak,
                "tokens_per_s_per_gpu": tps, "minutes_on_8192": reported.minutes * reported_tps / tps}

    return [
        row("reported before the software work (seed)", "derived", seed["tflops_per_gpu_before"] * 1e12),
        row(f"reported MLPerf v6.0 result, {reported.n_gpus:,} x {reported.system} (seed)", "reported",
            seed["tflops_per_gpu"] * 1e12, reported_tps),
        row(f"{spec.name} BF16 datasheet peak ({spec.source})", "projected bound", peak),
        row(f"{spec.name} FP8/MXFP8 datasheet peak ({spec.source})", "projected bound", fp8_peak),
    ]


def record_summary(summary: Sequence[dict], cfg: TTTConfig, notebook: str = NOTEBOOK,
                   **extra: object) -> None:
    """Every stack's time to target (median, spread), steps and tokens/s, and the speed-up
    of each over the naive stack, into the ledger."""
    common = dict(preset=cfg.preset, batch=cfg.batch_size, target_loss=cfg.target_loss,
                  corpus=cfg.corpus if cfg.corpus == "synthetic" else "text file", **extra)
    for row in summary:
        spread = dict(seeds=row["seeds"], reached=row["reached"])
        if row["time_to_target_s"] is not None:
            ledger.record(notebook, row["stack"], "time_to_target_s", row["time_to_target_s"], "s",
                          min_s=row["time_min_s"], max_s=row["time_max_s"], iqr_s=row["time_iqr_s"],
                          init_s=row["init_s"], **spread, **common)
            ledger.record(notebook, row["stack"], "steps_to_target", float(row["steps_to_target"]), "steps",
                          **spread, **common)
        ledger.record(notebook, row["stack"], "train_tokens_per_s", row["tokens_per_s"], "tok/s",
                      **spread, **common)
        if row["stack"] != "naive" and row["speedup"] is not None:
            ledger.record(notebook, f"{row['stack']} vs naive", "time_to_target_speedup", row["speedup"],
                          "x", min=row["speedup_min"], max=row["speedup_max"], **spread, **common)
