"""What notebook 03 (Triton from zero) teaches, read off the notebook without running it: the
learner's kernels are plain ``@triton.jit`` after `interpret_without_cuda` (as from notebook 04
on), and the gaps later notebooks fall into are closed — atomics (a histogram against
``torch.bincount``), the interpreter's bfloat16 ``tl.dot`` shown in a cell and said in the
prose, ``int64`` program ids explained, a look ahead at TMA and persistent kernels. The ridge
crossing it prints is computed exactly, not read off a log grid. (The notebook runs in
tests/workbench/lab/test_notebooks.py.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import numpy as np
import pytest

from moe_lab import preset
from moe_lab.perf import hardware

NOTEBOOK = Path(__file__).resolve().parents[3] / "notebooks" / "03_triton_from_zero.ipynb"


@pytest.fixture(scope="module")
def cells():
    return nbformat.read(NOTEBOOK, as_version=4).cells


def _code(cells) -> list[str]:
    return [cell.source for cell in cells if cell.cell_type == "code"]


def _prose(cells) -> str:
    return "\n".join(cell.source for cell in cells if cell.cell_type == "markdown")


def test_triton_is_made_interpretable_before_anything_imports_it(cells):
    code = _code(cells)
    first = next(i for i, source in enumerate(code) if "interpret_without_cuda()" in source)
    imports_triton = re.compile(r"^\s*(import triton|from triton\b|from moe_lab\.kernels\b)", re.M)
    assert not any(imports_triton.search(source) for source in code[:first])
    setup = code[first]
    call = setup.index("interpret_without_cuda()")
    assert not imports_triton.search(setup[:call])
    # Everything but the import of the switch itself comes after the call.
    before = [line for line in setup[:call].splitlines() if line.strip() and not line.startswith("#")]
    assert before == ["from moe_lab.workbench.lab.triton_mode import interpret_without_cuda"], before


def test_the_learners_kernels_are_plain_triton_jit(cells):
    code = "\n".join(_code(cells))
    decorators = re.findall(r"^@([\w.]+)", code, re.M)
    assert decorators and set(decorators) == {"triton.jit"}, decorators
    assert not re.search(r"from moe_lab\.kernels\.common import .*\bjit\b", code)
    assert "@jit" not in _prose(cells) and "Keep the decorator" not in _prose(cells)


def test_atomics_are_taught_with_a_histogram_checked_against_bincount(cells):
    cell = next(source for source in _code(cells) if "tl.atomic_add" in source)
    assert "torch.bincount" in cell and "assert" in cell
    assert "`tl.atomic_add" in _prose(cells)


def test_int64_program_ids_are_explained_where_they_are_used(cells):
    prose = _prose(cells)
    assert "tl.program_id(0).to(tl.int64)" in prose and "2³¹" in prose
    assert any("tl.program_id(0).to(tl.int64)" in source for source in _code(cells))


def test_the_interpreters_bf16_dot_is_in_the_prose_and_shown(cells):
    prose = _prose(cells)
    assert "bfloat16 `tl.dot`" in prose and "float32 tiles" in prose
    shown = [source for source in _code(cells)
             if "tl.dot" in source and "torch.bfloat16" in source and "print(" in source]
    assert shown, "no cell multiplies a bfloat16 tile with tl.dot and prints its error"


def test_a_look_ahead_at_tma_and_persistent_kernels_points_to_notebook_04(cells):
    prose = _prose(cells)
    assert "TMA" in prose and "persistent" in prose.lower()
    assert "Notebook 04" in prose and "grouped_gemm_tma" in prose


def test_the_prose_names_only_columns_its_compile_table_has(cells):
    code = "\n".join(_code(cells))
    header = re.search(r'lines = \["(\| compiled \|.*?)"\s*\n?\s*"?(.*?)"?,', code, re.S)
    assert header, "the compile table's header was not found"
    columns = {c.strip() for c in (header.group(1) + header.group(2)).split("|") if c.strip()}
    for name in re.findall(r"`(\w+)` column|\*([\w/ ]+)\* column", _prose(cells)):
        name = next(n for n in name if n)
        assert any(name in column for column in columns), (name, columns)


def _ridge_tokens(cells):
    """The notebook's ``ridge_tokens``, defined as its ridge cell defines it."""
    source = next(source for source in _code(cells) if "def ridge_tokens" in source)
    tree = ast.parse(source)
    function = next(node for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name == "ridge_tokens")
    namespace = {"np": np, "hardware": hardware, "ds": preset("deepseek_v3")}
    exec(compile(ast.Module([function], []), str(NOTEBOOK), "exec"), namespace)
    return namespace["ridge_tokens"], source


@pytest.mark.parametrize("gpu", ["L4", "A100", "H200", "B200"])
def test_the_ridge_crossing_is_exact(cells, gpu):
    ridge_tokens, source = _ridge_tokens(cells)
    ds, spec = preset("deepseek_v3"), hardware.gpu_spec(gpu)
    want = next(m for m in range(1, 100_000)
                if hardware.matmul_intensity(m, ds.moe.d_expert, ds.d_model, 2.0) >= spec.ridge_intensity)
    m_star, m = ridge_tokens(spec.ridge_intensity)
    assert m == want and m - 1 < m_star <= m, (gpu, m_star, m, want)
    assert "crossing = ridge_tokens(spec.ridge_intensity)" in source
    assert ridge_tokens(1e9) is None  # a ridge the GEMM's intensity never reaches
