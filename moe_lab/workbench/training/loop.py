"""The training loop: one `Trainer` advanced step by step, with a pluggable step.

``train(model_cfg, TrainConfig(...))`` trains an ``MoETransformer`` on a corpus (synthetic,
or any UTF-8 text file) and returns a `TrainResult`. ``TrainConfig.step`` names the step:
``"eager"`` (`moe_lab.training.steps.EagerStep`, the naive stack's: every statistic read back
every step, so ``history`` holds one record per step), ``"sync_free"``
(`moe_lab.training.steps.SyncFreeStep`: one record per window of ``read_every`` steps) or
``"graphed"`` (that step as a CUDA graph, `moe_lab.training.graphs.GraphedStep`). Every
``eval_every`` steps the eval loss per domain goes to ``evals``.

A `Trainer` holds what one run needs (model, optimizer, step, data stream, eval set, the
compiled or autocast forwards); `train` is the loop over it with evaluation, callback and
checkpoints, and the time-to-train race advances one `Trainer` per stack in lockstep. On a
GPU nothing around its step makes the host wait: the data stream (`BatchStream`) copies
each batch from pinned memory without blocking, one step ahead, and the step times
(`Trainer.step_times`) come from CUDA events, read once the run asks for them.

Runs are deterministic under a seed on the CPU. A checkpoint holds the model, optimizer,
the step's device state, the data generator and the history, so a resumed run continues the
uninterrupted loss curve exactly; it records the `RUN_SETTINGS` and the corpus file's size and
hash, and a resume with others, or on a corpus whose contents changed, is refused unless asked
for (``override``). A run holds its checkpoint path for its lifetime (a second run on it is
refused). A non-finite loss stops the run (`TrainingDiverged`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import stat
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

try:
    import tqdm.auto
    import tqdm.std
except ImportError:  # a machine with only torch and triton: runs train without a progress bar
    tqdm = None

from moe_lab.checks import boolean, int_in, non_negative_ints, non_negative_number, positive_ints
from moe_lab.config import ModelConfig, holds
from moe_lab.data import Batch, SyntheticCorpus, TextFileCorpus, load_corpus
from moe_lab.memory import check_fits
from moe_lab.model import MoETransformer
from moe_lab.training.build import BuildConfig, build_model, random_batch, step_forward
from moe_lab.training.graphs import EAGER_MODE, GraphedStep
from moe_lab.training.steps import EagerStep, StepConfig, SyncFreeStep
from moe_lab.workbench.training.checkpoint import (
    check_checkpoint_path,
    checkpoint_lock,
    load_checkpoint,
    save_checkpoint,
)

Tensor = torch.Tensor

#: The `TrainConfig` fields that change what a run computes: a checkpoint records them, and
#: resuming with other values is refused unless asked for (``train(..., override=True)``).
#: The others choose how it is computed (implementations, compilation), what is measured
#: (evaluation, statistics) or where it is saved.
RUN_SETTINGS = ("steps", "batch_size", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
                "grad_clip", "seed", "dispatcher", "step", "amp", "fp32_logits",
                "expert_bias_rate", "mxfp8", "corpus")

#: The largest seed: every generator derived from it (``seed + k``, ``seed * 2 + k``) stays a
#: valid 64-bit torch seed.
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class DataConfig:
    """What a run trains and is evaluated on: ``batch_size`` sequences a step from ``corpus``
    (``"synthetic"`` or the path of a UTF-8 text file), drawn from generators seeded from
    ``seed`` (which seeds the model's initial weights too); every ``eval_every`` steps (0:
    never) the eval loss on ``eval_per_domain`` fixed sequences of each domain."""

    batch_size: int = 16
    seed: int = 0
    corpus: str = "synthetic"
    eval_every: int = 50
    eval_per_domain: int = 8

    def __post_init__(self) -> None:
        positive_ints(self, "batch_size", "eval_per_domain")
        non_negative_ints(self, "eval_every")
        int_in(self.seed, "DataConfig.seed", 0, MAX_SEED)
        corpus = os.fspath(self.corpus) if isinstance(self.corpus, os.PathLike) else self.corpus
        if not isinstance(corpus, str) or not corpus:
            raise ValueError('DataConfig.corpus must be "synthetic" or the path of a UTF-8 text '
                             f"file, got {self.corpus!r}")
        object.__setattr__(self, "corpus", corpus)  # a Path is kept as its str


@holds(step_config=StepConfig, data=DataConfig, build=BuildConfig)
@dataclass
class TrainConfig:
    """One training run: the step's settings (``step_config``: the schedule — ``lr``,
    ``warmup_steps``, ``steps``, ``min_lr_ratio`` — ``grad_clip``, ``read_every``,
    ``expert_bias_rate``), the data and evaluation (``data``), how the run is computed
    (``build``: the model's implementations, the step kind, autocast, compile, MXFP8), the
    optimizer's ``weight_decay`` and the checkpoints. The fields of every part may be given
    and read flat: ``TrainConfig(steps=100, lr=1e-3, dispatcher="dropless")``.
    """

    step_config: StepConfig = field(default_factory=StepConfig)
    data: DataConfig = field(default_factory=DataConfig)
    build: BuildConfig = field(default_factory=BuildConfig)
    weight_decay: float = 0.1
    checkpoint_path: str | None = None
    checkpoint_every: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        non_negative_number(self.weight_decay, "TrainConfig.weight_decay")
        path = self.checkpoint_path
        if isinstance(path, os.PathLike):
            path = self.checkpoint_path = os.fspath(path)
        if path is not None and not (isinstance(path, str) and path):
            raise ValueError(f"TrainConfig.checkpoint_path must be None or a file path, got {path!r}")
        non_negative_ints(self, "checkpoint_every")
        if self.checkpoint_every and not self.checkpoint_path:
            raise ValueError("TrainConfig.checkpoint_every needs checkpoint_path")
        boolean(self.progress, "TrainConfig.progress")

    def run_settings(self) -> dict:
        """The `RUN_SETTINGS` of this run (what a checkpoint records and a resume compares);
        a corpus file by its absolute path, however it was spelled."""
        settings = {name: (list(v) if isinstance(v := getattr(self, name), tuple) else v)
                    for name in RUN_SETTINGS}
        settings["corpus"] = _absolute_corpus(self.corpus)
        return settings


def _absolute_corpus(corpus: str) -> str:
    return corpus if corpus == "synthetic" else str(Path(corpus).resolve())


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def check_corpus(corpus: str, name: str = "corpus") -> None:
    """Refuse (``FileNotFoundError``, ``ValueError``) a ``corpus`` that is neither
    ``"synthetic"`` nor a regular file, saying what it is instead (a directory, a FIFO, a
    device: reading one would never end or mean nothing). ``name`` is the argument's name
    in the message (``"--corpus"`` on the command line)."""
    if corpus == "synthetic":
        return
    expected = 'expected "synthetic" or the path of a UTF-8 text file'
    if not corpus:
        raise ValueError(f"{name} '' is empty; {expected}")
    try:
        mode = os.stat(corpus).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{name} '{corpus}' is neither \"synthetic\" nor an existing "
                                "file") from None
    if not stat.S_ISREG(mode):
        kind = next((kind for test, kind in _FILE_KINDS if test(mode)), "not a regular file")
        raise ValueError(f"{name} '{corpus}' is {kind}; the corpus must be a regular text file "
                         f"({expected})")


def corpus_fingerprint(path: str | os.PathLike) -> dict:
    """The size and BLAKE2b hash of the corpus file ``path`` (read in 1 MiB blocks: a fraction
    of the cost of loading it), which a checkpoint records so a resume notices the text changed."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return {"bytes": os.stat(path).st_size, "blake2b": digest.hexdigest()}


@dataclass
class TrainResult:
    model: MoETransformer
    history: list[dict]
    evals: list[dict]
    tokens_per_s: float
    steps: int  # training steps taken, resumed ones included
    step_kind: str  # the step that ran: TrainConfig.step, or "sync_free" where a graphed
    # step ran eagerly (no CUDA)

    def losses(self) -> list[float]:
        return [h["loss"] for h in self.history]


def _to(batch: Batch, device: torch.device) -> Batch:
    """``batch`` on ``device`` without stalling the host: a copy from pageable memory makes
    the host wait until the GPU has finished everything queued before it, so each tensor is
    first put in pinned (page-locked) host memory, from which ``non_blocking=True`` copies
    are queued behind the GPU's work and the host moves on. PyTorch's pinned-memory cache
    keeps the host buffer until its copy has run. On the CPU the batch already is there."""
    if device.type == "cpu":
        return batch
    return Batch(*(t.pin_memory().to(device, non_blocking=True) for t in batch))


class BatchStream:
    """The training batches of a run: ``batch_size`` sequences of ``corpus`` a step, drawn
    on the host from ``generator`` and moved to ``device`` (`_to`) one step ahead.

    `take` returns the next batch (the one `prefetch` drew and queued, else one drawn now);
    `prefetch` draws the batch after it and queues its copy, called once the step on the
    current batch is queued, so the host draws while the GPU computes. `state` is the
    generator's state before the batch not yet taken, so a checkpoint resumes with it (set
    on ``generator`` before the first batch) and the stream is the same whether or not a
    batch was prefetched."""

    def __init__(self, corpus: SyntheticCorpus | TextFileCorpus, batch_size: int,
                 generator: torch.Generator, device: torch.device) -> None:
        self.corpus, self.batch_size = corpus, batch_size
        self.generator, self.device = generator, device
        self._ahead: tuple[Batch, Tensor] | None = None  # (batch, generator state before it)

    def prefetch(self) -> None:
        """Draw the next batch now and queue its copy to the device (once: a second call
        before `take` keeps the batch already drawn)."""
        if self._ahead is None:
            before = self.generator.get_state()
            batch = self.corpus.sample(self.batch_size, generator=self.generator, split="train")
            self._ahead = (_to(batch, self.device), before)

    def take(self) -> Batch:
        """The next batch of the stream, on the device (drawn now where none was prefetched)."""
        self.prefetch()
        batch, self._ahead = self._ahead[0], None
        return batch

    def state(self) -> Tensor:
        """The generator's state at the next batch to be taken (a prefetched one included)."""
        return self.generator.get_state() if self._ahead is None else self._ahead[1]


class Trainer:
    """One training run, advanced a step at a time: ``trainer.advance()`` trains on the next
    batch of the data stream and returns the statistics the step read (or ``None``).

    Everything is built here from ``cfg``, seeded from ``cfg.seed``. With ``compile`` one
    forward and backward on random tokens compile the model before any training step (the
    weights do not move), and with ``warm_eval`` the compiled evaluation too. ``checkpoint``
    (a `state`) resumes a run: the model, optimizer, data stream and RNG are restored before
    the step is built, the step's device state after.
    """

    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, *,
                 corpus: SyntheticCorpus | TextFileCorpus | None = None,
                 device: torch.device | str | None = None, checkpoint: dict | None = None,
                 warm_eval: bool = False) -> None:
        self.model_cfg, self.cfg = model_cfg, cfg
        self.device = torch.device(device or "cpu")
        # Refuse a batch_size whose step cannot fit in the device's memory, before the corpus,
        # the model or any batch is built: a lower bound, the FP32 logits, their gradient and
        # softmax (3 × 4 × vocab_size bytes per token) and the int64 tokens and targets (16 bytes).
        tokens = cfg.batch_size * model_cfg.seq_len
        check_fits(f"batch_size={cfg.batch_size} ({tokens:,} tokens of {model_cfg.name})",
                   tokens * (12 * model_cfg.vocab_size + 16), "use a smaller batch size (--batch-size)",
                   self.device)
        if corpus is None:  # cfg.corpus, checked at the door (`train`, the command line)
            corpus = load_corpus(cfg.corpus, seq_len=model_cfg.seq_len, seed=cfg.seed)
        self.corpus = corpus
        self.model, self.optimizer = build_model(
            model_cfg, cfg.impls, step=cfg.step, device=self.device, seed=cfg.seed, lr=cfg.lr,
            weight_decay=cfg.weight_decay)
        self.batches = BatchStream(corpus, cfg.batch_size, torch.Generator().manual_seed(cfg.seed + 1),
                                   self.device)
        self.eval_batch = _to(corpus.fixed_eval_set(cfg.eval_per_domain), self.device)
        self.steps_done = 0
        self._marks: list[tuple] = []  # each `advance`'s (start, end) from `_now`
        if checkpoint is not None:
            self._restore(checkpoint)
        example = random_batch(model_cfg, cfg.batch_size, self.device,
                               torch.Generator().manual_seed(cfg.seed + 7))
        self.forward = step_forward(self.model, compile=cfg.compile, amp=cfg.amp,
                                    graphed=cfg.step == "graphed")
        if cfg.compile:
            self.forward(example.x, example.y).loss.backward()
            self.model.zero_grad(set_to_none=True)
        self.eval_forward = (step_forward(self.model, compile=cfg.compile, amp=cfg.amp,
                                          dynamic=False) if cfg.compiled_eval else None)
        if self.eval_forward is not None and warm_eval:
            self.evaluate()  # compiles the evaluation now, not in the first timed one
        if cfg.step == "eager":
            self.step = EagerStep(self.model, self.optimizer, cfg.step_config, forward=self.forward)
        elif cfg.step == "graphed":
            self.step = GraphedStep(self.model, self.optimizer, example, cfg.step_config,
                                    forward=self.forward, clip_step=cfg.clip_step, quiet=not cfg.progress)
        else:
            self.step = SyncFreeStep(self.model, self.optimizer, example, cfg.step_config,
                                     forward=self.forward, clip_step=cfg.clip_step)
        if checkpoint is not None and self.step.state is not None:
            with self._restoring("step_state", "the step's device state"):
                self.step.state.load_state_dict(checkpoint["step_state"])
        self.step.host_steps = self.steps_done  # a resumed run's schedule goes on where it was

    def train_on(self, batch: Batch) -> dict | None:
        """One training step on ``batch``; the statistics the step read, or ``None``."""
        record = self.step(batch)
        self.steps_done += 1
        return record

    def advance(self) -> dict | None:
        """One training step on the next batch of the stream (timed into `step_times`); the
        batch after it is drawn and its copy queued while the GPU runs the step."""
        start = self._now()
        record = self.train_on(self.batches.take())
        self.batches.prefetch()
        self._marks.append((start, self._now()))
        return record

    def _now(self) -> float | torch.cuda.Event:
        """The time now: ``time.perf_counter()``, on CUDA an event recorded in the stream, read
        only when `step_times` is asked for (the host never waits for it while steps run)."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @property
    def step_times(self) -> list[float]:
        """Seconds per `advance` so far, batch drawing included (on CUDA this waits for the
        GPU to pass the last step's end event)."""
        if self.device.type != "cuda":
            return [end - start for start, end in self._marks]
        if self._marks:  # events complete in stream order: the last end is the last to wait for
            self._marks[-1][1].synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in self._marks]  # elapsed_time: ms

    @torch.no_grad()
    def evaluate(self, compiled: bool = True) -> dict[str, float]:
        """Mean next-token loss per domain (and ``"all"``) on the fixed eval batch (no autograd
        graph: nothing is kept for a backward that never comes), through the compiled
        evaluation (its ``torch.compile`` under autocast) where there is one and ``compiled``,
        else the plain FP32 model; the model is put in eval mode for it, then back in training
        mode (where it always is between steps)."""
        self.model.eval()
        forward = self.eval_forward if compiled and self.eval_forward is not None else self.model
        logits = forward(self.eval_batch.x).logits
        per_token = torch.nn.functional.cross_entropy(
            logits.float().transpose(1, 2), self.eval_batch.y, reduction="none"
        )
        per_seq = per_token.mean(dim=1)
        result = {"all": per_seq.mean().item()}
        for d, name in enumerate(self.corpus.domains):
            mask = self.eval_batch.domain == d
            if mask.any():
                result[name] = per_seq[mask].mean().item()
        self.model.train()
        return result

    def sync(self) -> None:
        """Wait for the device (CUDA) to finish the steps queued so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def state(self, history: list[dict], evals: list[dict]) -> dict:
        """A checkpoint of the run so far (`moe_lab.workbench.training.checkpoint.save_checkpoint`)."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "data_gen": self.batches.state(), "torch_rng": torch.get_rng_state(),
                 "model_cfg": asdict(self.model_cfg), "settings": self.cfg.run_settings(),
                 "history": history, "evals": evals, "step": self.steps_done}
        if self.step.state is not None:
            state["step_state"] = self.step.state.state_dict()
        return state

    @contextlib.contextmanager
    def _restoring(self, key: str, what: str) -> object:
        """Turn torch's error on a checkpoint's ``key`` that does not fit this run (a
        hand-made or foreign checkpoint: wrong shapes, types, sizes) into one ``ValueError``
        naming the file and ``what`` is wrong."""
        try:
            yield
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__  # torch's, on one line
            reason = reason if len(reason) <= 200 else reason[:200] + "..."
            raise ValueError(f"checkpoint '{self.cfg.checkpoint_path}': its {key} ({what}) does "
                             f"not fit this run: {reason}") from None

    def _restore(self, state: dict) -> None:
        path = self.cfg.checkpoint_path
        if state["model_cfg"] != asdict(self.model_cfg):
            raise ValueError(f"checkpoint '{path}' was written for a different model config")
        saved_on_host = _host_optimizer(state["optimizer"].get("param_groups", []))
        if saved_on_host != _host_optimizer(self.optimizer.param_groups):
            saved = state.get("settings", {}).get("step", "eager" if saved_on_host else "sync_free")
            where = ("host", "device") if saved_on_host else ("device", "host")
            raise ValueError(
                f"checkpoint '{path}' was written by the {saved} step, whose optimizer keeps its "
                f"step count on the {where[0]}; the {self.cfg.step} step's keeps it on the "
                f"{where[1]} and cannot continue it: resume with --step {saved} (step={saved!r})")
        with self._restoring("model", "the model's weights"):
            self.model.load_state_dict(state["model"])
        lr = self.optimizer.param_groups[0]["lr"]
        with self._restoring("optimizer", "the optimizer's state"):
            self.optimizer.load_state_dict(state["optimizer"])
            _check_optimizer_state(self.optimizer)
        if isinstance(lr, Tensor):  # a device lr shared by every group stays that tensor
            lr.copy_(self.optimizer.param_groups[0]["lr"])
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        with self._restoring("data_gen", "the data generator's state"):
            self.batches.generator.set_state(state["data_gen"])  # nothing prefetched yet
        with self._restoring("torch_rng", "torch's RNG state"):
            torch.set_rng_state(state["torch_rng"])
        self.steps_done = state["step"]


