"""Every workbook notebook executes headless — and stops at its first exercise when unsolved.

Parametrized over ``notebooks/NN_*.ipynb`` as found on disk, so a new notebook is tested
the moment it is added. Each notebook runs once, in one kernel, ``PROFILE="smoke"``, with
the parameters injected the way papermill injects them:

1. with ``SOLUTIONS=False`` every cell before the first cell tagged ``exercise`` must run
   cleanly, and that cell must fail with ``ExerciseError`` — an unsolved exercise never
   passes a headless run;
2. then ``SOLUTIONS = True`` is set in the same kernel and the notebook continues from that
   exercise cell to the end, every cell succeeding.

One kernel session for both checks halves the cost of running each notebook twice; the
cells before the first exercise do not read ``SOLUTIONS``. The smoke budget is 90 s on a
2-core CPU; a slower notebook is a warning, not a failure, since CI machines vary.
``make workbook`` runs the notebooks separately with papermill, ``SOLUTIONS=True``.
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

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
SMOKE_BUDGET_S = 90.0

pytestmark = [pytest.mark.slow, pytest.mark.notebook, pytest.mark.timeout(400)]


def _error_text(cell) -> str:
    for out in cell.get("outputs", []):
        if out.output_type == "error":
            return f"{out.ename}: {out.evalue}\n" + "\n".join(out.traceback[-6:])
    return "(no error output)"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_stops_at_exercise_then_runs_with_solutions(notebook, tmp_path, monkeypatch,
                                                             record_property):
    monkeypatch.setenv("MOE_LAB_PROFILE", "smoke")
    nb = parameterize_notebook(load_notebook_node(str(notebook)),
                               {"PROFILE": "smoke", "SOLUTIONS": False})
    exercises = [i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and "exercise" in c.metadata.get("tags", [])]
    assert exercises, f"{notebook.name} has no cell tagged 'exercise'"
    first = exercises[0]
    client = NotebookClient(nb, kernel_name="python3", timeout=300, allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    start = time.perf_counter()
    try:
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                if index < first:
                    try:
                        client.execute_cell(cell, index)
                    except CellExecutionError:
                        pytest.fail(f"{notebook.name}: cell {index} failed before the first "
                                    f"exercise with SOLUTIONS=False:\n{cell.source}\n"
                                    f"{_error_text(cell)}")
                elif index == first:
                    with pytest.raises(CellExecutionError) as unsolved:
                        client.execute_cell(cell, index)
                    assert "ExerciseError" in str(unsolved.value), (
                        f"{notebook.name}: the first exercise should fail with ExerciseError "
                        f"when SOLUTIONS=False; got:\n{_error_text(cell)}")
                    switch = nbformat.v4.new_code_cell("SOLUTIONS = True")
                    client.execute_cell(switch, index)
                    cell.outputs = []
                    client.execute_cell(cell, index)
                else:
                    try:
                        client.execute_cell(cell, index)
                    except CellExecutionError:
                        pytest.fail(f"{notebook.name}: cell {index} failed with SOLUTIONS=True:"
                                    f"\n{cell.source}\n{_error_text(cell)}")
    finally:
        nbformat.write(nb, tmp_path / notebook.name)
    seconds = time.perf_counter() - start
    record_property("wall_s", round(seconds, 1))
    print(f"{notebook.name}: {seconds:.1f} s")
    if seconds > SMOKE_BUDGET_S:
        warnings.warn(f"{notebook.name} took {seconds:.0f} s with PROFILE='smoke'; the budget "
                      f"is {SMOKE_BUDGET_S:.0f} s on a 2-core CPU", UserWarning, stacklevel=1)
