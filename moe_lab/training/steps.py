"""The training steps a loop can plug in: the naive eager step, and the sync-free one.

`EagerStep` is the naive stack's step, as notebook 01 trains: the learning rate set from the
host, the stock AdamW, ``clip_grad_norm_``, and every statistic read back after every step.

A CUDA graph records a sequence of kernels once and replays it with one launch. It can hold
a whole training iteration only if nothing in the iteration needs the host: no value read
back (``.item()``, ``.tolist()``, ``if loss > x:``), no output whose size depends on the
data (``nonzero``, ``x[mask]``), no host-side number that changes from step to step. The
eager step breaks all three rules on purpose; `SyncFreeStep` is the step with each of them
fixed:

- **dropless dispatch** — tokens reach their experts by a sort and a grouped GEMM over
  offsets kept on the device (notebook 04), not by ``torch.where`` per expert;
- **a capturable optimizer** — AdamW with ``fused=True, capturable=True``
  (`moe_lab.training.optim.make_optimizer`): its step count lives on the device, and the
  learning rate is a device tensor the schedule (`moe_lab.training.optim.lr_schedule`)
  rewrites in place, where the stock AdamW reads its host step count every step;
- **clipping without a host read** — the global norm stays a tensor (``error_if_nonfinite``
  would read it: a non-finite norm shows in the statistics instead), and a fused AdamW
  divides every gradient by its ``grad_scale`` tensor as it reads it (the hook of AMP's loss
  scaling): ``grad_scale = max(1, norm / max_norm)`` is the clip, two passes over the
  gradients instead of three. A registered ``clip_step`` (`moe_lab.training.optim.CLIP_STEPS`)
  may do both in one call;
- **statistics on the device** — summed into device buffers (`StepState`) and read back in
  *one* copy every ``read_every`` steps (`SyncFreeStep.read_stats`);
- **static inputs** — every batch is copied into the same two device buffers, so a
  captured graph always reads its inputs from the same addresses.

`SyncFreeStep.certify` runs the *whole* step — forward, backward, clipping, the schedule and
the optimizer — under `moe_lab.training.sync.assert_sync_free` on fake tensors, so a CPU
proves what a GPU will do. Every step is called with a batch and returns the statistics it
read (a dict) or ``None``; ``flush()`` reads what is still accumulated.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from moe_lab.checks import non_negative_number, one_of, positive_ints, positive_number
from moe_lab.config import holds
from moe_lab.data import Batch
from moe_lab.model import MoETransformer
from moe_lab.moe.balance import update_expert_bias
from moe_lab.moe.experts import check_no_hidden_sync
from moe_lab.moe.stash import PagedStash
from moe_lab.training.optim import CLIP_STEPS, Schedule, lr_schedule
from moe_lab.training.sync import assert_sync_free

Tensor = torch.Tensor

# The profiler ranges a step opens around its phases, which the workbench's profiled breakdown
# (`moe_lab.workbench.measure.breakdown`) adds up; without a profiler running each costs a few
# microseconds.
PHASE_PREFIX = "moe_lab.training."
PHASES = ("forward", "backward", "optimizer")

#: What a sync-free step with a paged stash does with a step whose stash overflowed.
OVERFLOW_POLICIES = ("rerun", "skip")


def phase(name: str) -> torch.profiler.record_function:
    """The profiler range of one phase of a training step (``with phase("forward"): ...``)."""
    one_of(name, "phase", PHASES)
    return torch.profiler.record_function(PHASE_PREFIX + name)


@holds(schedule=Schedule)
@dataclass(frozen=True)
class StepConfig:
    """What a training step needs besides the model: the learning-rate ``schedule`` (its
    fields may be given flat: ``StepConfig(lr=1e-3)``), ``grad_clip`` (the global norm
    gradients are clipped to), ``read_every`` (a sync-free step copies its statistics to the
    host once every that many steps), ``expert_bias_rate`` (> 0: each router's expert bias
    moves after the optimizer step, `moe_lab.moe.balance.update_expert_bias`) and
    ``overflow_policy`` (with a paged stash only: ``"rerun"`` reads the stash's overflow flag
    after every step and repeats an overflowed step without stashing; ``"skip"`` reads
    nothing — an overflowed step updates nothing and is counted as skipped).
    """

    schedule: Schedule = field(default_factory=Schedule)
    grad_clip: float = 1.0
    read_every: int = 10
    expert_bias_rate: float = 0.0
    overflow_policy: str = "rerun"

    def __post_init__(self) -> None:
        positive_ints(self, "read_every")
        positive_number(self.grad_clip, "StepConfig.grad_clip")
        non_negative_number(self.expert_bias_rate, "StepConfig.expert_bias_rate")
        one_of(self.overflow_policy, "StepConfig.overflow_policy", OVERFLOW_POLICIES)


class StepState(nn.Module):
    """Everything the training loop keeps between steps, as device buffers.

    ``x``, ``y``: ``[batch, seq]`` int64, the static inputs; ``step``: ``[]`` float32,
    optimizer steps taken (drives the schedule); ``lr``: the optimizer's learning-rate tensor;
    ``skip``: ``[]``, 1.0 while the step must not update anything (a paged-stash overflow);
    ``grad_scale``: ``[]``, what a fused optimizer divides the gradients by (the clip);
    ``sums``: ``[7 + L·E + L]`` float64, the window's statistics (steps taken, steps skipped,
    the largest gradient norm, then the sums of the loss, LM loss, aux loss and gradient norm,
    the ``[L, E]`` tokens per expert, the ``[L]`` imbalance), zeroed when read. A module, so
    that `moe_lab.training.sync.assert_sync_free` swaps these buffers for fake ones too.
    """

    def __init__(self, example_batch: Batch, lr: Tensor, n_moe_layers: int, n_experts: int) -> None:
        super().__init__()
        f32, f64 = dict(dtype=torch.float32, device=lr.device), dict(dtype=torch.float64, device=lr.device)
        for name, value in (("x", torch.zeros_like(example_batch.x, device=lr.device)),
                            ("y", torch.zeros_like(example_batch.y, device=lr.device)),
                            ("step", torch.zeros((), **f32)), ("lr", lr), ("skip", torch.zeros((), **f32)),
                            ("grad_scale", torch.ones((), **f32)),
                            ("sums", torch.zeros(7 + n_moe_layers * (n_experts + 1), **f64))):
            self.register_buffer(name, value)


@contextlib.contextmanager
def optimizer_on_fake_params(optimizer: torch.optim.Optimizer, model: nn.Module) -> Iterator[None]:
    """Point ``optimizer`` at the fake twins of its parameters (and of its state, its lr,
    its ``found_inf`` and its ``grad_scale``) while `assert_sync_free` runs the step; restore on exit.

    `assert_sync_free` swaps the parameters of the modules it is given for fake tensors,
    but an optimizer holds its own references to the real ones: without this the certified
    step would update (or, with no gradients, silently skip) the real parameters, and the
    optimizer would not be certified at all. ``from_tensor`` memoises, so each parameter
    maps to the very fake twin the model now holds.
    """
    mode = next(p for p in model.parameters() if isinstance(p, FakeTensor)).fake_mode

    def to_fake(value: object) -> object:
        return mode.from_tensor(value) if isinstance(value, Tensor) else value

    saved = dict(vars(optimizer))  # its state, param groups, found_inf and grad_scale
    try:
        optimizer.state = defaultdict(dict, {to_fake(p): {k: to_fake(v) for k, v in state.items()}
                                             for p, state in optimizer.state.items()})
        optimizer.param_groups = [{**group, "params": [to_fake(p) for p in group["params"]],
                                   "lr": to_fake(group["lr"])} for group in optimizer.param_groups]
        vars(optimizer).update({name: to_fake(v) for name, v in saved.items() if isinstance(v, Tensor)})
        yield
    finally:
        vars(optimizer).update(saved)


# --------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------


class SyncFreeStep:
    """One training iteration of an `MoETransformer` that never waits for the device.

    ``step = SyncFreeStep(model, optimizer, example_batch)``; then ``stats = step(batch)``
    copies the batch into the static inputs, runs forward, backward, clipping, the
    learning-rate update and the optimizer, and returns ``None`` — or, every
    ``cfg.read_every`` steps, the statistics of the last window (`read_stats`, the only
    host read). ``optimizer`` must keep its learning rate in a device tensor and its step
    count on the device (`make_optimizer`). ``forward`` replaces the call of the model in
    the forward pass (e.g. ``torch.compile(model)``); the certificate always checks
    ``model``. ``stash`` (a `moe_lab.moe.stash.PagedStash` attached to the model) pages the
    experts' saved activations; see ``StepConfig.overflow_policy``.

    `certify` proves the whole step sync-free (`moe_lab.training.sync.assert_sync_free`); a
    sync inside a C++ operator it cannot see is refused here (`check_no_hidden_sync`).
    `moe_lab.training.graphs.GraphedStep` captures `run` in a CUDA graph. ``clip_step`` names
    the clip + optimizer update (`moe_lab.training.optim.CLIP_STEPS`), looked up once here.
    """

    def __init__(self, model: MoETransformer, optimizer: torch.optim.Optimizer,
                 example_batch: Batch, cfg: StepConfig | None = None, *,
                 forward: Callable | None = None, stash: PagedStash | None = None,
                 clip_step: str = "torch") -> None:
        if not isinstance(model, MoETransformer):
            raise ValueError(f"model must be an MoETransformer, got {type(model).__name__}")
        for ex in (layer.experts for layer in model.moe_layers):  # as the certificate runs them
            check_no_hidden_sync(ex.backend, ex.w_gate_up.device, ex.w_gate_up.dtype, "model",
                                 "model.bfloat16() or expert_backend='triton'")
        self.cfg, self.model, self.optimizer = cfg or StepConfig(), model, optimizer
        self.forward = forward if forward is not None else model
        lr = optimizer.param_groups[0]["lr"]
        if not (isinstance(lr, Tensor) and lr.device == next(model.parameters()).device
                and all(g["lr"] is lr and (g.get("capturable") or g.get("fused"))
                        for g in optimizer.param_groups)):
            raise ValueError(
                "optimizer: its lr must be a device tensor on the model's device, shared by every "
                "param group, and its step count must live on the device (fused=True or "
                f"capturable=True), so that the step needs no host value; got lr {lr!r}. Build "
                "it with moe_lab.training.optim.make_optimizer")
        self.state = StepState(example_batch, lr, len(model.moe_layers), model.cfg.moe.n_experts)
        # A fused optimizer clips for free: it divides the gradients by ``grad_scale`` as it
        # reads them. Any other optimizer gets clip_grad_norm_'s in-place multiply. A registered
        # clip + optimizer step (CLIP_STEPS) replaces torch's path where it can drive this
        # optimizer; decided once here.
        self.fused_clip = all(g.get("fused") for g in optimizer.param_groups)
        self.clip = CLIP_STEPS.lookup(clip_step, "clip_step")(optimizer) if self.fused_clip else None
        if self.fused_clip:
            optimizer.grad_scale = self.state.grad_scale
        self.stash = stash
        if stash is not None:
            stash.check_attached(model)
            # The fused AdamW skips its whole update on the device when this flag is 1.
            optimizer.found_inf = self.state.skip
        self.host_steps = 0  # a Python count: when to read, without asking the device
        self.reruns = 0

    # -- the device work ---------------------------------------------------------------

    def load(self, batch: Batch) -> None:
        """Copy ``batch.x`` and ``batch.y`` into the static inputs (same shape required)."""
        shape = self.state.x.shape
        if batch.x.shape != shape or batch.y.shape != shape:
            raise ValueError(f"batch must be [batch, seq] = {tuple(shape)} like the example "
                             f"batch, got x {tuple(batch.x.shape)} and y {tuple(batch.y.shape)}")
        self.state.x.copy_(batch.x, non_blocking=True)
        self.state.y.copy_(batch.y, non_blocking=True)

    def run(self, zero_grad: bool = True) -> None:
        """Forward, backward, clip, schedule, optimizer, statistics — all on the device.

        ``zero_grad=False`` leaves the gradients as they are: a captured graph sets them to
        ``None`` once before capture, and its backward then writes them afresh each replay.
        """
        st, cfg = self.state, self.cfg
        if zero_grad:
            with phase("optimizer"):
                self.optimizer.zero_grad(set_to_none=True)
        if self.stash is not None:
            self.stash.reset()
        st.lr.copy_(lr_schedule(st.step, cfg.schedule))
        with phase("forward"):
            out = self.forward(st.x, st.y)
        with phase("backward"):
            out.loss.backward()
        with phase("optimizer"):
            if self.stash is not None:
                st.skip.copy_(self.stash.overflow)
            grad_norm = None if self.clip is None else self.clip(cfg.grad_clip, st.grad_scale, st.skip)
            if grad_norm is None:
                if self.fused_clip:
                    # clip_grad_norm_'s factor min(1, max_norm / (norm + 1e-6)), applied by the
                    # fused AdamW as a divisor while it reads each gradient
                    grad_norm = torch.nn.utils.get_total_norm(
                        [p.grad for p in self.model.parameters() if p.grad is not None])
                    st.grad_scale.copy_(((grad_norm + 1e-6) / cfg.grad_clip).clamp(min=1.0))
                else:
                    grad_norm = torch.nn.utils.clip_grad_norm_(
                        self.model.parameters(), cfg.grad_clip, error_if_nonfinite=False)
                self.optimizer.step()
        keep = 1.0 - st.skip  # 0.0 for a step the optimizer skipped
        st.step.add_(keep)
        keep64 = keep.double()
        # [loss, lm_loss, aux_loss, grad_norm, L·E tokens per expert, L imbalance], zero if skipped
        values = torch.cat([torch.stack([out.loss, out.lm_loss, out.aux_loss, grad_norm]).detach().double(),
                            *(s.tokens_per_expert.double() for s in out.moe_stats),
                            *(s.imbalance.double().reshape(1) for s in out.moe_stats)]) * keep64
        st.sums[:2].add_(torch.stack([keep64, st.skip.double()]))
        st.sums[2].copy_(torch.maximum(st.sums[2], values[3]))
        st.sums[3:].add_(values)
        if cfg.expert_bias_rate:
            # A skipped step's loads are all zero: sign(mean - load) = 0, no move.
            n_layers, n_experts = len(out.moe_stats), self.model.cfg.moe.n_experts
            counts = values[4:4 + n_layers * n_experts].view(n_layers, n_experts)
            update_expert_bias(self.model, counts, cfg.expert_bias_rate)

    def read_stats(self) -> dict:
        """Copy the window's statistics to the host — one transfer, the step's only sync —
        and start a new window. Means are over the steps that updated the model."""
        st, n_experts = self.state, self.model.cfg.moe.n_experts
        step, lr, steps, skipped, grad_norm_max, *sums = torch.cat(
            [st.step.double().reshape(1), st.lr.double().reshape(1), st.sums]).tolist()
        st.sums.zero_()
        n = max(steps, 1.0)
        counts = [int(round(c)) for c in sums[4:4 + len(self.model.moe_layers) * n_experts]]
        return {"step": int(round(step)), "steps": int(round(steps)), "skipped": int(round(skipped)),
                **{name: v / n for name, v in zip(("loss", "lm_loss", "aux_loss", "grad_norm"), sums[:4])},
                "grad_norm_max": grad_norm_max, "lr": lr,
                "tokens_per_expert": [counts[i:i + n_experts] for i in range(0, len(counts), n_experts)],
                "imbalance": [v / n for v in sums[4 + len(counts):]], "reruns": self.reruns}

    def flush(self) -> dict | None:
        """The statistics of a window still open (fewer than ``read_every`` steps since the
        last read), or ``None``."""
        return self.read_stats() if self.host_steps % self.cfg.read_every else None

    # -- the host side -----------------------------------------------------------------

    def finish(self) -> dict | None:
        """After a step was launched: re-run it without stashing if the paged stash
        overflowed (policy ``"rerun"``), count it, and every ``read_every`` steps read.

        The re-run repeats the step eagerly with stashing off. The overflowed run updated
        nothing (the optimizer saw ``found_inf = 1``), so this is the step the data asked for."""
        # one flag, read after the whole step is queued
        if self.stash is not None and self.cfg.overflow_policy == "rerun" and bool(self.stash.overflow):
            self.reruns += 1
            with self.stash.disabled():
                self.run(zero_grad=True)
        self.host_steps += 1
        return None if self.host_steps % self.cfg.read_every else self.read_stats()

    def launch(self, batch: Batch) -> None:
        """Copy ``batch`` into the static inputs and run the step (no host read)."""
        self.load(batch)
        self.run()

    def __call__(self, batch: Batch) -> dict | None:
        self.launch(batch)
        return self.finish()

    # -- the certificate ---------------------------------------------------------------

    def certify(self) -> None:
        """Run the whole step — forward, backward, clipping, schedule, optimizer and the
        statistics — on fake tensors under `moe_lab.training.sync.assert_sync_free`; raise its
        ``SyncError`` at the first host sync. Nothing real is touched: the parameters,
        optimizer state and buffers keep their values."""
        assert_sync_free(self._certified_run, self.model, self.state, self.stash, backward=False)

    def _certified_run(self, *_modules: nn.Module | None) -> None:
        # The modules arrive as arguments only so that assert_sync_free swaps their tensors.
        # The model itself is certified, not a compiled wrapper of it.
        forward, self.forward = self.forward, self.model
        try:
            with optimizer_on_fake_params(self.optimizer, self.model):
                self.run()
        finally:
            self.forward = forward


class EagerStep:
    """The naive loop's training step: ``record = step(batch)`` after every step.

    The learning rate (`Schedule.lr_at`) is set as a Python float on every parameter group
    of ``optimizer`` (any torch optimizer), the gradients clipped with ``clip_grad_norm_``,
    and every statistic read back to the host — a sync per value, the naive stack's habit —
    into the record. ``forward`` replaces the call of the model (a compiled or autocast one).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 cfg: StepConfig | None = None, *, forward: Callable | None = None) -> None:
        self.model, self.optimizer, self.cfg = model, optimizer, cfg or StepConfig()
        self.forward = forward if forward is not None else model
        self.host_steps = 0
        self.state = None  # no device state: everything is read back every step

    def __call__(self, batch: Batch) -> dict:
        t0 = time.perf_counter()
        cfg, step = self.cfg, self.host_steps
        lr = cfg.schedule.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with phase("forward"):
            out = self.forward(batch.x, batch.y)
        with phase("optimizer"):
            self.optimizer.zero_grad(set_to_none=True)
        with phase("backward"):
            out.loss.backward()
        with phase("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
        if cfg.expert_bias_rate:
            update_expert_bias(self.model, [s.tokens_per_expert for s in out.moe_stats],
                               cfg.expert_bias_rate)
        counts = [s.tokens_per_expert.tolist() for s in out.moe_stats]
        self.host_steps += 1
        return {"step": step, "loss": out.loss.item(), "lm_loss": out.lm_loss.item(),
                "aux_loss": out.aux_loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
                "tokens_per_expert": counts, "imbalance": [max(c) / (sum(c) / len(c)) for c in counts],
                "dropped_tokens": sum(int(s.dropped_tokens) for s in out.moe_stats),
                "step_time_s": time.perf_counter() - t0}

    def flush(self) -> None:
        """Nothing accumulates between steps: every record was returned."""
