"""CUDA graphs: capture the whole sync-free training step once, replay it with one launch.

In eager PyTorch the host launches every kernel itself: a few microseconds of Python,
dispatch and driver work per operator, hundreds of operators per training step. When the
kernels are small — a small model, a small batch, or a large model split over many GPUs —
the GPU finishes each kernel before the host has launched the next, and the step runs at
the speed of the host. A CUDA graph records the kernels of one step, with their arguments
and memory addresses, and replays them all with a single launch: the host leaves the
critical path.

What a graph cannot hold is anything that needs the host in the middle of the step: a
value read back (``.item()``, ``if t:``), an output sized by the data (``nonzero``,
``x[mask]``), a host number that changes each step (a Python learning rate), new input
tensors (inputs must be copied into the same static buffers before each replay). The
`moe_lab.training.steps.SyncFreeStep` has none of those, and proves it on the CPU
(`moe_lab.training.sync.assert_sync_free`). `GraphedStep` then:

1. certifies the step, and refuses with the operator and the fix when it is not capturable
   (`NotCapturableError`);
2. warms up on a side stream (the first iterations allocate the optimizer state, compile
   Triton kernels and settle the allocator — none of which may happen during capture),
3. captures one iteration with ``torch.cuda.CUDAGraph``, restores the weights and optimizer
   state the warm-up changed (in place: the graph holds their addresses), and
4. replays it for every batch after copying the batch into the static inputs.

Without CUDA there is nothing to capture: `GraphedStep` runs the same step eagerly, says so
once, and reports ``mode == "eager (no CUDA)"`` — the certificate still runs, so a CPU
still refuses a step a GPU could not capture. `graphed_vs_eager` is the measurement a GPU
machine runs: same model, same batches, eager and graphed, losses compared and timed.

`moe_lab.training.capture_breakers` is a gallery of small snippets that break capture, each
with the operator `assert_sync_free` names and a sync-free rewrite.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_lab.config import preset as get_preset
from moe_lab.perf import capabilities, compare
from moe_lab.training.build import build_model, build_sync_free, random_batch
from moe_lab.training.steps import StepConfig, SyncFreeStep
from moe_lab.training.sync import SyncError, count_syncs

Tensor = torch.Tensor

EAGER_MODE = "eager (no CUDA)"
GRAPHED_MODE = "graphed (CUDA)"

__all__ = [
    "EAGER_MODE", "GRAPHED_MODE", "GraphedStep", "NotCapturableError", "capture_advice",
    "graphed_vs_eager", "plot_launch_timeline",
]

_EAGER_NOTICE_SHOWN = False


# --------------------------------------------------------------------------------------
# Refusing clearly
# --------------------------------------------------------------------------------------

_KEEP_ON_DEVICE = ("keep the value on the device: accumulate statistics in device buffers and "
                   "read them every N steps outside the graph (SyncFreeStep.read_stats); "
                   "turn a branch into torch.where or a clamp")

#: What to do about each sync operator, keyed like `moe_lab.training.sync.SYNC_OPS`.
ADVICE: dict[str, str] = {
    "aten._local_scalar_dense": _KEEP_ON_DEVICE,
    "aten.is_nonzero": _KEEP_ON_DEVICE,
    "Tensor.tolist": _KEEP_ON_DEVICE,
    "Tensor.numpy": _KEEP_ON_DEVICE,
    "Tensor.__array__": _KEEP_ON_DEVICE,
    "Tensor.__repr__": "do not print tensors inside the step; print what read_stats returns",
    "Tensor.__str__": "do not print tensors inside the step; print what read_stats returns",
    "Tensor.__format__": "do not format tensors inside the step; format what read_stats returns",
    "aten.nonzero": "an output sized by the data: use the dropless dispatcher (sort by expert, "
                    "offsets on the device), torch.where(cond, a, b), or nonzero_static(size=...)",
    "aten.index": "x[bool_mask] has a data-dependent size: keep the shape and mask the values "
                  "(x * mask, torch.where, masked_fill)",
    "aten.index_put_": "x[bool_mask] = v: use torch.where or masked_fill",
    "aten.index_put": "x[bool_mask] = v: use torch.where or masked_fill",
    "aten._index_put_impl_": "x[bool_mask] = v: use torch.where or masked_fill",
    "aten.masked_select": "keep the shape: torch.where(mask, x, 0)",
    "aten.bincount": "count with scatter_add_ (moe_lab.moe.router.tokens_per_expert_from_ids)",
    "aten.repeat_interleave": "pass output_size= (the static bound), or search the offsets "
                              "(torch.searchsorted) for each row",
    "aten._unique2": "a fixed-size answer: F.one_hot(ids, n).amax(0) marks the values present",
    "aten._unique": "a fixed-size answer: F.one_hot(ids, n).amax(0) marks the values present",
    "aten.unique_dim": "a fixed-size answer: F.one_hot(ids, n).amax(0) marks the values present",
    "aten.unique_consecutive": "keep the shape: mark run starts with x[1:] != x[:-1]",
    "aten.histc": "pass min= and max=",
    "aten.equal": "compare on the device: (a == b).all() stays a tensor",
    "aten.allclose": "compare on the device: torch.isclose(a, b).all() stays a tensor",
    "aten._to_copy": "move data before the step (static inputs) or after it (read_stats)",
    "aten.copy_": "move data before the step (static inputs) or after it (read_stats)",
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
    head = err.op.split(" ")[0]
    for key in (head, head.rsplit(".", 1)[0]):
        if key in ADVICE:
            return ADVICE[key]
    return ("find the line above and keep its values on the device "
            "(see moe_lab.training.sync.SYNC_OPS)")


class NotCapturableError(SyncError):
    """The step cannot be captured in a CUDA graph: the `SyncError` of the certificate (``op``,
    ``where``, ``phase``), with ``advice`` on how to remove it."""

    def __init__(self, op: str, where: str | None = None, phase: str = "fn",
                 advice: str = "") -> None:
        super().__init__(op, where, phase)
        self.advice = advice
        self.args = (
            "GraphedStep: this training step cannot be captured in a CUDA graph — a graph "
            "replays kernels without the host, and the step needs the host here.\n"
            f"{self.args[0]}\nFix: {advice}",
        )

    def __str__(self) -> str:
        return self.args[0]

    @classmethod
    def from_sync_error(cls, err: SyncError) -> NotCapturableError:
        return cls(err.op, err.where, err.phase, capture_advice(err))


# --------------------------------------------------------------------------------------
# GraphedStep
# --------------------------------------------------------------------------------------


class _Snapshot:
    """In-place copies of tensors, restored in place (a graph holds their addresses)."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.saved = [(t, t.detach().clone()) for t in tensors]
        self.ids = {id(t) for t in tensors}

    @torch.no_grad()
    def restore(self) -> None:
        for t, value in self.saved:
            t.copy_(value)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, Tensor)]


