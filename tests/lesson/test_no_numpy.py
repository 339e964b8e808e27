"""On a GPU machine with torch and triton and nothing else installed, moe_lab's compiled path
imports (so ``scripts/gpu_check.py`` runs there): NumPy is needed by Triton's interpreter
(``triton.runtime.interpreter`` imports it), which moe_lab imports only where its kernels run
interpreted, and by the workbook's figures and simulators, not by the kernels, the model, the
training step or the performance models.

A child process hides NumPy (a ``sitecustomize`` puts ``None`` in ``sys.modules["numpy"]``
before anything is imported, so ``import numpy`` raises) and compiles (``TRITON_INTERPRET=0``:
compiled by moe_lab's rule, and nothing needs a GPU to import); Triton itself imports without
NumPy when it compiles (it imports its interpreter only for an interpreted ``@triton.jit``).
A second child, beside it, interprets with NumPy present, so the interpreter's path stays whole.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]



def gpu_check_imports() -> tuple[str, ...]:
    """Every moe_lab module scripts/gpu_check.py imports (``from a.b import c``: ``a.b``, and
    ``a.b.c`` where that is a module), read from its source."""
    tree = ast.parse((ROOT / "scripts" / "gpu_check.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_lab"):
            found.add(node.module)
            folder = ROOT / node.module.replace(".", "/")
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if (folder / f"{a.name}.py").exists() or (folder / a.name).is_dir())
    return tuple(sorted(found))


# Every module of these packages is imported, and these modules besides (gpu_check's own imports).
PACKAGES = ("moe_lab.kernels", "moe_lab.perf", "moe_lab.quant", "moe_lab.moe", "moe_lab.training")
MODULES = ("moe_lab", "moe_lab.config", "moe_lab.model", "moe_lab.attention", *gpu_check_imports())

IMPORTS = r"""
import importlib, json, pkgutil, sys, traceback, warnings

warnings.simplefilter("ignore")  # torch warns that it found no NumPy
out = {"failed": {}}
try:
    import triton, triton.language  # noqa: F401
except ImportError as e:
    out["triton"] = f"{type(e).__name__}: {e}"


def load(name):
    try:
        return importlib.import_module(name)
    except Exception as e:
        frames = [f"{f.filename.rpartition('/moe_lab/')[2] or f.filename}:{f.lineno}"
                  for f in traceback.extract_tb(e.__traceback__) if "/moe_lab/" in f.filename]
        out["failed"][name] = f"{type(e).__name__}: {e} (via {' -> '.join(frames)})"


names = list(MODULES)
for package in PACKAGES:
    names.append(package)
    if (module := load(package)) is not None:
        names += [f"{package}.{m.name}" for m in pkgutil.iter_modules(module.__path__)]
for name in names:
    load(name)
out["modules"] = names
if (gg := load("moe_lab.kernels.grouped_gemm")) is not None:
    out["kernel"] = type(gg._grouped_gemm_kernel).__name__
out["numpy"] = "hidden" if "numpy" in sys.modules and sys.modules["numpy"] is None else "present"
print(json.dumps(out))
"""


def _child(tmp_path: Path, interpret: str, hide_numpy: bool) -> subprocess.Popen:
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    if hide_numpy:
        hide = tmp_path / "hide_numpy"
        hide.mkdir()
        (hide / "sitecustomize.py").write_text('import sys\nsys.modules["numpy"] = None\n')
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hide), str(ROOT), env.get("PYTHONPATH")]))
    code = f"PACKAGES = {PACKAGES!r}\nMODULES = {MODULES!r}\n{IMPORTS}"
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(child: subprocess.Popen) -> dict:
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def test_the_compiled_path_imports_without_numpy_and_the_interpreted_one_with_it(tmp_path):
    children = {"compiled": _child(tmp_path, "0", hide_numpy=True),
                "interpreted": _child(tmp_path, "1", hide_numpy=False)}
    compiled, interpreted = (_result(child) for child in children.values())

    assert compiled["numpy"] == "hidden", "something put NumPy back"
    assert "triton" not in compiled, f"Triton itself needs NumPy to compile: {compiled['triton']}"
    assert compiled["failed"] == {}, "\n".join(f"{k}: {v}" for k, v in compiled["failed"].items())
    assert len(compiled["modules"]) > len(PACKAGES) + len(MODULES)  # the packages' modules were found
    assert {"moe_lab.workbench.measure.autotune", "moe_lab.workbench.benchmarks.moe_layer"} <= set(MODULES)
    assert compiled["kernel"] == "JITFunction"

    assert interpreted["numpy"] == "present"
    assert interpreted["failed"] == {}, "\n".join(f"{k}: {v}" for k, v in interpreted["failed"].items())
    assert interpreted["modules"] == compiled["modules"]
    assert interpreted["kernel"] == "InterpretedFunction"  # Triton's own, under its interpret knob
