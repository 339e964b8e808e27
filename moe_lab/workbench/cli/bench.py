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


def check_sizes(args: argparse.Namespace) -> None:
    """Refuse, before anything runs or is recorded, an MX quantizer size that is not whole blocks
    and sizes whose tensors need more memory than this machine has (`moe_lab.memory.check_fits`,
    naming how much). Each size's own kind (a positive integer, ``--tokens 0`` is not "the
    default") is its argparse type, given where the benchmark adds it."""
    if args.benchmark == "mxfp8" and args.size:
        from moe_lab.quant.mx import BLOCK_SIZE

        if any(n % BLOCK_SIZE for n in args.size):
            raise ValueError(f"--size M K must both be multiples of {BLOCK_SIZE} (the MX block: the "
                             f"quantizer blocks rows and columns), got {args.size[0]} {args.size[1]}")
    need = {"router": _router_bytes, "mxfp8": _mxfp8_bytes}.get(args.benchmark)
    if need is not None:
        from moe_lab.memory import check_fits
        from moe_lab.perf.capabilities import capabilities

        for what, nbytes in need(args):
            check_fits(what, nbytes, f"use a smaller {what.split()[0]}", capabilities().device)


def _router_bytes(args: argparse.Namespace) -> list[tuple[str, int]]:
    """A lower bound of ``bench router``'s memory: the float64 and float32 logits."""
    from moe_lab.workbench.benchmarks.router import SHAPES

    if args.tokens is None:
        return []
    experts = max(SHAPES[s]["n_experts"] for s in (SHAPES if args.shape == "all" else [args.shape]))
    return [(f"--tokens {args.tokens} (x {experts} experts)", args.tokens * experts * (8 + 4))]


def _mxfp8_bytes(args: argparse.Namespace) -> list[tuple[str, int]]:
    """Lower bounds of ``bench mxfp8``'s memory: the quantizer's input in float32 and bf16;
    attention's Q, K, V in float32 and the reference's float32 scores, ``[B, H, T, T]``."""
    need = []
    if args.size:
        m, k = args.size
        need.append((f"--size {m} {k}", m * k * (4 + 2)))
    if args.attention:
        b, h, t, d = args.attention
        need.append((f"--attention {b} {h} {t} {d}", 4 * b * h * t * (3 * d + t)))
    return need


def _run(args: argparse.Namespace) -> int:
    check_sizes(args)
    module = importlib.import_module(BENCHMARKS[args.benchmark])
    with ledger.keep_unwritten() as unwritten:  # an unreadable input file: `main` says so in one line
        result = module.run(args)
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
