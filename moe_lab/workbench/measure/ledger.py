"""The results ledger: every figure a notebook reports, one JSON line each.

A notebook measures something (tokens/s, host syncs per step, bytes moved) and calls
``record(notebook, step, metric, value, unit)``; the ledger appends one line to
``ledger.jsonl`` holding the figure together with the hardware it was measured on, the
library versions, the time (UTC) and the profile. Everything that shows a figure later —
``build/RESULTS.md``, the README's gains table, the final notebook's waterfall — reads the
ledger, so no figure is ever typed by hand.

Where the ledger lives: ``$MOE_LAB_RESULTS_DIR/ledger.jsonl`` when that variable is set,
else ``<project root>/build/results/ledger.jsonl``. The project root is the nearest parent
of the current directory holding the moe-lab ``pyproject.toml``, so a notebook executing
with cwd ``notebooks/`` writes to the same ledger as the command line.

A notebook run by hand in JupyterLab (not by the workbook runner, which sets
``$MOE_LAB_PROFILE``, nor headless under papermill, ``$MOE_LAB_HEADLESS=1``) records to
``lab-ledger.jsonl`` beside it instead, each record tagged ``"source": "lab"``: a learner's
run never replaces the workbook's figures that later notebooks, ``RESULTS.md`` and the site
read. In such a session ``read()`` returns both files, so the learner's notebooks see their
own figures too; the site and ``RESULTS.md`` read ``ledger.jsonl`` by path, and drop any
record tagged ``lab`` (`workbook_records`).

Why appends cannot corrupt it: each record is encoded to one ``bytes`` line first and
written with a single ``os.write`` on a descriptor opened with ``O_APPEND``. The kernel
moves to the end of the file and writes in one step, so concurrent writers (two notebooks,
a notebook and the workbook runner) never interleave inside a line and never overwrite
each other. A crash can still leave a torn last line; the next ``record`` starts on a
fresh line when it finds one (checking the last byte under an advisory ``flock``, so a
long line another writer is still copying in is not mistaken for a torn one), and
``read`` skips a line that does not parse, with a warning. Rewriting the whole file
through a temporary file and a rename was the other choice; it costs a full copy per
figure and loses a figure when two writers rename at once, so it is not used here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import numbers
import os
import re
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from moe_lab.perf.capabilities import capabilities, library_versions

RESULTS_ENV = "MOE_LAB_RESULTS_DIR"
PROFILE_ENV = "MOE_LAB_PROFILE"
LEDGER_NAME = "ledger.jsonl"
LAB_LEDGER_NAME = "lab-ledger.jsonl"
HEADLESS_ENV = "MOE_LAB_HEADLESS"
LAB_SOURCE = "lab"
PROJECT_NAME = "moe-lab"

# Keys every record has; ``**extra`` may add others but not replace these (bar ``profile``).
CORE_KEYS = ("notebook", "step", "metric", "value", "unit", "hardware", "versions", "time")

# What makes two records the same figure (`latest` keeps the newest of each).
KEYS = ("notebook", "step", "metric", "hardware")

# Extra fields that give the size a figure was measured at: a positive integer when present.
SIZE_FIELDS = ("tokens", "batch", "batch_size", "seq_len", "ranks", "tokens_per_rank", "n_chunks")


class LedgerWarning(UserWarning):
    """A ledger line could not be read (a torn write, a hand edit) and was skipped."""


# ------------------------------------------------------------------------------ location


def _is_moe_lab_pyproject(path: Path) -> bool:
    """Whether ``path`` is a pyproject.toml whose ``[project] name`` is ``moe-lab``."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return False
    # The [project] table's name line (read as text: Python 3.10 has no tomllib).
    section = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    return bool(section) and bool(
        re.search(rf'^name\s*=\s*["\']{PROJECT_NAME}["\']', section.group(1), re.M))


