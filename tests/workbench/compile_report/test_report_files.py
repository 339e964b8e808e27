"""``python -m moe_lab compile`` never loses a good report (issue 47): a ``--modules`` typo is
refused before anything is compiled or written, naming the modules it knows; a report with
failed rows is written beside the good one, never over it; and a report is written whole or
not at all."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_lab.__main__ import main
from moe_lab.workbench.compile_report import report as compile_report


def _report(error: str | None = None) -> dict:
    """A one-row report for sm_90: a compiled row, or an error row."""
    row = {"kernel": "moe_lab.kernels.permute:_k", "label": "demo", "arch": "sm_90", "error": error}
    if error is None:
        row.update(gpu="H200 SXM", registers=40, spill_bytes=0, shared_bytes=0, blocks_per_sm=16,
                   warps_per_sm=64, limiter="warps", mma_kinds=[], async_copy="none",
                   copies={"max_pending_groups": 0}, num_stages=3, compile_s=0.1, agree=True,
                   blocks={"BLOCK": 64}, num_warps=4, mma_class="none")
    return {"archs": ["sm_90"], "triton": "test", "compiled_on": "test",
            "limits": {"sm_90": {"gpu": "H200 SXM", "registers_per_sm": 65536, "max_warps_per_sm": 64,
                                 "max_blocks_per_sm": 32, "shared_per_sm": 228 * 1024}},
            "rows": [row]}


@pytest.fixture
def good_report(tmp_path):
    """A folder holding a good report, and its files' contents."""
    compile_report.write_results(_report(), tmp_path)
    return tmp_path, {p.name: p.read_bytes() for p in tmp_path.iterdir()}


def test_a_modules_typo_is_refused_at_once_naming_the_known_modules(capsys, monkeypatch, good_report,
                                                                    tmp_path):
    out, before = good_report

    def compiles(*args, **kwargs):
        pytest.fail("compiled before checking --modules")

    monkeypatch.setattr(compile_report, "run_in_child", compiles)
    monkeypatch.setenv("MOE_LAB_RESULTS_DIR", str(tmp_path / "results"))
    start = time.monotonic()
    code = main(["compile", "--arch", "sm_90", "--modules", "permut", "--out", str(out)])
    assert code == 2 and time.monotonic() - start < 5
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "moe_lab.kernels.permut'" in lines[0], lines
    assert "known: " in lines[0] and "permute" in lines[0] and "grouped_gemm" in lines[0]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    code = main(["compile", "--arch", "sm_90", "--modules", "permute,permute", "--out", str(out)])
    assert code == 2 and "more than once" in capsys.readouterr().err
    code = main(["compile", "--arch", "sm_90", "--modules", "", "--out", str(out)])  # not "all of them"
    assert code == 2 and "known: " in capsys.readouterr().err


def test_a_report_with_failed_rows_goes_beside_the_good_one(capsys, monkeypatch, good_report, tmp_path):
    out, before = good_report
    monkeypatch.setattr(compile_report, "compile_report",
                        lambda archs, modules=None: _report(error="ptxas died"))
    monkeypatch.setenv("MOE_LAB_RESULTS_DIR", str(tmp_path / "results"))
    assert main(["compile", "--arch", "sm_90", "--modules", "permute", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"wrote {out / 'summary.failed.md'}" in err and "ptxas died" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in before} == before
    failed = json.loads((out / "sm_90.failed.json").read_text())
    assert failed["rows"][0]["error"] == "ptxas died"
    # A good report again: it replaces the old one and removes the failed one beside it.
    compile_report.write_results(_report(), out)
    assert sorted(p.name for p in out.iterdir()) == ["sm_90.json", "summary.md"]


def test_a_report_is_replaced_whole_or_not_at_all(monkeypatch, good_report):
    """A write that fails half-way (a full disk, Ctrl-C) replaced sm_90.json and left the old
    summary.md beside it."""
    out, before = good_report

    def summary(report):
        raise KeyboardInterrupt

    monkeypatch.setattr(compile_report, "summary_markdown", summary)
    report = _report()
    report["rows"][0]["registers"] = 255
    with pytest.raises(KeyboardInterrupt):
        compile_report.write_results(report, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # and no temporary left
    real_write = Path.write_text

    def full_disk(path, text, *args, **kwargs):  # the disk fills up while summary.md is written
        if "summary.md" in path.name:
            raise OSError(28, "No space left on device")
        return real_write(path, text, *args, **kwargs)

    monkeypatch.undo()
    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError):
        compile_report.write_results(report, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_interrupted_compile_leaves_no_child_behind(monkeypatch):
    """Ctrl-C (or any error) while the compile child runs kills it: no orphaned compile."""
    killed = []

    class Child:  # a compile process that the parent is interrupted while reading
        returncode = None

        def __init__(self, *args, **kwargs):
            self.stdout = self

        def __iter__(self):
            raise KeyboardInterrupt

        def poll(self):
            return None if not killed else -9

        def kill(self):
            killed.append(True)

        def wait(self):
            return -9

    monkeypatch.setattr(compile_report.subprocess, "Popen", Child)
    with pytest.raises(KeyboardInterrupt):
        compile_report.run_in_child({"archs": ["sm_90"]})
    assert killed == [True]


def test_a_modules_typo_is_refused_before_torch_or_triton_is_imported(tmp_path):
    """The refusal comes in the first second: the command's parser alone is built, and the
    modules are checked against the specs folder before any heavy import."""
    code = ("import sys\nfrom moe_lab.workbench.cli import main\n"
            f"rc = main(['compile', '--modules', 'permut', '--out', {str(tmp_path / 'out')!r}])\n"
            "print(rc, 'torch' in sys.modules, 'triton' in sys.modules)")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False", "False"], done.stdout + done.stderr
    assert "known: " in done.stderr and time.monotonic() - start < 10  # a loaded machine's margin
    assert not (tmp_path / "out").exists()
