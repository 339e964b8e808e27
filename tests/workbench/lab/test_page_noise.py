"""The page-noise scan (`moe_lab.workbench.lab.page_noise`) and its allow-list.

The scan runs on every real executed notebook in ``test_notebooks.py`` (the notebooks it
executes anyway); here it is shown to find what it must, on a tiny synthetic executed
notebook, and to let through what it must not flag.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from moe_lab.workbench.lab import page_noise
from moe_lab.workbench.lab.notebook_files import NOTEBOOK_PATTERN

NOTEBOOKS_DIR = Path(__file__).resolve().parents[3] / "notebooks"


def _executed(*cells):
    """A tiny executed notebook: each item (source, outputs) a code cell with its outputs."""
    nb = nbformat.v4.new_notebook()
    for source, outputs in cells:
        cell = nbformat.v4.new_code_cell(source)
        cell.outputs = outputs
        nb.cells.append(cell)
    return nb


def _result(text: str, **more):
    return nbformat.v4.new_output("execute_result", data={"text/plain": text, **more},
                                  execution_count=1)


NOISY = _executed(
    ("x = 1\nprint(x)", [nbformat.v4.new_output("stream", name="stdout", text="1\n")]),
    ("import sys\nsys.stderr.write('oops')", [nbformat.v4.new_output("stream", name="stderr",
                                                                     text="oops\n")]),
    ("# a record\nledger.record(...)", [_result("{'notebook': '00', 'value': 1}")]),
    ("plt.plot([1, 2])", [_result("[<matplotlib.lines.Line2D at 0x7f>]")]),
    ("len(x)", [_result("4")]),
    ("df", [_result("{'a': 1}", **{"text/html": "<table></table>"})]),  # rendered: not raw
    ("counts", [_result("defaultdict(<class 'int'>, {'a': 1})")]),
    ("'{not a dict'", [_result("'{not a dict'")]),  # a string's repr starts with a quote
)


def test_the_scan_finds_stderr_and_raw_dicts_and_lists():
    found = page_noise.scan(NOISY, "99_synthetic")
    assert [(n.cell, n.kind) for n in found] == [
        (1, "stderr"), (2, "raw value"), (3, "raw value"), (6, "raw value")]
    assert found[0].text == "oops\n" and found[0].first_line == "import sys"
    assert found[1].first_line == "ledger.record(...)"  # comments skipped
    assert "99_synthetic cell 1 (stderr): oops" in found[0].describe()


def test_the_check_fails_on_noise_not_allowed_and_passes_on_allowed_noise():
    found = page_noise.scan(NOISY, "99_synthetic")
    assert page_noise.unexpected(found, page_noise.ALLOWED) == found  # none of it is allowed
    allowed = (("99_synthetic", "stderr", "oops", "a test"), ("*", "raw value", "'notebook'", "a test"))
    left = page_noise.unexpected(found, allowed)
    assert [(n.cell, n.kind) for n in left] == [(3, "raw value"), (6, "raw value")]
    other = ("98_other", "stderr", "oops", "another notebook's")
    assert page_noise.unexpected(found[:1], (other,)) == found[:1]


def test_the_known_lines_a_kernel_printed_are_not_noise_and_the_rest_is():
    mark = "USDT:2026-12-06 07:51:07 3394:3394 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    def stderr(text):
        return [nbformat.v4.new_output("stream", name="stderr", text=text)]

    profiled = _executed(("with profile(): step()", stderr(mark)),
                         ("with profile(): step()", stderr(mark + "oops\n")))
    found = page_noise.scan(profiled, "99_synthetic")
    assert [(n.cell, n.kind, n.text) for n in found] == [(1, "stderr", "oops\n")]


def test_a_clean_notebook_has_no_noise():
    clean = _executed(("print('hi')", [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]),
                      ("x", [_result("4")]), ("", []))
    assert page_noise.scan(clean, "00_clean") == []


def _markdown(text: str):
    return nbformat.v4.new_output("display_data", data={"text/markdown": text, "text/plain": "<Markdown>"})


def test_a_table_whose_rows_a_pipe_in_code_splits_is_found():
    head = "| ranks | layout |\n|---:|---|\n"
    tables = _executed(
        ("display(Markdown(t))", [_markdown(head + "| 4 | `Et*16|t*16|mL` |\n")]),  # 3 cells, not 2
        ("display(Markdown(t))", [_markdown(head + "| 4 | `Et*16\\|t*16\\|mL` |\n")]),  # escaped: 2
        ("display(Markdown(t))", [_markdown("a | b\n\n" + head + "| 4 | x |\n\n"  # two sound tables
                                            "| 1 | 2 | 3 |\n|---|---|---|\n")]),
        ("t", [_result("<Markdown>", **{"text/markdown": head + "| 8 |\n"})]),  # a cell short
    )
    found = page_noise.scan(tables, "99_synthetic")
    assert [(n.cell, n.kind) for n in found] == [(0, "table"), (3, "table")]
    assert "Et*16|t*16" in found[0].text and found[0].first_line == "display(Markdown(t))"


@pytest.mark.parametrize("entry", page_noise.ALLOWED, ids=lambda e: f"{e[0]}:{e[2][:30]}")
def test_every_allowed_entry_says_why_and_names_a_notebook_and_a_kind(entry):
    notebook, kind, contains, reason = entry
    stems = {path.stem for path in NOTEBOOKS_DIR.glob("*.ipynb") if NOTEBOOK_PATTERN.match(path.name)}
    assert notebook == "*" or notebook in stems, f"{notebook!r} is not a notebook ({sorted(stems)})"
    assert kind in ("stderr", "raw value", "table")
    assert contains.strip(), "an entry must match some text, not every output"
    assert len(reason.split()) >= 8, f"say why the page may show it: {reason!r}"
