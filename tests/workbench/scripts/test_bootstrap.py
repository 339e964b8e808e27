"""scripts/bootstrap.py, the hosted-notebook route: moe_lab installs beside a Python's own torch
without reinstalling it, and reports the path each notebook takes. Here the "hosted" Python is a
fresh virtual environment that sees this one's packages (torch, triton, the notebook tooling) the
way a hosted image's Python sees its own: a ``.pth`` line to their site-packages."""

import importlib.util
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _checkout(tmp_path: Path) -> Path:
    """What a learner clones (the files the script reads), copied so the checkout is untouched."""
    copy = tmp_path / "moe_lab"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, copy / name)
    for folder in ("moe_lab", "notebooks"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "bootstrap.py", copy / "scripts" / "bootstrap.py")
    return copy


def _wheel_check():
    """scripts/wheel_check.py, whose fresh environment beside this Python's packages stands in
    for a hosted image's Python."""
    spec = importlib.util.spec_from_file_location("wheel_check", ROOT / "scripts" / "wheel_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_moe_lab_installs_beside_the_pythons_own_torch_and_reports_each_notebook(tmp_path):
    checkout = _checkout(tmp_path)
    python, purelib = _wheel_check().env_beside_this_python(tmp_path / "hosted")
    import torch

    done = subprocess.run([str(python), str(checkout / "scripts" / "bootstrap.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert f"1. torch {torch.__version__}" in out
    assert "3. torch untouched" in out and "torch changed" not in done.stderr
    # Neither torch nor triton landed in the hosted environment; moe_lab did, from the checkout.
    assert not (purelib / "torch").exists() and not (purelib / "triton").exists()
    ask = "import moe_lab, torch; print(moe_lab.__file__); print(torch.__file__)"
    where = subprocess.run([str(python), "-c", ask], cwd=tmp_path, capture_output=True, text=True,
                           check=True)
    moe_lab_file, torch_file = where.stdout.split()
    assert Path(moe_lab_file).is_relative_to(checkout) and torch_file == torch.__file__
    notebooks = sorted(p.stem for p in (checkout / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert sorted(rows) == notebooks, out
    assert "Triton kernels" in rows["03_triton_from_zero"] and "MXFP8" in rows["06_mxfp8_attention"]
    assert "Triton" not in rows["01_naive_moe"], rows["01_naive_moe"]


def test_a_python_without_torch_is_told_where_to_go(tmp_path):
    bare = tmp_path / "bare"
    venv.EnvBuilder(with_pip=False).create(bare)
    script = str(ROOT / "scripts" / "bootstrap.py")
    done = subprocess.run([str(bare / "bin" / "python"), script], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "this Python has no torch" in done.stderr and "Where to run it" in done.stderr
    assert "Traceback" not in done.stderr
