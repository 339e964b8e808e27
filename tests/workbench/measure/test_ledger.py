"""The results ledger: round trip, validation, safe appends, latest(), the markdown table."""

from __future__ import annotations

import json
import math
import multiprocessing
from datetime import datetime
from pathlib import Path

import pytest
import torch

from moe_lab.workbench.measure import ledger
from moe_lab.workbench.measure.ledger import (
    LedgerWarning,
    format_value,
    latest,
    read,
    record,
    results_dir,
    results_table_markdown,
)


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty ledger directory for one test."""
    monkeypatch.setenv("MOE_LAB_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.delenv("MOE_LAB_PROFILE", raising=False)
    return tmp_path / "results"


# ------------------------------------------------------------------------------ location


def _write_pyproject(directory: Path, name: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0"\n')


def test_results_dir_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_LAB_RESULTS_DIR", str(tmp_path / "elsewhere"))
    assert results_dir() == tmp_path / "elsewhere"
    assert ledger.ledger_path() == tmp_path / "elsewhere" / "ledger.jsonl"


def test_results_dir_finds_the_project_root_from_notebooks(tmp_path, monkeypatch):
    # Notebooks execute with cwd notebooks/: the ledger must still be <root>/build/results.
    _write_pyproject(tmp_path / "proj", "moe-lab")
    notebooks = tmp_path / "proj" / "notebooks"
    notebooks.mkdir()
    monkeypatch.delenv("MOE_LAB_RESULTS_DIR", raising=False)
    monkeypatch.chdir(notebooks)
    assert results_dir() == (tmp_path / "proj").resolve() / "build" / "results"


def test_results_dir_ignores_other_projects(tmp_path, monkeypatch):
    # The nearest pyproject.toml belongs to another project: keep looking, then use cwd.
    _write_pyproject(tmp_path / "other", "not-moe-lab")
    monkeypatch.delenv("MOE_LAB_RESULTS_DIR", raising=False)
    monkeypatch.chdir(tmp_path / "other")
    assert ledger.find_project_root() is None
    assert results_dir() == Path.cwd() / "build" / "results"


def test_find_project_root_prefers_the_nearest_moe_lab(tmp_path):
    _write_pyproject(tmp_path / "outer", "moe-lab")
    _write_pyproject(tmp_path / "outer" / "inner", "moe-lab")
    (tmp_path / "outer" / "inner" / "deep").mkdir()
    found = ledger.find_project_root(tmp_path / "outer" / "inner" / "deep")
    assert found == (tmp_path / "outer" / "inner").resolve()


# ------------------------------------------------------------------------------ record/read


def test_record_round_trip(results, monkeypatch):
    monkeypatch.setenv("MOE_LAB_PROFILE", "smoke")
    written = record(
        "01_naive_moe", "naive", "tokens_per_s", 1234.5, "tok/s", hardware="test-cpu", spread=3.5
    )
    assert (results / "ledger.jsonl").exists()
    (loaded,) = read()
    assert loaded == written
    assert list(loaded)[:9] == [
        "notebook", "step", "metric", "value", "unit", "hardware", "versions", "time", "profile"
    ]
    assert loaded["value"] == 1234.5
    assert loaded["hardware"] == "test-cpu"
    assert loaded["profile"] == "smoke"
    assert loaded["spread"] == 3.5
    assert isinstance(loaded["versions"], dict) and loaded["versions"]
    moment = datetime.fromisoformat(loaded["time"])
    assert moment.utcoffset() is not None and moment.utcoffset().total_seconds() == 0


def test_record_defaults_hardware_and_profile(results):
    written = record("00_lab_bench", "matmul", "tflops", 0.5, "TFLOP/s")
    assert isinstance(written["hardware"], str) and written["hardware"]
    assert written["profile"] is None  # no MOE_LAB_PROFILE, none passed


def test_profile_passed_beats_the_environment(results, monkeypatch):
    monkeypatch.setenv("MOE_LAB_PROFILE", "smoke")
    written = record("n", "s", "m", 1.0, "u", hardware="h", profile="full")
    assert written["profile"] == "full"
    assert read()[0]["profile"] == "full"


def test_integers_stay_integers(results):
    record("n", "s", "syncs", 3, "syncs", hardware="h")
    record("n", "s", "ratio", 2, "", hardware="h")
    values = [item["value"] for item in read()]
    assert values == [3, 2] and all(type(value) is int for value in values)


def test_records_append_in_order(results):
    for index in range(5):
        record("n", "s", f"m{index}", float(index), "u", hardware="h")
    assert [item["metric"] for item in read()] == [f"m{index}" for index in range(5)]


@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, "3.0", None, True, torch.tensor(1.0)]
)
def test_record_rejects_a_bad_value(results, value):
    with pytest.raises(ValueError, match="my_metric"):
        record("n", "s", "my_metric", value, "u", hardware="h")
    assert read() == []


@pytest.mark.parametrize("argument", ["notebook", "step", "metric"])
@pytest.mark.parametrize("bad", ["", "   ", None])
def test_record_rejects_an_empty_name(results, argument, bad):
    names = {"notebook": "n", "step": "s", "metric": "m"}
    names[argument] = bad
    with pytest.raises(ValueError, match=argument):
        record(names["notebook"], names["step"], names["metric"], 1.0, "u", hardware="h")
    assert read() == []


def test_record_rejects_extras_that_replace_core_fields(results):
    with pytest.raises(ValueError, match="time"):
        record("n", "s", "m", 1.0, "u", hardware="h", time="yesterday")
    with pytest.raises(ValueError, match="JSON"):
        record("n", "s", "m", 1.0, "u", hardware="h", payload=object())
    assert read() == []


def test_read_of_a_missing_ledger_is_empty(tmp_path):
    assert read(tmp_path / "nothing.jsonl") == []


def test_read_skips_a_torn_trailing_line(results):
    record("n", "s", "first", 1.0, "u", hardware="h")
    path = results / "ledger.jsonl"
    with path.open("ab") as handle:  # a crash in the middle of a write
        handle.write(b'{"notebook": "n", "step": "s", "met')
    with pytest.warns(LedgerWarning, match="line 2"):
        items = read(path)
    assert [item["metric"] for item in items] == ["first"]


def test_record_after_a_torn_line_starts_a_fresh_line(results):
    record("n", "s", "first", 1.0, "u", hardware="h")
    path = results / "ledger.jsonl"
    with path.open("ab") as handle:
        handle.write(b'{"notebook": "n", "ste')
    record("n", "s", "second", 2.0, "u", hardware="h")
    assert path.read_bytes().endswith(b"\n")
    with pytest.warns(LedgerWarning):
        items = read(path)
    assert [item["metric"] for item in items] == ["first", "second"]


def test_read_skips_a_line_that_is_not_an_object(results):
    path = results / "ledger.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('[1, 2]\n{"metric": "ok", "value": 1}\n')
    with pytest.warns(LedgerWarning, match="line 1"):
        assert read(path) == [{"metric": "ok", "value": 1}]


@pytest.mark.parametrize("line, why", [
    ('{"notebook": "n", "metric": "m"}', "no value"),
    ('{"notebook": "n", "value": 1.0}', "no metric"),
    ('{"notebook": "n", "metric": "m", "value": NaN}', "must be finite"),
    ('{"notebook": "n", "metric": "m", "value": "fast"}', "real number"),
    ('{"notebook": "n", "metric": "m", "value": true}', "real number"),
])
def test_read_skips_a_record_whose_value_is_missing_or_not_a_finite_number(results, line, why):
    """Hand-edited lines like these were published as headlines by readme_gains (or raised
    ``KeyError: 'value'``); they are skipped, and the warning says why."""
    record("n", "s", "good", 2.5, "u", hardware="h")
    path = results / "ledger.jsonl"
    with path.open("a") as handle:
        handle.write(line + "\n")
    with pytest.warns(LedgerWarning, match=f"line 2 .*{why}"):
        items = read(path)
    assert [item["metric"] for item in items] == ["good"]


def _append_many(worker: int, count: int, payload: int) -> None:
    for index in range(count):
        record("n", f"w{worker}", f"m{index}", float(index), "u", hardware="h", pad="x" * payload)


def test_concurrent_writers_never_interleave(results):
    # Lines far longer than a pipe buffer: a writer that split its line into several
    # writes would interleave with the others and leave lines that do not parse.
    workers, count, payload = 4, 25, 64 * 1024
    context = multiprocessing.get_context("fork")
    processes = [
        context.Process(target=_append_many, args=(worker, count, payload))
        for worker in range(workers)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    lines = (results / "ledger.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b""
    items = [json.loads(line) for line in lines[:-1]]  # every line parses
    assert len(items) == workers * count
    for worker in range(workers):
        mine = [item["metric"] for item in items if item["step"] == f"w{worker}"]
        assert mine == [f"m{index}" for index in range(count)]
    assert all(len(item["pad"]) == payload for item in items)


# ------------------------------------------------------------------------------ latest


def _item(metric: str, value: float, time: str, hardware: str = "h") -> dict:
    return {
        "notebook": "n",
        "step": "s",
        "metric": metric,
        "value": value,
        "unit": "u",
        "hardware": hardware,
        "time": time,
    }


def test_latest_keeps_the_newest_per_key():
    items = [
        _item("a", 1.0, "2026-01-02T00:00:00+00:00"),
        _item("b", 10.0, "2026-01-01T00:00:00+00:00"),
        _item("a", 2.0, "2026-01-01T00:00:00+00:00"),  # older, though later in the file
        _item("a", 3.0, "2026-01-02T00:00:00+00:00", hardware="gpu"),
        _item("b", 20.0, "2026-01-03T00:00:00+00:00"),
    ]
    kept = latest(items)
    assert [(item["metric"], item["hardware"], item["value"]) for item in kept] == [
        ("a", "h", 1.0),
        ("b", "h", 20.0),
        ("a", "gpu", 3.0),
    ]


def test_latest_breaks_ties_by_position():
    stamp = "2026-01-01T00:00:00+00:00"
    assert [item["value"] for item in latest([_item("a", 1.0, stamp), _item("a", 2.0, stamp)])] == [
        2.0
    ]


def test_latest_of_records_written(results):
    record("n", "s", "m", 1.0, "u", hardware="h")
    record("n", "s", "m", 2.0, "u", hardware="h")
    assert [item["value"] for item in latest(read())] == [2.0]


# ------------------------------------------------------------------------------ the table


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (6338, "6,338"),
        (0, "0"),
        (1648.27, "1,648"),
        (12.3456, "12.35"),
        (0.012345, "0.01235"),
        (-2.5, "-2.500"),
        (3.2e-7, "3.200e-07"),
        (1.5e9, "1.500e+09"),
        (0.0, "0"),
    ],
)
def test_format_value(value, text):
    assert format_value(value) == text


def test_results_table_markdown():
    items = [
        {**_item("tokens_per_s", 6338.4, "2026-03-04T05:06:07+00:00"), "notebook": "02_b"},
        {**_item("syncs", 0, "2026-03-01T00:00:00+00:00"), "notebook": "01_a", "unit": "a|b"},
    ]
    table = results_table_markdown(items).strip().splitlines()
    assert table[0] == "| notebook | step | metric | value | unit | hardware | date |"
    assert set(table[1]) <= set("|-:")
    assert len(table) == 4
    assert table[2] == "| 01_a | s | syncs | 0 | a\\|b | h | 2026-03-01 |"
    assert table[3] == "| 02_b | s | tokens_per_s | 6,338 | u | h | 2026-03-04 |"


def test_results_table_markdown_without_records():
    text = results_table_markdown([])
    assert "|" not in text and "No figures" in text


def test_figures_table_shows_only_the_chosen_steps_and_metrics_in_order():
    def rec(step, metric, value, unit, hardware="cpu:x"):
        return {"notebook": "04_x", "step": step, "metric": metric, "value": value, "unit": unit,
                "hardware": hardware}

    records = [rec("fine:dropless torch", "vs_naive", 21.59, "x"), rec("fine:naive", "vs_naive", 1.0, "x"),
               rec("fine:naive", "syncs_per_step", 64, "syncs"), rec("kernel", "warps_per_sm", 64, "warps")]
    table = ledger.figures_table_markdown(records, ["fine:naive", "fine:dropless torch", "fine:gone"],
                                          {"vs_naive": "vs naive", "syncs_per_step": "syncs"})
    assert table.splitlines() == [
        "| step | vs naive | syncs |", "|---|---:|---:|",
        "| fine:naive | 1.000 x | 64 syncs |", "| fine:dropless torch | 21.59 x |  |",
        "", "_measured on cpu:x_"]
    two = ledger.figures_table_markdown([*records, rec("fine:naive", "vs_naive", 1.0, "x", "gpu:y")],
                                        ["fine:naive"], {"vs_naive": "vs naive"})
    assert two.splitlines()[2:] == ["| fine:naive | cpu:x | 1.000 x |", "| fine:naive | gpu:y | 1.000 x |"]
    assert ledger.figures_table_markdown(records, ["nothing"], {"vs_naive": "v"}) == ""
    with pytest.raises(ValueError, match="non-empty"):
        ledger.figures_table_markdown(records, "fine:naive", {"vs_naive": "v"})
