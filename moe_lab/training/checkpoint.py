"""Checkpoints: written atomically, read without unpickling code.

A training checkpoint (`moe_lab.training.loop.Trainer.state`) holds the model, the optimizer,
the step's own device state where it has one, the data generator's state, torch's RNG and
the history, so a resumed run continues the uninterrupted loss curve exactly. It is written
to a temporary file in the same folder and renamed over the old one (``os.replace``), so a
crash mid-write leaves the previous checkpoint intact; it is read with ``weights_only=True``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` to ``path`` atomically: a temporary file beside it, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | os.PathLike) -> dict:
    """The state written by `save_checkpoint` (tensors on the CPU)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    return torch.load(path, map_location="cpu", weights_only=True)
