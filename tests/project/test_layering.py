"""The package's two layers, read from the source and checked in fresh processes.

The lesson is ``moe_lab`` outside ``moe_lab.workbench``; the workbench (and ``moe_lab.__main__``,
the command line's door) is the machinery around it. The arrow points one way: no lesson module
imports the workbench, even lazily inside a function or for a type hint. No import cycle exists
anywhere (type-hint-only imports count), no module imports another module's private name, and
``import moe_lab`` changes nothing in the caller's process.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "moe_lab"

WORKBENCH = ("moe_lab.workbench", "moe_lab.__main__")


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def is_lesson(name: str) -> bool:
    return name.startswith("moe_lab") and not _in(name, WORKBENCH)


def _import_nodes(tree: ast.AST, name: str, is_package: bool, modules: dict[str, Path]):
    """``(module imported, names taken from it)`` for every import statement of ``tree``,
    at module level, inside functions and under ``if TYPE_CHECKING:`` alike: the submodule
    itself where ``from X import Y`` names one."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    yield sub, ()
                else:
                    names.append(alias.name)
            if names:
                yield base, tuple(names)


def imports_of(source: str, name: str, is_package: bool = False,
               modules: dict[str, Path] | None = None) -> set[str]:
    """The moe_lab modules a module's source imports."""
    modules = MODULES if modules is None else modules
    found = {m for m, _ in _import_nodes(ast.parse(source), name, is_package, modules)}
    return {m for m in found if m in modules and m != name}


