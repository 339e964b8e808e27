"""Time to train: one model, one data stream, one target loss — the naive stack against the
optimised stack (a mini MLPerf).

MLPerf Training does not rank systems by tokens per second. It ranks them by *time to
train*: the wall-clock minutes from the start of the run until an evaluation on a fixed
held-out set first reaches a target quality. Throughput only counts through that clock, and
so do evaluation, host stalls, and anything that changes how many steps the model needs.
This module runs the same contest on whatever machine the reader has:

- the model is a preset (``small`` by default) trained on the synthetic corpus, or on any
  UTF-8 text file, from the same seed, on the same batches in the same order, with the same
  warm-up + cosine schedule (`moe_lab.train.lr_at`);
- every ``eval_every`` steps the mean next-token loss on a fixed eval set is measured
  (`moe_lab.train.evaluate`); the clock stops after the first evaluation at or below
  ``target_loss``;
- the clock starts at the first training step. What happens before — building the model,
  compiling it, capturing a CUDA graph, all on random tokens, never on training data — is
  *initialisation*, reported beside the time to target as ``init_s`` (MLPerf also keeps
  initialisation out of the timed region, within a cap). Evaluation time is inside the clock;
- on a CPU the stacks *race in lockstep* (`race`): one step of each in turn, each stack's
  clock adding up only its own steps and evaluations, so a burst of load from another
  process on a shared machine slows both alike instead of whichever ran at that moment.

A **stack** (`Stack`) is a set of implementation choices, each a config string of the
package, never a code path of its own:

- ``naive``: the loop over experts (one host sync per expert), the unfused router in
  FP64, and the training loop of `moe_lab.train` — the stock AdamW stepping parameter by
  parameter and the statistics read back every step — run eagerly;
- ``optimised`` (`optimised_stack`): dropless, sync-free dispatch with a grouped GEMM
  (on a CPU moe_lab's OpenMP kernel, `moe_lab.kernels.cpu_grouped`, where a C++ compiler
  builds it, else ``torch._grouped_mm``; moe_lab's Triton kernel on a GPU); the router in FP32
  (the fused Triton kernel where Triton compiles; on a CPU whichever of the reference chain
  and its ``torch.compile`` is measured faster, see `pick_router_impl`); the sync-free step
  of `moe_lab.step` (fused AdamW — on a CPU the norm, the clip and AdamW as one call of
  `moe_lab.kernels.cpu_optim` — and statistics on the device); on a CPU moe_lab's fused
  attention kernel (`moe_lab.kernels.cpu_attention`) and, with bf16 matmul instructions,
  BF16 autocast (FP32 master weights, router, softmax and loss; expert groups not padded:
  the expert kernel runs blocks of 32 rows forward and 64 backward, so a group's row count
  only sets the height of its last block); ``torch.compile``
  of the model on a CPU with Inductor's C++ wrapper, its evaluations compiled too (an
  evaluation that reaches the target is confirmed by the plain FP32 one before the clock
  stops), the whole step captured as a
  CUDA graph on a GPU; MXFP8 only where the GPU has
  MX tensor cores and Transformer Engine runs them — elsewhere it is emulated, slower, and
  left off.

`ladder` rebuilds the optimised stack one technique at a time; `ladder_throughput` times a
training step of every rung, interleaved on the same batches, and `record_ladder` writes
them to the ledger in the form `moe_lab.waterfall` draws.

``python -m moe_lab bench time-to-train [--profile full] [--seeds 3] [--corpus FILE]
[--json]`` runs it from the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from moe_lab.config import ModelConfig, _positive, preset

DESCRIPTION = "time to a target eval loss (a mini MLPerf): naive stack vs optimised stack"
NOTEBOOK = "bench:time-to-train"
LADDER_METRIC = "step_tokens_per_s"

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------
# Stacks
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    """One set of implementation choices for the same model.

    ``dispatcher``, ``expert_backend``, ``router_impl`` and ``router_dtype`` select the MoE
    implementations (`moe_lab.moe`); ``sync_free`` trains with `moe_lab.step.SyncFreeStep`
    (fused AdamW, schedule and statistics on the device) instead of the loop of
    `moe_lab.train`; ``compile`` wraps the model in ``torch.compile``; ``graphed`` captures
    the whole step as a CUDA graph (`moe_lab.graphs.GraphedStep`; CUDA only); ``mxfp8``
    names the parts run in MXFP8 (`moe_lab.quant.linear.apply_mxfp8`); ``amp`` (``"bf16"``)
    runs the forward under ``torch.autocast`` in that dtype (fp32 master weights, the router
    and the loss in fp32); ``fp32_logits`` (with ``amp``) computes the output projection and
    the logits in FP32 (`moe_lab.model.MoETransformer.fp32_logits`); ``attention_impl`` names
    the attention core
    (`moe_lab.attention.ATTENTION_IMPLS`); ``row_align`` pads every expert's group of the
    dropless layout to a multiple of that many rows (``SwiGLUExperts.row_align``);
    ``compiled_eval`` (with ``compile``) runs the evaluations through a ``torch.compile`` of
    the model under the stack's autocast, and confirms an evaluation that reaches the
    target with the plain FP32 one before the clock stops (`race`); ``cpp_wrapper`` (with
    ``compile``) has Inductor write each compiled graph's launcher — the code that calls
    its kernels and GEMMs in turn and manages its buffers — in C++ instead of Python
    (``torch.compile(options={"cpp_wrapper": True})``). ``notes`` say why a choice was
    made or left out on this machine.

    Under ``compile`` and ``amp`` the backward graph is traced under the forward's autocast
    (``torch._functorch.config.backward_pass_autocast = "same_as_forward"``, pinned here
    because PyTorch means to change its default): the backward GEMMs of the regions that
    the forward keeps in FP32 (the router, the logits) run in the autocast dtype, as every
    other backward GEMM does. Eager autograd would run them in FP32.
    """

    name: str
    dispatcher: str = "naive"
    expert_backend: str = "loop"
    router_impl: str = "reference"
    router_dtype: str = "fp64"
    sync_free: bool = False
    compile: bool = False
    graphed: bool = False
    mxfp8: tuple[str, ...] = ()
    amp: str = ""
    fp32_logits: bool = False
    attention_impl: str = "sdpa"
    row_align: int = 1
    compiled_eval: bool = False
    cpp_wrapper: bool = False
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from moe_lab.attention import ATTENTION_IMPLS
        from moe_lab.config import ROUTER_DTYPES
        from moe_lab.moe.dispatch import DISPATCHERS
        from moe_lab.moe.experts import EXPERT_BACKENDS
        from moe_lab.moe.router import ROUTER_IMPLS

        for attr, allowed in (("dispatcher", tuple(DISPATCHERS)),
                              ("expert_backend", EXPERT_BACKENDS),
                              ("router_impl", tuple(ROUTER_IMPLS)),
                              ("router_dtype", ROUTER_DTYPES),
                              ("amp", AMP_DTYPES),
                              ("attention_impl", tuple(ATTENTION_IMPLS))):
            value = getattr(self, attr)
            if value not in allowed:
                raise ValueError(f"Stack.{attr} must be one of {sorted(allowed)}, got {value!r}")
        if self.router_impl == "triton" and self.router_dtype != "fp32":
            raise ValueError("Stack: router_impl 'triton' computes in FP32; router_dtype must be "
                             f"'fp32', got {self.router_dtype!r}")
        if not isinstance(self.row_align, int) or isinstance(self.row_align, bool) or self.row_align < 1:
            raise ValueError(f"Stack.row_align must be a positive integer, got {self.row_align!r}")
        if self.row_align > 1 and self.dispatcher != "dropless":
            raise ValueError("Stack: row_align pads the dropless layout; dispatcher must be 'dropless'")
        if (self.compile or self.graphed or self.amp) and not self.sync_free:
            raise ValueError("Stack: compile, graphed and amp apply to the sync-free step; set "
                             "sync_free=True")
        if self.fp32_logits and not self.amp:
            raise ValueError("Stack: fp32_logits keeps the logits in FP32 under autocast; set amp")
        if self.compiled_eval and not self.compile:
            raise ValueError("Stack: compiled_eval evaluates through torch.compile; set compile=True")
        if self.cpp_wrapper and not self.compile:
            raise ValueError("Stack: cpp_wrapper is an option of torch.compile; set compile=True")

    def describe(self) -> str:
        """One line: what this stack runs."""
        parts = [f"{self.dispatcher} dispatch"]
        if self.dispatcher == "dropless":
            parts[0] += f" ({self.expert_backend} grouped GEMM)"
        parts.append(f"{self.router_impl} router {self.router_dtype.upper()}")
        parts.append("sync-free step" if self.sync_free else "moe_lab.train loop")
        if self.amp:
            parts.append(f"{self.amp.upper()} autocast" + (" (logits FP32)" if self.fp32_logits else ""))
        if self.attention_impl != "sdpa":
            parts.append(f"{self.attention_impl} attention")
        if self.row_align > 1:
            parts.append(f"expert groups padded to {self.row_align} rows")
        if self.compile:
            parts.append("torch.compile" + (" (C++ wrapper)" if self.cpp_wrapper else ""))
        if self.compiled_eval:
            parts.append("evaluation compiled" + (f" in {self.amp.upper()}" if self.amp else "")
                         + " (the crossing confirmed in FP32)")
        if self.graphed:
            parts.append("CUDA graph")
        if self.mxfp8:
            parts.append("MXFP8 " + "+".join(self.mxfp8))
        return ", ".join(parts)


AMP_DTYPES = ("", "bf16")  # "": no autocast


def _autocast_forward(fn: Callable, device_type: str, amp: str, graphed: bool = False) -> Callable:
    """``fn(x, y)`` under ``torch.autocast(device_type, amp)``. The cast cache (each weight
    cast once per forward, reused by its backward) is on, except under a CUDA graph, where
    a cached cast would be a capture-time copy of the weights. Off, it cost ~25% of a
    BF16 step on a CPU (every use of a weight casts it anew).

    A ``torch.compile``d ``fn`` traces its backward graph here, during the forward: with
    ``backward_pass_autocast`` pinned to ``"same_as_forward"`` (see `Stack`), whatever
    PyTorch's default."""
    import torch._functorch.config as functorch_config

    dtype = {"bf16": torch.bfloat16}[amp]

    def forward(x, y=None):
        with (torch.autocast(device_type, dtype=dtype, cache_enabled=not graphed),
              functorch_config.patch(backward_pass_autocast=BACKWARD_PASS_AUTOCAST)):
            return fn(x, y)

    return forward


