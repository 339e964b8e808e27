"""The workbook runner: execute every notebook, export HTML, write ``build/RESULTS.md``.

``python -m moe_lab workbook`` (what ``make workbook`` runs) finds ``notebooks/NN_*.ipynb``
in the project root and executes each, in order, with papermill — parameters ``PROFILE``
and ``SOLUTIONS`` (``True`` unless asked otherwise: the committed notebooks say ``False``,
learner mode), kernel ``python3``, working directory ``notebooks/`` — into
``build/workbook/<name>.ipynb``. The kernel inherits this process's environment, which carries
``MOE_LAB_PROFILE`` and ``MOE_LAB_RESULTS_DIR`` so every figure a notebook records lands in
one ledger, and ``PYTHONPATH`` starts with the project root, so the notebooks import its
``moe_lab``. At the end ``build/RESULTS.md`` shows the machine, one table of the latest
ledger figures and how long each notebook took, and (unless ``--no-html``) ``build/site/``
holds every executed notebook as a page and an ``index.html`` that opens without a server
(`moe_lab.workbench.lab.site`): the workbook's one HTML export.

A notebook that fails does not stop the run: the others still execute, the failure is
reported with the error's name and the cell it came from, and the command exits non-zero.

No notebook can stop the run forever. Each cell runs under a time limit,
``CELL_TIMEOUT_FACTOR`` times the profile's per-notebook budget (`NOTEBOOK_BUDGET_S`: 90 s
for ``smoke``), so a hanging cell, or a kernel gone silent, ends there; a kernel that dies
is seen within seconds. Either way the notebook is run again once, from its first cell, in
a fresh kernel (its state is gone with the old one); if it stops again, the run reports
which notebook and which cell stopped, and goes on to the next notebook.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

from moe_lab.perf.capabilities import capabilities, library_versions
from moe_lab.workbench.lab.notebook_files import NOTEBOOK_PATTERN, write_text_atomically
from moe_lab.workbench.lab.profiles import PROFILES
from moe_lab.workbench.lab.site import build_site
from moe_lab.workbench.measure.ledger import (
    LEDGER_NAME,
    find_project_root,
    latest,
    read,
    results_table_markdown,
)

KERNEL_NAME = "python3"
# What running a notebook needs beyond moe_lab (pyproject.toml's notebooks extra), by module.
NOTEBOOK_TOOLING = ("papermill", "ipykernel", "nbformat", "nbconvert", "matplotlib")
# Seconds each notebook should take under a profile (PROFILES in moe_lab.workbench.lab.profiles):
# smoke is the CI size; full is for a GPU or a patient reader.
NOTEBOOK_BUDGET_S = {"smoke": 90.0, "full": 1800.0}
CELL_TIMEOUT_FACTOR = 3  # a cell may take this many times a whole notebook's budget
# What stops a notebook without an error in a cell (a cell timed out, the kernel died): the
# notebook is run once more, as it is when its kernel does not answer at start.
STOPPED = ("CellTimeoutError", "DeadKernelError")


def cell_timeout_s(profile: str) -> float:
    """The time limit of one cell under ``profile``: ``CELL_TIMEOUT_FACTOR`` budgets."""
    return CELL_TIMEOUT_FACTOR * NOTEBOOK_BUDGET_S[profile]


@dataclass(frozen=True)
class NotebookFailure:
    """Why a notebook failed: the exception's name and message, and the cell that raised.

    ``cell_index`` counts cells of the executed notebook (papermill's injected-parameters
    cell included); ``exec_count`` is the ``In [n]`` number shown beside the cell.
    """

    ename: str
    evalue: str
    cell_index: int | None = None
    exec_count: int | None = None
    source: str = ""

    def describe(self) -> str:
        """One line: ``ExerciseError: wrong count at cell 7 (In [5]): check_x(x)``."""
        message = self.evalue.strip().splitlines()[0] if self.evalue.strip() else ""
        text = f"{self.ename}: {message}" if message else self.ename
        if self.cell_index is not None:
            where = f"cell {self.cell_index}"
            if self.exec_count is not None:
                where += f" (In [{self.exec_count}])"
            first_line = next((ln for ln in self.source.splitlines() if ln.strip()), "")
            text += f" at {where}" + (f": {first_line.strip()}" if first_line else "")
        return text


@dataclass(frozen=True)
class NotebookRun:
    """One notebook's execution: where its outputs went and how long it took."""

    name: str
    output: Path
    seconds: float
    failure: NotebookFailure | None = None
    restarted: NotebookFailure | None = None  # why the first run stopped, if it did

    @property
    def ok(self) -> bool:
        """Whether the notebook executed without an error."""
        return self.failure is None


