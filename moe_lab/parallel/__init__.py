"""Scaling out: expert parallelism over torch.distributed.

- ``ep`` — the expert-parallel MoE layer (`EPMoELayer`, `from_layer`): experts sharded over
  a process group, tokens moved by two all-to-alls (dropless, or budgeted and sync-free);
- ``overlap`` — a chunked step that overlaps one chunk's all-to-all with another's expert
  compute (async work handles, optional delayed weight gradients), timed per chunk;
- ``merged`` — 1F1B merging: the forward of one micro-batch and the backward of another run
  as one plan of named stages, each one's all-to-all in flight while the other computes
  (`MergedStep`, the four schedules, `measure_schedules`, `simulate_plan`);
- ``merged_model`` — a whole model trained on merged 1F1B units, block by block
  (`MergedModelStep`, used by ``scripts/train_ep.py --schedule 1f1b``);
- ``timeline`` — the per-chunk events such a step records (`Timeline`).

Starting ranks and the emulated network link are the workbench's (`moe_lab.workbench.ranks`).

Submodules load on first use: ``import moe_lab.parallel`` imports nothing heavy.
"""

from __future__ import annotations

import importlib

__all__ = ["ep", "overlap", "merged", "merged_model", "timeline"]


def __getattr__(name: str):
    if name in __all__:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
