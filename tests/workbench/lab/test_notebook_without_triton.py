"""A notebook on a machine without Triton (macOS, Windows) runs to its end: its setup cell says
Triton is absent, each cell marked ``# needs Triton`` prints what it needs instead of running,
and every other cell runs on PyTorch. Notebooks 04-07 (their set-up through
`interpret_without_cuda`) and 08 (`label_triton_cells`), through the workbook runner, with
Triton hidden from the runner and its kernel (`support.without_triton`)."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from support import without_triton

from moe_lab.workbench.lab.triton_mode import NEEDS_TRITON

ROOT = Path(__file__).resolve().parents[3]
# Each notebook, and a line one of its PyTorch cells prints after its first Triton cell.
RAN_AFTER = {"04_dropless_sync_free": "inline permute → grouped GEMM → unpermute == dropless layer",
             "05_fused_router": "imbalance",
             "06_mxfp8_attention": "bytes per attention forward",
             "07_fused_grouped_gemm": "of the unfused chain's time is in the stages the fusions remove",
             "08_cuda_graphs": "host syncs in 5 consecutive steps"}


def _text(cell) -> str:
    outputs = cell.get("outputs", [])
    return "".join(out.get("text", "") for out in outputs if out.get("output_type") == "stream")


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.parametrize("notebook", sorted(RAN_AFTER))
def test_a_notebook_runs_to_its_end_with_its_triton_cells_labelled(notebook, tmp_path):
    env = {**without_triton(tmp_path / "hide"), "MOE_LAB_RESULTS_DIR": str(tmp_path / "results")}
    done = subprocess.run([sys.executable, "-m", "moe_lab", "workbook", "--only", notebook, "--no-html",
                           "--out", str(tmp_path / "build")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    executed = nbformat.read(tmp_path / "build" / "workbook" / f"{notebook}.ipynb", as_version=4)
    code = [cell for cell in executed.cells if cell.cell_type == "code"]
    marked = [i for i, cell in enumerate(code) if cell.source.lstrip().startswith(NEEDS_TRITON)]
    assert marked, f"{notebook} has no cell marked {NEEDS_TRITON!r}"
    for i in marked:
        printed = _text(code[i]).strip()  # the label, one line, and nothing of the cell's own
        assert printed.startswith("this cell was skipped: it needs Triton, which installs on Linux only")
        assert "\n" not in printed, (code[i].source, printed)
    assert any("Triton is not installed here" in _text(cell) for cell in code[:4])
    errors = [out for cell in code for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert errors == []
    # The cells after them ran.
    assert any(RAN_AFTER[notebook] in _text(cell) for cell in code[marked[0] + 1:]), RAN_AFTER[notebook]