# ------------------------------------------------------------------------------ discovery


def project_root() -> Path:
    """The moe_lab checkout: above the current directory, else above this package."""
    root = find_project_root() or find_project_root(Path(__file__).resolve().parent)
    if root is None:
        raise ValueError("the workbook runs from the moe_lab checkout: no pyproject.toml with "
                         "[project] name 'moe-lab' above the current directory")
    return root


def find_notebooks(notebooks_dir: Path) -> list[Path]:
    """The workbook's notebooks, ``NN_name.ipynb``, sorted by name (so by number); none where
    ``notebooks_dir`` is not a folder."""
    return sorted(path for path in notebooks_dir.glob("*.ipynb")
                  if path.is_file() and NOTEBOOK_PATTERN.match(path.name))


def select_notebooks(notebooks: Sequence[Path], only: Sequence[str] | None) -> list[Path]:
    """The notebooks named in ``only``, in workbook order; all of them when ``only`` is empty.

    A name matches ``01_naive_moe``, ``01_naive_moe.ipynb``, ``naive_moe`` or ``01``.
    """
    if not only:
        return list(notebooks)
    chosen: set[Path] = set()
    for wanted in only:
        key = wanted.removesuffix(".ipynb")
        matches = [path for path in notebooks
                   if key in (path.stem, *NOTEBOOK_PATTERN.match(path.name).groups())]
        if not matches:
            available = ", ".join(path.stem for path in notebooks) or "none"
            raise ValueError(f"--only: no notebook named {wanted!r}; available: {available}")
        chosen.update(matches)
    return [path for path in notebooks if path in chosen]


# ------------------------------------------------------------------------------ execution


def _stopped_cell(partial: Path) -> tuple[int | None, int | None, str]:
    """(index, ``In [n]``, source) of the cell a stopped run was in (`NotebookFailure`'s last
    three fields): the last one papermill marked as started in the notebook it saves as it
    goes; ``(None, None, "")`` if none."""
    try:
        import nbformat

        notebook = nbformat.read(partial, as_version=4)
    except Exception:  # never written, or unreadable: the cell is not known
        return None, None, ""
    started = [index for index, cell in enumerate(notebook.cells)
               if cell.get("metadata", {}).get("papermill", {}).get("start_time")]
    if not started:
        return None, None, ""
    cell = notebook.cells[started[-1]]
    return started[-1], cell.get("execution_count"), str(cell.get("source", ""))


def _execute_once(source: Path, partial: Path, parameters: dict, cwd: Path,
                  timeout: float) -> tuple[NotebookFailure | None, bool]:
    """One papermill run of ``source`` into ``partial``: (the failure, or ``None``; whether
    the run stopped: a cell timed out, the kernel died or did not answer at start)."""
    import papermill  # slow to import (jupyter, nbclient); only a run needs it
    from papermill.exceptions import PapermillExecutionError
    from traitlets.config import Config

    try:
        # A short folder of its own: a Unix socket's path is limited to about 100 bytes.
        with tempfile.TemporaryDirectory(prefix="moe_lab_kernel_", ignore_cleanup_errors=True) as sockets:
            # The kernel's channels on Unix sockets in that folder (jupyter_client's ``ipc``
            # transport) instead of TCP ports on the loopback: only this user can reach them, and
            # the kernel no longer prints, for every notebook, its warning that TCP carries code and
            # outputs unencrypted.
            transport = Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(sockets, "kernel")}})
            # execution_timeout: per cell (nbclient's); shutdown "immediate": a hung kernel is not waited for
            papermill.execute_notebook(str(source), str(partial), parameters=parameters,
                                       kernel_name=KERNEL_NAME, cwd=str(cwd), progress_bar=False,
                                       log_output=False, execution_timeout=timeout,
                                       shutdown_kernel="immediate", config=transport)
    except PapermillExecutionError as exc:
        return NotebookFailure(str(exc.ename), str(exc.evalue), exc.cell_index, exc.exec_count,
                               str(exc.source)), False
    except Exception as exc:  # a dead or silent kernel, an unreadable notebook
        ename = type(exc).__name__
        if ename not in STOPPED:  # run again only if the kernel was silent at start (jupyter_client)
            return NotebookFailure(ename, str(exc)), "didn't respond" in str(exc)
        evalue = (f"the cell took more than {timeout:g} s" if ename == "CellTimeoutError"
                  else "the kernel died")
        return NotebookFailure(ename, evalue, *_stopped_cell(partial)), True
    return None, False


