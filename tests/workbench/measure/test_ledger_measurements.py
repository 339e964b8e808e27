"""A ledger record is a measurement of something real (issue 47): ``bench mxfp8 --size 0 0``
recorded "0.0 GB/s measured" into notebook 06's ledger. A rate is > 0 and a size a figure was
measured at is a positive integer, or nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_lab.workbench.measure.ledger import read, record


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOE_LAB_RESULTS_DIR", str(tmp_path / "results"))
    return tmp_path / "results"


@pytest.mark.parametrize("value, unit, extra, words", [
    (0.0, "GB/s", {}, ["'quantizer' is a rate (GB/s) and must be > 0, got 0.0"]),
    (-3.5, "tok/s", {}, ["rate (tok/s)", "got -3.5"]),
    (1.5, "ms", {"tokens": 0}, ["tokens of metric 'quantizer'", "positive integer, got 0"]),
    (1.5, "ms", {"batch_size": -2}, ["batch_size", "got -2"]),
    (1.5, "ms", {"tokens": 2.5}, ["tokens", "got 2.5"]),
])
def test_a_record_of_nothing_measured_is_refused_and_not_written(results, value, unit, extra, words):
    with pytest.raises(ValueError) as refused:
        record("06_mxfp8_attention", "bench", "quantizer", value, unit, hardware="test", **extra)
    assert all(w in str(refused.value) for w in words), str(refused.value)
    assert read() == []


def test_counts_may_be_zero_and_sizes_positive(results):
    record("04_dropless_sync_free", "dropless", "syncs_per_step", 0, "syncs", hardware="test", tokens=64)
    record("06_mxfp8_attention", "bench", "quantizer", 12.5, "GB/s", hardware="test", tokens=None)
    assert [r["value"] for r in read()] == [0, 12.5]