# How a compiled model's backward graph treats the forward's autocast (see `Stack`).
BACKWARD_PASS_AUTOCAST = "same_as_forward"


def _compile(model: torch.nn.Module, stack: Stack, **kwargs) -> Callable:
    """``torch.compile(model)`` with the stack's Inductor options (``cpp_wrapper``)."""
    options = {"cpp_wrapper": True} if stack.cpp_wrapper else None
    return torch.compile(model, options=options, **kwargs)


NAIVE = Stack("naive", notes=("the loop over experts, FP64 router, stock AdamW, statistics "
                              "read every step, eager",))


def _mxfp8_targets(device: torch.device) -> tuple[tuple[str, ...], str]:
    from moe_lab.perf.capabilities import capabilities

    caps = capabilities()
    if device.type == "cuda" and caps.native_mxfp8 and caps.transformer_engine:
        return ("attention",), "MXFP8 attention projections through Transformer Engine (native)"
    if device.type == "cuda" and caps.native_mxfp8:
        return (), "MXFP8 off: Transformer Engine is not installed, so it would be emulated"
    return (), ("MXFP8 off: no MX tensor cores here, so it would be emulated "
                "(quantize-dequantize around fp32 matmuls) — slower, not faster")


def optimised_stack(device: torch.device | str | None = None, *, compile: bool | None = None,
                    router_impl: str | None = None, amp: str | None = None) -> Stack:
    """The fastest sync-free stack this ``device`` runs (see the module docstring).

    ``compile`` (CPU only; default True) wraps the model in ``torch.compile``.
    ``router_impl`` overrides the router; by default the fused Triton router on a GPU, and on
    a CPU ``"reference"`` (under ``compile`` Inductor fuses the reference chain with the rest
    of the model; without it, pass the winner of `pick_router_impl`).
    ``amp`` (CPU only): ``"bf16"`` or ``""``; by default BF16 autocast where the CPU has bf16
    matmul instructions (`moe_lab.perf.capabilities.native_bf16_cpu`), with the attention
    core kept in FP32 (PyTorch's bf16 flash-attention backward on a CPU is slower than its
    FP32 one). On a CPU the attention is moe_lab's fused kernel (``cpu_fused``) where its
    C++ kernels build, else ``sdpa_fp32`` / ``sdpa``; with ``compile`` the evaluations are
    compiled too (``compiled_eval``). On a GPU the model stays in FP32 here (BF16 there is
    the next step, not yet validated on a GPU in this workbook).
    """
    device = _device(device)
    mxfp8, mx_note = _mxfp8_targets(device)
    if amp is not None and amp not in AMP_DTYPES:
        raise ValueError(f"amp must be one of {AMP_DTYPES}, got {amp!r}")
    if device.type == "cuda":
        from moe_lab.perf.capabilities import capabilities

        compiled = capabilities().triton_mode == "compiled"
        backend = "triton" if compiled else "torch"
        router = router_impl or ("triton" if compiled else "reference")
        return Stack("optimised", dispatcher="dropless", expert_backend=backend,
                     router_impl=router, router_dtype="fp32", sync_free=True, compile=False,
                     graphed=True, mxfp8=mxfp8,
                     notes=(f"{backend} grouped GEMM and {router} router (Triton compiles here)",
                            "the whole step captured as one CUDA graph", mx_note))
    compile = True if compile is None else bool(compile)
    from moe_lab.perf.capabilities import native_bf16_cpu

    amp = ("bf16" if native_bf16_cpu() else "") if amp is None else amp
    from moe_lab.kernels import cpu_ext

    kernels = cpu_ext.available()  # moe_lab's C++ CPU kernels: the grouped GEMM and the attention
    if kernels:
        backend, why = "openmp", ("moe_lab's OpenMP grouped GEMM (each core takes whole experts) "
                                  "and C++ token permutation (a counting sort, one pass per "
                                  "move); Triton runs interpreted on a CPU (correct, far too slow)")
    else:
        backend = "torch" if hasattr(torch, "_grouped_mm") else "loop"
        why = (f"{backend} grouped GEMM: the OpenMP one did not build here, and Triton runs "
               f"interpreted on a CPU (correct, far too slow)")
    router = router_impl or "reference"
    if kernels:
        attention, attention_note = "cpu_fused", (
            "moe_lab's fused CPU attention (moe_lab.kernels.cpu_attention): one core per "
            "(batch, head), causal blocks skipped; BF16 GEMMs with an FP32 softmax under BF16 "
            "autocast, FP32 otherwise")
    else:
        attention = "sdpa_fp32" if amp else "sdpa"
        attention_note = ("PyTorch's scaled_dot_product_attention" + (" with its core in FP32"
                          if amp else "") + ": moe_lab's CPU kernels did not build here")
    notes = [why, attention_note,
             ("the FP32 reference router, compiled together with the model" if compile and
              router == "reference" else f"the {router} router in FP32"),
             ("BF16 autocast (FP32 master weights, router, logits and loss): this CPU has bf16 "
              "matmul instructions; the attention's softmax stays FP32 (its GEMMs are BF16 in "
              "moe_lab's kernel; PyTorch's attention core stays FP32, whose CPU backward is "
              "faster); the logits in FP32 keep BF16 from costing steps to the target"
              if amp else "FP32: this CPU has no bf16 matmul instructions (bf16 would be emulated)"),
             ("torch.compile of the model with Inductor's C++ wrapper (each compiled graph's "
              "kernels and GEMMs called from C++, not one by one from Python; the compile time "
              "is initialisation, reported as init_s)" if compile else "eager: torch.compile off"),
             ("the backward traced under the forward's BF16 autocast, so the FP32 router's and "
              "logits' gradients come from BF16 GEMMs like every other layer's"
              if compile and amp else ""),
             ("evaluation through a torch.compile of the model" + (" under BF16 autocast" if amp
              else "") + "; an evaluation that reaches the target is confirmed by the plain "
              "FP32 one, which the naive stack uses, before the clock stops"
              if compile else "evaluation eager in FP32"),
             "no CUDA graph: there is no CUDA here", mx_note]
    return Stack("optimised", dispatcher="dropless", expert_backend=backend, router_impl=router,
                 router_dtype="fp32", sync_free=True, compile=compile, graphed=False,
                 mxfp8=(), amp=amp, fp32_logits=bool(amp), attention_impl=attention,
                 row_align=1,
                 compiled_eval=compile, cpp_wrapper=compile, notes=tuple(n for n in notes if n))


