"""Eager against graphed: the measurement a GPU machine runs for notebook 08 — the same model
and batches trained through `SyncFreeStep` and through `GraphedStep`, their losses and weights
compared, one iteration of each timed, interleaved."""

from __future__ import annotations

import torch

from moe_lab.config import preset as get_preset
from moe_lab.perf.capabilities import capabilities
from moe_lab.training.build import build_model, build_sync_free, random_batch
from moe_lab.training.graphs import GraphedStep
from moe_lab.training.steps import StepConfig
from moe_lab.training.sync import count_syncs
from moe_lab.workbench.measure.timing import compare


def graphed_vs_eager(preset: str = "small", batch_size: int = 2, steps: int = 20, *,
                     min_time_s: float = 0.5, device: torch.device | str | None = None) -> dict:
    """Train two identical models (``preset``, seed 0) ``steps`` steps on the same random
    batches on ``device`` (default: the GPU where there is one), one eager (`SyncFreeStep`),
    one through `GraphedStep`; compare their losses and weights, then time one iteration of
    each, interleaved (`moe_lab.workbench.measure.timing.compare`).

    Returns ``mode`` (what `GraphedStep` did), ``eager_ms``, ``graphed_ms``, ``speedup``
    (eager / graphed), their IQRs, ``loss_eager``, ``loss_graphed`` (mean over the steps),
    ``loss_abs_diff``, ``loss_rel_diff``, ``param_max_abs_diff``, ``syncs_per_step``
    (counted on the eager step), the hardware label and the sizes. On a CPU both run
    eagerly: the speed-up is ~1 by construction and ``mode`` says so.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_cfg = get_preset(preset)
    cfg = StepConfig(read_every=steps, warmup_steps=min(5, steps), steps=max(steps, 1))
    eager = build_sync_free(model_cfg, batch_size, device=device, seed=0, cfg=cfg)
    model, optimizer = build_model(model_cfg, device=device, seed=0, lr=cfg.lr)
    gen = torch.Generator().manual_seed(1)
    batches = [random_batch(model_cfg, batch_size, device, gen) for _ in range(steps)]
    graphed = GraphedStep(model, optimizer, batches[0], cfg, quiet=True)
    stats_e = stats_g = None
    for batch in batches:
        stats_e = eager(batch) or stats_e
        stats_g = graphed(batch) or stats_g
    param_diff = max((a - b).abs().max().item()
                     for a, b in zip(eager.model.parameters(), model.parameters(), strict=True))
    _, syncs = count_syncs(eager.launch, batches[0])
    cycle = iter(range(10**9))

    def eager_iter() -> None:
        eager.launch(batches[next(cycle) % steps])

    def graphed_iter() -> None:
        graphed.launch(batches[next(cycle) % steps])

    timings = compare({"eager": eager_iter, "graphed": graphed_iter}, min_time_s=min_time_s)
    e, g = timings["eager"], timings["graphed"]
    return {
        "preset": model_cfg.name, "batch_size": batch_size,
        "tokens_per_step": batch_size * model_cfg.seq_len, "steps": steps,
        "device": device.type, "hardware": capabilities().hardware_label(), "mode": graphed.mode,
        "eager_ms": e.median_s * 1e3, "graphed_ms": g.median_s * 1e3,
        "eager_iqr_ms": e.iqr_s * 1e3, "graphed_iqr_ms": g.iqr_s * 1e3,
        "speedup": e.median_s / g.median_s,
        "loss_eager": stats_e["loss"], "loss_graphed": stats_g["loss"],
        "loss_abs_diff": abs(stats_e["loss"] - stats_g["loss"]),
        "loss_rel_diff": abs(stats_e["loss"] - stats_g["loss"]) / max(abs(stats_e["loss"]), 1e-12),
        "param_max_abs_diff": param_diff, "syncs_per_step": sum(syncs.values()),
        "certified": graphed.certified,
    }
