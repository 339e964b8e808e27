"""Every notebook's headline comes with a unit and, beside it, a GPU line.

The site's index and the README's gains table show one headline figure per notebook
(`moe_lab.workbench.lab.site.HEADLINES`) and, next to it, what the technique moves on an H200,
B200 or GB300 (`GPU_LINES`): a number with a unit, either published (a citation: what was
measured, by whom, where) or projected (the assumptions stated). The GPU line is recorded by
the notebook's summary; these checks read the notebooks' source and the code that records the
headline figures, so they need no executed notebook and no ledger.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from moe_lab.workbench.lab import site
from moe_lab.workbench.lab.notebook_files import NOTEBOOK_PATTERN

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if NOTEBOOK_PATTERN.match(p.name))
# Units a ratio may carry; a headline whose metric names a ratio must use one of them.
RATIO_UNITS = ("x", "×", "%", "fraction")
RATIO_WORDS = re.compile(r"(^|_)(vs|over|ratio|speedup|share|frac|saved)(_|$|\[)")


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _source(cell: dict) -> str:
    text = cell["source"]
    return "".join(text) if isinstance(text, list) else text


def _python(source: str) -> ast.Module:
    """A code cell as Python: IPython's magics and shell lines are left out."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    return ast.parse("\n".join(lines))


def summary_code(path: Path) -> list[str]:
    """The code cells of the notebook's summary: from the markdown cell holding its
    ``## Summary`` heading to the next ``#``/``##`` heading (an appendix) or the end."""
    cells = _cells(path)
    start = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                  and any(line.strip() == "## Summary" for line in _source(c).splitlines())), None)
    if start is None:
        return []
    code = []
    for cell in cells[start + 1:]:
        if cell["cell_type"] == "markdown" and re.search(r"^#{1,2} ", _source(cell), re.M):
            break
        if cell["cell_type"] == "code":
            code.append(_source(cell))
    return code


def _constant(node: ast.AST | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def record_calls(tree: ast.AST) -> list[ast.Call]:
    """Calls of ``ledger.record(...)`` / ``record(...)`` with at least the five positional
    arguments (notebook, step, metric, value, unit)."""
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and len(node.args) >= 5:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "record":
                calls.append(node)
    return calls


def gpu_line_calls(sources: list[str]) -> list[ast.Call]:
    return [call for source in sources for call in record_calls(_python(source))
            if _constant(call.args[1]) == site.GPU_LINE_STEP]


# ------------------------------------------------------------------------------ the tables


def test_every_notebook_has_a_headline_and_a_gpu_line_entry():
    names = {p.stem for p in NOTEBOOKS}
    assert names, "no notebooks found"
    assert names <= set(site.HEADLINES), sorted(names - set(site.HEADLINES))
    assert set(site.GPU_LINES) == set(site.HEADLINES), (
        sorted(set(site.HEADLINES) ^ set(site.GPU_LINES)))
    for name, line in site.GPU_LINES.items():
        assert line.label.strip(), name


@pytest.mark.parametrize("name", sorted(site.HEADLINES))
def test_every_headline_names_its_unit(name):
    for spec in site.HEADLINES[name]:
        assert spec.unit and spec.unit.strip(), f"{name}: {spec.metric} has no unit"
        if RATIO_WORDS.search(spec.metric):
            assert spec.unit in RATIO_UNITS, f"{name}: {spec.metric} is a ratio, unit {spec.unit!r}"


def _code_files() -> list[tuple[str, str]]:
    files = [(str(p.relative_to(ROOT)), "\n".join(_source(c) for c in _cells(p)
                                                 if c["cell_type"] == "code"))
             for p in NOTEBOOKS]
    files += [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
              for p in sorted((ROOT / "moe_lab" / "workbench").rglob("*.py"))]
    return files


def test_the_code_that_records_a_headline_gives_it_its_unit():
    """Where a headline's metric is recorded with a literal name, its unit is the one the
    table expects (a bare ratio, ``""``, can never be a headline)."""
    specs = {(spec.metric, spec.step): spec for specs in site.HEADLINES.values() for spec in specs}
    checked = set()
    for where, text in _code_files():
        try:
            tree = _python(text)
        except SyntaxError:
            continue
        for call in record_calls(tree):
            metric, step, unit = (_constant(call.args[i]) for i in (2, 1, 4))
            for (spec_metric, spec_step), spec in specs.items():
                # a step given as a literal must be the headline's; one computed may be any
                if metric != spec_metric or (isinstance(step, str) and spec_step not in (None, step)):
                    continue
                if isinstance(call.args[4], ast.Constant):
                    assert site._same_unit(unit, spec.unit), (
                        f"{where}:{call.lineno} records {metric!r} in {unit!r}, the headline "
                        f"expects {spec.unit!r}")
                    checked.add(metric)
    # the headlines recorded under literal names were found (the check is not vacuous)
    assert {"exposed_vs_sequential", "bytes_vs_floor", "warps_per_sm", "a2a_bandwidth_over_link"} <= checked


# ------------------------------------------------------------------------------ the summaries


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_summary_records_a_gpu_line(path):
    code = summary_code(path)
    assert code, f"{path.name}: no code cell in its summary (after '## Summary')"
    calls = gpu_line_calls(code)
    assert calls, f"{path.name}: its summary records no {site.GPU_LINE_STEP!r} figure"
    spec = site.GPU_LINES[path.stem]
    for call in calls:
        keywords = {k.arg: k.value for k in call.keywords}
        unit = _constant(call.args[4])
        assert isinstance(unit, str) and unit.strip(), f"{path.name}: a GPU line needs a unit"
        assert _constant(keywords.get("hardware")) in site.GPU_LINE_HARDWARE, (
            f"{path.name}: hardware= must be one of {site.GPU_LINE_HARDWARE}")
        assert _constant(keywords.get("kind")) in site.GPU_LINE_KINDS, (
            f"{path.name}: kind= must be one of {site.GPU_LINE_KINDS}")
        basis = keywords.get("basis")
        assert basis is not None and _constant(basis) != "", f"{path.name}: a GPU line states its basis"
        if spec.metric is not None:
            assert _constant(call.args[2]) == spec.metric, (
                f"{path.name}: records {_constant(call.args[2])!r}, GPU_LINES names {spec.metric!r}")
    text = "\n".join(code)
    assert re.search(r"On an? ", text) and re.search(r"\((projection|published): ", text), (
        f"{path.name}: its summary prints no 'On an H200 (projection: ...)' sentence")


def test_a_gpu_line_missing_its_unit_is_caught():
    source = ('ledger.record(NB, "gpu line", "m", 1.0, "", hardware="H200", kind="projection", '
              'basis="b")\nprint("On an H200 (projection: b)")')
    (call,) = gpu_line_calls([source])
    assert _constant(call.args[4]) == ""
    assert not gpu_line_calls(['ledger.record(NB, "summary", "m", 1.0, "ms")'])


def test_a_one_seed_headline_is_said_in_words():
    text = site.format_figure({"value": 1.791, "unit": "x", "min": 1.791, "max": 1.791, "seeds": 1})
    assert "one seed" in text and "range" not in text and "1 seeds" not in text
