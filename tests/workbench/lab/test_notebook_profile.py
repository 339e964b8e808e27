"""Every notebook refuses a mistyped parameter in its setup cell (the code cell right after
the ``parameters`` cell), through `moe_lab.workbench.lab.profiles.check_parameters`: a typo in
``papermill -p PROFILE ...`` must not silently run the full profile, nor ``-p SOLUTIONS false``
(a string, so truthy) silently replace the learner's answers by the reference."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from moe_lab.workbench.lab.notebook_files import NOTEBOOK_PATTERN
from moe_lab.workbench.lab.profiles import check_parameters

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if NOTEBOOK_PATTERN.match(p.name))


def _setup_cell_index(nb) -> int:
    params = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "one cell tagged 'parameters'"
    return params[0] + 1


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_the_setup_cell_checks_the_parameters(notebook):
    nb = nbformat.read(notebook, as_version=4)
    params = nb.cells[_setup_cell_index(nb) - 1].source
    cell = nb.cells[_setup_cell_index(nb)]
    assert cell.cell_type == "code"
    assert "from moe_lab.workbench.lab.profiles import check_parameters" in cell.source
    assert "check_parameters(PROFILE, SEED, SOLUTIONS" in cell.source
    # Every other parameter the notebook takes is checked there too.
    names = {line.split("=")[0].strip() for line in params.splitlines() if "=" in line.split("#")[0]}
    for name in sorted(names - {"PROFILE", "SEED", "SOLUTIONS"}):
        assert f"{name}={name}" in cell.source, name


@pytest.mark.parametrize("profile, seed, solutions, counts, message", [
    ("smok", 0, True, {}, "PROFILE must be one of 'smoke', 'full', got 'smok'"),
    ("smoke", "abc", True, {}, "SEED must be an integer, got 'abc'"),
    ("smoke", 1.5, True, {}, "SEED must be an integer"),
    ("smoke", 0, "false", {}, "SOLUTIONS must be True or False, got 'false' .*-p SOLUTIONS False"),
    ("smoke", 0, 0, {}, "SOLUTIONS must be True or False, got 0"),
    ("smoke", 0, False, {"THREADS": -1}, "THREADS must be a non-negative integer, got -1"),
    ("smoke", 0, False, {"THREADS": "2"}, "THREADS must be a non-negative integer"),
])
def test_check_parameters_names_the_mistyped_one(profile, seed, solutions, counts, message):
    with pytest.raises(ValueError, match=message):
        check_parameters(profile, seed, solutions, **counts)


def test_check_parameters_takes_what_the_notebooks_default_to():
    check_parameters("smoke", 0, False)
    check_parameters("full", 7, True, THREADS=0)


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_a_bogus_profile_stops_the_setup_cell():
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    path = ROOT / "notebooks" / "10_pipeline_layout.ipynb"
    # What `papermill -p PROFILE bogus -p SOLUTIONS false` injects: the profile is refused first.
    nb = parameterize_notebook(load_notebook_node(str(path)), {"PROFILE": "bogus", "SOLUTIONS": "false"})
    setup = next(i for i, c in enumerate(nb.cells) if "injected-parameters" in
                 c.metadata.get("tags", [])) + 1
    client = NotebookClient(nb, kernel_name="python3", timeout=240,
                            resources={"metadata": {"path": str(path.parent)}})
    with client.setup_kernel():
        for index in range(setup):
            client.execute_cell(nb.cells[index], index)
        with pytest.raises(CellExecutionError, match="PROFILE must be one of 'smoke', 'full', "
                                                     "got 'bogus'"):
            client.execute_cell(nb.cells[setup], setup)