def ladder(device: torch.device | str | None = None, *, compile: bool | None = None,
           router_impl: str | None = None, amp: str | None = None) -> list[tuple[str, Stack]]:
    """From `NAIVE` to `optimised_stack`, one technique per rung: ``[(label, stack), ...]``.

    The rungs: the naive stack; + dropless dispatch with a grouped GEMM; + the router in
    FP32 (``router_impl``: fused where Triton compiles, on a CPU the winner of
    `pick_router_impl`); + the sync-free step; + moe_lab's fused CPU attention (where its
    C++ kernels build); + BF16 autocast (CPU, where it pays; ``amp``
    as in `optimised_stack`); + ``torch.compile`` (CPU, where on: the
    router chain is then compiled with the model, as the reference) or the CUDA graph
    (GPU); + MXFP8, where native. The last rung is `optimised_stack`.
    """
    device = _device(device)
    compile = True if compile is None else bool(compile)
    best = optimised_stack(device, compile=compile,
                           router_impl=None if compile and device.type == "cpu" else router_impl,
                           amp=amp)
    eager_router = router_impl or best.router_impl
    rungs = [("naive", NAIVE)]
    dropless = replace(NAIVE, name="dropless", dispatcher="dropless",
                       expert_backend=best.expert_backend, notes=())
    rungs.append((f"+ dropless, {best.expert_backend} grouped GEMM", dropless))
    fp32 = replace(dropless, name="fp32 router", router_impl=eager_router, router_dtype="fp32")
    rungs.append((f"+ FP32 router ({eager_router})", fp32))
    sync_free = replace(fp32, name="sync-free", sync_free=True)
    rungs.append(("+ sync-free step", sync_free))
    last = sync_free
    if best.attention_impl == "cpu_fused":
        last = replace(last, name="fused attention", attention_impl="cpu_fused")
        rungs.append(("+ fused CPU attention", last))
    if best.amp:
        last = replace(last, name=best.amp, amp=best.amp, fp32_logits=best.fp32_logits,
                       attention_impl=best.attention_impl, row_align=best.row_align)
        rungs.append((f"+ {best.amp.upper()} autocast", last))
    if best.compile:
        last = replace(last, name="compiled", compile=True, router_impl=best.router_impl)
        rungs.append(("+ torch.compile", last))
    if best.graphed:
        last = replace(last, name="graphed", graphed=True)
        rungs.append(("+ CUDA graph", last))
    if best.mxfp8:
        last = replace(last, name="mxfp8", mxfp8=best.mxfp8)
        rungs.append(("+ MXFP8 " + "+".join(best.mxfp8), last))
    rungs[-1] = (rungs[-1][0], replace(best, name=best.name))
    return rungs


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        from moe_lab.perf.capabilities import is_cuda

        return torch.device("cuda" if is_cuda() else "cpu")
    return torch.device(device)


