"""The workbook runner, on tiny generated notebooks in a temporary project.

The real notebooks are executed by ``test_notebooks.py``; here two small ones (one that
records a figure, one that fails midway) check the runner itself: executed notebooks,
the site, RESULTS.md with the recorded figure, and a failure reported with its cell.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import nbformat
import pytest

from moe_lab.workbench.lab import workbook
from moe_lab.workbench.measure.ledger import read

PARAMETERS = 'PROFILE = "full"\nSEED = 0\nSOLUTIONS = False\n'

RECORDS_A_FIGURE = """\
import os
from moe_lab.workbench.measure.ledger import record

record("00_tiny", "answer", "widgets_per_s", 42.5 if SOLUTIONS else -1.0, "widgets/s",
       hardware="test-machine", cwd=os.getcwd(), seen_profile=PROFILE,
       seen_pythonpath=os.environ.get("PYTHONPATH", ""))
print("recorded")
"""

BROKEN = ["x = 1", 'raise KeyError("deliberately broken")', 'print("never runs")']


def _notebook(path: Path, *sources: str) -> None:
    cells = [nbformat.v4.new_markdown_cell("# A tiny notebook")]
    parameters = nbformat.v4.new_code_cell(PARAMETERS)
    parameters.metadata["tags"] = ["parameters"]
    cells.append(parameters)
    cells += [nbformat.v4.new_code_cell(source) for source in sources]
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(notebook, path)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A minimal moe-lab project: a pyproject.toml and two notebooks (and a stray file)."""
    root = tmp_path_factory.mktemp("project")
    (root / "pyproject.toml").write_text('[project]\nname = "moe-lab"\nversion = "0"\n')
    notebooks = root / "notebooks"
    notebooks.mkdir()
    _notebook(notebooks / "00_tiny.ipynb", RECORDS_A_FIGURE)
    _notebook(notebooks / "01_broken.ipynb", *BROKEN)
    _notebook(notebooks / "scratch.ipynb", "raise RuntimeError('not part of the workbook')")
    return root


@pytest.fixture(scope="module")
def outcome(project: Path) -> list[workbook.NotebookRun]:
    """One workbook run over the tiny project (executing notebooks takes seconds)."""
    return workbook.run_workbook(
        profile="smoke",
        root=project,
        results_dir=project / "build" / "results",
        progress=False,
    )


@pytest.mark.timeout(300)
def test_runs_the_numbered_notebooks_in_order(outcome):
    assert [run.name for run in outcome] == ["00_tiny", "01_broken"]
    assert all(run.seconds > 0 for run in outcome)


@pytest.mark.timeout(300)
def test_executed_notebook_and_html(project, outcome):
    tiny = outcome[0]
    assert tiny.ok, tiny.failure
    assert tiny.output == project / "build" / "workbook" / "00_tiny.ipynb"
    executed = nbformat.read(tiny.output, as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1
    assert 'PROFILE = "smoke"' in injected[0].source
    assert "SOLUTIONS = True" in injected[0].source
    code = [cell for cell in executed.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code)
    assert "recorded" in json.dumps(code[-1].outputs)
    page = (project / "build" / "site" / "00_tiny.html").read_text()  # the site is the HTML export
    assert "<html" in page and "widgets_per_s" in page
    assert not list((project / "build" / "workbook").glob("*.html"))  # no second, plain export
    leftovers = [p.name for p in tiny.output.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


@pytest.mark.timeout(300)
def test_the_kernel_sees_parameters_environment_and_cwd(project, outcome):
    (figure,) = read(project / "build" / "results" / "ledger.jsonl")
    assert figure["value"] == 42.5  # SOLUTIONS=True reached the kernel
    assert figure["seen_profile"] == "smoke"
    assert figure["profile"] == "smoke"  # from MOE_LAB_PROFILE, set for the kernel
    assert Path(figure["cwd"]).resolve() == (project / "notebooks").resolve()
    first = figure["seen_pythonpath"].split(os.pathsep)[0]
    assert Path(first).resolve() == project.resolve()  # the checkout's moe_lab comes first


@pytest.mark.timeout(300)
def test_a_failing_notebook_is_reported_with_its_cell(outcome):
    broken = outcome[1]
    assert not broken.ok
    assert broken.failure.ename == "KeyError"
    assert "deliberately broken" in broken.failure.evalue
    assert "raise KeyError" in broken.failure.source
    # markdown, parameters, injected parameters, x = 1, then the raise
    assert broken.failure.cell_index == 4
    described = broken.failure.describe()
    assert "KeyError" in described and "cell 4" in described and "raise KeyError" in described
    assert broken.output.exists()  # the executed notebook, error included, is kept
    executed = nbformat.read(broken.output, as_version=4)
    never = [cell for cell in executed.cells if cell.source == BROKEN[-1]]
    assert len(never) == 1 and never[0].execution_count is None


@pytest.mark.timeout(300)
def test_results_md(project, outcome):
    text = (project / "build" / "RESULTS.md").read_text()
    assert text.startswith("# ")
    assert "## Machine" in text
    row = next(line for line in text.splitlines() if "widgets_per_s" in line)
    assert "| 00_tiny |" in row and "| 42.50 |" in row and "test-machine" in row
    assert "widgets/s" in row
    assert "| 00_tiny | ok |" in text
    assert "| 01_broken | FAILED |" in text
    assert "## Failures" in text and "KeyError" in text
    assert "scratch" not in text


@pytest.mark.timeout(300)
def test_cli_runs_from_the_project_and_exits_non_zero_on_failure(
    project, tmp_path, monkeypatch, capsys
):
    parser = argparse.ArgumentParser()
    workbook.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["workbook", "--only", "broken", "--no-html", "--out", str(tmp_path / "out")]
    )
    assert args.func is workbook.run and args.profile == "smoke" and args.solutions
    monkeypatch.chdir(project / "notebooks")  # the root is found from below
    assert args.func(args) == 1
    assert "FAILED 01_broken: KeyError" in capsys.readouterr().err
    assert (tmp_path / "out" / "workbook" / "01_broken.ipynb").exists()
    assert not (tmp_path / "out" / "site").exists()
    assert not (tmp_path / "out" / "workbook" / "00_tiny.ipynb").exists()
    assert "| 01_broken | FAILED |" in (tmp_path / "out" / "RESULTS.md").read_text()


def test_cli_options():
    parser = argparse.ArgumentParser()
    workbook.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["workbook", "--profile", "full", "--only", "a", "b"])
    assert (args.profile, args.only, args.html, args.out) == ("full", ["a", "b"], True, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["workbook", "--profile", "huge"])


