#!/usr/bin/env python
"""Print the README's "Gains" table from the results ledger — never typed by hand.

    python scripts/readme_gains.py                      # the project's ledger and results/
    python scripts/readme_gains.py --ledger build/results/ledger.jsonl --results results

One row per workbook notebook: its headline figure (chosen as the site's index chooses it,
`moe_lab.workbench.lab.site.HEADLINES`) as measured on a CPU, the machine and date, and the command that
reproduces it, and beside it its GPU line (what the technique moves on an H200/B200/GB300,
published or projected, `moe_lab.workbench.lab.site.GPU_LINES`). Then, for every
``results/<gpu>/`` folder: the same table from its ``ledger.jsonl`` when the workbook was run
there with ``MOE_LAB_RESULTS_DIR=results/<gpu>``, and the benchmarks of ``scripts/gpu_check.py``
from its ``bench.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_lab.workbench.lab.notebook_files import NOTEBOOK_PATTERN  # noqa: E402  (after the path is set)
from moe_lab.workbench.lab.site import headline_rows, on_cpu_or_machine_free  # noqa: E402
from moe_lab.workbench.measure.ledger import LedgerWarning, ledger_path, read  # noqa: E402

# Units whose figures cannot be negative: counts and ratios (a "%" gap and a bare number may be).
COUNT_UNITS = ("syncs", "x", "×", "B", "warps", "kernels", "ops", "tokens")


def corrupt(record: dict) -> str:
    """Why ``record`` cannot be published (a time that is not a date or is in the future, a
    negative count or rate, a share outside [0, 1]), or ``""``: the README must not carry a
    figure that a corrupted line made."""
    try:
        moment = datetime.fromisoformat(str(record.get("time")))
    except ValueError:
        return f"its time {record.get('time')!r} is not a date"
    tomorrow = datetime.now(timezone.utc) + timedelta(days=1)  # a clock a little ahead is no corruption
    if (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)) > tomorrow:
        return f"its time {record.get('time')!r} is in the future"
    value, unit = record["value"], str(record.get("unit") or "")
    if unit == "fraction" and not 0 <= value <= 1:
        return f"a fraction of {value!r}, outside [0, 1]"
    if (unit in COUNT_UNITS or unit.endswith("/s")) and value < 0:
        return f"a negative figure ({value!r} {unit})"
    return ""


def read_ledger(path: Path) -> list[dict]:
    """The records of the ledger at ``path`` fit to publish, with a `LedgerWarning` for each
    line skipped (not a record, or `corrupt`). ``ValueError`` when none is left: an empty or
    garbage ledger would give a README table of "not measured yet"."""
    with warnings.catch_warnings(record=True) as unreadable:
        warnings.simplefilter("always")
        records = read(path)
    notes = [str(warning.message) for warning in unreadable]
    good = []
    for item in records:
        why = corrupt(item)
        if why:
            notes.append(f"{path}: the record of {item.get('notebook')} / {item.get('metric')} was "
                         f"skipped: {why}")
        else:
            good.append(item)
    if not good:
        raise ValueError(f"{path} holds no record fit to publish ({len(unreadable)} unreadable "
                         f"line(s), {len(records)} corrupt record(s)); run `make workbook` first")
    for note in notes:
        warnings.warn(note, LedgerWarning, stacklevel=2)
    return good


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def gpu_line_cell(row: dict) -> str:
    """The GPU line beside a headline: figure, GPU, and whether it is published or projected
    (with the citation or the assumptions); ``—`` when the ledger holds none."""
    gpu = row.get("gpu")
    if not gpu:
        return "—"
    kind = "projection" if gpu["kind"] == "projection" else "published"
    return _cell(f"{gpu['figure']} on {gpu['hardware']}: {gpu['label']} ({kind}: {gpu['basis']})")


def ledger_table(records: list[dict], notebooks: list[str], hardware=None,
                 gpu_lines: bool = False) -> list[str]:
    """The headline table; with ``gpu_lines`` a column holds each notebook's GPU line."""
    extra_head, extra_rule = (" on a GPU |", "---|") if gpu_lines else ("", "")
    lines = [f"| notebook | headline | figure |{extra_head} measured on | reproduce |",
             f"|---|---|---:|{extra_rule}---|---|"]
    for row in headline_rows(records, notebooks, hardware):
        gpu = f" {gpu_line_cell(row)} |" if gpu_lines else ""
        if row["record"] is None:
            lines.append(f"| {row['notebook']} | not measured yet | — |{gpu} — | "
                         f"`{_cell(row['command'])}` |")
            continue
        profile = f", {row['profile']} profile" if row.get("profile") else ""
        lines.append(f"| {row['notebook']} | {_cell(row['label'])} | {_cell(row['figure'])} |{gpu} "
                     f"{_cell(row['hardware'])}, {row['date']}{profile} | "
                     f"`{_cell(row['command'])}` |")
    return lines


def gpu_check_table(folder: Path) -> list[str]:
    """The benchmarks of ``scripts/gpu_check.py`` stored in ``folder/bench.json``."""
    bench = json.loads((folder / "bench.json").read_text())
    env = json.loads((folder / "env.json").read_text())  # gpu_check writes it with every bench.json
    lines = [f"Measured {env.get('date', '?')} on {env.get('gpu', folder.name)} "
             f"(torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}); reproduce: "
             "`python scripts/gpu_check.py`.", "",
             "| benchmark | figures |", "|---|---|"]
    for entry in bench:
        fields = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in entry.items() if k != "bench")
        lines.append(f"| {_cell(entry.get('bench', '?'))} | {_cell(fields)} |")
    return lines


def gains_markdown(ledger: Path, results: Path, notebooks: list[str]) -> str:
    records = read_ledger(ledger)
    out = ["### Measured on a CPU (simulations and counts included)", "",
           *ledger_table(records, notebooks, on_cpu_or_machine_free, gpu_lines=True)]
    if results.is_dir():
        for folder in sorted(p for p in results.iterdir() if p.is_dir()):
            section: list[str] = []
            if (folder / "ledger.jsonl").exists():
                gpu_records = [r for r in read_ledger(folder / "ledger.jsonl")
                               if not on_cpu_or_machine_free(r)]
                section += ledger_table(gpu_records, notebooks, None)
            if (folder / "bench.json").exists():
                section += ([""] if section else []) + gpu_check_table(folder)
            if section:
                out += ["", f"### Measured on {folder.name}", "", *section]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledger", type=Path, default=None,
                        help="the ledger (default: $MOE_LAB_RESULTS_DIR or build/results)")
    parser.add_argument("--results", type=Path, default=ROOT / "results",
                        help="folder of results/<gpu>/ (default: results/)")
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks")
    args = parser.parse_args(argv)
    ledger = args.ledger if args.ledger is not None else ledger_path()
    if not ledger.is_file():
        # An empty table would read as "nothing measured yet" and be pasted into the README.
        print(f"readme_gains: no ledger at {ledger}; run `make workbook` first (or pass --ledger)",
              file=sys.stderr)
        return 1
    notebooks = sorted(p.stem for p in args.notebooks.glob("*.ipynb") if NOTEBOOK_PATTERN.match(p.name))
    try:
        with warnings.catch_warnings():  # a line skipped: one line on stderr, not two
            warnings.simplefilter("always", LedgerWarning)
            warnings.showwarning = lambda message, *_: print(f"readme_gains: {message}", file=sys.stderr)
            text = gains_markdown(ledger, args.results, notebooks)
    except (OSError, ValueError) as exc:  # an unreadable, empty or corrupt ledger: one line
        print(f"readme_gains: {exc}", file=sys.stderr)
        return 1
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