def _host_optimizer(groups: list) -> bool:
    """Whether an optimizer's param groups keep its step count on the host (the eager step's
    stock AdamW) rather than the device (the sync-free step's fused, capturable one)."""
    return not any(isinstance(g, dict) and (g.get("fused") or g.get("capturable")) for g in groups)


def _check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``ValueError`` where a loaded state tensor (a moment) has another shape than its
    parameter: torch loads it without a word and fails at the first step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.dim() and value.shape != p.shape:
                    raise ValueError(f"{name} has shape {list(value.shape)}, its parameter "
                                     f"{list(p.shape)}")


class TrainingDiverged(RuntimeError):
    """The training loss became non-finite (NaN or infinite): the run stops there rather than
    train on, and save, weights that are no longer numbers. The message names the step and
    the last checkpoint."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during `train`: a ``KeyboardInterrupt`` whose message says where the run stood
    (the steps taken, the last checkpoint)."""


def _progress_bar(steps: range, **options: object) -> object:
    """tqdm's bar for the steps: a widget in a notebook with a front end, text elsewhere. In a
    kernel no front end draws (``MOE_LAB_HEADLESS=1``: papermill, the workbook runner, CI) a
    widget would never be updated on the saved page, which would show it at 0; there the text
    bar goes to standard output, where the page keeps its last state (a carriage return
    overwrites the one before it) and nothing reads as an error."""
    if os.environ.get("MOE_LAB_HEADLESS") == "1":
        return tqdm.std.tqdm(steps, file=sys.stdout, mininterval=1.0, ascii=True, **options)
    return tqdm.auto.tqdm(steps, **options)


