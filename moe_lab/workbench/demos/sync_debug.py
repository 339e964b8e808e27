"""The GPU's own sync check: run a step under ``torch.cuda.set_sync_debug_mode`` and collect
what it reports.

PyTorch's CUDA backend knows each place where it makes the host wait for the device: a
value read back (``.item()``, ``.tolist()``, ``bool(t)``), an output sized by the data
(``torch.nonzero``, ``torch.where(mask)``, ``x[mask]``), a blocking copy between host and
device, an explicit synchronize. With ``torch.cuda.set_sync_debug_mode("warn")`` every such
call also issues a ``UserWarning`` ("called a synchronizing CUDA operation"); with
``"error"`` the first one raises a ``RuntimeError`` instead of waiting. Only CUDA work is
watched: a CPU tensor's ``.item()`` makes no device wait, so on a CPU the mode reports
nothing — and a PyTorch built without CUDA cannot set it at all. That is what
`moe_lab.training.sync.assert_sync_free` is for: the same question answered from the
operators, on any machine. The two agree on the syncs of a step on the GPU; the certificate
also names a host value baked into a graph (the stock AdamW's step count), which is no
device wait and which the GPU's check does not report.

- `sync_debug_report(fn, *args, mode=...)` runs ``fn`` under the mode and restores the mode
  it found, also when ``fn`` raises; without CUDA it does not call ``fn`` and says why. It
  groups the warnings by the line of the caller's code that issued them (the innermost
  frame outside PyTorch: the line in moe_lab or the notebook), and for ``"error"`` names
  the line where the step was stopped.
- `sync_debug_demo(model_cfg, batch_size)` runs one training step of the naive loop and
  one of the sync-free step on the GPU, each under ``"warn"`` and under ``"error"``.
"""

from __future__ import annotations

import linecache
import os
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe_lab.config import ModelConfig
from moe_lab.training.build import build_model, build_sync_free, random_batch
from moe_lab.training.steps import EagerStep, StepConfig

#: What PyTorch says, as a warning or an error, at each synchronizing CUDA call.
MESSAGE = "called a synchronizing CUDA operation"

#: The modes that report (``"default"`` reports nothing).
MODES = ("warn", "error")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SKIP_FILES = (os.path.abspath(__file__), os.path.abspath(warnings.__file__))


@dataclass(frozen=True)
class SyncSite:
    """One line of code that made the host wait: ``where`` (``file:line``, the path from the
    package folder on: ``moe_lab/moe/dispatch.py:104``), its source text, how many times."""

    where: str
    code: str
    count: int = 1


@dataclass
class SyncDebugReport:
    """What ``torch.cuda.set_sync_debug_mode(mode)`` reported while ``fn`` ran.

    ``ran`` is False where there is no CUDA (``fn`` was not called; `summary` says why).
    ``sites``: the warnings, one entry per line of code, in the order first seen.
    ``stopped_at``: in mode ``"error"``, the line where the first sync raised (``error``
    holds its message); ``None`` when the step ran to its end."""

    label: str
    mode: str
    ran: bool
    sites: list[SyncSite] = field(default_factory=list)
    stopped_at: SyncSite | None = None
    error: str | None = None
    result: Any = None

    @property
    def syncs(self) -> int:
        """The synchronizing calls reported: warnings counted, plus the one that raised."""
        return sum(s.count for s in self.sites) + (self.stopped_at is not None)

    def summary(self) -> str:
        """A few lines for a notebook: the verdict, then each line of code that synced."""
        head = f"{self.label} under set_sync_debug_mode({self.mode!r}): "
        if not self.ran:
            return (head + "not run — no CUDA device: set_sync_debug_mode watches CUDA work only "
                    "(on a CPU it would report nothing)")
        if self.mode == "error":
            if self.stopped_at is None:
                return head + "ran to its end, no synchronizing CUDA call"
            return (head + f"stopped by a RuntimeError ({self.error})\n"
                    f"    at {self.stopped_at.where}: {self.stopped_at.code}")
        if not self.sites:
            return head + "no warning: no synchronizing CUDA call"
        lines = [head + f"{self.syncs} warnings ({MESSAGE!r}) from {len(self.sites)} lines:"]
        lines += [f"    ×{s.count:<3} {s.where}: {s.code}" for s in self.sites]
        return "\n".join(lines)


