"""The contest's rules, one run's result, and the trainer of a stack.

`TTTConfig` fixes what every stack trains on: the model, the data, the schedule, the
evaluation and the target; `PROFILES` are the two sizes notebook 10 runs. `make_trainer`
builds a stack's `moe_lab.training.loop.Trainer` by those rules — the very object
`moe_lab.training.loop.train` drives — and `TTTRun` is what one stack's run to the target
measured.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from moe_lab.config import ModelConfig, _positive, preset
from moe_lab.data import load_corpus
from moe_lab.model import MoETransformer
from moe_lab.training.build import build_model
from moe_lab.training.loop import TrainConfig, Trainer
from moe_lab.workbench.benchmarks.ttt.stacks import NAIVE, Stack, device_of

__all__ = ["PROFILES", "TTTConfig", "TTTRun", "load_contest_corpus", "make_trainer",
           "stack_model"]


@dataclass(frozen=True)
class TTTConfig:
    """The contest: model, data, schedule, evaluation, target.

    ``preset`` names the model (`moe_lab.config.preset`); ``corpus`` is ``"synthetic"`` or
    the path of a UTF-8 text file. ``max_steps`` is the length of the learning-rate schedule
    and the most steps a run may take; a run that has not reached ``target_loss`` by then
    is reported as not reached. ``eval_every`` steps the eval loss on
    ``eval_per_domain`` fixed sequences of every domain (at least ``min_eval_rows`` rows in
    all) is measured: it is also the resolution of "steps to target".
    """

    preset: str = "small"
    target_loss: float = 1.3
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    max_steps: int = 500
    eval_every: int = 10
    eval_per_domain: int = 4
    min_eval_rows: int = 28
    seed: int = 0
    corpus: str = "synthetic"

    def __post_init__(self) -> None:
        _positive(self, "batch_size", "max_steps", "eval_every", "eval_per_domain", "min_eval_rows")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"TTTConfig.warmup_steps must be a non-negative integer, "
                             f"got {self.warmup_steps!r}")
        if not (isinstance(self.target_loss, (int, float)) and self.target_loss > 0
                and math.isfinite(self.target_loss)):
            raise ValueError(f"TTTConfig.target_loss must be a finite number > 0 (nats per "
                             f"token), got {self.target_loss!r}")
        if not self.lr > 0:
            raise ValueError(f"TTTConfig.lr must be > 0, got {self.lr!r}")
        preset(self.preset)  # raises with the known names

    def model_config(self, router_dtype: str = "fp32") -> ModelConfig:
        return preset(self.preset).replace(moe={"router_dtype": router_dtype})

    def eval_per_domain_of(self, n_domains: int) -> int:
        """Eval rows per domain: ``eval_per_domain``, and at least ``min_eval_rows`` in all."""
        return max(self.eval_per_domain, -(-self.min_eval_rows // n_domains))

    def train_config(self, stack: Stack = NAIVE, n_domains: int = 1) -> TrainConfig:
        """The `moe_lab.training.loop.TrainConfig` that trains ``stack`` by these rules
        (schedule, optimiser, seed, data, evaluation on a corpus of ``n_domains`` domains),
        reading a sync-free step's statistics at every evaluation."""
        return TrainConfig(
            steps=self.max_steps, batch_size=self.batch_size, lr=self.lr,
            warmup_steps=self.warmup_steps, seed=self.seed, eval_every=self.eval_every,
            eval_per_domain=self.eval_per_domain_of(n_domains), corpus=self.corpus,
            progress=False, **asdict(stack.impls), step=stack.step, read_every=self.eval_every,
            clip_step=stack.clip_step, amp=stack.amp, fp32_logits=stack.fp32_logits,
            compile=stack.compile, compiled_eval=stack.compiled_eval, mxfp8=stack.mxfp8)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * preset(self.preset).seq_len


# The two profiles; targets are eval losses (nats per byte) on the fixed synthetic eval set.
# Full: where the small preset's curve has slowed (some 300-400 steps at batch 16), so the
# naive stack trains for minutes on a 2-core CPU; there, small numerical differences between
# the stacks move the step that reaches it by tens of steps, hence several seeds. Smoke: on
# the steep part of the tiny preset's curve, seconds of training.
PROFILES: dict[str, TTTConfig] = {
    "smoke": TTTConfig(preset="tiny", target_loss=1.7, batch_size=8, max_steps=200,
                       warmup_steps=10, eval_every=5),
    "full": TTTConfig(preset="small", target_loss=1.3, batch_size=16, max_steps=500,
                      warmup_steps=20, eval_every=10),
}


@dataclass
class TTTRun:
    """One stack trained to the target (or to ``max_steps``).

    ``time_to_target_s``: seconds from the first training step to the end of the evaluation
    that reached the target (``None`` if not reached); ``steps``: steps taken (the steps to
    target when reached); ``init_s``: building, compiling, capturing (not timed);
    ``train_s`` / ``eval_s``: the timed region split into training and evaluation;
    ``tokens_per_s``: training tokens over ``train_s``; ``curve``: one point per
    evaluation, ``{"step", "time_s", "eval_loss"}`` (and ``"compiled_eval_loss"`` where a
    stack's compiled evaluation reached the target and the plain FP32 one, ``eval_loss``,
    was asked to confirm it).
    """

    stack: str
    description: str
    seed: int
    hardware: str
    target_loss: float
    reached: bool
    steps: int
    time_to_target_s: float | None
    elapsed_s: float
    init_s: float
    train_s: float
    eval_s: float
    tokens_per_step: int
    tokens_per_s: float
    final_eval_loss: float
    curve: list[dict] = field(default_factory=list)
    train_curve: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def load_contest_corpus(cfg: TTTConfig):
    """The corpus of the contest (``cfg.corpus``, seeded with ``cfg.seed``)."""
    return load_corpus(cfg.corpus, seq_len=preset(cfg.preset).seq_len, seed=cfg.seed)


def make_trainer(stack: Stack, cfg: TTTConfig, device: torch.device | str | None = None, *,
                 corpus=None, warm_eval: bool = False) -> Trainer:
    """The `moe_lab.training.loop.Trainer` of ``stack`` under ``cfg``: every stack starts from
    the same weights (seeded with ``cfg.seed``) and draws the same batches. Building it is
    initialisation: with ``compile`` the model is compiled here, and with ``warm_eval`` its
    compiled evaluation too."""
    corpus = load_contest_corpus(cfg) if corpus is None else corpus
    return Trainer(cfg.model_config(stack.router_dtype),
                   cfg.train_config(stack, len(corpus.domains)), corpus=corpus,
                   device=device_of(device), warm_eval=warm_eval)


def stack_model(stack: Stack, cfg: TTTConfig,
                device: torch.device | str | None = None) -> MoETransformer:
    """The model ``stack`` trains under ``cfg``, as its trainer builds it (same seed, same
    implementations, FP32 logits and MXFP8 where the stack asks), without its step."""
    model, _ = build_model(cfg.model_config(stack.router_dtype), stack.impls, step=stack.step,
                           device=device_of(device), seed=cfg.seed, lr=cfg.lr,
                           fp32_logits=stack.fp32_logits, mxfp8=stack.mxfp8)
    return model
