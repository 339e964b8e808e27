"""The command line: ``python -m moe_lab <command> ...``.

Each command lives beside the code it drives; a module that offers commands has a
``register(subparsers)`` function that adds them and sets ``func`` on its parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "moe_lab.workbench.cli.env",  # env, flops, compile
    "moe_lab.workbench.cli.train",  # train
    "moe_lab.workbench.lab.workbook",  # workbook
    "moe_lab.workbench.cli.bench",  # bench NAME
    "moe_lab.workbench.cli.sim",  # sim pipeline|fabric
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moe_lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


#: Exit status of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 130


def interrupted(what: str) -> int:
    """Say in one line that Ctrl-C stopped ``what``; returns `EXIT_INTERRUPTED`."""
    print(f"interrupted (Ctrl-C): {what} stopped before it finished", file=sys.stderr)
    return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    command = "python -m moe_lab"
    try:  # Ctrl-C anywhere, start-up included (the parser imports every command's module)
        args = build_parser().parse_args(argv)
        command += f" {args.command}"
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # `train` catches its own, to say where its checkpoint stands
        return interrupted(command)
    except ValueError as exc:  # bad input: one clear line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
