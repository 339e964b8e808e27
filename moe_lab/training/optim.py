"""The optimizers, the learning-rate schedule, and the registry of clip-and-step variants.

Two AdamWs train the same parameter groups (weight decay on matrices except the
embedding): `stock_optimizer`, the naive loop's — its step count on the host, a Python
learning rate, one parameter at a time — and `make_optimizer`, the one a CUDA graph can
hold — ``fused=True, capturable=True``, the step counts and the learning rate on the device.

The schedule (`Schedule`, held by every training config) is linear warm-up then cosine
decay, written twice on purpose: `Schedule.lr_at` on the host (the naive loop sets a float)
and `lr_schedule` on the device (the sync-free step rewrites the optimizer's learning-rate
tensor in place, so a captured graph replays the schedule).

`CLIP_STEPS` names how the sync-free step clips the gradients and updates the parameters:
``"torch"`` is the step's own path (`moe_lab.training.steps.SyncFreeStep`); a plug-in may
register a faster one (the CPU plug-in's ``"cpu_one_call"``). An entry is a factory
``factory(optimizer) -> fn | None`` (``None``: it cannot drive this optimizer, torch's path
is taken); ``fn(max_norm, grad_scale, skip) -> norm | None`` computes the global gradient
norm, sets ``grad_scale = max(1, norm / max_norm)``, runs the update (skipped on the device
where ``skip == 1``) and returns the norm, or ``None`` where it does not apply at this step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from moe_lab.checks import non_negative_ints, positive_ints, positive_number
from moe_lab.registry import Registry

Tensor = torch.Tensor

ClipStep = Callable[[float, Tensor, Tensor], "Tensor | None"]

CLIP_STEPS: Registry[Callable[[torch.optim.Optimizer], ClipStep | None]] = Registry(
    "clip + optimizer step", "the sync-free step's clip and optimizer update: "
    "factory(optimizer) -> fn | None", plugin=True)


@CLIP_STEPS.register("torch")
def torch_clip_step(optimizer: torch.optim.Optimizer) -> ClipStep | None:
    """torch's path, which `SyncFreeStep` runs itself (the norm over the model's parameters,
    then the fused AdamW): nothing to substitute, so ``None``."""
    return None


@dataclass(frozen=True)
class Schedule:
    """The learning rate of a run: linear warm-up to ``lr`` over ``warmup_steps``, then cosine
    decay to ``lr · min_lr_ratio`` at ``steps``, the length of the run."""

    lr: float = 3e-3
    warmup_steps: int = 20
    steps: int = 200
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        positive_number(self.lr, "Schedule.lr")
        positive_ints(self, "steps")
        non_negative_ints(self, "warmup_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"Schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (from 0), on the host."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * progress))


def lr_schedule(step: Tensor, schedule: Schedule) -> Tensor:
    """`Schedule.lr_at` computed on the device: ``step: []`` (optimizer steps taken so far, any
    dtype) → the learning rate, ``[]`` float32."""
    lr, warmup_steps = schedule.lr, schedule.warmup_steps
    s = step.double()  # one scalar: float64 costs nothing and keeps the cosine's tail exact
    floor = lr * schedule.min_lr_ratio
    span = max(1, schedule.steps - warmup_steps)
    progress = ((s - warmup_steps) / span).clamp(0.0, 1.0)
    decay = floor + 0.5 * (lr - floor) * (1.0 + torch.cos(progress * math.pi))
    # Without warm-up the first branch is never taken (its division by zero gives inf, unused).
    warm = lr * (s + 1.0) / warmup_steps
    return torch.where(s < warmup_steps, warm, decay).float()


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight decay on matrices except the embedding, none elsewhere."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


# Both AdamWs' moment decay rates.
BETAS = (0.9, 0.95)


def stock_optimizer(model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """The naive loop's AdamW: a Python learning rate, the step count on the host, one
    parameter at a time (``foreach=False``)."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=BETAS, foreach=False)


def make_optimizer(model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW that a graph can hold: ``fused=True, capturable=True`` and the learning rate a
    0-dim tensor on the parameters' device, shared by every parameter group (the schedule
    writes it in place).

    The fused kernel keeps each parameter's step count on the device and also takes a
    ``found_inf`` flag on the device that turns the whole update into a no-op — what the
    paged stash uses to drop an overflowed step without asking the host.
    """
    lr_t = torch.tensor(float(lr), dtype=torch.float32, device=next(model.parameters()).device)
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr_t, betas=BETAS, fused=True,
                             capturable=True)