def find_project_root(start: str | os.PathLike[str] | None = None) -> Path | None:
    """The nearest directory at or above ``start`` (default: cwd) holding moe-lab's pyproject.

    Returns ``None`` when there is none, e.g. moe_lab installed from a wheel and run
    outside the checkout.
    """
    here = Path(start if start is not None else Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if _is_moe_lab_pyproject(directory / "pyproject.toml"):
            return directory
    return None


def results_dir() -> Path:
    """Where the ledger lives: ``$MOE_LAB_RESULTS_DIR``, else ``<root>/build/results``.

    Without a project root above the current directory, ``./build/results``.
    """
    env = os.environ.get(RESULTS_ENV)
    if env:
        return Path(env)
    root = find_project_root()
    return (root if root is not None else Path.cwd()) / "build" / "results"


def ledger_path() -> Path:
    """The ledger file: ``results_dir() / "ledger.jsonl"``."""
    return results_dir() / LEDGER_NAME


def lab_session() -> bool:
    """True inside a Jupyter kernel that neither the workbook runner (``$MOE_LAB_PROFILE``)
    nor a headless run (``$MOE_LAB_HEADLESS=1``) started: a learner running cells by hand."""
    if os.environ.get(PROFILE_ENV) or os.environ.get(HEADLESS_ENV) == "1":
        return False
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def workbook_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` without those of hand-run notebooks (tagged ``"source": "lab"``)."""
    return [r for r in records if r.get("source") != LAB_SOURCE]


# ------------------------------------------------------------------------------ writing


def _check_name(argument: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{argument} must be a non-empty string, got {value!r}")


def _check_value(metric: str, value: object) -> int | float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"value of metric {metric!r} must be a real number (int or float), "
            f"got {type(value).__name__} {value!r}"
        )
    if isinstance(value, numbers.Integral):
        return int(value)
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"value of metric {metric!r} must be finite, got {number!r}")
    return number


def _check_measured(metric: str, number: int | float, unit: str, extra: dict[str, Any]) -> None:
    """A figure is a measurement of something real: a rate (a unit per second) is > 0 (nothing
    moved in no time is no measurement), and a size it was measured at (`SIZE_FIELDS`) is a
    positive integer (``--size 0 0`` measured nothing)."""
    if unit.endswith("/s") and not number > 0:
        raise ValueError(f"value of metric {metric!r} is a rate ({unit}) and must be > 0, got {number!r}")
    for field in SIZE_FIELDS:
        size = extra.get(field)
        if size is not None and (isinstance(size, bool) or not isinstance(size, numbers.Integral)
                                 or size < 1):
            raise ValueError(f"{field} of metric {metric!r} (the size it was measured at) must be a "
                             f"positive integer, got {size!r}")


def _append_line(path: Path, line: bytes) -> None:
    """Append ``line`` (ending in a newline) to ``path`` with one write on an O_APPEND fd."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Read-write only so the last byte can be checked; O_APPEND still puts every write at the end.
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        # Only for the torn-line check below: another writer's long line may be half
        # copied in when we look at the last byte. The write itself needs no lock.
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        # A crash mid-write may have left a torn last line: start on a fresh one so the
        # torn bytes stay a line of their own (which `read` skips) instead of
        # swallowing this record.
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock


def record(
    notebook: str,
    step: str,
    metric: str,
    value: float,
    unit: str,
    *,
    hardware: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Append one figure to the ledger and return the record written.

    Args:
        notebook: the notebook that measured it, e.g. ``"01_naive_moe"``.
        step: what was measured within it, e.g. ``"naive"`` or ``"dropless"``.
        metric: the quantity, e.g. ``"tokens_per_s"``.
        value: a finite number; ints stay ints (counts), other reals become floats.
        unit: e.g. ``"tok/s"``, ``"ms"``, ``"syncs"``; ``""`` for a pure ratio.
        hardware: the label of the machine; default: ``capabilities().hardware_label()``.
            Pass it when recording a figure measured elsewhere.
        **extra: more JSON-serialisable fields (``profile``, ``spread``, ``n_repeats``, ...).
            ``profile`` defaults to ``$MOE_LAB_PROFILE`` (set by the workbook runner).

    Raises:
        ValueError: an empty name, a non-finite or non-numeric value, a rate that is not > 0,
            a size field (`SIZE_FIELDS`) that is not a positive integer, an extra field that
            would replace a core field, or an extra value JSON cannot hold.
    """
    for argument, name in (("notebook", notebook), ("step", step), ("metric", metric)):
        _check_name(argument, name)
    number = _check_value(metric, value)
    if not isinstance(unit, str):
        raise ValueError(f"unit of metric {metric!r} must be a string, got {unit!r}")
    _check_measured(metric, number, unit, extra)
    if hardware is not None:
        _check_name("hardware", hardware)
    clashes = sorted(set(extra) & set(CORE_KEYS))
    if clashes:
        raise ValueError(
            f"extra fields must not replace the core fields {list(CORE_KEYS)}, got {clashes}"
        )

    profile = extra.pop("profile", None)
    if profile is None:
        profile = os.environ.get(PROFILE_ENV) or None
    entry: dict[str, Any] = {
        "notebook": notebook,
        "step": step,
        "metric": metric,
        "value": number,
        "unit": unit,
        "hardware": hardware if hardware is not None else capabilities().hardware_label(),
        "versions": library_versions(),
        "time": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        "profile": profile,
        **extra,
    }
    lab = lab_session()
    if lab:  # a hand run: its own file, tagged, so it never replaces the workbook's figures
        entry["source"] = LAB_SOURCE
    try:
        line = json.dumps(entry, allow_nan=False, ensure_ascii=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"extra fields of metric {metric!r} must be JSON-serialisable and finite: {exc}"
        ) from None
    path = results_dir() / (LAB_LEDGER_NAME if lab else LEDGER_NAME)
    try:
        _append_line(path, line.encode("utf-8"))
    except OSError as exc:
        if _unwritten is None:
            raise
        _unwritten.append((path, exc, entry))
    return entry


# Records that `record` could not write while `keep_unwritten` is active.
_unwritten: list[tuple[Path, OSError, dict[str, Any]]] | None = None


@contextlib.contextmanager
def keep_unwritten() -> Iterator[list[tuple[Path, OSError, dict[str, Any]]]]:
    """Within it, a ledger `record` that cannot be written (a read-only or full disk) does not
    raise: the work measured so far goes on, and the ``(path, error, record)`` of each such
    record is appended to the list it yields, for the caller to report and keep. Used by the
    commands (``bench``, ``compile``) so that minutes of measuring are never thrown away."""
    global _unwritten
    outer, _unwritten = _unwritten, []
    try:
        yield _unwritten
    finally:
        _unwritten = outer


# ------------------------------------------------------------------------------ reading


def read(path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """All records in the ledger at ``path`` (default: ``ledger_path()``), oldest first.

    A missing ledger is an empty one. A line that is not a record (a write torn by a crash,
    a hand edit: not a JSON object, no metric or value, a value that is not a finite
    number) is skipped with a ``LedgerWarning`` naming the file, the line and why. With
    no ``path`` in a hand-run Jupyter session (`lab_session`), the records of
    ``lab-ledger.jsonl`` follow those of ``ledger.jsonl``.
    """
    if path is None and lab_session():
        return _read_file(ledger_path()) + _read_file(results_dir() / LAB_LEDGER_NAME)
    return _read_file(Path(path) if path is not None else ledger_path())


def _read_file(file: Path) -> list[dict[str, Any]]:
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return []
    records: list[dict[str, Any]] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            item = None
        why = _not_a_record(item)
        if why:
            warnings.warn(
                f"{file}: line {number} is not a ledger record and was skipped "
                f"({why}): {raw[:80]!r}",
                LedgerWarning,
                stacklevel=3,
            )
            continue
        records.append(item)
    return records


def _not_a_record(item: object) -> str:
    """Why ``item`` (a parsed line) is not a ledger record, or ``""`` when it is one."""
    if not isinstance(item, dict):
        return "not a JSON object: a torn write?"
    missing = [key for key in ("metric", "value") if key not in item]
    if missing:
        return f"no {' and no '.join(missing)}"
    try:
        _check_value(str(item["metric"]), item["value"])
    except ValueError as exc:
        return str(exc)
    return ""


def _time_of(item: dict[str, Any]) -> datetime:
    try:
        moment = datetime.fromisoformat(str(item["time"]))
    except (KeyError, ValueError):
        return datetime.min.replace(tzinfo=timezone.utc)
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def latest(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest record (by ``time``; later in the list on a tie) of each figure: each value of
    ``KEYS`` (notebook, step, metric, hardware).

    The result keeps the order in which each key first appears in ``records``.
    """
    newest: dict[tuple[str, ...], tuple[datetime, int, dict[str, Any]]] = {}
    for index, item in enumerate(records):
        key = tuple(json.dumps(item.get(name), sort_keys=True) for name in KEYS)
        candidate = (_time_of(item), index, item)
        if key not in newest or candidate[:2] >= newest[key][:2]:
            newest[key] = candidate
    # Dicts keep insertion order: each key sits where it first appeared.
    return [item for _, _, item in newest.values()]


def format_value(value: object) -> str:
    """A figure for a table: ints with thousands separators, reals to 4 significant figures.

    ``6338`` → ``"6,338"``; ``1648.27`` → ``"1,648"``; ``0.012345`` → ``"0.01235"``;
    ``3.2e-07`` → ``"3.200e-07"``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    number = float(value)
    if not math.isfinite(number) or number == 0.0:
        return f"{number:g}"
    magnitude = math.floor(math.log10(abs(number)))
    if magnitude < -3 or magnitude >= 6:
        return f"{number:.3e}"
    decimals = max(0, 3 - magnitude)
    return f"{number:,.{decimals}f}"


def markdown_table(head: Sequence[str], align: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: the ``head`` row, the ``align`` markers, then ``rows`` (a cell ``None``
    is empty; a ``|`` or a line break inside a cell is escaped)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        cells = ("" if value is None else str(value).replace("|", "\\|").replace("\n", " ") for value in row)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


TABLE_COLUMNS = ("notebook", "step", "metric", "value", "unit", "hardware", "date")


def figures_table_markdown(records: Iterable[dict[str, Any]], steps: Sequence[str],
                           metrics: dict[str, str]) -> str:
    """A small markdown table of chosen figures: one row per step of ``steps`` (in that order;
    a step without any of the figures is left out), one column per metric of ``metrics``
    (metric -> column heading), each cell the value and its unit; a row per hardware where
    the records come from more than one. ``""`` when no record matches.

    Pass ``latest(read())`` filtered to one notebook: a recap of the few figures that matter,
    not every row that notebook wrote (`results_table_markdown` shows them all).
    """
    if isinstance(steps, str) or isinstance(metrics, str) or not steps or not metrics:
        raise ValueError(f"steps and metrics must be non-empty collections, got {steps!r}, {metrics!r}")
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for item in records:
        step, metric = item.get("step"), item.get("metric")
        if step in steps and metric in metrics:
            value = format_value(item.get("value"))
            unit = item.get("unit") or ""
            cells.setdefault((step, str(item.get("hardware", ""))), {})[metric] = (
                f"{value} {unit}".strip())
    if not cells:
        return ""
    hardware = sorted({where for _, where in cells})
    several = len(hardware) > 1
    rows = [(step, *([where] if several else []), *(cells[step, where].get(m, "") for m in metrics))
            for step in steps for where in hardware if (step, where) in cells]
    table = markdown_table(["step", *(["hardware"] if several else []), *metrics.values()],
                            ["---"] * (1 + several) + ["---:"] * len(metrics), rows)
    return table if several else table + f"\n_measured on {hardware[0]}_\n"


def results_table_markdown(records: Iterable[dict[str, Any]]) -> str:
    """One markdown table of ``records``: notebook, step, metric, value, unit, hardware, date.

    Rows are grouped by notebook (sorted), keeping the records' order within a notebook.
    Pass ``latest(read())`` for one row per figure. No records: a one-line note instead.
    """
    rows = sorted(records, key=lambda item: str(item.get("notebook", "")))
    if not rows:
        return "_No figures in the ledger yet: run `make workbook`._\n"
    return markdown_table(TABLE_COLUMNS, ["---", "---", "---", "---:", "---", "---", "---"], [
        (item.get("notebook"), item.get("step"), item.get("metric"), format_value(item.get("value")),
         item.get("unit"), item.get("hardware"), str(item.get("time", ""))[:10]) for item in rows])
