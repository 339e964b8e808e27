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

3. the executed notebook shows no page noise (`moe_lab.workbench.lab.page_noise`): no stderr
   output and no cell ending in a raw dict or list, except what ``page_noise.ALLOWED``
   accepts, each entry with its reason. The scan reads the notebook this test executed.

One kernel session for both halves the cost of running each notebook twice. The smoke
budget is 90 s on a 2-core CPU; a slower notebook is a warning, not a failure, since CI
machines vary. ``make workbook`` runs the notebooks separately with papermill,
``SOLUTIONS=True``.

No notebook can hang the suite: each cell runs under the workbook's own limit
(`moe_lab.workbench.lab.workbook.cell_timeout_s`: ``CELL_TIMEOUT_FACTOR`` times the smoke
budget); a cell that times out, or a kernel that dies, gets the notebook run once more in a
fresh kernel, and if it stops again the test fails naming the notebook and the cell.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
from papermill.iorw import load_notebook_node
from papermill.parameterize import parameterize_notebook

from moe_lab.workbench.lab import page_noise
from moe_lab.workbench.lab.notebook_files import NOTEBOOK_PATTERN
from moe_lab.workbench.lab.workbook import NOTEBOOK_BUDGET_S, cell_timeout_s

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS_DIR = ROOT / "notebooks"
# The notebooks the workbook runs (`moe_lab.workbench.lab.workbook`), by its own pattern.
NOTEBOOKS = sorted(p for p in NOTEBOOKS_DIR.glob("*.ipynb") if NOTEBOOK_PATTERN.match(p.name))
SMOKE_BUDGET_S = NOTEBOOK_BUDGET_S["smoke"]  # 90 s
CELL_TIMEOUT_S = cell_timeout_s("smoke")  # a stated multiple of it (CELL_TIMEOUT_FACTOR)
NOT_DONE = "is not done yet"  # what an exercise check prints for a stub (exercises.exercise)


class Stopped(Exception):
    """A cell timed out or the kernel died: which cell, and how."""

    def __init__(self, index: int, source: str, how: str):
        super().__init__(f"cell {index} {how}")
        self.index, self.source, self.how = index, source, how


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


def _learner_run(notebook: Path, cwd: Path, timeout: float):
    """One kernel session over ``notebook`` as the module docstring says; the executed
    notebook. A failing check fails the test; a cell that stops raises `Stopped`."""
    nb = parameterize_notebook(load_notebook_node(str(notebook)),
                               {"PROFILE": "smoke", "SOLUTIONS": False})
    exercises = [i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and "exercise" in c.metadata.get("tags", [])]
    client = NotebookClient(nb, kernel_name="python3", timeout=timeout, allow_errors=False,
                            shutdown_kernel="immediate", resources={"metadata": {"path": str(cwd)}})
    solved = nbformat.v4.new_code_cell("SOLUTIONS = True")
    unsolved = nbformat.v4.new_code_cell("SOLUTIONS = False")
    index = 0
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
    except CellTimeoutError as exc:
        raise Stopped(index, nb.cells[index].source, f"took more than {timeout:g} s") from exc
    except DeadKernelError as exc:
        raise Stopped(index, nb.cells[index].source, "killed the kernel") from exc
    return nb, exercises


