"""Clipping and AdamW in one call on a CPU (``cpu_optim.cpp``, beside this file).

The sync-free training step clips the gradients and steps the optimizer in three stages:
the global gradient norm (``torch.nn.utils.get_total_norm``: one norm per tensor, then the
norm of those), the clip factor ``max(1, (norm + 1e-6) / max_norm)``, and torch's fused
AdamW, which divides every gradient by that factor as it reads it — one call per parameter
group, each a loop over its tensors, with Python in between: on a CPU, more time than the
memory it moves. `clip_adamw_` does the same with one custom op: one parallel pass over all
the gradients for the norm, one over all the parameters for the update (the same AdamW:
decoupled weight decay, float32 moments, the step counts and the moments in the optimizer's
own state, so checkpoints are unchanged).

`supports` says whether an optimizer can take it: a CPU AdamW as the sync-free step's
``make_optimizer`` builds it (fused, float32, no AMSGrad, not maximising) with moe_lab's CPU kernels built.
While step hooks are registered on it (or globally) the step keeps torch's path: those run only
in ``optimizer.step()``. The op has a fake implementation, so the step's sync-free certificate
covers it. `one_call_step` is the entry the plug-in registers as the clip step ``cpu_one_call``.
"""

from __future__ import annotations

import torch
from torch.optim import optimizer as optim_module

from moe_lab.workbench.cpu.build import kernel_op, unavailable_reason

Tensor = torch.Tensor


def _clip_adamw_shapes(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                       exp_avg_sqs: list[Tensor], steps: list[Tensor], weight_decays: list[float],
                       lr: Tensor, beta1: float, beta2: float, eps: float, max_norm: float, skip: Tensor,
                       grad_scale: Tensor) -> Tensor:
    return lr.new_empty(())


_clip_adamw = kernel_op("cpu_clip_adamw_", "clip_adamw_", _clip_adamw_shapes,
                        mutates_args=("params", "exp_avgs", "exp_avg_sqs", "steps", "grad_scale"))


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `clip_adamw_` can step ``optimizer``: a ``torch.optim.AdamW`` with ``fused=True``
    on contiguous float32 CPU parameters, without AMSGrad or maximising, its groups sharing
    one learning rate, betas and eps (as the sync-free step's ``make_optimizer`` builds it), and
    moe_lab's CPU kernels here."""
    if type(optimizer) is not torch.optim.AdamW or not optimizer.param_groups:
        return False
    first = optimizer.param_groups[0]
    for group in optimizer.param_groups:
        if not group.get("fused") or group.get("amsgrad") or group.get("maximize"):
            return False
        if group["lr"] is not first["lr"] or group["betas"] != first["betas"] or group["eps"] != first["eps"]:
            return False
        for p in group["params"]:
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                return False
    return unavailable_reason() is None


def clip_adamw_(optimizer: torch.optim.AdamW, max_norm: float, grad_scale: Tensor,
                skip: Tensor) -> Tensor:
    """Clip the gradients of ``optimizer``'s parameters to a global norm of ``max_norm`` and
    take its AdamW step, as ``SyncFreeStep`` does with torch's fused AdamW: the factor
    ``max(1, (norm + 1e-6) / max_norm)`` is written into ``grad_scale`` and every gradient is
    divided by it as it is read (the gradients themselves are not changed). ``skip`` (a
    one-element float32 tensor) nonzero leaves everything as it was. Parameters without a
    gradient are left alone, as AdamW does. Returns the global norm, a 0-dim tensor.

    For an optimizer `supports` takes (`one_call_step` asks once, at construction, so the
    per-step path does not walk every parameter to check it again); the kernel checks each
    tensor's dtype, layout and size, and ``max_norm > 0``."""
    params, decays = [], []
    first = optimizer.param_groups[0]
    lr, betas, eps = first["lr"], first["betas"], first["eps"]
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if not state:  # as AdamW initialises it (capturable: the count a float32 tensor)
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            decays.append(float(group["weight_decay"]))
    states = [optimizer.state[p] for p in params]
    if not isinstance(lr, Tensor):
        lr = torch.tensor(float(lr), dtype=torch.float32)
    with torch.no_grad():
        return _clip_adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                           [s["exp_avg_sq"] for s in states], [s["step"] for s in states], decays, lr,
                           float(betas[0]), float(betas[1]), float(eps), float(max_norm), skip, grad_scale)


def one_call_step(optimizer: torch.optim.Optimizer):
    """The clip step ``cpu_one_call`` (``CLIP_STEPS`` of the sync-free step): for an optimizer
    `supports` takes, ``fn(max_norm, grad_scale, skip) -> norm`` running `clip_adamw_`, or
    None (not applicable now) while step hooks are registered; None for any other optimizer."""
    if not supports(optimizer):
        return None

    def step(max_norm: float, grad_scale: Tensor, skip: Tensor) -> Tensor | None:
        # ``optimizer.step()`` would call step hooks (its own or global ones); `clip_adamw_` does not
        if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or optim_module._global_optimizer_pre_hooks or optim_module._global_optimizer_post_hooks):
            return None
        return clip_adamw_(optimizer, max_norm, grad_scale, skip)

    return step
