"""The stacks of the time-to-train contest: sets of registered implementation names.

A `Stack` is a set of choices, each a name of the package, never a code path of its own: the
model's implementations (a `moe_lab.config.ModelImpls`), the router's precision, the training
step (`moe_lab.training.build.STEP_KINDS`), its clip + optimizer update
(`moe_lab.training.optim.CLIP_STEPS`), ``torch.compile``
(`moe_lab.training.build.COMPILE_MODES`), autocast, MXFP8. `NAIVE` is the starting point;
`optimised_stack` the fastest stack this machine runs, where on a CPU the CPU plug-in
(`moe_lab.workbench.cpu`) adds its names when it builds; `ladder` goes from one to the other a
technique at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from moe_lab.attention import ATTENTION_IMPLS
from moe_lab.checks import one_of
from moe_lab.config import holds
from moe_lab.model import EMBEDDING_IMPLS, ModelImpls
from moe_lab.moe.dispatch import DISPATCHERS
from moe_lab.moe.experts import EXPERT_BACKENDS
from moe_lab.moe.router import ROUTER_IMPLS
from moe_lab.perf.capabilities import capabilities, is_cuda, native_bf16_cpu
from moe_lab.quant.linear import triton_mxfp8_status
from moe_lab.training.build import AMP_DTYPES, BuildConfig
from moe_lab.training.optim import CLIP_STEPS


@holds(build=BuildConfig)
@dataclass(frozen=True)
class Stack:
    """One set of implementation choices for the same model: ``build`` (a
    `moe_lab.training.build.BuildConfig`, its fields given and read flat — ``impls``,
    ``step``, ``clip_step``, ``compile``, ``amp``, ``fp32_logits``, ``compiled_eval``,
    ``mxfp8``), the router's precision ``router_dtype``, and ``notes`` saying why a choice was
    made or left out on this machine. Every name must be registered; a stack is built here
    (`NAIVE`, `optimised_stack`, `ladder`) from the registries' own names, and the model's
    build refuses an unknown one where it looks it up.

    The steps: ``"eager"`` (`moe_lab.training.steps.EagerStep`: the stock AdamW, statistics
    read every step), ``"sync_free"`` (`moe_lab.training.steps.SyncFreeStep`: fused AdamW,
    schedule and statistics on the device) or ``"graphed"`` (that step captured as a CUDA
    graph, `moe_lab.training.graphs.GraphedStep`); compile, autocast and a clip step apply to
    the sync-free ones. ``"cpp_wrapper"`` compiles with Inductor writing each compiled graph's
    launcher in C++; ``compiled_eval`` confirms an evaluation that reaches the target with
    the plain FP32 one before the clock stops. Under ``compile`` and ``amp`` the backward
    GEMMs of the regions the forward keeps in FP32 run in the autocast dtype
    (`moe_lab.training.build`).
    """

    name: str
    build: BuildConfig = field(default_factory=BuildConfig)
    router_dtype: str = "fp64"
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: what this stack runs."""
        impls = self.impls
        parts = [f"{impls.dispatcher} dispatch"]
        runs_experts = DISPATCHERS[impls.dispatcher].runs_experts
        if runs_experts == "backend":
            parts[0] += f" ({impls.expert_backend} grouped GEMM)"
        elif runs_experts == "kernels":  # the expert backend is not used
            parts[0] += " (grouped GEMMs with gather prologue and scatter epilogue)"
        parts.append(f"{impls.router_impl} router {self.router_dtype.upper()}")
        parts.append("sync-free step" if self.step != "eager" else "eager step (stock AdamW)")
        if self.clip_step != "torch":
            parts.append(f"{self.clip_step} clip + AdamW")
        if self.amp:
            parts.append(f"{self.amp.upper()} autocast" + (" (logits FP32)" if self.fp32_logits else ""))
        if impls.attention_impl != "sdpa":
            parts.append(f"{impls.attention_impl} attention")
        if impls.embedding_impl != "reference":
            parts.append(f"{impls.embedding_impl} embedding")
        if self.compile:
            parts.append("torch.compile" + (" (C++ wrapper)" if self.compile == "cpp_wrapper" else ""))
        if self.compiled_eval:
            parts.append("evaluation compiled" + (f" in {self.amp.upper()}" if self.amp else "")
                         + " (the crossing confirmed in FP32)")
        if self.step == "graphed":
            parts.append("CUDA graph")
        if self.mxfp8:
            parts.append("MXFP8 " + "+".join(self.mxfp8))
        return ", ".join(parts)