# --------------------------------------------------------------------------------------
# The contest's rules
# --------------------------------------------------------------------------------------


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

    def train_config(self):
        """The equivalent `moe_lab.train.TrainConfig` (schedule, optimiser, seed)."""
        from moe_lab.train import TrainConfig

        return TrainConfig(steps=self.max_steps, batch_size=self.batch_size, lr=self.lr,
                           warmup_steps=self.warmup_steps, seed=self.seed,
                           eval_every=self.eval_every, eval_per_domain=self.eval_per_domain,
                           corpus=self.corpus, progress=False)

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


# --------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------


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


def _to(batch, device: torch.device):
    from moe_lab.data import Batch

    if device.type == "cpu":
        return batch
    return Batch(batch.x.to(device), batch.y.to(device), batch.domain.to(device))


def eval_set(corpus, cfg: TTTConfig):
    """The fixed eval batch: ``eval_per_domain`` rows per domain, at least ``min_eval_rows``."""
    per_domain = max(cfg.eval_per_domain, -(-cfg.min_eval_rows // len(corpus.domains)))
    return corpus.fixed_eval_set(per_domain)


def build_model(stack: Stack, cfg: TTTConfig, device: torch.device | str | None = None):
    """The model of ``stack``, seeded with ``cfg.seed`` (every stack starts from the same
    weights: the seed is set just before the model is built, as `moe_lab.train.train`
    does), MXFP8 applied where the stack asks."""
    from moe_lab.model import MoETransformer

    device = _device(device)
    torch.manual_seed(cfg.seed)
    model = MoETransformer(cfg.model_config(stack.router_dtype), dispatcher=stack.dispatcher,
                           expert_backend=stack.expert_backend, router_impl=stack.router_impl,
                           attention_impl=stack.attention_impl)
    model = model.to(device)
    for layer in model.moe_layers:
        layer.experts.row_align = stack.row_align
    model.fp32_logits = stack.fp32_logits
    if stack.mxfp8:
        from moe_lab.quant.linear import apply_mxfp8

        apply_mxfp8(model, stack.mxfp8)
    return model


class _Trainer:
    """``trainer.step(step, batch)`` trains on one batch; ``trainer.evaluate(...)`` is the
    stack's own evaluation of ``trainer.model``: the plain one (eager, FP32) unless
    ``eval_forward`` is set (the compiled forward of ``compiled_eval``)."""

    model: torch.nn.Module
    train_records: list[dict]
    eval_forward: Callable | None = None

    def step(self, step: int, batch) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def evaluate(self, eval_batch, domains: list[str]) -> float:
        from moe_lab.train import evaluate

        return evaluate(self.model, eval_batch, domains, forward=self.eval_forward)["all"]

    def sync(self) -> None:
        if next(self.model.parameters()).device.type == "cuda":
            torch.cuda.synchronize()


class _LoopTrainer(_Trainer):
    """The loop of `moe_lab.train.train`, step for step: the learning rate set from the host,
    the stock AdamW (``foreach=False``), loss, norm and router statistics read back every
    step."""

    def __init__(self, stack: Stack, cfg: TTTConfig, device: torch.device) -> None:
        from moe_lab.train import _make_optimizer

        self.cfg = cfg
        self.train_cfg = cfg.train_config()
        self.model = build_model(stack, cfg, device)
        self.model.train()
        self.optimizer = _make_optimizer(self.model, self.train_cfg)
        self.train_records = []

    def step(self, step: int, batch) -> None:
        from moe_lab.perf.breakdown import phase
        from moe_lab.train import lr_at

        lr = lr_at(step, self.train_cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with phase("forward"):
            out = self.model(batch.x, batch.y)
        with phase("optimizer"):
            self.optimizer.zero_grad(set_to_none=True)
        with phase("backward"):
            out.loss.backward()
        with phase("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self.train_cfg.grad_clip)
            self.optimizer.step()
        counts = [s.tokens_per_expert.tolist() for s in out.moe_stats]
        record = {"step": step + 1, "loss": out.loss.item(), "grad_norm": grad_norm.item(),
                  "imbalance": [max(c) / (sum(c) / len(c)) for c in counts],
                  "dropped_tokens": sum(int(s.dropped_tokens) for s in out.moe_stats)}
        self.train_records.append(record)


def _random_batch(model_cfg: ModelConfig, batch_size: int, device: torch.device, seed: int):
    from moe_lab.step import random_batch

    return random_batch(model_cfg, batch_size, device, torch.Generator().manual_seed(seed + 7))


class _SyncFreeTrainer(_Trainer):
    """`moe_lab.step.SyncFreeStep` (or its CUDA graph), statistics read at each evaluation.

    With ``compile``, one forward and backward on random tokens compile the model before the
    clock starts; the weights do not move (no optimizer step) and the gradients are dropped.
    With ``compiled_eval``, a second ``torch.compile`` of the model (static shapes, so the
    training graph is never recompiled as dynamic) serves the evaluations, under the same
    autocast; given ``eval_shape`` (the eval batch's ``[rows, seq]``) it too is compiled
    before the clock starts, on random tokens of that shape.
    """

    def __init__(self, stack: Stack, cfg: TTTConfig, device: torch.device,
                 eval_shape: tuple[int, int] | None = None) -> None:
        from moe_lab.step import StepConfig, SyncFreeStep, make_optimizer

        self.cfg = cfg
        train_cfg = cfg.train_config()
        self.model = build_model(stack, cfg, device)
        self.model.train()
        optimizer = make_optimizer(self.model, lr=train_cfg.lr,
                                   weight_decay=train_cfg.weight_decay)
        step_cfg = StepConfig.from_train_config(train_cfg, read_every=cfg.eval_every)
        model_cfg = self.model.cfg
        example = _random_batch(model_cfg, cfg.batch_size, device, cfg.seed)
        forward = None
        if stack.compile:
            forward = _compile(self.model, stack)
        if stack.amp:
            forward = _autocast_forward(self.model if forward is None else forward, device.type,
                                        stack.amp, graphed=stack.graphed and device.type == "cuda")
        if stack.compile:
            out = forward(example.x, example.y)
            out.loss.backward()
            self.model.zero_grad(set_to_none=True)
        if stack.compiled_eval:
            eval_forward = _compile(self.model, stack, dynamic=False)
            if stack.amp:
                eval_forward = _autocast_forward(eval_forward, device.type, stack.amp)
            self.eval_forward = eval_forward
            if eval_shape is not None:
                warm = torch.randint(0, model_cfg.vocab_size, tuple(eval_shape),
                                     generator=torch.Generator().manual_seed(cfg.seed + 11))
                from moe_lab.data import Batch
                from moe_lab.train import evaluate

                evaluate(self.model, Batch(warm.to(device), warm.to(device),
                                           torch.zeros(warm.shape[0], dtype=torch.long, device=device)),
                         [], forward=eval_forward)
        if stack.graphed and device.type == "cuda":
            from moe_lab.graphs import GraphedStep

            self.runner = GraphedStep(self.model, optimizer, example, step_cfg, forward=forward,
                                      quiet=True)
        else:
            self.runner = SyncFreeStep(self.model, optimizer, example, step_cfg, forward=forward)
        self.train_records = []

    def step(self, step: int, batch) -> None:
        stats = self.runner(batch)
        if stats is not None:
            self.train_records.append({"step": stats["step"], "loss": stats["loss"],
                                       "grad_norm": stats["grad_norm"],
                                       "imbalance": stats["imbalance"]})


def make_trainer(stack: Stack, cfg: TTTConfig, device: torch.device | str | None = None, *,
                 eval_shape: tuple[int, int] | None = None) -> _Trainer:
    """The trainer of ``stack``: ``trainer.step(step, batch)``, ``trainer.evaluate(batch,
    domains)``, ``trainer.model``. ``eval_shape`` (the eval batch's ``[rows, seq]``) lets a
    stack with ``compiled_eval`` compile its evaluation before the clock starts."""
    device = _device(device)
    if stack.sync_free:
        return _SyncFreeTrainer(stack, cfg, device, eval_shape=eval_shape)
    return _LoopTrainer(stack, cfg, device)


class _Lane:
    """One stack's run inside `race`: its trainer, its own data stream and its own clock."""

    def __init__(self, stack: Stack, cfg: TTTConfig, device: torch.device,
                 eval_shape: tuple[int, int] | None = None) -> None:
        self.stack = stack
        t0 = time.perf_counter()
        self.trainer = make_trainer(stack, cfg, device, eval_shape=eval_shape)
        self.init_s = time.perf_counter() - t0
        self.data_gen = torch.Generator().manual_seed(cfg.seed + 1)  # as moe_lab.train.train
        self.clock = 0.0  # timed seconds so far (interleaved: this lane's own segments only)
        self.eval_s = 0.0
        self.steps = 0
        self.curve: list[dict] = []
        self.reached = False
        self.done = False
        self.time_to_target: float | None = None


def race(stacks: Sequence[Stack], cfg: TTTConfig, *, corpus=None,
         device: torch.device | str | None = None, max_seconds: float | None = None,
         progress: bool = False) -> list[TTTRun]:
    """Train every stack in ``stacks`` to the target, *in lockstep*: one step of each in turn
    (the order flipping every step), each stack's clock adding up only its own steps and
    evaluations. A burst of load on a shared machine then slows every stack alike, where
    running them one after the other would hand it to whichever ran at that moment. With
    one stack this is a plain run against the wall clock.

    Interleaving needs each step finished before the next lane's begins: on a CPU steps are
    synchronous; on CUDA the sync-free step must not be made to wait after every step, so
    several stacks on CUDA are refused (run them one at a time, ``interleave=False`` in
    `compare_stacks`).
    """
    from moe_lab.data import load_corpus
    from moe_lab.perf.capabilities import capabilities
    from moe_lab.train import evaluate

    if not stacks:
        raise ValueError("stacks must name at least one Stack, got none")
    device = _device(device)
    if len(stacks) > 1 and device.type != "cpu":
        raise ValueError(f"race: interleaving several stacks needs a CPU (got {device}); on "
                         "CUDA each stack runs alone so that nothing syncs its steps")
    if corpus is None:
        corpus = load_corpus(cfg.corpus, seq_len=preset(cfg.preset).seq_len, seed=cfg.seed)
    eval_batch = _to(eval_set(corpus, cfg), device)
    domains = list(corpus.domains)
    lanes = [_Lane(stack, cfg, device, eval_shape=tuple(eval_batch.x.shape)) for stack in stacks]
    solo = len(lanes) == 1
    start = time.perf_counter()
    for step in range(cfg.max_steps):
        active = [lane for lane in lanes if not lane.done]
        if not active:
            break
        for lane in active if step % 2 == 0 else active[::-1]:
            t0 = time.perf_counter()
            batch = _to(corpus.sample(cfg.batch_size, generator=lane.data_gen, split="train"),
                        device)
            lane.trainer.step(step, batch)
            lane.steps = step + 1
            if lane.steps % cfg.eval_every == 0 or lane.steps == cfg.max_steps:
                lane.trainer.sync()
                t_eval = time.perf_counter()
                loss = lane.trainer.evaluate(eval_batch, domains)
                point = {"step": lane.steps}
                if loss <= cfg.target_loss and lane.trainer.eval_forward is not None:
                    # the stack's own (compiled, autocast) evaluation says "reached": the
                    # plain FP32 evaluation, the naive stack's, has the last word
                    point["compiled_eval_loss"] = loss
                    loss = evaluate(lane.trainer.model, eval_batch, domains)["all"]
                now = time.perf_counter()
                lane.eval_s += now - t_eval
                lane.clock = now - start if solo else lane.clock + now - t0
                lane.curve.append({**point, "time_s": lane.clock, "eval_loss": loss})
                if progress:
                    print(f"{lane.stack.name:>10} step {lane.steps:4d}  {lane.clock:7.1f} s  "
                          f"eval loss {loss:.3f}", flush=True)
                if loss <= cfg.target_loss:
                    lane.reached, lane.time_to_target, lane.done = True, lane.clock, True
                elif max_seconds is not None and lane.clock > max_seconds:
                    lane.done = True
            elif not solo:
                lane.clock += time.perf_counter() - t0
    hardware = capabilities().hardware_label()
    runs = []
    for lane in lanes:
        lane.trainer.sync()
        if solo:
            lane.clock = time.perf_counter() - start
        train_s = max(lane.clock - lane.eval_s, 1e-9)
        runs.append(TTTRun(
            stack=lane.stack.name, description=lane.stack.describe(), seed=cfg.seed,
            hardware=hardware, target_loss=cfg.target_loss, reached=lane.reached,
            steps=lane.steps, time_to_target_s=lane.time_to_target, elapsed_s=lane.clock,
            init_s=lane.init_s, train_s=train_s, eval_s=lane.eval_s,
            tokens_per_step=cfg.tokens_per_step,
            tokens_per_s=lane.steps * cfg.tokens_per_step / train_s,
            final_eval_loss=lane.curve[-1]["eval_loss"] if lane.curve else float("nan"),
            curve=lane.curve, train_curve=list(lane.trainer.train_records)))
    return runs


def time_to_train(stack: Stack, cfg: TTTConfig, *, corpus=None,
                  device: torch.device | str | None = None, max_seconds: float | None = None,
                  progress: bool = False) -> TTTRun:
    """Train ``stack`` alone on ``cfg`` until the eval loss reaches ``cfg.target_loss`` (or
    ``cfg.max_steps``, or ``max_seconds`` of timed region), against the wall clock."""
    return race([stack], cfg, corpus=corpus, device=device, max_seconds=max_seconds,
                progress=progress)[0]


# --------------------------------------------------------------------------------------
# Several seeds, both stacks
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def deterministic_algorithms():
    """Run the enclosed training bit for bit the same every time (on a CPU, for a fixed
    thread count).

    Without it, a compiled stack is not wherever Inductor generates a scatter (the combine's
    ``index_add`` without moe_lab's kernels, the embedding's gradient before it became the
    opaque `moe_lab.model.embedding_grad`): Inductor's CPU code adds scattered values with
    atomic adds, in whatever order the threads get there, so two runs of one seed part at
    the last bits after a few steps and, at a target on the flat part of the loss curve, can
    reach it tens of steps apart. The optimised CPU stack with moe_lab's kernels has no such
    scatter left: two 10-seed races gave the same eval curves bit for bit without the mode.
    ``torch.use_deterministic_algorithms(True)`` (warnings only) makes Inductor call ATen's
    ordered kernels there instead; it must be on when the model compiles and while it runs
    (Dynamo recompiles when it changes). Uninitialised memory is left as it is (PyTorch
    would otherwise fill every new buffer, at a cost). Restores the previous settings on exit.
    """
    import torch.utils.deterministic as det

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        det.fill_uninitialized_memory = before[2]


def compare_stacks(stacks: Sequence[Stack], cfg: TTTConfig, seeds: Sequence[int] = (0,), *,
                   corpus=None, device: torch.device | str | None = None,
                   max_seconds: float | None = None, interleave: bool | None = None,
                   progress: bool = False) -> list[TTTRun]:
    """Every stack on every seed. ``interleave`` (default: on a CPU) races the stacks of a
    seed in lockstep (`race`); otherwise they run one after the other, their order
    alternating from seed to seed. Either way a slow spell of a shared machine does not
    land on one stack only."""
    if not stacks:
        raise ValueError("stacks must name at least one Stack, got none")
    if not seeds:
        raise ValueError("seeds must hold at least one seed, got none")
    device = _device(device)
    if interleave is None:
        interleave = device.type == "cpu"
    runs: list[TTTRun] = []
    for i, seed in enumerate(seeds):
        seeded = replace(cfg, seed=int(seed))
        order = list(stacks) if i % 2 == 0 else list(reversed(stacks))
        if interleave:
            by_name = {r.stack: r for r in race(order, seeded, corpus=corpus, device=device,
                                                max_seconds=max_seconds, progress=progress)}
            runs += [by_name[stack.name] for stack in order]
            continue
        for stack in order:
            runs.append(time_to_train(stack, seeded, corpus=corpus, device=device,
                                      max_seconds=max_seconds, progress=progress))
    return runs


def _spread(values: Sequence[float]) -> dict:
    from moe_lab.perf.bench import BenchResult

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
            "stack": name,
            "description": mine[0].description,
            "hardware": mine[0].hardware,
            "seeds": len(mine),
            "reached": len(reached),
            "target_loss": mine[0].target_loss,
            "time_to_target_s": t["median"],
            "time_min_s": t["min"],
            "time_max_s": t["max"],
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


# --------------------------------------------------------------------------------------
# Choosing the router honestly; the ladder of step throughput
# --------------------------------------------------------------------------------------


def pick_router_impl(cfg: TTTConfig, candidates: Sequence[str] = ("reference", "compiled"),
                     min_time_s: float = 0.5) -> tuple[str, dict[str, float]]:
    """Time the FP32 router of one MoE layer (forward + backward, at the step's token count)
    for each of ``candidates`` on this machine, interleaved (`moe_lab.perf.compare`), and
    return the fastest name and every median in milliseconds. A ``torch.compile`` candidate
    compiles on its first call, which the warm-up absorbs."""
    from moe_lab.moe.router import Router
    from moe_lab.perf import compare

    moe_cfg = cfg.model_config("fp32").moe
    tokens = cfg.tokens_per_step
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(tokens, moe_cfg.d_model, generator=gen)
    providers: dict[str, Callable[[], None]] = {}
    for name in candidates:
        torch.manual_seed(cfg.seed)
        router = Router(moe_cfg, impl=name)

        def fwd_bwd(router=router) -> None:
            xi = x.detach().requires_grad_()
            out = router(xi)
            (out.topk_weights.sum() + out.aux_loss).backward()

        providers[name] = fwd_bwd
    timings = compare(providers, warmup=2, min_time_s=min_time_s)
    medians = {name: t.median_s * 1e3 for name, t in timings.items()}
    return min(medians, key=medians.get), medians


def ladder_throughput(rungs: Sequence[tuple[str, Stack]], cfg: TTTConfig, *,
                      device: torch.device | str | None = None, min_time_s: float = 2.0,
                      warmup: int = 2, corpus=None) -> list[dict]:
    """Training tokens/s of one step of every rung, on the same batches, timed interleaved
    (`moe_lab.perf.compare`: round by round, so noise lands on all rungs alike). Returns one
    row per rung: label, stack, median step time, spread, tokens/s, ratio to the first."""
    from moe_lab.perf import compare

    device = _device(device)
    batches = _step_batches(cfg, device, corpus)
    providers: dict[str, Callable[[], None]] = {}
    init_s: dict[str, float] = {}
    for label, stack in rungs:
        t0 = time.perf_counter()
        trainer = make_trainer(stack, cfg, device)
        init_s[label] = time.perf_counter() - t0
        providers[label] = _stepper(trainer, batches)
    timings = compare(providers, warmup=warmup, min_time_s=min_time_s)
    first = next(iter(timings.values())).median_s
    rows = []
    for i, (label, stack) in enumerate(rungs):
        t = timings[label]
        rows.append({"rung": i, "label": label, "stack": stack.describe(),
                     "median_ms": t.median_s * 1e3, "min_ms": t.min_s * 1e3,
                     "max_ms": t.max_s * 1e3, "iqr_ms": t.iqr_s * 1e3, "n": t.n,
                     "tokens_per_s": cfg.tokens_per_step / t.median_s,
                     "vs_first": first / t.median_s, "init_s": init_s[label]})
    return rows


def step_breakdowns(stacks: Sequence[Stack], cfg: TTTConfig, *, steps: int = 5, warmup: int = 3,
                    device: torch.device | str | None = None, corpus=None) -> dict[str, dict]:
    """Where a training step of each stack spends its time, ``{stack.name: breakdown}``
    (`moe_lab.perf.breakdown.step_breakdown`: ms per step by phase and by kind, under the
    profiler). Each stack's trainer is built as for the race and steps on the contest's
    training batches, ``warmup`` steps first (compiling happens when the trainer is built)."""
    from moe_lab.perf.breakdown import step_breakdown

    if not stacks:
        raise ValueError("stacks must name at least one Stack, got none")
    device = _device(device)
    batches = _step_batches(cfg, device, corpus)
    return {stack.name: step_breakdown(_stepper(make_trainer(stack, cfg, device), batches),
                                       steps=steps, warmup=warmup) for stack in stacks}


def _step_batches(cfg: TTTConfig, device: torch.device, corpus=None, n: int = 4) -> list:
    """``n`` training batches of the contest (its first ones), for step-by-step measurements."""
    from moe_lab.data import load_corpus

    if corpus is None:
        corpus = load_corpus(cfg.corpus, seq_len=preset(cfg.preset).seq_len, seed=cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    return [_to(corpus.sample(cfg.batch_size, generator=gen, split="train"), device)
            for _ in range(n)]


def _stepper(trainer: _Trainer, batches: Sequence) -> Callable[[], None]:
    """One finished training step of ``trainer`` per call, cycling through ``batches``."""
    counter = iter(range(10**9))

    def one_step() -> None:
        i = next(counter)
        trainer.step(i, batches[i % len(batches)])
        trainer.sync()

    return one_step


def record_ladder(rows: Sequence[dict], cfg: TTTConfig, notebook: str = NOTEBOOK,
                  ladder_name: str | None = None, **extra) -> list[dict]:
    """Write the ladder to the ledger as `moe_lab.waterfall` reads it: metric
    ``step_tokens_per_s``, one record per rung with ``rung``, ``ladder`` and one ``run`` id."""
    from moe_lab.perf import ledger

    run_id = uuid.uuid4().hex[:12]
    ladder_name = ladder_name or f"{cfg.preset}, batch {cfg.batch_size}"
    return [ledger.record(notebook, f"ladder:{row['label']}", LADDER_METRIC, row["tokens_per_s"],
                          "tok/s", rung=row["rung"], ladder=ladder_name, run=run_id,
                          median_ms=row["median_ms"], iqr_ms=row["iqr_ms"], n_repeats=row["n"],
                          stack=row["stack"], preset=cfg.preset, batch=cfg.batch_size, **extra)
            for row in rows]


# --------------------------------------------------------------------------------------
# MFU and the projection to GB300
# --------------------------------------------------------------------------------------


def mfu_rows(summary: Sequence[dict], cfg: TTTConfig, peak_flops: float | dict[str, float]) -> list[dict]:
    """Model FLOPs utilisation of each stack's training throughput against ``peak_flops``
    (this machine's measured matmul ceiling, FLOP/s; a dict gives each stack the ceiling of
    the precision it computes in, e.g. ``{"naive": fp32, "optimised": bf16}``): the FLOPs
    model of `moe_lab.perf.flops` (matmuls only, 6 FLOPs per weight per token plus
    attention)."""
    from moe_lab.perf.flops import mfu, training_flops_per_token

    per_token = training_flops_per_token(preset(cfg.preset))
    rows = []
    for row in summary:
        if isinstance(peak_flops, dict):
            if row["stack"] not in peak_flops:
                raise ValueError(f"peak_flops has no ceiling for stack {row['stack']!r}: "
                                 f"got {sorted(peak_flops)}")
            peak = peak_flops[row["stack"]]
        else:
            peak = peak_flops
        rows.append({"stack": row["stack"], "tokens_per_s": row["tokens_per_s"],
                     "achieved_gflops": row["tokens_per_s"] * per_token / 1e9,
                     "ceiling_gflops": peak / 1e9,
                     "mfu": mfu(row["tokens_per_s"] * per_token, peak)})
    return rows


def stack_ceilings(stacks: Sequence[Stack], n: int = 2048, min_time_s: float = 0.3) -> dict:
    """Each stack's measured matmul ceiling (`moe_lab.perf.ceilings.Ceiling`), in the precision
    its matmuls run in: fp32, or its ``amp`` dtype; each precision measured once."""
    from moe_lab.perf import ceilings

    measured: dict[str, object] = {}
    for stack in stacks:
        dtype = stack.amp or "fp32"
        if dtype not in measured:
            measured[dtype] = ceilings.matmul_peak(dtype, n=n, min_time_s=min_time_s)
    return {stack.name: measured[stack.amp or "fp32"] for stack in stacks}


def speedup_bound(mfu_value: float) -> float:
    """The most any change that keeps the arithmetic (same FLOPs, same precision) can speed
    up a step running at ``mfu_value`` of the machine's measured ceiling: at best the step
    becomes pure matmul at the ceiling, so ``1 / mfu``."""
    if not (isinstance(mfu_value, (int, float)) and mfu_value > 0):
        raise ValueError(f"mfu_value must be a number > 0, got {mfu_value!r}")
    return 1.0 / mfu_value


def gb300_projection(mfu_by_stack: dict[str, float], gpu: str = "GB300",
                     dtype: str = "bf16") -> list[dict]:
    """What-if rows for DeepSeek-V3 (seq 4096) on ``gpu``, beside NVIDIA's reported result.

    A *projection*, not a measurement: each stack's MFU measured here, times ``gpu``'s
    datasheet ``dtype`` peak (`moe_lab.perf.hardware`), divided by DeepSeek-V3's training
    FLOPs per token (`moe_lab.perf.flops`), gives tokens/s per GPU; the minutes to train
    scale the reported 2.02 min on 8,192 GB300 by the reported over the projected tokens/s
    (the same tokens, the same GPUs). MFU on a 2-core CPU running a model of a few million
    parameters says little about a 671B model on a GB300: the rows show what the measured
    efficiency would mean at that scale, and how far the reported figure is from the
    datasheet bound.
    """
    from moe_lab.perf import mlperf
    from moe_lab.perf.flops import training_flops_per_token
    from moe_lab.perf.hardware import gpu_spec

    spec = gpu_spec(gpu)
    peak = spec.peak_flops(dtype)
    seed = mlperf.DEEPSEEK_V3_GB300
    per_token = training_flops_per_token(preset("deepseek_v3"), seed["seq_len"])
    reported = mlperf.result("DeepSeek-V3 671B")
    reported_tps = seed["tokens_per_s_per_gpu"]

    def row(name: str, kind: str, mfu_value: float, note: str) -> dict:
        tps = mfu_value * peak / per_token
        return {"name": name, "kind": kind, "mfu": mfu_value, "tflops_per_gpu": mfu_value * peak / 1e12,
                "tokens_per_s_per_gpu": tps,
                "minutes_on_8192": reported.minutes * reported_tps / tps if tps > 0 else math.inf,
                "note": note}

    rows = [row(f"{name} stack's MFU (measured here) on {spec.name}", "projection", value,
                f"MFU measured on this machine x {spec.name} {dtype} datasheet peak")
            for name, value in mfu_by_stack.items()]
    rows.append({"name": f"reported by NVIDIA ({reported.n_gpus:,} x {reported.system})",
                 "kind": "reported", "mfu": seed["tflops_per_gpu"] * 1e12 / peak,
                 "tflops_per_gpu": seed["tflops_per_gpu"], "tokens_per_s_per_gpu": reported_tps,
                 "minutes_on_8192": reported.minutes, "note": mlperf.SOURCE})
    rows.append(row(f"{spec.name} {dtype} datasheet peak (MFU = 1)", "bound", 1.0,
                    f"{spec.source} figure; unreachable"))
    return rows


# --------------------------------------------------------------------------------------
# Recording and the command line
# --------------------------------------------------------------------------------------


def record_summary(summary: Sequence[dict], cfg: TTTConfig, notebook: str = NOTEBOOK,
                   **extra) -> list[dict]:
    """Every stack's time to target (median, spread), steps and tokens/s, and the speed-up
    of each over the naive stack, into the ledger."""
    from moe_lab.perf import ledger

    common = dict(preset=cfg.preset, batch=cfg.batch_size, target_loss=cfg.target_loss,
                  corpus=cfg.corpus if cfg.corpus == "synthetic" else "text file", **extra)
    written = []
    for row in summary:
        spread = dict(seeds=row["seeds"], reached=row["reached"])
        if row["time_to_target_s"] is not None:
            written.append(ledger.record(
                notebook, row["stack"], "time_to_target_s", row["time_to_target_s"], "s",
                min_s=row["time_min_s"], max_s=row["time_max_s"], iqr_s=row["time_iqr_s"],
                init_s=row["init_s"], **spread, **common))
            written.append(ledger.record(notebook, row["stack"], "steps_to_target",
                                         float(row["steps_to_target"]), "steps", **spread,
                                         **common))
        written.append(ledger.record(notebook, row["stack"], "train_tokens_per_s",
                                     row["tokens_per_s"], "tok/s", **spread, **common))
        if row["stack"] != "naive" and row["speedup"] is not None:
            written.append(ledger.record(
                notebook, f"{row['stack']} vs naive", "time_to_target_speedup", row["speedup"],
                "x", min=row["speedup_min"], max=row["speedup_max"], **spread, **common))
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="smoke", choices=list(PROFILES),
                        help="smoke: tiny preset, seconds; full: small preset, minutes")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (median and spread)")
    parser.add_argument("--target", type=float, default=None,
                        help="target eval loss in nats per token (default: the profile's)")
    parser.add_argument("--max-steps", type=int, default=None, help="schedule length and step cap")
    parser.add_argument("--batch-size", type=int, default=None)
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
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="give up on a run after this many timed seconds")
    parser.add_argument("--notebook", default=NOTEBOOK, help="ledger 'notebook' field")
    parser.add_argument("--progress", action="store_true", help="print every evaluation")


def config_from_args(args: argparse.Namespace) -> TTTConfig:
    cfg = PROFILES[args.profile]
    changes: dict = {}
    if args.corpus != "synthetic":
        if args.target is None:
            raise ValueError("--corpus FILE needs --target (nats per byte): the synthetic "
                             "targets mean nothing on other text; a short run's final eval "
                             "loss is a good guide")
        changes["corpus"] = args.corpus
    if args.target is not None:
        changes["target_loss"] = args.target
    if args.max_steps is not None:
        changes["max_steps"] = args.max_steps
    if args.batch_size is not None:
        changes["batch_size"] = args.batch_size
    return replace(cfg, **changes) if changes else cfg


def run(args: argparse.Namespace) -> dict:
    from moe_lab.perf import ledger
    from moe_lab.perf.capabilities import capabilities

    cfg = config_from_args(args)
    device = _device(None)
    notes: list[str] = []
    router_times = None
    compile_ = not args.no_compile
    router = None
    if args.pick_router and device.type == "cpu":
        router, router_times = pick_router_impl(cfg)
        notes.append(f"router picked by measurement: {router} ({router_times})")
    amp = {"auto": None, "bf16": "bf16", "off": ""}[getattr(args, "amp", "auto")]
    best = optimised_stack(device, compile=compile_,
                           router_impl=None if compile_ and device.type == "cpu" else router, amp=amp)
    deterministic = bool(getattr(args, "deterministic", False))
    with deterministic_algorithms() if deterministic else contextlib.nullcontext():
        runs = compare_stacks([NAIVE, best], cfg, seeds=range(args.seeds), device=device,
                              max_seconds=args.max_seconds, progress=args.progress)
    summary = summarise(runs)
    record_summary(summary, cfg, args.notebook, profile=args.profile, deterministic=deterministic)
    gaps = loss_gap(runs)
    if router_times:
        for name, ms in router_times.items():
            ledger.record(args.notebook, f"router:{name}", "router_fwd_bwd_ms", ms, "ms",
                          tokens=cfg.tokens_per_step, preset=cfg.preset)
    result: dict = {"hardware": capabilities().hardware_label(), "config": asdict(cfg),
                    "optimised": {"stack": best.describe(), "notes": list(best.notes)},
                    "notes": notes, "rows": summary, "loss_gap": gaps}
    if getattr(args, "json", False):  # the curves only where a program reads them
        result["runs"] = [{k: v for k, v in r.to_dict().items() if k != "train_curve"}
                          for r in runs]
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
        rows = ladder_throughput(ladder(device, compile=compile_, router_impl=router,
                                        amp=best.amp if device.type == "cpu" else None),
                                 cfg, device=device)
        record_ladder(rows, cfg, args.notebook, profile=args.profile)
        result["ladder"] = rows
    return result


__all__ = [
    "DESCRIPTION", "LADDER_METRIC", "NAIVE", "PROFILES", "Stack", "TTTConfig", "TTTRun",
    "add_arguments", "build_model", "compare_stacks", "deterministic_algorithms", "eval_set",
    "gb300_projection", "ladder", "loss_gap",
    "race", "stack_ceilings",
    "ladder_throughput", "make_trainer", "mfu_rows", "optimised_stack", "pick_router_impl",
    "record_ladder", "record_summary", "run", "speedup_bound", "summarise", "time_to_train",
]
