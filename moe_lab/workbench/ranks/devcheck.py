"""Catching a rank that builds on the wrong device, on a machine without a GPU.

Under NCCL every tensor a collective touches must be on the rank's GPU, and a layer built on
the CPU next to data on the GPU fails at its first operation. On a CPU machine both land on
the CPU, so a forgotten ``device=`` passes every test there and fails on the first GPU run.
`with_default_device` makes it fail here too: it runs rank functions with torch's *default*
device set to ``"meta"`` (tensors with a shape and no data), so anything created without
naming its device — ``torch.zeros(n)``, ``MoELayer(cfg)`` then ``.to(device)``, a CPU tensor
handed to a collective — is a meta tensor and raises at once ("Cannot copy out of meta
tensor", a device mismatch, gloo refusing it), while what names `rank_device` runs as before.
Data deliberately drawn on the host says so (``device="cpu"``) and is then moved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def with_default_device(default: str, calls: Sequence[tuple[Callable, tuple]]) -> list[Any]:
    """Run each ``fn(*args)`` of ``calls`` with ``torch.set_default_device(default)`` (a rank
    function for `moe_lab.workbench.ranks.launch.run_ranks`); returns their results in order."""
    torch.set_default_device(default)
    try:
        return [fn(*args) for fn, args in calls]
    finally:
        torch.set_default_device(None)