def test_unknown_only_names_list_the_notebooks(project):
    with pytest.raises(ValueError, match="nope.*available: 00_tiny, 01_broken"):
        workbook.run_workbook(root=project, only=["nope"], progress=False)


@pytest.mark.parametrize("name", ["01_broken", "01_broken.ipynb", "broken", "01"])
def test_select_notebooks_by_any_form_of_the_name(project, name):
    notebooks = workbook.find_notebooks(project / "notebooks")
    assert [path.name for path in notebooks] == ["00_tiny.ipynb", "01_broken.ipynb"]
    assert [path.stem for path in workbook.select_notebooks(notebooks, [name])] == ["01_broken"]
    assert workbook.select_notebooks(notebooks, None) == notebooks


def test_a_lettered_notebook_sits_after_its_number_and_is_selected_by_it(tmp_path):
    for name in ("03_next", "02b_between", "02_first", "2_stray", "02B_upper"):
        _notebook(tmp_path / f"{name}.ipynb", "x = 1")
    notebooks = workbook.find_notebooks(tmp_path)
    assert [path.stem for path in notebooks] == ["02_first", "02b_between", "03_next"]
    assert [path.stem for path in workbook.select_notebooks(notebooks, ["02b"])] == ["02b_between"]
    assert [path.stem for path in workbook.select_notebooks(notebooks, ["02"])] == ["02_first"]


def test_bad_arguments(project, tmp_path):
    with pytest.raises(ValueError, match="profile"):
        workbook.run_workbook(profile="huge", root=project)
    (tmp_path / "notebooks").mkdir()
    with pytest.raises(ValueError, match="no NN_name.ipynb"):
        workbook.run_workbook(root=tmp_path, progress=False)


# ------------------------------------------------------------------- stopped notebooks

HANGS = ["x = 1", "import time\ntime.sleep(1e6)", 'print("never runs")']
DIES = ["x = 1", "import os\nos._exit(1)", 'print("never runs")']
TIMEOUT_S = 2.0  # the hanging cell's limit here; the workbook's own is CELL_TIMEOUT_FACTOR budgets


def _dies_first_time(marker: Path) -> list[str]:
    """A notebook whose kernel dies the first time it runs (a marker file tells)."""
    return ["x = 1", f"import os, pathlib\nmarker = pathlib.Path({str(marker)!r})\n"
            "if not marker.exists():\n    marker.touch()\n    os._exit(1)",
            'print("ran after the restart")']


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[workbook.NotebookRun]]:
    """A workbook run, cells limited to TIMEOUT_S, over notebooks that hang, die, die once."""
    root = tmp_path_factory.mktemp("stopped")
    (root / "pyproject.toml").write_text('[project]\nname = "moe-lab"\nversion = "0"\n')
    notebooks = root / "notebooks"
    notebooks.mkdir()
    _notebook(notebooks / "00_hangs.ipynb", *HANGS)
    _notebook(notebooks / "01_dies.ipynb", *DIES)
    _notebook(notebooks / "02_dies_once.ipynb", *_dies_first_time(root / "died-once"))
    runs = workbook.run_workbook(profile="smoke", root=root, html=False, progress=False,
                                 results_dir=root / "build" / "results", cell_timeout=TIMEOUT_S)
    return root, runs


