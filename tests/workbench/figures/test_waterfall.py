"""The waterfall: one machine per chart, the newest measurement per ladder, reported figures
drawn apart."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from moe_lab.workbench.figures.waterfall import (
    LADDER_METRIC,
    Waterfall,
    plot_waterfall,
    plot_waterfalls,
    reported_waterfall,
    waterfalls_from_ledger,
)


def _rec(rung, value, hardware="cpu:test x2", run="a", time="2026-11-29T10:00:00", **extra):
    """A ladder record as `moe_lab.workbench.benchmarks.ttt.record_ladder` writes it."""
    return {"notebook": "12_time_to_train", "step": f"ladder:rung {rung}", "metric": LADDER_METRIC,
            "value": value, "unit": "tok/s", "hardware": hardware, "time": time, "rung": rung,
            "ladder": "small, batch 16", "run": run, "iqr_ms": 1.0, "median_ms": 10.0, **extra}


def test_steps_and_total():
    wf = Waterfall("t", "h", "tok/s", (("a", 100.0), ("b", 150.0), ("c", 120.0)))
    assert wf.total == pytest.approx(1.2)
    table = wf.table_markdown()
    assert "| b | 150.0 | 1.50 | 1.50 |" in table and "| c | 120.0 | 0.80 | 1.20 |" in table
    ax = plot_waterfall(wf)
    assert [t.get_text() for t in ax.texts[1:3]] == ["×1.50", "×0.80"]  # one ratio per optimisation


def test_ledger_one_waterfall_per_hardware_newest_run_only():
    records = [
        _rec(0, 100.0, run="old", time="2026-11-28T10:00:00"),
        _rec(1, 300.0, run="old", time="2026-11-28T10:00:01"),
        _rec(0, 110.0, run="new"), _rec(1, 140.0, run="new"), _rec(2, 160.0, run="new"),
        _rec(0, 1000.0, hardware="H200", run="gpu"), _rec(1, 3000.0, hardware="H200", run="gpu"),
        # not ladders: no rung, another metric
        {"notebook": "12_time_to_train", "step": "x", "metric": LADDER_METRIC, "value": 5.0,
         "unit": "tok/s", "hardware": "cpu:test x2", "time": "2026-11-30T00:00:00"},
        {**_rec(0, 7.0), "metric": "time_to_target_s"},
    ]
    wfs = waterfalls_from_ledger(records)
    assert [wf.hardware for wf in wfs] == ["H200", "cpu:test x2"]
    cpu = wfs[1]
    assert [value for _, value in cpu.rungs] == [110.0, 140.0, 160.0]  # the old run is not mixed in
    assert [label for label, _ in cpu.rungs] == ["rung 0", "rung 1", "rung 2"]
    assert cpu.unit == "tok/s" and cpu.kind == "measured"
    assert "12_time_to_train: small, batch 16" in cpu.title
    assert wfs[0].total == pytest.approx(3.0)
    assert waterfalls_from_ledger(records, notebook=["other"]) == []


def test_a_noisy_measurement_is_passed_over():
    steady = [_rec(0, 100.0, run="steady", time="2026-11-28T10:00:00", iqr_ms=1.0, median_ms=10.0),
              _rec(1, 150.0, run="steady", time="2026-11-28T10:00:01", iqr_ms=1.0, median_ms=7.0)]
    noisy = [_rec(0, 5.0, run="busy", iqr_ms=9.0, median_ms=10.0),
             _rec(1, 9.0, run="busy", iqr_ms=1.0, median_ms=10.0)]
    (wf,) = waterfalls_from_ledger(steady + noisy)
    assert [value for _, value in wf.rungs] == [100.0, 150.0] and "NOISY" not in wf.title
    (wf,) = waterfalls_from_ledger(noisy)
    assert [value for _, value in wf.rungs] == [5.0, 9.0] and "NOISY" in wf.title


def test_reported_is_labelled():
    rep = reported_waterfall()
    assert [value for _, value in rep.rungs] == [1298.0, 1648.0]
    assert rep.kind == "reported" and "GB300" in rep.hardware
    assert rep.total == pytest.approx(1648 / 1298)
    assert "reported" in plot_waterfall(rep).get_title()


def test_plots_draw_one_bar_per_rung_plus_total():
    measured = Waterfall("m", "h", "tok/s", (("a", 100.0), ("b", 150.0)))
    ax = plot_waterfall(measured)
    assert len(ax.patches) == 3
    assert all(not p.get_hatch() for p in ax.patches)
    assert "measured" in ax.get_title() and "h" in ax.get_title()
    fig = plot_waterfalls([measured, measured, reported_waterfall()])
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert len(titles) == 3 and any("reported" in t for t in titles)
    plt.close("all")