class GraphedStep:
    """The sync-free training step, captured as one CUDA graph and replayed per batch.

    ``graphed = GraphedStep(model, optimizer, example_batch)``; ``stats = graphed(batch)``
    as with `moe_lab.training.steps.SyncFreeStep` (same arguments: ``cfg``, ``forward``,
    ``stash``, ``clip_step``).
    ``warmup`` iterations on a side stream precede the capture; afterwards the weights,
    the optimizer state and the step's buffers are restored, so the first replay is the
    first training step. ``certify=False`` skips the certificate (capture then fails with
    CUDA's own error instead of a `NotCapturableError`).

    ``mode`` is ``"graphed (CUDA)"``, or ``"eager (no CUDA)"`` when there is no CUDA device
    or the model is not on one: then every call runs the step eagerly, and a one-time
    message says so (``quiet=True`` suppresses it).
    """

    def __init__(self, model, optimizer: torch.optim.Optimizer, example_batch,
                 cfg: StepConfig | None = None, *, forward: Callable | None = None, stash=None,
                 clip_step: str = "torch", warmup: int = 3, certify: bool = True,
                 quiet: bool = False) -> None:
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be a positive integer, got {warmup!r}")
        self.step = SyncFreeStep(model, optimizer, example_batch, cfg, forward=forward,
                                 stash=stash, clip_step=clip_step)
        self.step.load(example_batch)
        self.certified = False
        if certify:
            try:
                self.step.certify()
            except SyncError as err:
                raise NotCapturableError.from_sync_error(err) from err
            self.certified = True
        self.graph = None
        if self.step.device.type == "cuda" and torch.cuda.is_available():
            self._capture(warmup)
            self.mode = GRAPHED_MODE
            self.notice = f"captured the training step as one CUDA graph ({warmup} warm-up steps)"
        else:
            self.mode = EAGER_MODE
            why = ("no CUDA device" if not torch.cuda.is_available()
                   else f"the model is on {self.step.device}")
            self.notice = (f"GraphedStep: {why} — running the step eagerly (mode "
                           f"{EAGER_MODE!r}); the certificate ran: it would be capturable")
            _show_once(self.notice, quiet)

    def _capture(self, warmup: int) -> None:
        step = self.step
        tensors = [*step.model.parameters(), *step.model.buffers(), *step.state.buffers(),
                   *_optimizer_tensors(step.optimizer)]
        if step.stash is not None:
            tensors += list(step.stash.buffers())
        snapshot = _Snapshot(tensors)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step.run()
        torch.cuda.current_stream().wait_stream(side)
        step.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                step.run(zero_grad=False)
        except RuntimeError as err:
            raise RuntimeError(
                "GraphedStep: CUDA refused to capture the step although assert_sync_free "
                f"passed: {err}\nThe usual cause is a host tensor used inside the step (a CPU "
                "tensor argument, torch.tensor(...) of a Python value) or a library call that "
                "synchronises outside PyTorch's operators.") from err
        snapshot.restore()
        with torch.no_grad():  # Adam state created by the warm-up starts from zero, as fresh
            for t in _optimizer_tensors(step.optimizer):
                if id(t) not in snapshot.ids:
                    t.zero_()
        step.state.zero_window()
        self.graph = graph

    def launch(self, batch) -> None:
        """Copy ``batch`` into the static inputs and replay the graph (or run eagerly)."""
        self.step.load(batch)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step.run()

    def __call__(self, batch) -> dict | None:
        self.launch(batch)
        return self.step.finish()

    def read_stats(self) -> dict:
        return self.step.read_stats()

    def flush(self) -> dict | None:
        return self.step.flush()

    @property
    def state(self):
        """The step's device state (`moe_lab.training.steps.StepState`)."""
        return self.step.state

    @property
    def host_steps(self) -> int:
        return self.step.host_steps

    @host_steps.setter
    def host_steps(self, value: int) -> None:
        self.step.host_steps = value

    def __repr__(self) -> str:
        return f"GraphedStep(mode={self.mode!r}, batch={self.step.batch_shape}, certified={self.certified})"


