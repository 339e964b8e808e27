"""A workbook run prints nothing per notebook that tells its user nothing (issue 47: every
kernel logged "Kernel is running over TCP without encryption"), while what a notebook itself
warns about still shows on its page."""

from pathlib import Path

import nbformat
import pytest

from moe_lab.workbench.lab import workbook

CELLS = ["PROFILE = 'smoke'", "print('ran')",
         "import warnings\nwarnings.warn('moe_lab: a warning of our own')"]


@pytest.mark.timeout(120)
def test_a_notebook_runs_without_the_kernel_transport_warning(tmp_path: Path, capfd):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    notebook.cells[0].metadata["tags"] = ["parameters"]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    source, out = tmp_path / "00_quiet.ipynb", tmp_path / "out.ipynb"
    nbformat.write(notebook, source)
    failure, stopped = workbook._execute_once(source, out, {"PROFILE": "smoke"}, tmp_path, 60)
    assert failure is None and not stopped, failure
    err = capfd.readouterr().err
    assert "without encryption" not in err, err
    outputs = [o for cell in nbformat.read(out, as_version=4).cells for o in cell.get("outputs", [])]
    texts = "".join(o.get("text", "") for o in outputs)
    assert "ran" in texts and "moe_lab: a warning of our own" in texts, outputs
