"""CUDA graphs: capture the whole sync-free training step once, replay it with one launch.

In eager PyTorch the host launches every kernel itself, a few microseconds each, hundreds per
step; when the kernels are small the GPU waits for the host. A CUDA graph records the kernels
of one step, with their arguments and memory addresses, and replays them with one launch.
It cannot hold anything that needs the host mid-step: a value read back, an output sized by
the data, a host number that changes each step, new input tensors. The
`moe_lab.training.steps.SyncFreeStep` has none of those, and proves it on the CPU
(`moe_lab.training.sync.assert_sync_free`). `GraphedStep` then:

1. certifies the step, and refuses with the operator and the fix when it is not capturable
   (`NotCapturableError`);
2. warms up on a side stream (the optimizer state, Triton's compiles and the allocator
   settle, none of which may happen during capture);
3. captures one iteration with ``torch.cuda.CUDAGraph`` and restores, in place, the weights
   and optimizer state the warm-up changed (the graph holds their addresses);
4. replays it for every batch after copying the batch into the static inputs.

Without CUDA `GraphedStep` runs the same step eagerly, says so once, and reports
``mode == "eager (no CUDA)"`` — the certificate still runs, so a CPU still refuses a step a
GPU could not capture.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_lab.data import Batch
from moe_lab.model import MoETransformer
from moe_lab.moe.stash import PagedStash
from moe_lab.training.steps import StepConfig, SyncFreeStep
from moe_lab.training.sync import SyncError

EAGER_MODE = "eager (no CUDA)"
GRAPHED_MODE = "graphed (CUDA)"
WARMUP = 3  # steps run on a side stream before the capture (lazy allocations, autotuning)

_EAGER_NOTICE_SHOWN = False


# --------------------------------------------------------------------------------------
# Refusing clearly
# --------------------------------------------------------------------------------------

_KEEP_ON_DEVICE = ("keep the value on the device: accumulate statistics in device buffers and "
                   "read them every N steps outside the graph (SyncFreeStep.read_stats); "
                   "turn a branch into torch.where or a clamp")

#: What to do about each sync operator, keyed like `moe_lab.training.sync.SYNC_OPS`.
ADVICE: dict[str, str] = {
    **dict.fromkeys(("aten._local_scalar_dense", "aten.is_nonzero", "Tensor.tolist", "Tensor.numpy",
                     "Tensor.__array__"), _KEEP_ON_DEVICE),
    **dict.fromkeys(("Tensor.__repr__", "Tensor.__str__"),
                    "do not print tensors inside the step; print what read_stats returns"),
    "Tensor.__format__": "do not format tensors inside the step; format what read_stats returns",
    "aten.nonzero": "an output sized by the data: use the dropless dispatcher (sort by expert, "
                    "offsets on the device), torch.where(cond, a, b), or nonzero_static(size=...)",
    "aten.index": "x[bool_mask] has a data-dependent size: keep the shape and mask the values "
                  "(x * mask, torch.where, masked_fill)",
    **dict.fromkeys(("aten.index_put_", "aten.index_put", "aten._index_put_impl_"),
                    "x[bool_mask] = v: use torch.where or masked_fill"),
    "aten.masked_select": "keep the shape: torch.where(mask, x, 0)",
    "aten.bincount": "count with scatter_add_ (moe_lab.moe.router.tokens_per_expert_from_ids)",
    "aten.repeat_interleave": "pass output_size= (the static bound), or search the offsets "
                              "(torch.searchsorted) for each row",
    **dict.fromkeys(("aten._unique2", "aten._unique", "aten.unique_dim"),
                    "a fixed-size answer: F.one_hot(ids, n).amax(0) marks the values present"),
    "aten.unique_consecutive": "keep the shape: mark run starts with x[1:] != x[:-1]",
    "aten.histc": "pass min= and max=",
    "aten.equal": "compare on the device: (a == b).all() stays a tensor",
    "aten.allclose": "compare on the device: torch.isclose(a, b).all() stays a tensor",
    **dict.fromkeys(("aten._to_copy", "aten.copy_"),
                    "move data before the step (static inputs) or after it (read_stats)"),
    "F.one_hot without num_classes": "pass num_classes",
}

_OPTIMIZER_ADVICE = ("the optimizer keeps its step count (or learning rate) on the host: build it "
                     "with moe_lab.training.optim.make_optimizer (AdamW fused=True, capturable=True, the "
                     "learning rate a device tensor)")


def capture_advice(err: SyncError) -> str:
    """How to remove the sync ``err`` names, in one sentence."""
    where = err.where or ""
    if "optimizer" in where:
        return _OPTIMIZER_ADVICE
    if "clip_grad_norm_" in where:
        return "clip_grad_norm_(..., error_if_nonfinite=False): the check reads the norm on the host"
    # a recorded name such as ``aten.index.Tensor (bool mask)`` is keyed ``aten.index``
    key = err.op if err.op in ADVICE else err.op.split(" ")[0].rsplit(".", 1)[0]
    return ADVICE.get(key, "find the line above and keep its values on the device "
                           "(see moe_lab.training.sync.SYNC_OPS)")


class NotCapturableError(SyncError):
    """The step cannot be captured in a CUDA graph: the `SyncError` of the certificate (``op``,
    ``where``, ``phase``), with ``advice`` on how to remove it (`capture_advice`)."""

    def __init__(self, err: SyncError) -> None:
        super().__init__(err.op, err.where, err.phase)
        self.advice = capture_advice(err)
        self.args = ("GraphedStep: this training step cannot be captured in a CUDA graph — a graph "
                     "replays kernels without the host, and the step needs the host here.\n"
                     f"{self.args[0]}\nFix: {self.advice}",)


# --------------------------------------------------------------------------------------
# GraphedStep
# --------------------------------------------------------------------------------------


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class GraphedStep(SyncFreeStep):
    """The sync-free training step, captured as one CUDA graph and replayed per batch.

    ``graphed = GraphedStep(model, optimizer, example_batch)``; ``stats = graphed(batch)``
    as with `moe_lab.training.steps.SyncFreeStep`, which it is, with `launch` replaying the
    graph (same arguments: ``cfg``, ``forward``, ``stash``, ``clip_step``).
    `WARMUP` iterations on a side stream precede the capture; afterwards the weights,
    the optimizer state and the step's buffers are restored, so the first replay is the
    first training step. The certificate runs first: a step that syncs is refused with a
    `NotCapturableError` before anything is captured.

    ``mode`` is ``"graphed (CUDA)"``, or ``"eager (no CUDA)"`` when there is no CUDA device
    or the model is not on one: then every call runs the step eagerly, and a one-time
    message says so (``quiet=True`` suppresses it).
    """

    def __init__(self, model: MoETransformer, optimizer: torch.optim.Optimizer,
                 example_batch: Batch, cfg: StepConfig | None = None, *,
                 forward: Callable | None = None, stash: PagedStash | None = None,
                 clip_step: str = "torch", quiet: bool = False) -> None:
        super().__init__(model, optimizer, example_batch, cfg, forward=forward, stash=stash,
                         clip_step=clip_step)
        self.load(example_batch)
        try:
            self.certify()
        except SyncError as err:
            raise NotCapturableError(err) from err
        self.certified = True
        device = self.state.x.device
        self.graph = self._capture() if device.type == "cuda" else None
        self.mode = EAGER_MODE if self.graph is None else GRAPHED_MODE
        global _EAGER_NOTICE_SHOWN
        if self.graph is None and not quiet and not _EAGER_NOTICE_SHOWN:
            why = "no CUDA device" if not torch.cuda.is_available() else f"the model is on {device}"
            print(f"GraphedStep: {why} — running the step eagerly (mode {EAGER_MODE!r}); the "
                  "certificate ran: it would be capturable")
            _EAGER_NOTICE_SHOWN = True

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Warm up, capture one iteration, restore what the warm-up changed; the graph."""
        tensors = [*self.model.parameters(), *self.model.buffers(), *self.state.buffers(),
                   *_optimizer_tensors(self.optimizer),
                   *(self.stash.buffers() if self.stash is not None else ())]
        saved = [(t, t.detach().clone()) for t in tensors]  # restored in place: the graph holds addresses
        kept = {id(t) for t in tensors}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self.run()
        torch.cuda.current_stream().wait_stream(side)
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.run(zero_grad=False)
        except RuntimeError as err:
            raise RuntimeError(
                "GraphedStep: CUDA refused to capture the step although assert_sync_free "
                f"passed: {err}\nThe usual cause is a host tensor used inside the step (a CPU "
                "tensor argument, torch.tensor(...) of a Python value) or a library call that "
                "synchronises outside PyTorch's operators.") from err
        with torch.no_grad():
            for t, value in saved:
                t.copy_(value)
            for t in _optimizer_tensors(self.optimizer):  # Adam state the warm-up created starts at zero
                if id(t) not in kept:
                    t.zero_()
        self.state.sums.zero_()
        return graph

    def launch(self, batch: Batch) -> None:
        """Copy ``batch`` into the static inputs and replay the graph (or run eagerly)."""
        if self.graph is None:
            return super().launch(batch)
        self.load(batch)
        self.graph.replay()