@pytest.mark.timeout(300)
def test_a_hanging_cell_ends_in_its_timeout_and_is_reported_after_one_restart(stopped, capsys):
    root, runs = stopped
    hangs = runs[0]
    assert hangs.name == "00_hangs" and not hangs.ok
    assert hangs.restarted is not None and hangs.restarted.ename == "CellTimeoutError"
    failure = hangs.failure
    assert failure.ename == "CellTimeoutError"
    assert failure.cell_index == 4  # markdown, parameters, injected parameters, x = 1, sleep
    assert "time.sleep(1e6)" in failure.source
    described = failure.describe()
    assert "more than 2 s" in described and "again after one kernel restart" in described
    assert "cell 4" in described and "import time" in described
    # two runs of at most the limit each, plus kernel starts: far from the sleep's 1e6 s
    assert hangs.seconds < 120
    text = (root / "build" / "RESULTS.md").read_text()
    assert "| 00_hangs | FAILED |" in text
    assert "**00_hangs**: `CellTimeoutError: the cell took more than 2 s" in text


@pytest.mark.timeout(300)
def test_a_kernel_that_dies_is_restarted_once_and_reported(stopped):
    root, runs = stopped
    dies = runs[1]
    assert dies.name == "01_dies" and not dies.ok
    assert dies.restarted is not None and dies.restarted.ename == "DeadKernelError"
    assert dies.failure.ename == "DeadKernelError"
    assert dies.failure.cell_index == 4 and "os._exit(1)" in dies.failure.source
    described = dies.failure.describe()
    assert "the kernel died, again after one kernel restart at cell 4" in described
    executed = nbformat.read(dies.output, as_version=4)
    assert [c for c in executed.cells if c.source == DIES[-1]][0].execution_count is None


@pytest.mark.timeout(300)
def test_a_kernel_that_dies_once_is_restarted_and_the_notebook_runs(stopped):
    root, runs = stopped
    once = runs[2]
    assert once.name == "02_dies_once"
    assert once.ok, once.failure
    assert once.restarted is not None and once.restarted.ename == "DeadKernelError"
    assert once.restarted.cell_index == 4
    executed = nbformat.read(once.output, as_version=4)
    assert "ran after the restart" in json.dumps(executed.cells[-1].outputs)
    text = (root / "build" / "RESULTS.md").read_text()
    assert "| 02_dies_once | ok |" in text
    assert "## Restarted once in a fresh kernel" in text
    assert "**02_dies_once**: `DeadKernelError: the kernel died at cell 4" in text


def test_the_cell_timeout_is_a_stated_multiple_of_the_profile_budget():
    assert workbook.NOTEBOOK_BUDGET_S["smoke"] == 90.0
    assert workbook.cell_timeout_s("smoke") == workbook.CELL_TIMEOUT_FACTOR * 90.0
    assert workbook.cell_timeout_s("full") == (workbook.CELL_TIMEOUT_FACTOR
                                               * workbook.NOTEBOOK_BUDGET_S["full"])
    assert set(workbook.NOTEBOOK_BUDGET_S) == set(workbook.PROFILES)


@pytest.mark.parametrize(("first", "calls"), [
    (RuntimeError("Kernel didn't respond in 60 seconds"), 2),  # silent at start: run again
    (ValueError("not a notebook"), 1),  # not a stop: reported as it is, not run again
])
def test_which_failures_run_a_notebook_again(monkeypatch, tmp_path, first, calls):
    import papermill

    seen = []

    def execute_notebook(*args, **kwargs):
        seen.append(kwargs["execution_timeout"])
        if len(seen) == 1:
            raise first

    monkeypatch.setattr(papermill, "execute_notebook", execute_notebook)
    failure, restarted = workbook._execute(tmp_path / "00_x.ipynb", tmp_path / "out.ipynb", {},
                                           tmp_path, timeout=7.0)
    assert seen == [7.0] * calls
    if calls == 2:
        assert failure is None and restarted.ename == "RuntimeError"
    else:
        assert restarted is None and failure.ename == "ValueError"
        assert failure.describe() == "ValueError: not a notebook"