def _execute(source: Path, output: Path, parameters: dict, cwd: Path,
             timeout: float) -> tuple[NotebookFailure | None, NotebookFailure | None]:
    """Execute ``source`` into ``output``, each cell under ``timeout`` seconds, once more in
    a fresh kernel if a cell timed out or the kernel died: (the failure, or ``None`` when
    every cell ran; why the first run stopped, or ``None`` when it was not run again)."""
    # papermill saves as it goes; it writes beside the output and the file is renamed into
    # place at the end, so build/workbook never holds a half-written notebook.
    partial = output.with_name(f".{output.stem}.partial.ipynb")
    failure, stopped = _execute_once(source, partial, parameters, cwd, timeout)
    first_stop = None
    if stopped:
        first_stop = failure
        failure, stopped = _execute_once(source, partial, parameters, cwd, timeout)
        if stopped:
            failure = dataclasses.replace(failure, evalue=f"{failure.evalue}, again after one kernel restart")
    if partial.exists():
        os.replace(partial, output)
    return failure, first_stop


def run_workbook(profile: str = "smoke", only: Sequence[str] | None = None, html: bool = True,
                 out: str | os.PathLike[str] | None = None, solutions: bool = True, *,
                 root: str | os.PathLike[str] | None = None,
                 results_dir: str | os.PathLike[str] | None = None, progress: bool = True,
                 cell_timeout: float | None = None) -> list[NotebookRun]:
    """Execute the workbook's notebooks and write ``<out>/RESULTS.md``.

    Args:
        profile: ``"smoke"`` (each notebook <= 90 s on a 2-core CPU) or ``"full"``.
        only: run just these notebooks (``01_naive_moe``, ``naive_moe`` or ``01``).
        html: also build the site, ``<out>/site/`` (`moe_lab.workbench.lab.site.build_site`).
        out: the build directory; default ``<root>/build``.
        solutions: the ``SOLUTIONS`` parameter, injected into every notebook (whose own
            default is ``False``, learner mode): ``True`` checks the reference solutions;
            ``False`` checks your answers, reports each exercise not done yet and carries on
            with its reference solution.
        root: the project root, whose ``notebooks/`` are run; default: the moe_lab checkout
            (see ``project_root``).
        results_dir: the ledger's directory; default ``$MOE_LAB_RESULTS_DIR``, else
            ``<out>/results`` (with the default ``out``, the ledger's usual place).
        progress: show a progress bar over the notebooks.
        cell_timeout: the seconds one cell may run (a positive number); default `cell_timeout_s`
            of the profile (``CELL_TIMEOUT_FACTOR`` times its per-notebook budget). A notebook
            whose cell times out, or whose kernel dies, is run once more in a fresh kernel.

    Returns:
        One ``NotebookRun`` per notebook, in order; failed ones carry ``failure``. A
        failure does not raise: the remaining notebooks still run.

    Raises:
        ValueError: an unknown profile, an ``only`` name that matches no notebook, or no
            notebooks at all.
    """
    from tqdm.auto import tqdm  # probes for IPython and ipywidgets; only a run needs it

    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    cell_timeout = cell_timeout or cell_timeout_s(profile)
    root_dir = Path(root).resolve() if root is not None else project_root()
    source_dir = root_dir / "notebooks"
    build = Path(out) if out is not None else root_dir / "build"
    ledger_dir = Path(results_dir or os.environ.get("MOE_LAB_RESULTS_DIR") or build / "results")

    available = find_notebooks(source_dir)
    if not available:
        raise ValueError(f"notebooks_dir {str(source_dir)!r} holds no NN_name.ipynb notebooks")
    notebooks = select_notebooks(available, only)
    executed_dir = build / "workbook"
    _check_writable(executed_dir, "out")
    _check_writable(ledger_dir, "results_dir ($MOE_LAB_RESULTS_DIR)")

    parameters = {"PROFILE": profile, "SOLUTIONS": bool(solutions)}
    runs: list[NotebookRun] = []
    # Set for the duration, inherited by each kernel. MOE_LAB_HEADLESS: no front end renders widgets in
    # a headless run, so explorers draw static figures. PYTHONPATH: the kernel runs in notebooks/ and
    # imports this checkout's moe_lab first, not whichever one is installed (an editable install may
    # point at another checkout).
    path = os.pathsep.join([str(root_dir), *filter(None, [os.environ.get("PYTHONPATH")])])
    environment = {"MOE_LAB_PROFILE": profile, "MOE_LAB_RESULTS_DIR": str(ledger_dir.resolve()),
                   "MOE_LAB_HEADLESS": "1", "PYTHONPATH": path}
    with mock.patch.dict(os.environ, environment):
        bar = tqdm(notebooks, desc="workbook", unit="notebook", disable=not progress)
        for source in bar:
            bar.set_postfix_str(source.stem)
            output = executed_dir / source.name
            start = time.perf_counter()
            failure, restarted = _execute(source, output, parameters, cwd=source_dir.resolve(),
                                          timeout=cell_timeout)
            runs.append(NotebookRun(source.stem, output, time.perf_counter() - start, failure, restarted))
            if restarted is not None:
                tqdm.write(f"RESTARTED {source.stem} once in a fresh kernel: "
                           f"{restarted.describe()}", file=sys.stderr)
            if failure is not None:
                tqdm.write(f"FAILED {source.stem}: {failure.describe()}", file=sys.stderr)
        bar.close()

    write_text_atomically(build / "RESULTS.md", results_markdown(runs, ledger_dir, profile))
    if html:
        # build/site/ (`moe_lab.workbench.lab.site`): a failure is said, not raised (the notebooks
        # ran and RESULTS.md is written).
        try:
            build_site(executed_dir, build / "site", ledger_dir / LEDGER_NAME)
        except Exception as exc:
            print(f"site: not built ({type(exc).__name__}: {exc})", file=sys.stderr)
    return runs


