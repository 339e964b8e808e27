"""Three ways to balance the experts, trained side by side on the same data.

`compare_balancing` trains the same model three times — no balancing, an auxiliary loss,
and the aux-loss-free expert bias of `moe_lab.moe.balance` (DeepSeek-V3) — and returns what
each did to the load imbalance and the language-model loss, step by step.
"""

from __future__ import annotations

import torch

from moe_lab.checks import positive_int
from moe_lab.config import ModelConfig
from moe_lab.data import load_corpus
from moe_lab.moe.balance import ExpertBiasBalancer, load_imbalance
from moe_lab.workbench.training.loop import TrainConfig, train


def compare_balancing(model_cfg: ModelConfig, steps: int, *, batch_size: int = 8, seed: int = 0,
                      aux_loss_coef: float = 0.01, bias_rate: float = 0.01) -> dict[str, list[dict]]:
    """Train ``model_cfg`` three times on the same data — ``"none"`` (no balancing),
    ``"aux loss"`` (``aux_loss_coef``), ``"bias"`` (aux-loss-free, ``bias_rate``) — and
    return, per run, one record per step: ``loss`` (the language-model loss, comparable
    across runs), ``imbalance`` (max/mean load, averaged over the MoE layers) and
    ``max_share`` (the busiest expert's share of the routed slots, averaged likewise)."""
    positive_int(steps, "steps")
    corpus = load_corpus("synthetic", seq_len=model_cfg.seq_len, seed=seed)
    runs = {"none": (0.0, None), "aux loss": (aux_loss_coef, None), "bias": (0.0, bias_rate)}
    out: dict[str, list[dict]] = {}
    for name, (coef, rate) in runs.items():
        cfg = model_cfg.replace(moe={"aux_loss_coef": coef})
        train_cfg = TrainConfig(steps=steps, batch_size=batch_size, seed=seed, eval_every=0,
                                warmup_steps=max(1, steps // 10), dispatcher="naive",
                                expert_backend="loop", router_impl="reference", progress=False)
        if rate is None:
            result = train(cfg, train_cfg, corpus=corpus)
        else:
            with ExpertBiasBalancer(rate) as balancer:
                result = train(cfg, train_cfg, corpus=corpus, callback=balancer)
        records = []
        for h in result.history:
            counts = torch.tensor(h["tokens_per_expert"], dtype=torch.float64)  # [layers, E]
            records.append({
                "step": h["step"],
                "loss": h["lm_loss"],
                "imbalance": float(load_imbalance(counts).mean()),
                "max_share": float((counts.amax(-1) / counts.sum(-1).clamp_min(1)).mean()),
            })
        out[name] = records
    return out
