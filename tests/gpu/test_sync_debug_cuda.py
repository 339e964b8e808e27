"""PyTorch's own sync check on a CUDA device (`moe_lab.workbench.demos.sync_debug`): the naive
loop's step is reported and stopped, the sync-free step runs through both modes untouched, and
the mode found before is set back. Skipped without CUDA (the CPU path and the report's logic
are tested in tests/workbench/demos/test_sync_debug.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_gpu_reports_the_naive_step_and_not_the_sync_free_one():
    from moe_lab.config import preset
    from moe_lab.workbench.demos.sync_debug import sync_debug_demo, sync_debug_report

    before = torch.cuda.get_sync_debug_mode()
    reports = {(r.label, r.mode): r for r in sync_debug_demo(preset("tiny"), 2)}
    assert torch.cuda.get_sync_debug_mode() == before
    naive_warn, naive_error = reports["naive loop step", "warn"], reports["naive loop step", "error"]
    assert naive_warn.syncs > 0 and any("dispatch.py" in s.where for s in naive_warn.sites)
    assert naive_error.stopped_at is not None
    for mode in ("warn", "error"):
        assert reports["sync-free step", mode].syncs == 0, reports["sync-free step", mode].summary()
    x = torch.ones(3, device="cuda")
    assert sync_debug_report(lambda: x.sum().item(), mode="warn").syncs == 1