def _check_writable(folder: Path, what: str) -> None:
    """Make ``folder`` and write a file in it, before any notebook runs: a folder that cannot
    take the executed notebooks or the ledger would otherwise lose them after the work."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(f"{what}: {folder} cannot be written ({exc.strerror or exc}); "
                         "nothing was run") from None


# ------------------------------------------------------------------------------ RESULTS.md


def results_markdown(runs: Sequence[NotebookRun], ledger_dir: Path, profile: str) -> str:
    """The text of RESULTS.md: machine, the latest ledger figures, notebook times."""
    summary = capabilities().summary()
    versions = ", ".join(f"{name} {version}" for name, version in library_versions().items())
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    figures = results_table_markdown(latest(read(ledger_dir / LEDGER_NAME))).rstrip()
    lines = ["# moe_lab workbook results", "",
             f"Generated by `python -m moe_lab workbook --profile {profile}` on {stamp}. "
             "Every figure below is read from the results ledger; none is typed by hand.", "",
             "## Machine", "", "```text", summary.rstrip(), "```", "", f"Libraries: {versions}", "",
             "## Figures (latest per notebook, step, metric and hardware)", "", figures, "",
             "## Notebooks", "", "| notebook | status | time (s) |", "|---|---|---:|"]
    lines += [f"| {run.name} | {'ok' if run.ok else 'FAILED'} | {run.seconds:.1f} |" for run in runs]
    total = sum(run.seconds for run in runs)
    lines.append(f"| total | {sum(run.ok for run in runs)}/{len(runs)} ok | {total:.1f} |")
    for title, field in (("Restarted once in a fresh kernel", "restarted"), ("Failures", "failure")):
        listed = [(run.name, getattr(run, field)) for run in runs if getattr(run, field) is not None]
        if listed:
            lines += ["", f"## {title}", ""]
            for name, why in listed:
                description = why.describe().replace("`", "'")
                lines.append(f"- **{name}**: `{description}`")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ CLI


def run(args: argparse.Namespace) -> int:
    """The ``workbook`` command: 0 when every notebook ran, 1 when any failed, 2 when the
    notebooks' tooling is not installed (moe_lab installs without it: the ``notebooks`` extra)."""
    missing = [name for name in NOTEBOOK_TOOLING if importlib.util.find_spec(name) is None]
    if missing:
        print(f"workbook: running the notebooks needs {', '.join(missing)}, not installed here: "
              "pip install -e '.[lab]' (make workbook does)", file=sys.stderr)
        return 2
    runs = run_workbook(profile=args.profile, only=args.only, html=args.html, out=args.out,
                        solutions=args.solutions)
    failed = [run for run in runs if not run.ok]
    build = Path(args.out) if args.out is not None else project_root() / "build"
    print(f"{len(runs) - len(failed)}/{len(runs)} notebooks ran; see {build / 'RESULTS.md'}")
    return 1 if failed else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``workbook`` command to the CLI."""
    parser = subparsers.add_parser("workbook", description=__doc__.splitlines()[0],
                                   help="execute every notebook, export HTML, write build/RESULTS.md")
    parser.add_argument("--profile", choices=PROFILES, default="smoke", help="smoke (CI-sized) or full")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only these notebooks (e.g. 01_naive_moe, naive_moe or 01)")
    parser.add_argument("--no-html", dest="html", action="store_false", help="skip the HTML export")
    parser.add_argument("--out", type=Path, default=None, help="build directory (default: <project>/build)")
    parser.add_argument("--no-solutions", dest="solutions", action="store_false",
                        help="run with SOLUTIONS=False (learner mode): your answers are checked, and each "
                        "exercise not done yet is reported and its reference solution used")
    parser.set_defaults(func=run)
