"""This machine's measured ceilings (`moe_lab.workbench.measure.ceilings`)."""

from __future__ import annotations

import pytest
import torch

import moe_lab.perf as perf
from moe_lab.workbench.measure import ceilings
from moe_lab.workbench.measure.timing import MIN_ADAPTIVE_REPEAT, bench

# ------------------------------------------------------------------------------ ceilings


def test_matmul_peak_is_flops_over_median_and_never_on_zeros(monkeypatch):
    seen = []

    def spy(fn, *args, **kwargs):
        seen.extend(t for t in args if isinstance(t, torch.Tensor))
        return bench(fn, *args, **kwargs)

    monkeypatch.setattr(ceilings, "bench", spy)
    c = ceilings.matmul_peak("fp32", 128, min_time_s=0.0)
    assert c.value == pytest.approx(2 * 128**3 / c.result.median_s)
    assert c.unit == "FLOP/s" and c.name == "matmul_fp32" and c.params["n"] == 128
    assert seen and all(t.abs().sum() > 0 for t in seen)
    assert c.hardware == perf.capabilities().hardware_label()
    b = ceilings.matmul_peak(torch.bfloat16, 64, min_time_s=0.0)
    assert b.name == "matmul_bf16" and b.value > 0


def test_copy_bandwidth_counts_read_and_write():
    c = ceilings.copy_bandwidth(4 * 2**20, min_time_s=0.0)
    assert c.value == pytest.approx(2 * 4 * 2**20 / c.result.median_s)
    assert c.unit == "B/s" and c.giga == pytest.approx(c.value / 1e9)


@pytest.mark.slow
def test_measure_ceilings_smoke():
    out = ceilings.measure_ceilings("smoke")
    assert set(out) == {"matmul_fp32", "matmul_bf16", "copy"}
    assert all(c.value > 0 and c.result.n >= MIN_ADAPTIVE_REPEAT for c in out.values())
