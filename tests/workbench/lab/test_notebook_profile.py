"""Every notebook refuses a ``PROFILE`` it does not know in its setup cell (the code cell
right after the ``parameters`` cell), through `moe_lab.workbench.lab.profiles.check_profile` — a typo
in ``papermill -p PROFILE ...`` must not silently run the full profile."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _setup_cell_index(nb) -> int:
    params = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "one cell tagged 'parameters'"
    return params[0] + 1


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_the_setup_cell_checks_profile(notebook):
    nb = nbformat.read(notebook, as_version=4)
    cell = nb.cells[_setup_cell_index(nb)]
    assert cell.cell_type == "code"
    assert "from moe_lab.workbench.lab.profiles import check_profile" in cell.source
    assert "check_profile(PROFILE)" in cell.source


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_a_bogus_profile_stops_the_setup_cell():
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    path = ROOT / "notebooks" / "08_pipeline_layout.ipynb"
    nb = parameterize_notebook(load_notebook_node(str(path)), {"PROFILE": "bogus"})
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
