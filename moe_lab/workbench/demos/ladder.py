"""The ladder: from the naive loop to the sync-free step, one fix at a time.

`LADDER` lists the fixes in the order notebook 08 applies them, each with what was wrong and
what fixes it; `ladder_step` builds a training step with the first few applied, so counting
its host syncs (`moe_lab.training.sync.count_syncs`) shows them going down to zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from moe_lab.checks import int_in
from moe_lab.config import ModelConfig
from moe_lab.data import Batch
from moe_lab.training.build import build_model, build_sync_free, default_impls
from moe_lab.training.steps import EagerStep, StepConfig

#: The fixes, in the order notebook 08 applies them: (name, what was wrong, what fixes it).
LADDER: tuple[tuple[str, str, str], ...] = (
    ("dropless dispatch",
     "the naive dispatcher finds each expert's tokens with torch.where: one nonzero per "
     "expert per layer",
     "sort by expert, offsets on the device, one grouped GEMM (notebook 04)"),
    ("statistics on the device",
     "the loop reads loss, grad norm, counts and dropped tokens every step "
     "(.item(), .tolist(), int())",
     "sum them into device buffers and read them in one copy every N steps"),
    ("capturable optimizer",
     "AdamW keeps each parameter's step count on the host and reads it every step "
     "(.item()); the learning rate is a Python float set by the host",
     "fused, capturable AdamW: step counts and the learning rate live on the device"),
)


def ladder_step(model_cfg: ModelConfig, batch: Batch, n_fixes: int, *, seed: int = 0,
                lr: float = 3e-3) -> Callable[[], object]:
    """A training step with the first ``n_fixes`` entries of `LADDER` applied (0: the naive
    loop's step; ``len(LADDER)``: `SyncFreeStep`), as a closure over a fresh model seeded
    with ``seed`` — count its syncs with `moe_lab.training.sync.count_syncs`."""
    int_in(n_fixes, "n_fixes", 0, len(LADDER))
    if n_fixes == len(LADDER):
        step = build_sync_free(model_cfg, batch.x.shape[0], seed=seed, cfg=StepConfig(lr=lr))
        step.load(batch)
        return step.run
    impls = replace(default_impls("cpu"), dispatcher="dropless" if n_fixes >= 1 else "naive")
    model, optimizer = build_model(model_cfg, impls, step="eager", seed=seed, lr=lr)
    if n_fixes < 2:  # the naive loop's step: statistics read back every step
        eager = EagerStep(model, optimizer, StepConfig(lr=lr))
        return lambda: eager(batch)
    sums = torch.zeros(4, dtype=torch.float64)

    def step() -> None:  # statistics summed on the device; the stock AdamW still syncs
        optimizer.zero_grad(set_to_none=True)
        out = model(batch.x, batch.y)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        sums.add_(torch.stack([out.loss.detach(), out.lm_loss.detach(), out.aux_loss.detach(),
                               grad_norm]).double())

    return step