def _where_to_resume(last_checkpoint: tuple[str, int] | None) -> str:
    if last_checkpoint is None:
        return "no checkpoint was written (--checkpoint PATH keeps one)"
    path, step = last_checkpoint
    return f"the last checkpoint is '{path}' (step {step})"


def _is_state_tensor(value: object) -> bool:
    return isinstance(value, Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def _is_record(value: object, key: str, kind: type | tuple[type, ...]) -> bool:
    return isinstance(value, dict) and isinstance(value.get(key), kind) and not isinstance(
        value.get(key), bool)


#: What each value of a training checkpoint must be (a test and its description), checked
#: before any of it is loaded: a hand-made checkpoint with the right keys and wrong values
#: gets one line naming the key.
_CHECKPOINT_VALUES = {
    "model": (lambda v: isinstance(v, dict), "a dict of tensors"),
    "optimizer": (lambda v: isinstance(v, dict) and isinstance(v.get("state"), dict)
                  and isinstance(v.get("param_groups"), list), "an optimizer state_dict"),
    "data_gen": (_is_state_tensor, "a generator state (a 1-D uint8 tensor)"),
    "torch_rng": (_is_state_tensor, "an RNG state (a 1-D uint8 tensor)"),
    "model_cfg": (lambda v: isinstance(v, dict), "a model config dict"),
    "history": (lambda v: isinstance(v, list) and all(
        _is_record(h, "loss", (int, float)) and isinstance(h.get("imbalance"), list) for h in v),
        "a list of step records, each with a loss and imbalance"),
    "evals": (lambda v: isinstance(v, list) and all(_is_record(e, "step", int) for e in v),
              "a list of eval records, each with a step"),
    "step": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
             "a number of steps (an integer >= 0)"),
    "settings": (lambda v: isinstance(v, dict), "a dict of run settings"),
    "step_state": (lambda v: isinstance(v, dict), "a dict of tensors"),
    "corpus_fingerprint": (lambda v: v is None or isinstance(v, dict), "None or a dict"),
}
_OPTIONAL_KEYS = ("settings", "step_state", "corpus_fingerprint")  # older checkpoints lack them


