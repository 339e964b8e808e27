"""The site's pages are honest and short, for every notebook's own exercises.

``make workbook`` runs every notebook with ``SOLUTIONS=True``: each exercise's check runs the
reference solution and prints ``✓`` under the learner's stub, still unsolved. A page must
never show that ``✓``: it says "not done — the reference ran in its place". A progress bar
(one stream output per redraw in a headless run) renders as one block showing its last
line, and no output longer than a screen (`moe_lab.workbench.lab.page_outputs.FOLD_LINES`
lines) is left unfolded.

Running the notebooks takes minutes, so this check builds, for each notebook, the page
such a run would give: its parameters cell, the cell papermill injects, and its exercise
cells as they are committed (the stubs), each with the ``✓`` line its check prints for the
reference; then a cell with a text progress bar as nbclient saves it, and one with a long
listing. The page is rendered by the site's own `render_page` and read as HTML.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from moe_lab.workbench.lab import page_outputs, site

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*.ipynb"))
# The answer each check is called on: ``x = check_x(answer, ..., solutions=SOLUTIONS)``.
CHECKED = re.compile(r"\bcheck_\w+\s*\(\s*([A-Za-z_]\w*)")
NOT_DONE = "not done — the reference ran in its place"


def _code(source: str, outputs=(), tags=()):
    cell = nbformat.v4.new_code_cell(source, execution_count=1)
    cell.outputs = list(outputs)
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def _stdout(text: str):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def executed_as_the_workbook_runs_it(path: Path):
    """The page-relevant cells of ``path`` as ``make workbook`` leaves them (see the module
    docstring), and how many checks its exercise cells call."""
    nb = nbformat.reads(path.read_text(encoding="utf-8"), as_version=4)
    cells, checks = [], 0
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.cell_type != "code":
            continue
        if "parameters" in tags:
            cells += [_code(cell.source, tags=["parameters"]),
                      _code('# Parameters\nPROFILE = "smoke"\nSOLUTIONS = True\n',
                            tags=["injected-parameters"])]
        elif "exercise" in tags:
            answers = CHECKED.findall(cell.source)
            checks += len(answers)
            cells.append(_code(cell.source, [_stdout("".join(f"✓ {name} is correct\n"
                                                             for name in answers))], ["exercise"]))
    bar = [_stdout(f"\rtrain tiny: {n:3d}%|{'#' * (n // 10):<10}| {n}/100 [00:01<00:00, 50.0it/s]")
           for n in range(0, 101, 4)] + [_stdout("\n")]
    cells.append(_code("result = train(cfg)", bar))
    listing = "".join(f"kernel row {i:3d} | regs 128 | spills 0\n" for i in range(137))
    cells.append(_code("print(compile_table)", [_stdout(listing)]))
    page = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# {path.stem}"), *cells])
    page.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                   "language": "python"}
    return page, checks


def _outputs(page: str) -> list[str]:
    """The text of each output block of ``page`` outside ``<details>``."""
    unfolded = re.sub(r"<details\b.*?</details>", "", page, flags=re.S)
    blocks = re.findall(r'<div class="[^"]*jp-OutputArea-output[^"]*"[^>]*>(.*?)</div>', unfolded,
                        flags=re.S)
    return [re.sub(r"<[^>]+>", "", block) for block in blocks]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_page_of_a_workbook_run_is_honest_and_short(path):
    nb, checks = executed_as_the_workbook_runs_it(path)
    assert checks, f"{path.name}: no exercise cell calls a check"
    page = site.render_page(nb)
    outputs = _outputs(page)
    ticks = [text for text in outputs if "✓" in text]
    assert not ticks, (f"{path.name}: the page shows ✓ under an unsolved stub (the reference "
                       f"passed its check): {ticks}")
    assert page.count(NOT_DONE) == checks, f"{path.name}: expected {checks} × {NOT_DONE!r}"
    bars = [text for text in outputs if "it/s" in text]
    assert len(bars) == 1 and bars[0].strip().count("\n") == 0 and "100/100" in bars[0], bars
    longest = max(len(text.strip("\n").split("\n")) for text in outputs if text.strip())
    assert longest <= page_outputs.FOLD_LINES, (
        f"{path.name}: an output of {longest} lines is not folded into <details>")
    assert "137 lines of output" in page


def test_every_exercise_cell_holds_a_stub_the_site_recognises():
    """The page says "not done" only where it sees a stub: every committed exercise cell
    must hold one (``return not_done()``, or a Triton stub's static assert)."""
    missing = []
    for path in NOTEBOOKS:
        for index, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
            source = "".join(cell.get("source", ""))
            if "exercise" in cell.get("metadata", {}).get("tags", []) and not \
                    page_outputs.is_unsolved_stub(source):
                missing.append(f"{path.stem} cell {index}")
    assert not missing, f"exercise cells without a recognised stub: {missing}"
