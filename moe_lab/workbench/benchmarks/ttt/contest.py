"""The contest's rules, one run's result, and the trainer of a stack.

`TTTConfig` fixes what every stack trains on: the model, the data, the schedule, the
evaluation and the target; `PROFILES` are the two sizes notebook 12 runs. `make_trainer`
builds a stack's `moe_lab.workbench.training.loop.Trainer` by those rules — the very object
`moe_lab.workbench.training.loop.train` drives — and `TTTRun` is what one stack's run to the target
measured. `pick_router_impl` times the router candidates at the contest's size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from moe_lab.checks import positive_int, positive_ints, positive_number
from moe_lab.config import ModelConfig, holds, preset
from moe_lab.data import SyntheticCorpus, TextFileCorpus, load_corpus
from moe_lab.model import MoETransformer
from moe_lab.moe.router import Router
from moe_lab.training.build import build_model
from moe_lab.training.optim import Schedule
from moe_lab.training.steps import StepConfig
from moe_lab.workbench.benchmarks.ttt.stacks import NAIVE, Stack, cpu_plugin_status, cpu_router, device_of
from moe_lab.workbench.measure.timing import compare
from moe_lab.workbench.training.loop import DataConfig, TrainConfig, Trainer


@holds(schedule=Schedule, data=DataConfig)
@dataclass(frozen=True)
class TTTConfig:
    """The contest: model, data, schedule, evaluation, target.

    ``preset`` names the model (`moe_lab.config.preset`). ``schedule`` is the learning rate
    every stack trains with; its ``steps`` are also the most steps a run may take: a run that
    has not reached ``target_loss`` by then is reported as not reached. ``data``: the batches
    and the evaluation, every ``eval_every`` steps on ``eval_per_domain`` fixed sequences of
    every domain (at least ``min_eval_rows`` rows in all) — the resolution of "steps to
    target". The fields of both parts may be given and read flat (``TTTConfig(steps=100)``).
    """

    preset: str = "small"
    target_loss: float = 1.3
    schedule: Schedule = field(default_factory=lambda: Schedule(steps=500))
    data: DataConfig = field(default_factory=lambda: DataConfig(eval_every=10, eval_per_domain=4))
    min_eval_rows: int = 28

    def __post_init__(self) -> None:
        positive_ints(self, "min_eval_rows")
        positive_int(self.eval_every, "TTTConfig.eval_every")  # the race stops at an evaluation
        positive_number(self.target_loss, "TTTConfig.target_loss (nats per token)")
        preset(self.preset)  # raises with the known names

    def model_config(self, router_dtype: str = "fp32") -> ModelConfig:
        return preset(self.preset).replace(moe={"router_dtype": router_dtype})

    def train_config(self, stack: Stack = NAIVE, n_domains: int = 1) -> TrainConfig:
        """The `moe_lab.workbench.training.loop.TrainConfig` that trains ``stack`` by these rules
        (schedule, data, evaluation on a corpus of ``n_domains`` domains), reading a
        sync-free step's statistics at every evaluation. Eval rows per domain:
        ``eval_per_domain``, and at least ``min_eval_rows`` in all."""
        per_domain = max(self.eval_per_domain, -(-self.min_eval_rows // n_domains))
        return TrainConfig(
            step_config=StepConfig(self.schedule, read_every=self.eval_every),
            data=replace(self.data, eval_per_domain=per_domain),
            build=stack.build, progress=False)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * preset(self.preset).seq_len


# The two profiles; targets are eval losses (nats per byte) on the fixed synthetic eval set.
# Full: where the small preset's curve has slowed (some 300-400 steps at batch 16), so the
# naive stack trains for minutes on a 2-core CPU; there, small numerical differences between
# the stacks move the step that reaches it by tens of steps, hence several seeds. Smoke: on
# the steep part of the tiny preset's curve, seconds of training.
PROFILES: dict[str, TTTConfig] = {
    "smoke": TTTConfig(preset="tiny", target_loss=1.7, batch_size=8, steps=200,
                       warmup_steps=10, eval_every=5),
    "full": TTTConfig(preset="small", target_loss=1.3, batch_size=16, steps=500,
                      warmup_steps=20, eval_every=10),
}


@dataclass
class TTTRun:
    """One stack trained to the target (or for the schedule's ``steps``).

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
    reached: bool = False
    steps: int = 0
    time_to_target_s: float | None = None
    elapsed_s: float = 0.0
    init_s: float = 0.0
    train_s: float = 0.0
    eval_s: float = 0.0
    tokens_per_step: int = 0
    tokens_per_s: float = 0.0
    final_eval_loss: float = float("nan")
    curve: list[dict] = field(default_factory=list)


def load_contest_corpus(cfg: TTTConfig) -> SyntheticCorpus | TextFileCorpus:
    """The corpus of the contest (``cfg.corpus``, seeded with ``cfg.seed``)."""
    return load_corpus(cfg.corpus, seq_len=preset(cfg.preset).seq_len, seed=cfg.seed)


def make_trainer(stack: Stack, cfg: TTTConfig, device: torch.device, *,
                 corpus: SyntheticCorpus | TextFileCorpus, warm_eval: bool = False) -> Trainer:
    """The `moe_lab.workbench.training.loop.Trainer` of ``stack`` under ``cfg`` on ``corpus``
    (`load_contest_corpus`): every stack starts from the same weights (seeded with
    ``cfg.seed``) and draws the same batches. Building it is initialisation: with ``compile``
    the model is compiled here, and with ``warm_eval`` its compiled evaluation too."""
    return Trainer(cfg.model_config(stack.router_dtype),
                   cfg.train_config(stack, len(corpus.domains)), corpus=corpus,
                   device=device, warm_eval=warm_eval)


def stack_model(stack: Stack, cfg: TTTConfig,
                device: torch.device | str | None = None) -> MoETransformer:
    """The model ``stack`` trains under ``cfg``, as its trainer builds it (same seed, same
    implementations, FP32 logits and MXFP8 where the stack asks), without its step."""
    model, _ = build_model(cfg.model_config(stack.router_dtype), stack.impls, step=stack.step,
                           device=device_of(device), seed=cfg.seed, lr=cfg.lr)
    return model


def pick_router_impl(cfg: TTTConfig, min_time_s: float = 0.5) -> tuple[str, dict[str, float]]:
    """Time the FP32 router of one MoE layer of ``cfg``'s model (forward + backward, at the
    step's token count) for each candidate on this machine, interleaved
    (`moe_lab.workbench.measure.timing.compare`), and return the fastest name and every median in
    milliseconds.
    The candidates are the CPU's reference router (with the plug-in's top-k where it is
    registered) and its ``torch.compile``; the compiled candidate compiles on its first call,
    which the warm-up absorbs."""
    cpu_plugin_status()
    moe_cfg = cfg.model_config("fp32").moe
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.tokens_per_step, moe_cfg.d_model, generator=gen)
    providers: dict[str, Callable[[], None]] = {}
    for name in (cpu_router(), "compiled"):
        torch.manual_seed(cfg.seed)
        router = Router(moe_cfg, impl=name)

        def fwd_bwd(router: Router = router) -> None:
            xi = x.detach().requires_grad_()
            out = router(xi)
            (out.topk_weights.sum() + out.aux_loss).backward()

        providers[name] = fwd_bwd
    timings = compare(providers, warmup=2, min_time_s=min_time_s)
    medians = {name: t.median_s * 1e3 for name, t in timings.items()}
    return min(medians, key=medians.get), medians