def _check_resume(checkpoint: dict, cfg: TrainConfig, override: bool,
                  fingerprint: dict | None) -> None:
    """Refuse a checkpoint that is not a training checkpoint (a key missing, a value of the
    wrong kind), has nothing left to train under ``cfg``, or was written with other
    `RUN_SETTINGS` or on a corpus file whose contents (``fingerprint``, now) have changed
    (unless ``override``)."""
    path = cfg.checkpoint_path
    missing = [k for k in _CHECKPOINT_VALUES if k not in checkpoint and k not in _OPTIONAL_KEYS]
    if missing:
        raise ValueError(f"checkpoint '{path}' is not a training checkpoint: it has no "
                         f"{', '.join(missing)}")
    for key, (valid, what) in _CHECKPOINT_VALUES.items():
        if key in checkpoint and not valid(checkpoint[key]):
            raise ValueError(f"checkpoint '{path}' is not a training checkpoint: its {key} is "
                             f"not {what} ({type(checkpoint[key]).__name__})")
    done = checkpoint["step"]
    if done >= cfg.steps:
        raise ValueError(f"checkpoint '{path}' is at step {done}, and steps={cfg.steps}: nothing "
                         f"left to train; give more steps (--steps) to continue the run")
    if override or "settings" not in checkpoint:  # checkpoints written before settings were
        return
    saved, now = dict(checkpoint["settings"]), cfg.run_settings()
    if isinstance(saved.get("corpus"), str):  # an older checkpoint's path, as it was spelled
        saved["corpus"] = _absolute_corpus(saved["corpus"])
    differ = [f"{k} {saved[k]!r} (now {now[k]!r})" for k in RUN_SETTINGS
              if k in saved and saved[k] != now[k]]
    if differ:
        raise ValueError(f"checkpoint '{path}' was written with other settings: "
                         f"{', '.join(differ)}; resume with the same ones, or continue with "
                         "the new ones on purpose (--override, override=True)")
    then = checkpoint.get("corpus_fingerprint")
    if then is not None and fingerprint is not None and then != fingerprint:
        size = (f"{then.get('bytes')} bytes then, {fingerprint['bytes']} now"
                if then.get("bytes") != fingerprint["bytes"] else "same size, other bytes")
        raise ValueError(f"corpus '{cfg.corpus}' has changed since checkpoint '{path}' was "
                         f"written ({size}); resume on the text it was trained on, or continue "
                         "on the new one on purpose (--override, override=True)")


