"""Building what a training run trains (`BuildConfig` names it): the model and its optimizer,
random batches, and the forward a step calls (under autocast, compiled or not).

`build_model` is the one place a model is built for training: seeded, so every stack and
step kind starts from the same weights, with the optimizer its step kind takes.
`step_forward` wraps the model for the step in ``torch.compile`` (a `COMPILE_MODES` name)
and ``torch.autocast`` (an `AMP_DTYPES` name). Under both, the backward graph is traced
under the forward's autocast (``backward_pass_autocast = "same_as_forward"``, pinned here
because PyTorch means to change its default): the backward GEMMs of the regions the forward
keeps in FP32 (the router, the logits) run in the autocast dtype, as every other backward
GEMM does, where eager autograd would run them in FP32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._functorch.config as functorch_config

from moe_lab.checks import one_of, positive_int
from moe_lab.config import ModelConfig, ModelImpls, holds
from moe_lab.data import Batch
from moe_lab.model import MoETransformer
from moe_lab.moe.dispatch import DISPATCHERS
from moe_lab.perf.capabilities import capabilities
from moe_lab.training.optim import make_optimizer, stock_optimizer
from moe_lab.training.steps import StepConfig, SyncFreeStep

#: The step kinds a training loop plugs in: the naive eager step, the sync-free step, and
#: the sync-free step captured as a CUDA graph (run eagerly, labelled, without CUDA).
STEP_KINDS = ("eager", "sync_free", "graphed")

#: Autocast dtypes of the forward, by name ("": none).
AMP_DTYPES: dict[str, torch.dtype | None] = {"": None, "bf16": torch.bfloat16}

#: ``torch.compile`` of the model: "" (eager), "default", or "cpp_wrapper" (Inductor writes
#: each compiled graph's launcher — the code that calls its kernels and GEMMs in turn and
#: manages its buffers — in C++ instead of Python).
COMPILE_MODES: dict[str, dict | None] = {"": None, "default": {}, "cpp_wrapper": {"cpp_wrapper": True}}


@holds(impls=ModelImpls)
@dataclass(frozen=True)
class BuildConfig:
    """How a run is computed: the model's implementation names (``impls``, whose fields may be
    given flat: ``dispatcher=``, ``expert_backend=``, ...), the step kind (`STEP_KINDS`) and a
    sync-free step's clip + optimizer update (``clip_step``,
    `moe_lab.training.optim.CLIP_STEPS`); ``amp`` runs the forward under autocast in that
    dtype (`AMP_DTYPES`), where ``fp32_logits`` keeps the logits in FP32; ``compile`` wraps
    the model in ``torch.compile`` (`COMPILE_MODES`) and ``compiled_eval`` evaluates through a
    second, static-shape compile. The precision is the model's (``impls.mxfp8``,
    ``impls.fp32_logits``)."""

    impls: ModelImpls = field(default_factory=ModelImpls)
    step: str = "eager"
    clip_step: str = "torch"
    amp: str = ""
    compile: str = ""
    compiled_eval: bool = False

    def __post_init__(self) -> None:
        one_of(self.step, "BuildConfig.step", STEP_KINDS)
        dispatcher = DISPATCHERS.get(self.impls.dispatcher)
        if self.step != "eager" and dispatcher is not None and dispatcher.syncs_host:
            raise ValueError(
                f"BuildConfig.step={self.step!r} is a sync-free step, and dispatcher "
                f"{self.impls.dispatcher!r} syncs the host (its certificate fails); use one of "
                f"{sorted(n for n, d in DISPATCHERS.items() if not d.syncs_host)}, or step='eager'")
        one_of(self.amp, "BuildConfig.amp", AMP_DTYPES)
        one_of(self.compile, "BuildConfig.compile", COMPILE_MODES)
        if self.impls.fp32_logits and not self.amp:
            raise ValueError("BuildConfig.fp32_logits keeps the logits in FP32 under autocast; set amp")
        if self.compiled_eval and not self.compile:
            raise ValueError("BuildConfig.compiled_eval evaluates through torch.compile; set compile")


def default_impls(device: torch.device | str) -> ModelImpls:
    """The sync-free MoE implementations that run fastest on ``device`` in the core: on CUDA
    the Triton grouped GEMM and the fused Triton router (compiled there); on a CPU the
    ``torch._grouped_mm`` backend and the reference router (Triton is interpreted on a CPU:
    correct, far too slow to train with); on a GPU without compiled Triton (older than
    sm_80, say) the loop over experts, ``torch._grouped_mm`` syncing there. All sync-free."""
    cuda = torch.device(device).type == "cuda"
    if cuda and capabilities().triton_mode == "compiled":
        return ModelImpls(dispatcher="dropless", expert_backend="triton", router_impl="triton")
    return ModelImpls(dispatcher="dropless", expert_backend="loop" if cuda else "torch")


def build_model(model_cfg: ModelConfig, impls: ModelImpls | None = None, *,
                step: str = "sync_free", device: torch.device | str = "cpu", seed: int = 0,
                lr: float = 3e-3, weight_decay: float = 0.1, **names: object,
                ) -> tuple[MoETransformer, torch.optim.Optimizer]:
    """A fresh model and the optimizer its ``step`` kind takes (`STEP_KINDS`).

    The model is seeded with ``seed`` just before it is built (every caller with the same
    seed gets the same weights), built with ``impls`` — by default `ModelImpls` (the naive
    ones) for the eager step and `default_impls` of ``device`` for the others; ``names``
    override single fields, e.g. ``expert_backend="loop"`` or ``mxfp8=("experts",)`` — and
    moved to ``device``."""
    one_of(step, "step", STEP_KINDS)
    if impls is None:
        impls = ModelImpls() if step == "eager" else default_impls(device)
    torch.manual_seed(seed)
    model = MoETransformer(model_cfg, impls, **names).to(device)
    make = stock_optimizer if step == "eager" else make_optimizer
    return model, make(model, lr=lr, weight_decay=weight_decay)


def random_batch(model_cfg: ModelConfig, batch_size: int, device: torch.device | str = "cpu",
                 generator: torch.Generator | None = None) -> Batch:
    """A `moe_lab.data.Batch` of uniformly random bytes (``y`` is ``x`` shifted by one):
    for timing, warming up and certificates, where the text does not matter."""
    positive_int(batch_size, "batch_size")
    tokens = torch.randint(0, model_cfg.vocab_size, (batch_size, model_cfg.seq_len + 1), generator=generator)
    return Batch(tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device),
                 torch.zeros(batch_size, dtype=torch.int64, device=device))


def build_sync_free(model_cfg: ModelConfig, batch_size: int, *, device: torch.device | str = "cpu",
                    seed: int = 0, cfg: StepConfig | None = None, **names: str) -> SyncFreeStep:
    """`build_model` (``names`` override `default_impls`) and a `SyncFreeStep` around it,
    its static inputs shaped by a random batch of ``batch_size`` sequences."""
    cfg = cfg or StepConfig()
    model, optimizer = build_model(model_cfg, device=device, seed=seed, lr=cfg.lr, **names)
    example = random_batch(model_cfg, batch_size, device, torch.Generator().manual_seed(seed))
    return SyncFreeStep(model, optimizer, example, cfg)


def autocast_forward(fn: Callable, device_type: str, amp: str, graphed: bool = False) -> Callable:
    """``fn(x, y)`` under ``torch.autocast(device_type, amp)``. The cast cache (each weight
    cast once per forward, reused by its backward) is on, except under a CUDA graph, where
    a cached cast would be a capture-time copy of the weights; off, every use of a weight
    casts it anew.

    A ``torch.compile``d ``fn`` traces its backward graph here, during the forward: with
    ``backward_pass_autocast`` pinned to ``"same_as_forward"``, whatever PyTorch's default."""

    def forward(x: torch.Tensor, y: torch.Tensor | None = None) -> object:
        with (torch.autocast(device_type, dtype=AMP_DTYPES[amp], cache_enabled=not graphed),
              functorch_config.patch(backward_pass_autocast="same_as_forward")):
            return fn(x, y)

    return forward


def step_forward(model: torch.nn.Module, *, compile: str = "", amp: str = "",
                 graphed: bool = False, dynamic: bool | None = None) -> Callable | None:
    """The forward a step calls in place of ``model``: compiled with the options of
    ``COMPILE_MODES[compile]`` (``dynamic`` as ``torch.compile``'s), under ``amp``
    autocast (without the cast cache when ``graphed`` on CUDA); ``None`` when neither
    applies (the step calls the model)."""
    forward = None
    if compile:
        forward = torch.compile(model, options=COMPILE_MODES[compile] or None, dynamic=dynamic)
    if amp:
        device_type = next(model.parameters()).device.type
        forward = autocast_forward(model if forward is None else forward, device_type, amp,
                                   graphed=graphed and device_type == "cuda")
    return forward
