"""The ``train`` command: ``python -m moe_lab train [--preset tiny] [--steps N] ... [--json]``.

A user error (a bad value, a missing or unreadable file, a checkpoint that does not fit
the run, a checkpoint another run holds) ends the command with one line on stderr and exit
status 2; a run whose loss becomes non-finite with one line naming the step and the last
checkpoint, status 1; Ctrl-C, from start-up on, with one line saying where the last
checkpoint is, status 130.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_lab.config import preset
from moe_lab.moe.dispatch import DISPATCHERS
from moe_lab.moe.experts import EXPERT_BACKENDS
from moe_lab.training.build import STEP_KINDS
from moe_lab.workbench.cli import EXIT_INTERRUPTED
from moe_lab.workbench.jsonout import dumps
from moe_lab.workbench.training.loop import (
    TrainConfig,
    TrainingDiverged,
    TrainingInterrupted,
    check_corpus,
    train,
)


def _train(args: argparse.Namespace) -> dict:
    model_cfg = preset(args.preset)
    if args.override and not args.resume:
        raise ValueError("--override applies to --resume only: it continues a checkpoint with "
                         "settings other than its own")
    if args.checkpoint_every and not args.checkpoint:
        raise ValueError(f"--checkpoint-every {args.checkpoint_every} needs --checkpoint PATH")
    if args.resume and not args.checkpoint:
        raise ValueError("--resume needs --checkpoint PATH (the checkpoint to continue)")
    if args.overwrite and not args.checkpoint:
        raise ValueError("--overwrite replaces an existing checkpoint file with this run: it "
                         "needs --checkpoint PATH")
    if args.overwrite and args.resume:
        raise ValueError("--overwrite replaces an existing --checkpoint PATH with a new run; "
                         "it does not go with --resume")
    check_corpus(args.corpus, "--corpus")
    # The corpus is never replaced by a checkpoint (an existing file only with --overwrite:
    # `train` checks that once it holds the path).
    target = Path(args.checkpoint) if args.checkpoint else None
    if target and args.corpus != "synthetic" and target.exists() and target.samefile(args.corpus):
        raise ValueError(f"--checkpoint {target} is the --corpus file: a checkpoint would overwrite it")
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      dispatcher=args.dispatcher, expert_backend=args.expert_backend, corpus=args.corpus,
                      step=args.step, eval_every=args.eval_every, warmup_steps=min(20, args.steps // 10),
                      checkpoint_path=args.checkpoint, checkpoint_every=args.checkpoint_every,
                      progress=not args.json)
    result = train(model_cfg, cfg, resume=args.resume, override=args.override, overwrite=args.overwrite)
    history = result.history
    imbalance = sum(sum(h["imbalance"]) / max(1, len(h["imbalance"])) for h in history) / max(1, len(history))
    return {"preset": args.preset, "dispatcher": args.dispatcher,
            "step": result.step_kind,  # what ran: a graphed step without CUDA runs sync_free
            "step_requested": args.step, "steps": result.steps,
            "final_loss": history[-1]["loss"] if history else None,
            "eval": result.evals[-1] if result.evals else None, "tokens_per_s": result.tokens_per_s,
            "mean_imbalance": imbalance, "checkpoint": args.checkpoint}


def _run_cli(args: argparse.Namespace) -> int:
    try:
        summary = _train(args)
    except KeyboardInterrupt as exc:  # Ctrl-C: `train` says where the run stood
        print(exc if isinstance(exc, TrainingInterrupted) else
              "interrupted before the first step: nothing was trained", file=sys.stderr)
        return EXIT_INTERRUPTED
    except TrainingDiverged as exc:  # an OSError (an unreadable corpus, a full disk) is `main`'s
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    d = TrainConfig()
    p = subparsers.add_parser("train", help="train a preset on the synthetic corpus or a text file")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--steps", type=int, default=d.steps,
                   help="length of the run (and its learning-rate schedule), resumed steps included")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (finite, > 0)")
    p.add_argument("--seed", type=int, default=d.seed, help="an integer in [0, 2**32 - 1]")
    p.add_argument("--dispatcher", default=d.dispatcher, choices=sorted(DISPATCHERS))
    p.add_argument("--expert-backend", default=d.expert_backend, choices=sorted(EXPERT_BACKENDS),
                   help="grouped GEMM of the dropless dispatcher")
    p.add_argument("--step", default=d.step, choices=list(STEP_KINDS),
                   help="the training step (sync_free and graphed need a dispatcher that does not "
                        "sync the host: not naive; without CUDA graphed runs sync_free, and "
                        "--json reports the step that ran)")
    p.add_argument("--corpus", default="synthetic", help="'synthetic' or a path to a UTF-8 text file")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint file, written when the run completes (and every "
                        "--checkpoint-every steps), read by --resume; one run at a time holds it")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also save every N steps (0: only at the end)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --checkpoint file with this run (refused otherwise)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint; it must have steps left (a checkpoint at "
                        "or past --steps is refused: nothing left to train) and was written "
                        "with the same settings")
    p.add_argument("--override", action="store_true",
                   help="with --resume: continue even where --steps, --lr, --seed, "
                        "--dispatcher, ... differ from the checkpoint's")
    p.add_argument("--json", action="store_true", help="print one JSON object (null where a "
                   "figure is not a finite number)")
    p.set_defaults(func=_run_cli)