NAIVE = Stack("naive", notes=("the loop over experts, FP64 router, stock AdamW, statistics "
                              "read every step, eager",))


def device_of(device: torch.device | str | None) -> torch.device:
    """``device``, or CUDA where there is one and the CPU otherwise."""
    if device is None:
        return torch.device("cuda" if is_cuda() else "cpu")
    return torch.device(device)


def cpu_plugin_status() -> str | None:
    """Register the CPU plug-in's implementations (idempotent): ``None`` when its kernels
    are available, else why they are not."""
    # Imported on use: the plug-in's ops load torch._dynamo, a second of every CLI start-up.
    from moe_lab.workbench import cpu

    return cpu.status()


def cpu_router() -> str:
    """The CPU's FP32 router: the reference chain with the plug-in's one-pass top-k where it
    is registered, else the reference."""
    return "cpu_topk" if "cpu_topk" in ROUTER_IMPLS else "reference"


def _mxfp8_targets(device: torch.device) -> tuple[tuple[str, ...], str]:
    caps = capabilities()
    if device.type == "cuda" and caps.native_mxfp8 and caps.transformer_engine:
        return ("attention",), "MXFP8 attention projections through Transformer Engine (native)"
    if device.type == "cuda" and triton_mxfp8_status()[0]:
        return ("attention",), ("MXFP8 attention projections through the Triton quantizer and "
                                "tl.dot_scaled GEMM (block-scaled tcgen05.mma; checked by "
                                "scripts/gpu_check.py, not yet run on a Blackwell GPU here)")
    if device.type == "cuda" and caps.native_mxfp8:
        return (), "MXFP8 off: neither Transformer Engine nor compiled Triton, so it would be emulated"
    return (), ("MXFP8 off: no MX tensor cores here, so it would be emulated "
                "(quantize-dequantize around fp32 matmuls) — slower, not faster")


