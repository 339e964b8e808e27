"""The package's layering: no import cycles inside ``moe_lab``, and a core that never imports
the CPU plug-in (``moe_lab.cpu``), read from the source and checked in a fresh process."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "moe_lab"

# The core a GPU reader learns from: no module here may import the plug-in, even lazily.
CORE = ("moe_lab.config", "moe_lab.model", "moe_lab.attention", "moe_lab.registry",
        "moe_lab.moe", "moe_lab.kernels", "moe_lab.training", "moe_lab.quant")
PLUGIN = "moe_lab.cpu"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str) -> set[str]:
    """Every moe_lab module ``name`` imports by an import statement, at module level or inside
    a function (``if TYPE_CHECKING:`` blocks excepted): the module itself where ``from X
    import Y`` names a submodule, else ``X``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("moe_lab"):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("moe_lab"):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


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


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_walk_sees_the_package():
    assert {"moe_lab.model", "moe_lab.moe.layer", "moe_lab.cpu", "moe_lab.training.steps"} <= set(MODULES)
    assert "moe_lab.moe.experts" in GRAPH["moe_lab.moe.layer"]
    assert "moe_lab.moe.experts" in GRAPH["moe_lab.cpu"]  # the plug-in registers into the core


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles_inside_moe_lab():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles (each a set of modules that import each other): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_core_never_imports_the_cpu_plugin():
    offenders = []
    for name in MODULES:
        if not _in(name, CORE):
            continue
        seen, todo = set(), [name]
        while todo:  # everything the module pulls in, transitively
            for dep in GRAPH[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        bad = sorted(m for m in seen if _in(m, (PLUGIN,)))
        if bad:
            offenders.append(f"{name} -> {bad}")
    assert not offenders, "core modules that reach the CPU plug-in: " + "; ".join(offenders)


@pytest.mark.slow
def test_training_a_model_in_a_fresh_process_loads_no_plugin_module():
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
        "loaded = sorted(m for m in sys.modules if m == 'moe_lab.cpu' or m.startswith('moe_lab.cpu.'))\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