def _show_once(message: str, quiet: bool) -> None:
    global _EAGER_NOTICE_SHOWN
    if not quiet and not _EAGER_NOTICE_SHOWN:
        print(message)
        _EAGER_NOTICE_SHOWN = True


# --------------------------------------------------------------------------------------
# The measurement a GPU machine runs
# --------------------------------------------------------------------------------------


def graphed_vs_eager(preset: str = "small", batch_size: int = 2, steps: int = 20, *,
                     seed: int = 0, warmup: int = 3, min_time_s: float = 0.5,
                     device: torch.device | str | None = None) -> dict:
    """Train two identical models ``steps`` steps on the same random batches, one eager
    (`SyncFreeStep`), one through `GraphedStep`; compare their losses and weights, then
    time one iteration of each, interleaved (`moe_lab.perf.compare`).

    Returns ``mode`` (what `GraphedStep` did), ``eager_ms``, ``graphed_ms``, ``speedup``
    (eager / graphed), their IQRs, ``loss_eager``, ``loss_graphed`` (mean over the steps),
    ``loss_abs_diff``, ``loss_rel_diff``, ``param_max_abs_diff``, ``syncs_per_step``
    (counted on the eager step), the hardware label and the sizes. On a CPU both run
    eagerly: the speed-up is ~1 by construction and ``mode`` says so.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_cfg = get_preset(preset) if isinstance(preset, str) else preset
    cfg = StepConfig(read_every=steps, warmup_steps=min(5, steps), total_steps=max(steps, 1))
    eager = build_sync_free(model_cfg, batch_size, device=device, seed=seed, cfg=cfg)
    model, optimizer = build_model(model_cfg, device=device, seed=seed, lr=cfg.lr)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [random_batch(model_cfg, batch_size, device, gen) for _ in range(steps)]
    graphed = GraphedStep(model, optimizer, batches[0], cfg, warmup=warmup, quiet=True)
    stats_e = stats_g = None
    for batch in batches:
        stats_e = eager(batch) or stats_e
        stats_g = graphed(batch) or stats_g
    param_diff = max((a - b).abs().max().item()
                     for a, b in zip(eager.model.parameters(), model.parameters(), strict=True))
    _, syncs = count_syncs(eager.launch, batches[0])
    cycle = iter(range(10**9))

    def eager_iter() -> None:
        eager.launch(batches[next(cycle) % steps])

    def graphed_iter() -> None:
        graphed.launch(batches[next(cycle) % steps])

    timings = compare({"eager": eager_iter, "graphed": graphed_iter}, min_time_s=min_time_s)
    e, g = timings["eager"], timings["graphed"]
    return {
        "preset": model_cfg.name, "batch_size": batch_size,
        "tokens_per_step": batch_size * model_cfg.seq_len, "steps": steps,
        "device": device.type, "hardware": capabilities().hardware_label(), "mode": graphed.mode,
        "eager_ms": e.median_s * 1e3, "graphed_ms": g.median_s * 1e3,
        "eager_iqr_ms": e.iqr_s * 1e3, "graphed_iqr_ms": g.iqr_s * 1e3,
        "speedup": e.median_s / g.median_s,
        "loss_eager": stats_e["loss"], "loss_graphed": stats_g["loss"],
        "loss_abs_diff": abs(stats_e["loss"] - stats_g["loss"]),
        "loss_rel_diff": abs(stats_e["loss"] - stats_g["loss"]) / max(abs(stats_e["loss"]), 1e-12),
        "param_max_abs_diff": param_diff, "syncs_per_step": sum(syncs.values()),
        "certified": graphed.certified,
    }


# --------------------------------------------------------------------------------------
# The picture
# --------------------------------------------------------------------------------------


def plot_launch_timeline(n_kernels: int = 10, launch_us: float = 5.0, kernel_us: float = 2.0,
                         graph_launch_us: float = 8.0, axes=None):
    """A schematic (not a measurement) of one step's host launches and device kernels,
    eager and graphed: when each kernel takes less time than a launch, the device idles
    between kernels in eager mode; a graph launches them all at once."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(9, 3.4), sharex=True)
    eager_end = n_kernels * launch_us + kernel_us
    graph_end = graph_launch_us + n_kernels * kernel_us
    for ax, title in zip(axes, ("eager: the host launches every kernel",
                                "graphed: one launch replays them all"), strict=True):
        ax.set_yticks([0.5, 1.5], ["device", "host"])
        ax.set_ylim(0, 2)
        ax.set_title(title, fontsize=10, loc="left")
    host, device, free = [], [], 0.0
    for i in range(n_kernels):
        host.append((i * launch_us, launch_us * 0.9))
        start = max((i + 1) * launch_us, free)
        device.append((start, kernel_us * 0.95))
        free = start + kernel_us
    axes[0].broken_barh(host, (1.1, 0.8), color="tab:orange")
    axes[0].broken_barh(device, (0.1, 0.8), color="tab:blue")
    axes[1].broken_barh([(0, graph_launch_us * 0.95)], (1.1, 0.8), color="tab:orange")
    axes[1].broken_barh([(graph_launch_us + i * kernel_us, kernel_us * 0.95)
                         for i in range(n_kernels)], (0.1, 0.8), color="tab:blue")
    axes[1].set_xlabel(f"time (µs), schematic: launch {launch_us:g} µs, kernel {kernel_us:g} µs "
                       f"→ eager {eager_end:g} µs, graphed {graph_end:g} µs")
    axes[1].set_xlim(0, max(eager_end, graph_end) * 1.02)
    return axes

