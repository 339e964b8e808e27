"""A notebook on a machine without Triton (macOS, Windows) runs to its end: its setup cell says
Triton is absent, each cell marked ``# needs Triton`` prints what it needs instead of running,
and every other cell runs on PyTorch. Each notebook with Triton cells (03 and 08 call
`label_triton_cells` in their set-up, 04-07 through `interpret_without_cuda`), through the
workbook runner, with Triton hidden from the runner and its kernel (`support.without_triton`)."""

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from support import without_triton

from moe_lab.workbench.lab.triton_mode import NEEDS_TRITON

ROOT = Path(__file__).resolve().parents[3]
# Each notebook, and a line one of its PyTorch cells prints after its first Triton cell.
RAN_AFTER = {"03_triton_from_zero": "the expert GEMM reaches the ridge at about",
             "04_dropless_sync_free": "inline permute → grouped GEMM → unpermute == dropless layer",
             "05_fused_router": "imbalance",
             "06_mxfp8_attention": "bytes per attention forward",
             "07_fused_grouped_gemm": "of the unfused chain's time is in the stages the fusions remove",
             "08_cuda_graphs": "host syncs in 5 consecutive steps"}


# What only runs with Triton installed: Triton itself, moe_lab's kernels, and the compile report
# (which imports them). A code cell holding any of these must be marked.
NEEDS_TRITON_CODE = re.compile(
    r"^\s*(import triton|from triton\b|from moe_lab\.kernels\b|import moe_lab\.kernels\b"
    r"|from moe_lab\.workbench\.compile_report\b|from moe_lab\.workbench\.exercises\.\w+_triton\b)"
    r"|@(triton\.)?jit\b|\btl\.(constexpr|program_id|arange|load|store)\b"
    r"|expert_backend=\"triton|router_impl=\"triton",
    re.M)
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_every_cell_that_needs_triton_is_marked(notebook):
    """The static half: no unmarked cell imports Triton, a kernel or the compile report, or asks
    for a Triton implementation by name (the runs below catch what this misses)."""
    cells = nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", as_version=4).cells
    code = [cell.source for cell in cells if cell.cell_type == "code"]
    unmarked = [source for source in code
                if not source.lstrip().startswith(NEEDS_TRITON) and NEEDS_TRITON_CODE.search(source)]
    assert unmarked == [], f"{notebook}: cells that need Triton without {NEEDS_TRITON!r}:\n" + \
        "\n---\n".join(unmarked)


def test_the_static_check_finds_what_needs_triton():
    for source in ("import triton", "from moe_lab.kernels import common", "@triton.jit\ndef k(): ...",
                   "x = tl.arange(0, 4)", "def k(N: tl.constexpr): pass",
                   'MoELayer(cfg, expert_backend="triton")',
                   "from moe_lab.workbench.compile_report import traffic"):
        assert NEEDS_TRITON_CODE.search(source), source
    for source in ('BACKENDS = [b for b in ("torch", "triton") if b in EXPERT_BACKENDS]',
                   "for label, tl in timelines.items(): print(tl.step_s)",
                   "from moe_lab.workbench.lab.triton_mode import interpret_without_cuda"):
        assert not NEEDS_TRITON_CODE.search(source), source


def _text(cell) -> str:
    outputs = cell.get("outputs", [])
    return "".join(out.get("text", "") for out in outputs if out.get("output_type") == "stream")


@pytest.fixture(scope="module")
def workbook_without_triton(tmp_path_factory):
    """Every notebook with Triton cells, run once by the workbook runner (one process, a kernel
    each) with Triton hidden: ``(the runner's exit, its output, the build folder)``. The file is
    one unit of tests/conftest.py's SAME_WORKER, so the run happens once."""
    tmp = tmp_path_factory.mktemp("no_triton")
    env = {**without_triton(tmp / "hide"), "MOE_LAB_RESULTS_DIR": str(tmp / "results")}
    done = subprocess.run([sys.executable, "-m", "moe_lab", "workbook", "--only", *sorted(RAN_AFTER),
                           "--no-html", "--out", str(tmp / "build")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    return done, tmp / "build"


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.parametrize("notebook", sorted(RAN_AFTER))
def test_a_notebook_runs_to_its_end_with_its_triton_cells_labelled(notebook, workbook_without_triton):
    done, build = workbook_without_triton
    failed = [line for line in done.stderr.splitlines() if line.startswith(f"FAILED {notebook}")]
    assert failed == [] and (build / "workbook" / f"{notebook}.ipynb").exists(), \
        done.stdout[-3000:] + done.stderr[-3000:]
    executed = nbformat.read(build / "workbook" / f"{notebook}.ipynb", as_version=4)
    code = [cell for cell in executed.cells if cell.cell_type == "code"]
    marked = [i for i, cell in enumerate(code) if cell.source.lstrip().startswith(NEEDS_TRITON)]
    assert marked, f"{notebook} has no cell marked {NEEDS_TRITON!r}"
    for i in marked:
        printed = _text(code[i]).strip()  # the label, one line, and nothing of the cell's own
        assert printed.startswith("this cell was skipped: it needs Triton, which installs on Linux only")
        assert "\n" not in printed, (code[i].source, printed)
    assert any("Triton's kernels cannot run here" in _text(cell) for cell in code[:4])
    errors = [out for cell in code for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert errors == []
    # The cells after them ran.
    assert any(RAN_AFTER[notebook] in _text(cell) for cell in code[marked[0] + 1:]), RAN_AFTER[notebook]