def train(model_cfg: ModelConfig, cfg: TrainConfig | None = None, *,
          corpus: SyntheticCorpus | TextFileCorpus | None = None, resume: bool = False,
          override: bool = False, overwrite: bool = True,
          callback: Callable[[int, dict | None], object] | None = None,
          device: torch.device | str | None = None) -> TrainResult:
    """Train a fresh model (or resume from ``cfg.checkpoint_path`` when ``resume``).

    With ``cfg.checkpoint_path`` the run is saved every ``cfg.checkpoint_every`` steps
    (if > 0) and when it completes; the path and the corpus are checked before anything is
    trained, and the run holds the path until it ends (`checkpoint_lock`: a second run on it
    raises `CheckpointInUse`). ``overwrite=False`` refuses a path that already holds a file
    (unless ``resume``). A resumed run must have steps left, and the `RUN_SETTINGS` and
    corpus contents it was saved with unless ``override``.
    ``callback(step, record)`` is called after every step (``record`` is ``None`` where the
    step read nothing).

    A non-finite training loss raises `TrainingDiverged`, Ctrl-C `TrainingInterrupted`;
    both name the step and the last checkpoint.
    """
    cfg = cfg or TrainConfig()
    if override and not resume:
        raise ValueError("override=True (--override) applies to a resumed run: add resume=True "
                         "(--resume)")
    if resume and not cfg.checkpoint_path:
        raise ValueError("resume=True needs TrainConfig.checkpoint_path")
    if corpus is None:
        check_corpus(cfg.corpus)
    path = check_checkpoint_path(cfg.checkpoint_path) if cfg.checkpoint_path else None
    with checkpoint_lock(path) if path else contextlib.nullcontext():  # a run without one holds none
        if path and not (resume or overwrite) and path.exists():
            raise ValueError(f"--checkpoint {path} exists; pass --resume (resume=True) to continue "
                             "it or --overwrite (overwrite=True) to replace it with this run")
        # The file the run trains on, if it trains on one: the given corpus's, or cfg.corpus;
        # its fingerprint goes in the checkpoints, if the run writes any.
        corpus_file = getattr(corpus, "path", None) if corpus is not None else cfg.corpus
        fingerprint = (None if path is None or corpus_file in (None, "synthetic")
                       else corpus_fingerprint(corpus_file))
        checkpoint = load_checkpoint(path) if resume else None
        if resume:
            _check_resume(checkpoint, cfg, override, fingerprint)
        trainer = Trainer(model_cfg, cfg, corpus=corpus, device=device, checkpoint=checkpoint)
        return _run(trainer, checkpoint, fingerprint, callback)