def private_imports(source: str, name: str, is_package: bool = False,
                    modules: dict[str, Path] | None = None) -> list[str]:
    """``module:_name`` for every private name (one leading underscore, not a dunder) that
    ``source`` imports from another moe_lab module."""
    modules = MODULES if modules is None else modules
    bad = []
    for module, names in _import_nodes(ast.parse(source), name, is_package, modules):
        if module.startswith("moe_lab") and module != name:
            bad += [f"{module}:{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    return bad


GRAPH = {name: imports_of(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
         for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def lesson_to_workbench(graph: dict[str, set[str]]) -> list[str]:
    """Every lesson module that reaches the workbench, directly or through other modules."""
    offenders = []
    for name in sorted(graph):
        if not is_lesson(name):
            continue
        seen, todo = set(), [name]
        while todo:
            for dep in graph[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        bad = sorted(m for m in seen if not is_lesson(m))
        if bad:
            offenders.append(f"{name} -> {bad}")
    return offenders


# ---------------------------------------------------------------------------- the checkers


def test_the_walk_sees_both_layers():
    assert {"moe_lab.model", "moe_lab.moe.layer", "moe_lab.workbench.cpu",
            "moe_lab.training.steps", "moe_lab.parallel.ep"} <= set(MODULES)
    assert "moe_lab.moe.experts" in GRAPH["moe_lab.moe.layer"]
    assert "moe_lab.moe.experts" in GRAPH["moe_lab.workbench.cpu"]  # the plug-in registers into it
    assert is_lesson("moe_lab.kernels.grouped_gemm") and not is_lesson("moe_lab.workbench.measure.ledger")
    assert not is_lesson("moe_lab.__main__")


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_arrow_check_finds_a_lesson_module_reaching_the_workbench():
    graph = {"moe_lab.model": {"moe_lab.moe.layer"},
             "moe_lab.moe.layer": {"moe_lab.workbench.measure.timing"},
             "moe_lab.workbench.measure.timing": set(), "moe_lab.workbench.cli": {"moe_lab.model"}}
    assert lesson_to_workbench(graph) == [
        "moe_lab.model -> ['moe_lab.workbench.measure.timing']",
        "moe_lab.moe.layer -> ['moe_lab.workbench.measure.timing']",
    ]


def test_the_walk_counts_lazy_and_type_hint_imports():
    source = textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from moe_lab.training.steps import StepConfig
        def f():
            import moe_lab.workbench.measure.ledger
    """)
    assert imports_of(source, "moe_lab.training.optim") == {
        "moe_lab.training.steps", "moe_lab.workbench.measure.ledger"}


def test_the_private_name_check_finds_one():
    source = "from moe_lab.kernels.grouped_gemm import _tile_schedule, cast_for_store, __all__\n"
    assert private_imports(source, "moe_lab.kernels.fused_moe") == [
        "moe_lab.kernels.grouped_gemm:_tile_schedule"]
    public = "from moe_lab.kernels.common import tile_schedule\n"
    assert private_imports(public, "moe_lab.kernels.fused_moe") == []


# ---------------------------------------------------------------------------- the package


def test_no_import_cycles_inside_moe_lab():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles (each a set of modules that import each other): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_lesson_never_imports_the_workbench():
    offenders = lesson_to_workbench(GRAPH)
    assert not offenders, "lesson modules that reach the workbench: " + "; ".join(offenders)


def _sources_that_import_moe_lab():
    """The package's modules, the scripts and the notebooks' code cells: ``(label, name,
    is_package, source)``."""
    for name, path in MODULES.items():
        yield str(path.relative_to(REPO)), name, path.name == "__init__.py", path.read_text(encoding="utf-8")
    for path in sorted((REPO / "scripts").glob("*.py")):
        yield str(path.relative_to(REPO)), "scripts." + path.stem, False, path.read_text(encoding="utf-8")
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
        yield str(path.relative_to(REPO)), "notebook", False, code


def test_no_private_name_is_imported_across_modules():
    offenders = []
    for label, name, is_package, source in _sources_that_import_moe_lab():
        offenders += [f"{label} imports {bad}" for bad in private_imports(source, name, is_package)]
    assert not offenders, "private names imported from another module: " + "; ".join(offenders)


# What the fresh process reports: the environment before and after importing moe_lab, and every
# process it started (Python's audit events for subprocesses, exec, fork and spawn).
_IMPORT_PROBE = r"""
import json, os, sys
started = []
def hook(event, args):
    if event in ("subprocess.Popen", "os.system", "os.posix_spawn", "os.spawn", "os.exec",
                 "os.fork", "os.forkpty"):
        started.append(event + " " + repr(args)[:200])
before = dict(os.environ)
sys.addaudithook(hook)
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
after = dict(os.environ)
changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
print(json.dumps({"changed": changed, "started": started}))
"""


def _probe(*modules: str, env_drop: tuple[str, ...] = ("TRITON_INTERPRET",),
           preload: tuple[str, ...] = (), path: Path | None = None) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    code = _IMPORT_PROBE
    if preload:  # libraries imported before the probe starts: what they do is theirs, not ours
        code = "".join(f"import {m}\n" for m in preload) + code
    done = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_import_probe_sees_an_environment_change_and_a_child_process(tmp_path):
    assert _probe("subprocess") == {"changed": [], "started": []}  # importing it does neither
    (tmp_path / "probe_side_effects.py").write_text(
        "import os, subprocess\nos.environ['X_PROBE'] = '1'\nsubprocess.run(['true'])\n")
    seen = _probe("probe_side_effects", path=tmp_path)
    assert seen["changed"] == ["X_PROBE"] and seen["started"], seen


def test_import_moe_lab_changes_nothing_in_the_callers_process():
    seen = _probe("moe_lab")
    assert seen == {"changed": [], "started": []}, seen


@pytest.mark.slow
def test_importing_every_lesson_module_changes_nothing_in_the_callers_process():
    lesson = sorted(m for m in MODULES if is_lesson(m))
    seen = _probe(*lesson, preload=("torch", "torch._dynamo", "triton", "numpy"))
    assert seen == {"changed": [], "started": []}, seen


@pytest.mark.slow
def test_training_a_model_in_a_fresh_process_loads_no_workbench_module():
    code = (
        "import sys, torch, moe_lab\n"
        "from moe_lab.model import MoETransformer\n"
        "from moe_lab.training.build import random_batch\n"
        "from moe_lab.training.optim import make_optimizer\n"
        "from moe_lab.training.steps import SyncFreeStep\n"
        "cfg = moe_lab.preset('tiny')\n"
        "model = MoETransformer(cfg, dispatcher='dropless', expert_backend='torch')\n"
        "step = SyncFreeStep(model, make_optimizer(model), random_batch(cfg, 2))\n"
        "step(random_batch(cfg, 2))\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('moe_lab.workbench'))\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
