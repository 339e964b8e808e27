"""The ``bench`` command: ``python -m moe_lab bench NAME [options] [--json]``."""

from __future__ import annotations

import argparse
import importlib
import sys

from moe_lab.workbench.benchmarks import BENCHMARKS
from moe_lab.workbench.jsonout import dumps
from moe_lab.workbench.measure import ledger


def _format(result: dict) -> str:
    rows = result.get("rows")
    lines = [f"{k}: {v}" for k, v in result.items() if k != "rows"]
    if rows:
        cols = list(rows[0])
        lines.append(" | ".join(cols))
        for row in rows:
            cells = [f"{row.get(c):.4g}" if isinstance(row.get(c), float) else str(row.get(c))
                     for c in cols]
            lines.append(" | ".join(cells))
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHMARKS[args.benchmark])
    try:
        with ledger.keep_unwritten() as unwritten:
            result = module.run(args)
    except OSError as exc:  # a missing or unreadable input file: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(dumps(result, default=str) if args.json else _format(result))
    return report_unwritten(unwritten)


def report_unwritten(unwritten: list) -> int:
    """Say, in one line on stderr, that the ledger could not take ``unwritten`` records (the
    result was printed above, so nothing measured is lost); exit status 1 if any."""
    if not unwritten:
        return 0
    path, exc, _ = unwritten[0]
    print(f"error: the ledger {path} could not be written ({exc.strerror or exc}): its "
          f"{len(unwritten)} records are not in it; the result printed above is all that was kept",
          file=sys.stderr)
    return 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark and append it to the ledger")
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, module_name in BENCHMARKS.items():
        # Each benchmark's own arguments; its module is imported only to add them.
        module = importlib.import_module(module_name)
        bench_parser = sub.add_parser(name, help=module.DESCRIPTION)
        module.add_arguments(bench_parser)
        bench_parser.add_argument("--json", action="store_true", help="print one JSON object")
        bench_parser.set_defaults(func=_run)
