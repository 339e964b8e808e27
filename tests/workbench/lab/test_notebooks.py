"""Every workbook notebook executes headless in learner mode — and every check passes.

Parametrized over the notebooks the workbook runs, as found on disk, so a new notebook is tested
the moment it is added. Each notebook runs once, in one kernel, ``PROFILE="smoke"``, with
the parameters injected the way papermill injects them, ``SOLUTIONS=False`` — what a
learner who has solved nothing yet gets:

1. every cell runs to the end of the notebook; each exercise cell (tagged ``exercise``)
   reports that its exercise is not done yet, and the cells after it run on the reference
   solution it hands back;
2. right after each exercise cell, ``SOLUTIONS = True`` is set in the same kernel and the
   cell runs again: its check must pass on the reference solution (nothing reported as
   not done); then ``SOLUTIONS = False`` again for the cells that follow.

One kernel session for both halves the cost of running each notebook twice. The smoke
budget is 90 s on a 2-core CPU; a slower notebook is a warning, not a failure, since CI
machines vary. ``make workbook`` runs the notebooks separately with papermill,
``SOLUTIONS=True``.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from papermill.iorw import load_notebook_node
from papermill.parameterize import parameterize_notebook

from moe_lab.workbench.lab.notebook_files import NOTEBOOK_PATTERN

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS_DIR = ROOT / "notebooks"
# The notebooks the workbook runs (`moe_lab.workbench.lab.workbook`), by its own pattern.
NOTEBOOKS = sorted(p for p in NOTEBOOKS_DIR.glob("*.ipynb") if NOTEBOOK_PATTERN.match(p.name))
SMOKE_BUDGET_S = 90.0
NOT_DONE = "is not done yet"  # what moe_lab.workbench.exercises.not_done_message prints

pytestmark = [pytest.mark.slow, pytest.mark.notebook, pytest.mark.timeout(400)]


def _error_text(cell) -> str:
    for out in cell.get("outputs", []):
        if out.output_type == "error":
            return f"{out.ename}: {out.evalue}\n" + "\n".join(out.traceback[-6:])
    return "(no error output)"


def _stdout(cell) -> str:
    return "".join(out.get("text", "") for out in cell.get("outputs", [])
                   if out.output_type == "stream")


def _run(client, cell, index, notebook, what):
    if cell.cell_type == "code":
        cell.outputs = []
    try:
        client.execute_cell(cell, index)
    except CellExecutionError:
        pytest.fail(f"{notebook.name}: cell {index} failed {what}:\n{cell.source}\n{_error_text(cell)}")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_unsolved_to_the_end_and_every_check_passes(notebook, tmp_path, monkeypatch,
                                                                    record_property):
    monkeypatch.setenv("MOE_LAB_PROFILE", "smoke")
    nb = parameterize_notebook(load_notebook_node(str(notebook)),
                               {"PROFILE": "smoke", "SOLUTIONS": False})
    exercises = [i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and "exercise" in c.metadata.get("tags", [])]
    assert exercises, f"{notebook.name} has no cell tagged 'exercise'"
    client = NotebookClient(nb, kernel_name="python3", timeout=300, allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    solved = nbformat.v4.new_code_cell("SOLUTIONS = True")
    unsolved = nbformat.v4.new_code_cell("SOLUTIONS = False")
    start = time.perf_counter()
    try:
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                if index not in exercises:
                    _run(client, cell, index, notebook, "with SOLUTIONS=False")
                    continue
                # As the learner finds it: the stub, unsolved.
                _run(client, cell, index, notebook, "with SOLUTIONS=False (an exercise not done "
                     "must be reported, not raised)")
                assert NOT_DONE in _stdout(cell), (
                    f"{notebook.name}: exercise cell {index} should report that the exercise "
                    f"{NOT_DONE!r} with SOLUTIONS=False; it printed:\n{_stdout(cell)}")
                learner_outputs = cell.outputs
                # With the reference solutions the check must pass.
                client.execute_cell(solved, index)
                _run(client, cell, index, notebook, "with SOLUTIONS=True (the check of the "
                     "reference solution)")
                assert NOT_DONE not in _stdout(cell), (
                    f"{notebook.name}: exercise cell {index} reports an exercise not done with "
                    f"SOLUTIONS=True:\n{_stdout(cell)}")
                client.execute_cell(unsolved, index)
                cell.outputs = learner_outputs
                nb.cells[index] = cell  # execute_cell put the switch there
    finally:
        nbformat.write(nb, tmp_path / notebook.name)
    seconds = time.perf_counter() - start
    record_property("wall_s", round(seconds, 1))
    print(f"{notebook.name}: {seconds:.1f} s")
    if seconds > SMOKE_BUDGET_S:
        warnings.warn(f"{notebook.name} took {seconds:.0f} s with PROFILE='smoke'; the budget "
                      f"is {SMOKE_BUDGET_S:.0f} s on a 2-core CPU", UserWarning, stacklevel=1)
