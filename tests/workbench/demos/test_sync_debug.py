"""`sync_debug_report`: its CPU path for real; its CUDA path against a stand-in for PyTorch's
sync debug mode (``torch.cuda.get_sync_debug_mode`` / ``set_sync_debug_mode`` replaced by a
variable, each synchronizing call played by a function that warns or raises as PyTorch's
CUDA backend does in that mode). The real thing runs in tests/gpu/test_sync_debug_cuda.py."""

from __future__ import annotations

import functools
import os
import warnings
from traceback import FrameSummary

import pytest
import torch

from moe_lab.workbench.demos import sync_debug
from moe_lab.workbench.demos.sync_debug import MESSAGE, sync_debug_report

NUMBERS = {"default": 0, "warn": 1, "error": 2}


# A synchronizing operator as PyTorch reports it in each mode, compiled as if it were a file of
# PyTorch's own: the report must name the caller's line, not a frame inside torch.
_OP_SOURCE = """
def sync(cuda):
    if cuda.mode == 1:
        warnings.warn(MESSAGE, UserWarning, stacklevel=2)
    elif cuda.mode == 2:
        raise RuntimeError(MESSAGE)
"""
_OP: dict = {"warnings": warnings, "MESSAGE": MESSAGE}
exec(compile(_OP_SOURCE, os.path.join(sync_debug._TORCH_DIR, "_fake_sync_op.py"), "exec"), _OP)


class FakeCuda:
    """The mode as PyTorch keeps it: an int, read and set through torch.cuda; ``sync()`` is
    one synchronizing CUDA call."""

    def __init__(self, monkeypatch, start: int = 0) -> None:
        self.mode = start
        self.history: list[int] = []
        self.sync = functools.partial(_OP["sync"], self)  # no frame of this file in between
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: self.mode)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", self.set)

    def set(self, mode) -> None:
        self.mode = NUMBERS[mode] if isinstance(mode, str) else int(mode)
        self.history.append(self.mode)


def _step(cuda: FakeCuda) -> str:
    for _ in range(3):
        cuda.sync()  # the loop's sync
    cuda.sync()  # the read-back
    return "done"


def test_without_cuda_fn_is_not_called_and_the_report_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    called = []
    report = sync_debug_report(lambda: called.append(1), mode="warn", label="step")
    assert not report.ran and called == [] and report.syncs == 0
    assert "not run" in report.summary() and "CUDA" in report.summary()


def test_warn_groups_the_warnings_by_the_line_that_synced(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    report = sync_debug_report(_step, cuda, mode="warn", label="step")
    assert report.ran and report.result == "done" and report.stopped_at is None
    assert [s.count for s in report.sites] == [3, 1]
    assert [s.code for s in report.sites] == ["cuda.sync()  # the loop's sync",
                                              "cuda.sync()  # the read-back"]
    assert all(s.where.startswith("test_sync_debug.py:") for s in report.sites)
    assert report.syncs == 4
    assert "4 warnings" in report.summary() and "×3" in report.summary()
    assert cuda.history == [1, 0] and cuda.mode == 0  # set, then set back


def test_error_names_the_line_that_stopped_the_step(monkeypatch):
    cuda = FakeCuda(monkeypatch, start=1)
    report = sync_debug_report(_step, cuda, mode="error", label="step")
    assert report.ran and report.result is None and report.sites == []
    assert report.stopped_at.code == "cuda.sync()  # the loop's sync"
    assert report.error == MESSAGE and report.syncs == 1
    assert "stopped by a RuntimeError" in report.summary()
    assert cuda.mode == 1  # the mode found before (warn) is back


def test_a_sync_free_step_reports_nothing(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    for mode in ("warn", "error"):
        report = sync_debug_report(lambda: 7, mode=mode, label="sync-free")
        assert report.ran and report.result == 7 and report.syncs == 0 and report.stopped_at is None
        assert "no synchronizing CUDA call" in report.summary()
    assert cuda.mode == 0


def test_other_errors_propagate_and_the_mode_is_restored(monkeypatch):
    cuda = FakeCuda(monkeypatch)

    def broken():
        cuda.sync()
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        sync_debug_report(broken, mode="warn")
    assert cuda.mode == 0


def test_other_warnings_pass_through(monkeypatch):
    cuda = FakeCuda(monkeypatch)

    def noisy():
        cuda.sync()
        warnings.warn("something else", UserWarning, stacklevel=1)

    with pytest.warns(UserWarning, match="something else"):
        report = sync_debug_report(noisy, mode="warn")
    assert report.syncs == 1


def test_the_line_named_is_the_innermost_frame_outside_torch():
    frames = [FrameSummary("/x/moe_lab/training/steps.py", 10, "run", line="out = self.forward(x, y)"),
              FrameSummary("/x/moe_lab/moe/dispatch.py", 104, "forward", line="torch.where(m)"),
              FrameSummary(os.path.join(sync_debug._TORCH_DIR, "functional.py"), 5, "op", line="x")]
    site = sync_debug._site(sync_debug._caller_frame(frames))
    assert site == ("moe_lab/moe/dispatch.py:104", "torch.where(m)")
    # all inside torch: the innermost frame is named rather than none
    assert sync_debug._caller_frame(frames[2:]).lineno == 5


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        sync_debug_report(lambda: None, mode="default")


def test_the_demo_runs_both_steps_under_both_modes(monkeypatch):
    """`sync_debug_demo`'s own code, run on the CPU with the CUDA calls stood in for: CPU work
    makes nothing wait, so every report is empty; the labels, modes and order are the GPU's."""
    from moe_lab.config import preset

    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    reports = sync_debug.sync_debug_demo(preset("tiny"), 2, device="cpu")
    assert [(r.label, r.mode) for r in reports] == [("naive loop step", "warn"), ("naive loop step", "error"),
                                                    ("sync-free step", "warn"), ("sync-free step", "error")]
    assert all(r.ran and r.syncs == 0 for r in reports)
    assert isinstance(reports[0].result, dict) and "loss" in reports[0].result  # the naive step's record
    assert cuda.history == [1, 0, 2, 0, 1, 0, 2, 0]