def _short(filename: str) -> str:
    """``filename`` from its package folder on (``moe_lab/...`` or ``torch/...``), or its name."""
    parts = Path(filename).parts
    anchors = [i for i, part in enumerate(parts) if part in ("moe_lab", "torch")]
    return "/".join(parts[anchors[-1]:]) if anchors else Path(filename).name


def _caller_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary:
    """The innermost frame outside PyTorch and this module: the caller's line that synced."""
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_TORCH_DIR) and path not in _SKIP_FILES:
            return frame
    return frames[-1]  # a sync inside PyTorch called directly: its innermost frame


def _site(frame: traceback.FrameSummary) -> tuple[str, str]:
    """``(where, code)`` of ``frame``, as a `SyncSite` names them."""
    code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    return f"{_short(frame.filename)}:{frame.lineno}", code


def sync_debug_report(fn: Callable[..., Any], *args: Any, mode: str = "warn", label: str = "",
                      **kwargs: Any) -> SyncDebugReport:
    """Run ``fn(*args, **kwargs)`` under ``torch.cuda.set_sync_debug_mode(mode)`` (``"warn"``
    or ``"error"``) and return a `SyncDebugReport`; the mode found before is set back
    afterwards, whatever happens. Without CUDA, ``fn`` is not called (``ran=False``): the
    mode watches CUDA work only. Warnings other than the sync warning pass through; a
    ``RuntimeError`` that is not the mode's own propagates (after the mode is restored)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    label = label or getattr(fn, "__qualname__", type(fn).__name__)
    if not torch.cuda.is_available():
        return SyncDebugReport(label, mode, ran=False)
    seen: Counter[tuple[str, str]] = Counter()  # (where, code) -> warnings, in the order first seen
    report = SyncDebugReport(label, mode, ran=True)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show = warnings.showwarning

        def collect(message, category, filename, lineno, file=None, line=None):
            if MESSAGE not in str(message):  # the step's other warnings, shown as they would have been
                show(message, category, filename, lineno, file, line)
                return
            seen[_site(_caller_frame(traceback.extract_stack()[:-1]))] += 1

        warnings.showwarning = collect
        torch.cuda.set_sync_debug_mode(mode)
        try:
            report.result = fn(*args, **kwargs)
        except RuntimeError as err:
            if MESSAGE not in str(err):
                raise
            report.error = str(err).strip().splitlines()[0]
            report.stopped_at = SyncSite(*_site(_caller_frame(traceback.extract_tb(err.__traceback__))))
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    report.sites = [SyncSite(where, code, n) for (where, code), n in seen.items()]
    return report


def sync_debug_demo(model_cfg: ModelConfig, batch_size: int, *, seed: int = 0,
                    device: str = "cuda") -> list[SyncDebugReport]:
    """One training step of the naive loop (naive dispatcher, stock AdamW, statistics read
    back every step: `moe_lab.training.steps.EagerStep`) and one of the sync-free step
    (`moe_lab.training.steps.SyncFreeStep`, no statistics read in the window), each under
    ``"warn"`` and then ``"error"``. Each is warmed up by one step first (the optimizer
    allocates its state), outside the mode; the batch is already on the device."""
    batch = random_batch(model_cfg, batch_size, device, torch.Generator().manual_seed(seed))
    naive = EagerStep(*build_model(model_cfg, step="eager", device=device, seed=seed))
    sync_free = build_sync_free(model_cfg, batch_size, device=device, seed=seed,
                                cfg=StepConfig(read_every=1_000_000))
    naive(batch)
    sync_free.launch(batch)
    torch.cuda.synchronize(device)
    reports = []
    for label, step in (("naive loop step", naive), ("sync-free step", sync_free.launch)):
        for mode in MODES:
            reports.append(sync_debug_report(step, batch, mode=mode, label=label))
            torch.cuda.synchronize(device)
    return reports
