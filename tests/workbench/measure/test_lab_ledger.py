"""A notebook run by hand in JupyterLab records to its own ledger, tagged: it never replaces
the workbook's figures that later notebooks, RESULTS.md and the site read."""

from __future__ import annotations

from moe_lab.workbench.measure import ledger


def test_a_lab_run_records_to_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv(ledger.RESULTS_ENV, str(tmp_path))
    monkeypatch.delenv(ledger.PROFILE_ENV, raising=False)
    ledger.record("01_naive_moe", "naive", "syncs_per_step", 8, "syncs", hardware="cpu:test")
    monkeypatch.setattr(ledger, "lab_session", lambda: True)
    lab = ledger.record("01_naive_moe", "naive", "syncs_per_step", 9, "syncs", hardware="cpu:test")
    assert lab["source"] == "lab"
    workbook = ledger.read(tmp_path / ledger.LEDGER_NAME)
    assert [r["value"] for r in workbook] == [8]  # the workbook's ledger is untouched
    assert [r["value"] for r in ledger.read(tmp_path / ledger.LAB_LEDGER_NAME)] == [9]
    assert [r["value"] for r in ledger.read()] == [8, 9]  # the Lab session sees both
    assert ledger.workbook_records(ledger.read()) == workbook


def test_the_workbook_runner_and_headless_runs_are_not_lab_sessions(monkeypatch):
    monkeypatch.setenv(ledger.PROFILE_ENV, "smoke")
    assert not ledger.lab_session()
    monkeypatch.delenv(ledger.PROFILE_ENV)
    monkeypatch.setenv(ledger.HEADLESS_ENV, "1")
    assert not ledger.lab_session()
    monkeypatch.delenv(ledger.HEADLESS_ENV)
    assert not ledger.lab_session()  # plain Python: no Jupyter kernel
