"""The ``env``, ``flops`` and ``compile`` commands of ``python -m moe_lab``.

``env``: what this machine is (`moe_lab.perf.capabilities`). ``flops``: training FLOPs
per token of a preset, broken down, and the TFLOPS per GPU a token rate implies.
``compile``: every Triton kernel compiled for sm_90 and sm_100 and read
(`moe_lab.workbench.compile_report.report`); no GPU needed. A full compile then writes the
tile-traffic and roofline tables from its reports.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_lab.config import PRESETS, preset
from moe_lab.workbench import jsonout
from moe_lab.workbench.cli import non_negative_float, positive_int


def env_command(args: argparse.Namespace) -> int:
    """Print the capability report (one line, or one JSON object with ``--json``)."""
    from moe_lab.perf.capabilities import capabilities

    caps = capabilities()
    print(jsonout.dumps(caps.to_dict()) if args.json else caps.summary())
    return 0


def flops_command(args: argparse.Namespace) -> int:
    """Print the FLOPs report for ``--preset`` at ``--seq-len``: GFLOP/token, broken down by
    kind, and, with ``--tokens-per-s``, the TFLOPS per GPU that rate implies."""
    from moe_lab.perf import flops

    cfg = preset(args.preset)
    seq = cfg.seq_len if args.seq_len is None else args.seq_len
    include_mtp = not args.no_mtp
    breakdown = flops.flops_breakdown(cfg, seq, include_mtp=include_mtp)
    report = {"preset": args.preset, "seq_len": seq, "include_mtp": include_mtp,
              "gflop_per_token": sum(breakdown.values()) / 1e9,
              "breakdown_gflop_per_token": {k: v / 1e9 for k, v in breakdown.items()}}
    if args.tokens_per_s is not None:
        report["tokens_per_s"] = args.tokens_per_s
        report["tflops_per_gpu"] = flops.tflops_per_gpu(cfg, seq, args.tokens_per_s, include_mtp=include_mtp)
    if args.json:
        print(jsonout.dumps(report))
        return 0
    print(f"{report['preset']} at seq_len {report['seq_len']}"
          f"{'' if report['include_mtp'] else ' (without MTP)'}: "
          f"{report['gflop_per_token']:.1f} GFLOP/token (training, forward + backward)")
    for kind, value in report["breakdown_gflop_per_token"].items():
        print(f"  {kind:<15} {value:10.2f} GFLOP/token")
    if "tflops_per_gpu" in report:
        print(f"at {report['tokens_per_s']:,g} tokens/s/GPU: "
              f"{report['tflops_per_gpu']:,.0f} TFLOPS/GPU")
    return 0


def compile_command(args: argparse.Namespace) -> int:
    """Compile every kernel module's specs for ``--arch``; print the table (or one JSON
    object), write ``<arch>.json`` and ``summary.md`` into ``--out`` (after a full compile also
    ``traffic.md`` and ``roofline.md``), append the figures to the ledger. Exit
    status 1 when a row failed or its two accounts of a figure disagree."""
    from moe_lab.workbench.compile_report import check_modules

    modules = None
    if args.modules is not None:  # "" is no module, not every one
        modules = [m if "." in m else f"moe_lab.kernels.{m}" for m in args.modules.split(",") if m]
        check_modules(modules)  # a typo refused before the first heavy import (Triton, torch)
    from moe_lab.workbench.compile_report import report as compile_report
    from moe_lab.workbench.compile_report import roofline, traffic

    report = compile_report.compile_report(compile_report.parse_archs(args.arch), modules)
    rows = report["rows"]
    from moe_lab.workbench.cli.bench import report_unwritten
    from moe_lab.workbench.measure import ledger

    unsaved = False
    if args.out is not None or modules is None:
        out = args.out if args.out is not None else compile_report.default_out_dir()
        try:
            for path in compile_report.write_results(report, out):
                print(f"wrote {path}", file=sys.stderr)
        except OSError as exc:  # the compiling is done: print the report rather than lose it
            print(f"error: the report could not be written into {out} ({exc}); it is printed below",
                  file=sys.stderr)
            unsaved = True
    # After a full compile, once every target's report is in ``out``, the tile-traffic and
    # roofline tables (`moe_lab.workbench.compile_report.roofline.write_tables`) from them.
    if modules is None and not unsaved and all(p.exists() for p in traffic.reports(Path(out)).values()):
        try:
            for path in roofline.write_tables(Path(out)):
                print(f"wrote {path}", file=sys.stderr)
        except (OSError, ValueError) as exc:  # a report without a launch's row, or an unwritable file
            print(f"error: traffic.md and roofline.md could not be written into {out} ({exc})",
                  file=sys.stderr)
            unsaved = True
    with ledger.keep_unwritten() as unwritten:
        compile_report.record(rows)
    print(jsonout.dumps(report) if args.json else compile_report.format_table(rows))
    unsaved = report_unwritten(unwritten) or unsaved
    bad = [row for row in rows if row.get("error") or not row.get("agree", True)]
    for row in bad:
        why = row.get("error") or f"cuobjdump and ptxas/metadata disagree: {row['checks']}"
        print(f"{row['kernel']} [{row.get('arch')}]: {why.splitlines()[0]}", file=sys.stderr)
    return 1 if bad or unsaved else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``env``, ``flops`` and ``compile`` commands to ``python -m moe_lab``."""
    env = subparsers.add_parser("env", help="capabilities of this machine (detected once)")
    env.add_argument("--json", action="store_true", help="print one JSON object")
    env.set_defaults(func=env_command)

    fl = subparsers.add_parser("flops", help="training FLOPs per token of a preset; TFLOPS/GPU")
    fl.add_argument("--preset", required=True, choices=sorted(PRESETS))
    fl.add_argument("--seq-len", type=positive_int, default=None,
                    help="sequence length (default: the preset's)")
    fl.add_argument("--tokens-per-s", type=non_negative_float, default=None,
                    help="tokens per second per GPU: also report TFLOPS/GPU")
    fl.add_argument("--no-mtp", action="store_true", help="leave multi-token prediction out")
    fl.add_argument("--json", action="store_true", help="print one JSON object")
    fl.set_defaults(func=flops_command)

    co = subparsers.add_parser("compile", help="compile every Triton kernel for sm_90/sm_100 and report "
                               "registers, spills, shared memory, occupancy, tensor cores, async copies")
    co.add_argument("--arch", default="sm_90,sm_100", help="comma-separated targets (default: sm_90,sm_100)")
    co.add_argument("--modules", default=None,
                    help="comma-separated kernel modules (default: all, written to results/compile)")
    co.add_argument("--out", default=None, help="directory for <arch>.json and summary.md")
    co.add_argument("--json", action="store_true", help="print one JSON object")
    co.set_defaults(func=compile_command)