def run_with_one_restart(notebook: Path, cwd: Path, timeout: float = CELL_TIMEOUT_S):
    """`_learner_run`, once more in a fresh kernel if a cell stopped; a second stop fails
    the test, naming the notebook and the cell."""
    try:
        return _learner_run(notebook, cwd, timeout)
    except Stopped as first:
        warnings.warn(f"{notebook.name}: {first}; running it again in a fresh kernel",
                      UserWarning, stacklevel=1)
    try:
        return _learner_run(notebook, cwd, timeout)
    except Stopped as again:
        pytest.fail(f"{notebook.name}: {again}, again after one kernel restart:\n{again.source}")


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.timeout(int(2 * 3 * CELL_TIMEOUT_S))  # a stopped run and its rerun end first
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_unsolved_to_the_end_and_every_check_passes(notebook, tmp_path, monkeypatch,
                                                                    record_property):
    monkeypatch.setenv("MOE_LAB_PROFILE", "smoke")
    # The kernel runs in notebooks/: it imports this checkout's moe_lab, not an installed one.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    start = time.perf_counter()
    nb, exercises = run_with_one_restart(notebook, NOTEBOOKS_DIR)
    nbformat.write(nb, tmp_path / notebook.name)
    assert exercises, f"{notebook.name} has no cell tagged 'exercise'"
    noise = page_noise.unexpected(page_noise.scan(nb, notebook.stem), page_noise.ALLOWED)
    assert not noise, (f"{notebook.name} shows page noise (stderr, or a cell ending in a raw dict "
                       "or list); fix the cell, or add an entry with its reason to "
                       "moe_lab.workbench.lab.page_noise.ALLOWED:\n"
                       + "\n".join(item.describe() for item in noise))
    seconds = time.perf_counter() - start
    record_property("wall_s", round(seconds, 1))
    print(f"{notebook.name}: {seconds:.1f} s")
    if seconds > SMOKE_BUDGET_S:
        warnings.warn(f"{notebook.name} took {seconds:.0f} s with PROFILE='smoke'; the budget "
                      f"is {SMOKE_BUDGET_S:.0f} s on a 2-core CPU", UserWarning, stacklevel=1)


def _tiny(path: Path, *sources: str) -> Path:
    cells = [nbformat.v4.new_code_cell('PROFILE = "full"\nSOLUTIONS = True')]
    cells[0].metadata["tags"] = ["parameters"]
    cells += [nbformat.v4.new_code_cell(source) for source in sources]
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    nbformat.write(notebook, path)
    return path


@pytest.mark.timeout(120)
def test_a_hanging_cell_fails_naming_the_notebook_and_cell_after_one_restart(tmp_path):
    notebook = _tiny(tmp_path / "00_hangs.ipynb", "x = 1", "import time\ntime.sleep(1e6)")
    start = time.perf_counter()
    with pytest.warns(UserWarning, match="00_hangs.ipynb: cell 3 took more than 2 s; running"):
        with pytest.raises(pytest.fail.Exception) as failed:
            run_with_one_restart(notebook, tmp_path, timeout=2.0)
    message = str(failed.value)
    assert message.startswith("00_hangs.ipynb: cell 3 took more than 2 s, again after one "
                              "kernel restart")  # parameters, injected parameters, x = 1, sleep
    assert "time.sleep(1e6)" in message
    assert time.perf_counter() - start < 90  # two 2 s limits and two kernel starts


@pytest.mark.timeout(120)
def test_a_kernel_that_dies_is_restarted_once_then_named(tmp_path):
    marker = tmp_path / "died-once"
    once = _tiny(tmp_path / "01_dies_once.ipynb", "import os, pathlib\n"
                 f"marker = pathlib.Path({str(marker)!r})\n"
                 "if not marker.exists():\n    marker.touch()\n    os._exit(1)",
                 'print("ran after the restart")')
    with pytest.warns(UserWarning, match="01_dies_once.ipynb: cell 2 killed the kernel"):
        nb, _ = run_with_one_restart(once, tmp_path, timeout=30.0)
    assert "ran after the restart" in _stdout(nb.cells[-1])
    always = _tiny(tmp_path / "02_dies.ipynb", "import os\nos._exit(1)")
    with pytest.warns(UserWarning, match="killed the kernel; running it again"):
        with pytest.raises(pytest.fail.Exception, match=r"02_dies.ipynb: cell 2 killed the "
                           r"kernel, again after one kernel restart:\nimport os"):
            run_with_one_restart(always, tmp_path, timeout=30.0)
