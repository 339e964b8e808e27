"""``scripts/readme_gains.py`` never publishes what a corrupted ledger says (issue 47): it
printed a garbage date and a negative share from corrupted records, and exited 0 with a table of
"not measured yet" on an empty or garbage ledger."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def gains():
    spec = importlib.util.spec_from_file_location("readme_gains", ROOT / "scripts" / "readme_gains.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(**fields) -> str:
    base = {"notebook": "01_naive_moe", "step": "naive", "metric": "syncs_per_step", "value": 9,
            "unit": "syncs", "hardware": "cpu: test", "versions": {}, "time": "2026-01-02T03:04:05+00:00",
            "profile": "smoke"}
    return json.dumps({**base, **fields}) + "\n"


def _run(gains, capsys, tmp_path, text: str) -> tuple[int, str, list[str]]:
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text(text)
    code = gains.main(["--ledger", str(ledger), "--results", str(tmp_path / "no_results")])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


@pytest.mark.parametrize("text", ["", "\n\n", "garbage\n{not json\n[1, 2]\n",
                                  _record(time="garbage")])
def test_an_empty_or_corrupt_ledger_fails_in_one_line(gains, capsys, tmp_path, text):
    code, out, err = _run(gains, capsys, tmp_path, text)
    assert code == 1 and out == "" and len(err) == 1, (code, out, err)
    assert err[0].startswith("readme_gains: ") and "no record fit to publish" in err[0]


def test_corrupt_records_are_skipped_with_a_line_each(gains, capsys, tmp_path):
    text = (_record(value=9, time="2026-01-02T03:04:05+00:00")
            + _record(value=3, time="1987-13-45 garbage")  # the newest, were its date one
            + _record(value=4, time="2999-01-01T00:00:00+00:00")
            + _record(notebook="02_capacity_and_dropping", step="capacity cf1", metric="dropped_frac",
                      value=-0.25, unit="fraction")
            + "{torn")
    code, out, err = _run(gains, capsys, tmp_path, text)
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("| 01_naive_moe"))
    assert "| 9 syncs |" in row and "2026-01-02" in row
    share = next(line for line in out.splitlines() if line.startswith("| 02_capacity_and_dropping"))
    assert "not measured yet" in share and "-25" not in out
    assert len(err) == 4 and all(line.startswith("readme_gains: ") for line in err), err
    assert "'1987-13-45 garbage' is not a date" in err[1] and "in the future" in err[2]
    assert "a fraction of -0.25, outside [0, 1]" in err[3] and "line 5" in err[0]
