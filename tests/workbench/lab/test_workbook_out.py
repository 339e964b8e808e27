"""The workbook runner refuses, before running anything, a build folder or ledger folder it
cannot write: it ran every notebook and then lost the results (or raised a traceback)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from support import mounted_tmpfs

from moe_lab.workbench.lab import workbook


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "moe-lab"\nversion = "0"\n')
    (tmp_path / "notebooks").mkdir()
    cell = nbformat.v4.new_code_cell("raise SystemExit('this notebook must never run')")
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), tmp_path / "notebooks" / "00_x.ipynb")
    return tmp_path


@pytest.fixture
def read_only_folder():
    """A read-only tmpfs (read-only for root too)."""
    with mounted_tmpfs("ro,size=64k") as folder:
        yield folder


def test_an_out_folder_that_cannot_exist_is_refused_first(project, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    where = blocker / "out" / "workbook"
    with pytest.raises(ValueError, match=f"out: {where} cannot be written .*nothing was run"):
        workbook.run_workbook(root=project, out=blocker / "out", results_dir=tmp_path / "r",
                              progress=False)


def test_a_read_only_out_or_ledger_is_refused_first(project, tmp_path, read_only_folder):
    with pytest.raises(ValueError, match="out: .* cannot be written .*nothing was run"):
        workbook.run_workbook(root=project, out=read_only_folder, results_dir=tmp_path / "r",
                              progress=False)
    with pytest.raises(ValueError, match=r"results_dir \(\$MOE_LAB_RESULTS_DIR\): .* cannot be written"):
        workbook.run_workbook(root=project, out=tmp_path / "b", results_dir=read_only_folder,
                              progress=False)