def optimised_stack(device: torch.device | str | None = None, *, compile: bool | None = None,
                    router_impl: str | None = None, amp: str | None = None) -> Stack:
    """The fastest sync-free stack this ``device`` runs.

    On a GPU: the Triton grouped GEMM and the fused Triton router where Triton compiles,
    with the permute and the combine fused into the grouped GEMMs (the ``fused``
    dispatcher, `moe_lab.kernels.fused_moe`), the whole step captured as a CUDA graph,
    FP32 (BF16 there is the next step, not yet validated on a GPU in this workbook), MXFP8
    where native.

    On a CPU the CPU plug-in is registered (`cpu_plugin_status`) and its names are used
    where they are registered — the OpenMP grouped GEMM (``"openmp"``), the fused attention
    (``"cpu_fused"``), the router with its one-pass top-k (``"cpu_topk"``), the embedding
    whose weight gradient is one opaque op for Inductor (``"opaque_grad"``) and the one-call
    clip + AdamW (``"cpu_one_call"``) — else the core's (``torch._grouped_mm``, PyTorch's
    attention, the reference router, torch's clip step), labelled with the plug-in's reason.
    ``compile`` (default True) wraps the model in ``torch.compile`` with Inductor's C++
    wrapper and compiles the evaluations too (``compiled_eval``). ``router_impl`` overrides
    the router of an eager stack (pass the winner of `pick_router_impl`); under ``compile``
    Inductor fuses the router chain with the rest of the model, and the CPU's router
    (`cpu_router`) is kept whatever is passed. ``amp``: ``"bf16"`` or
    ``""``; by default BF16 autocast where the CPU has bf16 matmul instructions
    (`moe_lab.perf.capabilities.native_bf16_cpu`), the logits in FP32, and PyTorch's
    attention core (without the plug-in) kept in FP32, whose CPU backward is faster.
    """
    device = device_of(device)
    mxfp8, mx_note = _mxfp8_targets(device)
    if amp is not None:
        one_of(amp, "amp", AMP_DTYPES)
    if device.type == "cuda":
        compiled = capabilities().triton_mode == "compiled"
        backend = "triton" if compiled else "torch"
        router = router_impl or ("triton" if compiled else "reference")
        # The fused dispatcher folds the permute and the combine into the grouped GEMMs
        # (moe_lab.kernels.fused_moe); it is Triton only, so it needs Triton compiled.
        dispatcher = "fused" if compiled else "dropless"
        dispatch_note = ("fused dispatch: the permute and the weighted combine folded into the "
                         "grouped GEMMs (gather prologue, deterministic scatter epilogue)" if compiled
                         else "dropless dispatch: the fused grouped GEMMs need Triton compiled")
        return Stack("optimised", impls=ModelImpls(dispatcher=dispatcher, expert_backend=backend,
                                                   router_impl=router),
                     router_dtype="fp32", step="graphed", mxfp8=mxfp8,
                     notes=(f"{backend} grouped GEMM and {router} router (Triton compiles here)",
                            dispatch_note, "the whole step captured as one CUDA graph", mx_note))
    compile = True if compile is None else bool(compile)
    amp = ("bf16" if native_bf16_cpu() else "") if amp is None else amp
    reason = cpu_plugin_status()
    unavailable = f"the CPU plug-in is unavailable here: {reason}"
    interpreted = "Triton runs interpreted on a CPU (correct, far too slow)"
    interpreted += ("; the fused grouped GEMMs (gather prologue, scatter epilogue) are Triton "
                    "only, so the CPU keeps the unfused dropless chain")
    if "openmp" in EXPERT_BACKENDS:
        backend, why = "openmp", ("the CPU plug-in's OpenMP grouped GEMM (each core takes whole "
                                  f"experts) and C++ token permutation; {interpreted}")
    else:
        backend, why = "torch", f"torch grouped GEMM: {unavailable}; {interpreted}"
    if "cpu_fused" in ATTENTION_IMPLS:
        attention, attention_note = "cpu_fused", (
            "the CPU plug-in's fused attention (cpu_fused): one core per (batch, head), causal "
            "blocks skipped, the rotary embedding inside; BF16 GEMMs with an FP32 softmax under "
            "BF16 autocast, FP32 otherwise")
    else:
        attention = "sdpa_fp32" if amp else "sdpa"
        attention_note = ("PyTorch's scaled_dot_product_attention" + (" with its core in FP32"
                          if amp else "") + f": {unavailable}")
    router = router_impl if router_impl and not compile else cpu_router()
    embedding = "opaque_grad" if "opaque_grad" in EMBEDDING_IMPLS else "reference"
    clip_step = "cpu_one_call" if "cpu_one_call" in CLIP_STEPS else "torch"
    router_note = (f"the FP32 {router} router" + (" (the reference chain with the CPU "
                   "plug-in's one-pass top-k)" if router == "cpu_topk" else "")
                   + (", compiled together with the model" if compile else ""))
    notes = [why, attention_note, router_note,
             ("the CPU plug-in's clip + AdamW in one call (the norm, the clip factor and the "
              "update without Python between)" if clip_step != "torch"
              else f"torch's norm and fused AdamW: {unavailable}"),
             ("the embedding's weight gradient as one opaque op (the CPU plug-in's "
              "opaque_grad), which Inductor keeps instead of generating an atomic scatter"
              if embedding != "reference" else ""),
             ("BF16 autocast (FP32 master weights, router, logits and loss): this CPU has bf16 "
              "matmul instructions; the attention's softmax stays FP32; the logits in FP32 keep "
              "BF16 from costing steps to the target"
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
    impls = ModelImpls(dispatcher="dropless", expert_backend=backend, router_impl=router,
                       attention_impl=attention, embedding_impl=embedding)
    return Stack("optimised", impls=impls, router_dtype="fp32", step="sync_free", clip_step=clip_step,
                 compile="cpp_wrapper" if compile else "", amp=amp, fp32_logits=bool(amp),
                 compiled_eval=compile, notes=tuple(n for n in notes if n))


def ladder(device: torch.device | str | None = None, *, compile: bool | None = None,
           router_impl: str | None = None, amp: str | None = None) -> list[tuple[str, Stack]]:
    """From `NAIVE` to `optimised_stack`, one technique per rung: ``[(label, stack), ...]``.

    The rungs: the naive stack; + dropless dispatch with a grouped GEMM; + the router in
    FP32 (``router_impl``: fused where Triton compiles, on a CPU the winner of
    `pick_router_impl`); + the sync-free step (with the stack's clip step); + the CPU
    plug-in's fused attention (where it builds); + the fused dispatcher (GPU, where Triton
    compiles); + BF16 autocast (CPU, where it pays; ``amp`` as in `optimised_stack`);
    + ``torch.compile`` (CPU, where on: the router chain is then compiled with the model,
    and the embedding's gradient is one opaque op) or the CUDA graph (GPU); + MXFP8, where
    native. The last rung is `optimised_stack`.
    """
    best = optimised_stack(device, compile=compile, router_impl=router_impl, amp=amp)
    eager_router = router_impl or best.impls.router_impl
    rungs = [("naive", NAIVE)]

    def with_impls(stack: Stack, name: str, **names: str) -> Stack:
        return replace(stack, name=name, impls=replace(stack.impls, **names), notes=())

    dropless = with_impls(NAIVE, "dropless", dispatcher="dropless",
                          expert_backend=best.impls.expert_backend)
    rungs.append((f"+ dropless, {best.impls.expert_backend} grouped GEMM", dropless))
    # The router and its precision change together: a Triton router computes in FP32.
    fp32 = replace(dropless, name="fp32 router", impls=replace(dropless.impls, router_impl=eager_router),
                   router_dtype="fp32", notes=())
    rungs.append((f"+ FP32 router ({eager_router})", fp32))
    last = replace(fp32, name="sync-free", step="sync_free", clip_step=best.clip_step)
    rungs.append(("+ sync-free step", last))
    if best.impls.dispatcher != last.impls.dispatcher:
        last = with_impls(last, "fused", dispatcher=best.impls.dispatcher)
        rungs.append(("+ permute/combine fused into the grouped GEMMs", last))
    if best.impls.attention_impl == "cpu_fused":
        last = with_impls(last, "fused attention", attention_impl="cpu_fused")
        rungs.append(("+ fused CPU attention", last))
    if best.amp:
        last = replace(with_impls(last, best.amp, attention_impl=best.impls.attention_impl),
                       amp=best.amp, fp32_logits=best.fp32_logits)
        rungs.append((f"+ {best.amp.upper()} autocast", last))
    if best.compile:
        last = replace(with_impls(last, "compiled", router_impl=best.impls.router_impl,
                                  embedding_impl=best.impls.embedding_impl),
                       compile=best.compile, compiled_eval=best.compiled_eval)
        rungs.append(("+ torch.compile", last))
    if best.step == "graphed":
        last = replace(last, name="graphed", step="graphed")
        rungs.append(("+ CUDA graph", last))
    if best.mxfp8:
        last = replace(last, name="mxfp8", mxfp8=best.mxfp8)
        rungs.append(("+ MXFP8 " + "+".join(best.mxfp8), last))
    rungs[-1] = (rungs[-1][0], best)
    return rungs
