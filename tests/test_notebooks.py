"""Every workbook notebook executes headless — and stops at its first exercise when unsolved.

Parametrized over ``notebooks/NN_*.ipynb`` as found on disk, so a new notebook is tested
the moment it is added. Each is executed twice with papermill, ``PROFILE="smoke"``:

- ``SOLUTIONS=True``: every cell must run (the smoke budget is 90 s on a 2-core CPU; a
  slower notebook is a warning, not a failure, since CI machines vary);
- ``SOLUTIONS=False``: it must stop with ``ExerciseError`` exactly at the first cell
  tagged ``exercise``, every cell before it having run cleanly — so an unsolved exercise
  can never pass a headless run.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import nbformat
import papermill
import pytest
from papermill.exceptions import PapermillExecutionError, strip_color

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
SMOKE_BUDGET_S = 90.0

pytestmark = [pytest.mark.slow, pytest.mark.notebook, pytest.mark.timeout(300)]


def _execute(notebook: Path, output: Path, solutions: bool) -> None:
    papermill.execute_notebook(
        str(notebook),
        str(output),
        parameters={"PROFILE": "smoke", "SOLUTIONS": solutions},
        kernel_name="python3",
        cwd=str(NOTEBOOKS_DIR),
        progress_bar=False,
    )


def _describe(error: PapermillExecutionError) -> str:
    traceback = strip_color("\n".join(error.traceback[-8:]))
    return (
        f"{error.ename}: {error.evalue}\n"
        f"in cell {error.cell_index} (In [{error.exec_count}]):\n{error.source}\n{traceback}"
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_with_solutions(notebook, tmp_path, monkeypatch, record_property):
    monkeypatch.setenv("MOE_LAB_PROFILE", "smoke")
    start = time.perf_counter()
    try:
        _execute(notebook, tmp_path / notebook.name, solutions=True)
    except PapermillExecutionError as error:
        pytest.fail(f"{notebook.name} failed with SOLUTIONS=True: {_describe(error)}")
    seconds = time.perf_counter() - start
    record_property("wall_s", round(seconds, 1))
    if seconds > SMOKE_BUDGET_S:
        warnings.warn(
            f"{notebook.name} took {seconds:.0f} s with PROFILE='smoke'; "
            f"the budget is {SMOKE_BUDGET_S:.0f} s on a 2-core CPU",
            UserWarning,
            stacklevel=1,
        )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_stops_at_the_first_exercise_without_solutions(notebook, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_LAB_PROFILE", "smoke")
    output = tmp_path / notebook.name
    try:
        _execute(notebook, output, solutions=False)
    except PapermillExecutionError as error:
        assert error.ename == "ExerciseError", (
            f"{notebook.name} with SOLUTIONS=False should stop with ExerciseError at its "
            f"first exercise; it failed with {_describe(error)}"
        )
    else:
        pytest.fail(f"{notebook.name} ran to the end with SOLUTIONS=False: no check raised")

    # Code cells only: papermill adds markdown cells pointing at the error.
    cells = [cell for cell in nbformat.read(output, as_version=4).cells if cell.cell_type == "code"]
    exercises = [i for i, cell in enumerate(cells) if "exercise" in cell.metadata.get("tags", [])]
    assert exercises, f"{notebook.name} has no cell tagged 'exercise'"
    first = exercises[0]
    failed = [
        i
        for i, cell in enumerate(cells)
        if any(item.output_type == "error" for item in cell.get("outputs", []))
    ]
    assert failed == [first], (
        f"{notebook.name}: expected the only error in code cell {first} (the first tagged "
        f"'exercise'), got errors in code cells {failed}"
    )
    not_run = [
        i
        for i, cell in enumerate(cells[:first])
        if cell.source.strip() and cell.execution_count is None  # empty cells are skipped
    ]
    assert not_run == [], f"{notebook.name}: code cells {not_run} before the exercise did not run"
