"""Training: AdamW, warm-up + cosine learning rate, clipping, router statistics, checkpoints.

``train(model_cfg, TrainConfig(...))`` trains an ``MoETransformer`` on a corpus
(the synthetic multi-domain corpus by default, or any UTF-8 text file) and returns a
``TrainResult`` whose ``history`` holds, per step: the loss, learning rate, gradient
norm, tokens per expert of every MoE layer, load imbalance (max/mean), dropped tokens and
step time; and, every ``eval_every`` steps, the eval loss per domain.

Runs are deterministic under a seed on the CPU: the model is initialised, and batches
drawn, from generators seeded from ``TrainConfig.seed``. A checkpoint holds the model,
the optimiser, the data generator's state and the history, so a resumed run continues
the uninterrupted loss curve exactly. Checkpoints are written atomically (a temporary
file in the same folder, then ``os.replace``) and read with ``weights_only=True``.

This loop reads router statistics back to the host every step (``.tolist()``): that is
the naive stack's habit, and notebook 06 builds the sync-free step that does not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_lab.config import ModelConfig, preset
from moe_lab.model import MoETransformer

Tensor = torch.Tensor


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    eval_per_domain: int = 8
    dispatcher: str = "naive"
    expert_backend: str = "loop"
    router_impl: str = "reference"
    attention_impl: str = "sdpa"
    expert_bias_rate: float = 0.0  # aux-loss-free balancing: bias += rate * sign(mean - load)
    mxfp8: tuple[str, ...] = ()  # ("attention",), ("experts",) or both: emulated MXFP8
    corpus: str = "synthetic"
    checkpoint_path: str | None = None
    checkpoint_every: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_per_domain"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainConfig.{name} must be a non-negative integer, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.expert_bias_rate < 0:
            raise ValueError(f"TrainConfig.expert_bias_rate must be >= 0, got {self.expert_bias_rate!r}")
        if not self.grad_clip > 0:
            raise ValueError(f"TrainConfig.grad_clip must be > 0, got {self.grad_clip!r}")
        if self.checkpoint_every and not self.checkpoint_path:
            raise ValueError("TrainConfig.checkpoint_every needs checkpoint_path")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    model: MoETransformer
    history: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    domains: list[str] = field(default_factory=list)
    tokens_per_s: float = float("nan")

    def losses(self) -> list[float]:
        return [h["loss"] for h in self.history]


def _make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), foreach=False)


@torch.no_grad()
def evaluate(model: MoETransformer, eval_batch, domains: list[str],
             forward: Callable | None = None) -> dict[str, float]:
    """Mean next-token loss per domain (and ``"all"``) on a fixed eval batch (no autograd
    graph: nothing is kept for a backward that never comes). ``forward`` (default: the
    model itself) runs the model, e.g. its ``torch.compile`` under autocast; the model is put
    in eval mode around it either way."""
    was_training = model.training
    model.eval()
    logits = (model if forward is None else forward)(eval_batch.x).logits
    per_token = torch.nn.functional.cross_entropy(
        logits.float().transpose(1, 2), eval_batch.y, reduction="none"
    )
    per_seq = per_token.mean(dim=1)
    result = {"all": per_seq.mean().item()}
    for d, name in enumerate(domains):
        mask = eval_batch.domain == d
        if mask.any():
            result[name] = per_seq[mask].mean().item()
    model.train(was_training)
    return result


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` to ``path`` atomically: a temporary file beside it, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    return torch.load(path, map_location="cpu", weights_only=True)


def train(
    model_cfg: ModelConfig,
    cfg: TrainConfig | None = None,
    *,
    corpus=None,
    resume: bool = False,
    stop_after: int | None = None,
    callback=None,
) -> TrainResult:
    """Train a fresh model (or resume from ``cfg.checkpoint_path`` when ``resume``).

    ``stop_after`` ends the run early after that many total steps (the schedule still
    spans ``cfg.steps``): used to simulate an interrupted run. ``callback(step, record)``
    is called after every step.
    """
    from tqdm.auto import tqdm

    from moe_lab.data import load_corpus
    from moe_lab.moe.balance import update_expert_bias

    cfg = cfg or TrainConfig()
    if corpus is None:
        corpus = load_corpus(cfg.corpus, seq_len=model_cfg.seq_len, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = MoETransformer(model_cfg, dispatcher=cfg.dispatcher, attention_impl=cfg.attention_impl,
                           expert_backend=cfg.expert_backend, router_impl=cfg.router_impl)
    if cfg.mxfp8:
        from moe_lab.quant.linear import apply_mxfp8

        apply_mxfp8(model, tuple(cfg.mxfp8))
    optimizer = _make_optimizer(model, cfg)
    data_gen = torch.Generator().manual_seed(cfg.seed + 1)
    eval_batch = corpus.fixed_eval_set(cfg.eval_per_domain)
    domains = list(corpus.domains)
    result = TrainResult(model=model, domains=domains)
    start = 0
    if resume:
        if not cfg.checkpoint_path:
            raise ValueError("resume=True needs TrainConfig.checkpoint_path")
        state = load_checkpoint(cfg.checkpoint_path)
        if state["model_cfg"] != model_cfg.to_dict():
            raise ValueError("checkpoint was written for a different model config")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data_gen.set_state(state["data_gen"])
        torch.set_rng_state(state["torch_rng"])
        result.history, result.evals = state["history"], state["evals"]
        start = state["step"]

    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    tokens_per_step = cfg.batch_size * model_cfg.seq_len
    model.train()
    bar = tqdm(range(start, end), desc=f"train {model_cfg.name}", disable=not cfg.progress,
               initial=start, total=end)
    for step in bar:
        t0 = time.perf_counter()
        batch = corpus.sample(cfg.batch_size, generator=data_gen, split="train")
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        out = model(batch.x, batch.y)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        if cfg.expert_bias_rate:
            update_expert_bias(model, [s.tokens_per_expert for s in out.moe_stats],
                               cfg.expert_bias_rate)
        # Reading the statistics back is a host sync per step: the naive stack's habit.
        counts = [s.tokens_per_expert.tolist() for s in out.moe_stats]
        record = {
            "step": step,
            "loss": out.loss.item(),
            "lm_loss": out.lm_loss.item(),
            "aux_loss": out.aux_loss.item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_expert": counts,
            "imbalance": [max(c) / (sum(c) / len(c)) for c in counts],
            "dropped_tokens": sum(int(s.dropped_tokens) for s in out.moe_stats),
            "step_time_s": time.perf_counter() - t0,
        }
        result.history.append(record)
        if cfg.progress:
            bar.set_postfix(loss=f"{record['loss']:.3f}")
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            result.evals.append({"step": step + 1, **evaluate(model, eval_batch, domains)})
        if callback is not None:
            callback(step, record)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(cfg.checkpoint_path, _state(model, optimizer, data_gen,
                                                        model_cfg, result, step + 1))
    bar.close()
    times = [h["step_time_s"] for h in result.history[start:]]
    if times:
        result.tokens_per_s = tokens_per_step / (sorted(times)[len(times) // 2])
    return result


def _state(model, optimizer, data_gen, model_cfg, result, step) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "data_gen": data_gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "model_cfg": model_cfg.to_dict(),
        "history": result.history,
        "evals": result.evals,
        "step": step,
    }


def _run_cli(args: argparse.Namespace) -> int:
    model_cfg = preset(args.preset)
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        dispatcher=args.dispatcher, expert_backend=args.expert_backend, corpus=args.corpus,
        eval_every=args.eval_every,
        warmup_steps=min(20, args.steps // 10),
        checkpoint_path=args.checkpoint, checkpoint_every=args.checkpoint_every,
        progress=not args.json,
    )
    result = train(model_cfg, cfg, resume=args.resume)
    summary = {
        "preset": args.preset,
        "dispatcher": args.dispatcher,
        "steps": len(result.history),
        "final_loss": result.history[-1]["loss"] if result.history else None,
        "eval": result.evals[-1] if result.evals else None,
        "tokens_per_s": result.tokens_per_s,
        "mean_imbalance": (
            sum(sum(h["imbalance"]) / max(1, len(h["imbalance"])) for h in result.history)
            / max(1, len(result.history))
        ),
    }
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from moe_lab.moe.dispatch import DISPATCHERS
    from moe_lab.moe.experts import EXPERT_BACKENDS

    d = TrainConfig()
    p = subparsers.add_parser("train", help="train a preset on the synthetic corpus or a text file")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dispatcher", default=d.dispatcher, choices=sorted(DISPATCHERS))
    p.add_argument("--expert-backend", default=d.expert_backend, choices=list(EXPERT_BACKENDS),
                   help="grouped GEMM of the dropless dispatcher")
    p.add_argument("--corpus", default="synthetic", help="'synthetic' or a path to a UTF-8 text file")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--checkpoint", default=None, help="checkpoint file to write (and resume from)")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_cli)


__all__ = ["TrainConfig", "TrainResult", "train", "evaluate", "lr_at", "save_checkpoint",
           "load_checkpoint"]
