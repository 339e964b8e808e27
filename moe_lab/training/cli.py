"""The ``train`` command: ``python -m moe_lab train [--preset tiny] [--steps N] ... [--json]``."""

from __future__ import annotations

import argparse
import json

from moe_lab.config import preset
from moe_lab.moe.dispatch import DISPATCHERS
from moe_lab.moe.experts import EXPERT_BACKENDS
from moe_lab.training.build import STEP_KINDS
from moe_lab.training.loop import TrainConfig, train


def _run_cli(args: argparse.Namespace) -> int:
    model_cfg = preset(args.preset)
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        dispatcher=args.dispatcher, expert_backend=args.expert_backend, corpus=args.corpus,
        step=args.step, eval_every=args.eval_every,
        warmup_steps=min(20, args.steps // 10),
        checkpoint_path=args.checkpoint, checkpoint_every=args.checkpoint_every,
        progress=not args.json,
    )
    result = train(model_cfg, cfg, resume=args.resume)
    summary = {
        "preset": args.preset,
        "dispatcher": args.dispatcher,
        "step": args.step,
        "steps": result.steps,
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
    d = TrainConfig()
    p = subparsers.add_parser("train", help="train a preset on the synthetic corpus or a text file")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dispatcher", default=d.dispatcher, choices=sorted(DISPATCHERS))
    p.add_argument("--expert-backend", default=d.expert_backend, choices=sorted(EXPERT_BACKENDS),
                   help="grouped GEMM of the dropless dispatcher")
    p.add_argument("--step", default=d.step, choices=list(STEP_KINDS),
                   help="the training step (sync_free and graphed need --dispatcher dropless)")
    p.add_argument("--corpus", default="synthetic", help="'synthetic' or a path to a UTF-8 text file")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--checkpoint", default=None, help="checkpoint file to write (and resume from)")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_cli)