def _run(trainer: Trainer, checkpoint: dict | None, fingerprint: dict | None,
         callback: Callable[[int, dict | None], object] | None) -> TrainResult:
    """`train`'s loop over a built ``trainer`` (resumed from ``checkpoint``, if given), its
    checkpoints recording the corpus ``fingerprint``."""
    cfg, model_cfg = trainer.cfg, trainer.model_cfg
    last_checkpoint = None if checkpoint is None else (str(cfg.checkpoint_path), checkpoint["step"])
    history, evals = ([], []) if checkpoint is None else (checkpoint["history"], checkpoint["evals"])
    steps = range(trainer.steps_done, cfg.steps)
    bar = (None if tqdm is None else  # no progress bar where tqdm is not installed
           _progress_bar(steps, desc=f"train {model_cfg.name}", disable=not cfg.progress,
                         initial=steps.start, total=cfg.steps))

    def keep(record: dict) -> None:
        """Add the statistics ``record`` to the history, once its loss is known finite."""
        if not math.isfinite(record["loss"]):
            n, window = trainer.steps_done, record.get("steps", 1)
            where = f"step {n}" if window <= 1 else f"steps {n - window + 1}-{n}"
            raise TrainingDiverged(
                f"training diverged: the loss is {record['loss']} at {where} (lr {cfg.lr:g}); "
                f"{_where_to_resume(last_checkpoint)}")
        history.append(record)

    def save() -> None:
        def saved() -> None:
            nonlocal last_checkpoint
            last_checkpoint = (str(cfg.checkpoint_path), trainer.steps_done)
        state = trainer.state(history, evals)
        save_checkpoint(cfg.checkpoint_path, {**state, "corpus_fingerprint": fingerprint}, saved)

    try:
        for step in steps if bar is None else bar:
            record = trainer.advance()
            if record is not None:
                keep(record)
                if cfg.progress and bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.3f}")
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                evals.append({"step": step + 1, **trainer.evaluate()})
            if callback is not None:
                callback(step, record)
            if (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
                    and step + 1 < cfg.steps):
                save()
        last = trainer.step.flush()  # the statistics the step still holds (a sync-free window)
        if last is not None:
            keep(last)
        if cfg.checkpoint_path:
            save()  # the completed run, its last statistics read and checked
    except KeyboardInterrupt:
        raise TrainingInterrupted(
            f"interrupted after step {trainer.steps_done}; {_where_to_resume(last_checkpoint)}") from None
    finally:
        if bar is not None:
            bar.close()
    # The step that ran: cfg.step, or "sync_free" where a graphed step runs eagerly (no CUDA).
    step_kind = "sync_free" if getattr(trainer.step, "mode", None) == EAGER_MODE else cfg.step
    seconds = statistics.median_high(trainer.step_times)  # upper median; a run takes >= 1 step
    return TrainResult(model=trainer.model, history=history, evals=evals, steps=trainer.steps_done,
                       tokens_per_s=cfg.batch_size * model_cfg.seq_len / seconds, step_kind=step_kind)
