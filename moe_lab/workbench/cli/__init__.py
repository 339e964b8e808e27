"""The command line: ``python -m moe_lab <command> ...``.

Each command lives beside the code it drives; a module that offers commands has a
``register(subparsers)`` function that adds them and sets ``func`` on its parser.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys

COMMAND_MODULES = {  # command -> the module that registers it
    "env": "moe_lab.workbench.cli.env", "flops": "moe_lab.workbench.cli.env",
    "compile": "moe_lab.workbench.cli.env",
    "train": "moe_lab.workbench.cli.train",
    "workbook": "moe_lab.workbench.lab.workbook",
    "bench": "moe_lab.workbench.cli.bench",
    "sim": "moe_lab.workbench.cli.sim",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command`` alone (only its module imported: a
    command that needs no torch starts without it)."""
    parser = argparse.ArgumentParser(prog="python -m moe_lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = [COMMAND_MODULES[command]] if command in COMMAND_MODULES else COMMAND_MODULES.values()
    for name in dict.fromkeys(names):
        importlib.import_module(name).register(sub)
    return parser


def _number(text: str, kind: type, ok, expected: str) -> int | float:
    """``text`` as ``kind`` when ``ok(value)``, else argparse's error saying what was expected."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer > 0."""
    return _number(text, int, lambda v: v > 0, "a positive integer")


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer >= 0."""
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0."""
    return _number(text, float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def non_negative_float(text: str) -> float:
    """An argparse ``type``: a finite number >= 0."""
    return _number(text, float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


#: Exit status of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 130


def interrupted(what: str) -> int:
    """Say in one line that Ctrl-C stopped ``what``; returns `EXIT_INTERRUPTED`."""
    print(f"interrupted (Ctrl-C): {what} stopped before it finished", file=sys.stderr)
    return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    command = "python -m moe_lab"
    try:  # Ctrl-C anywhere, start-up included (the parser imports every command's module)
        argv = sys.argv[1:] if argv is None else argv
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        command += f" {args.command}"
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # `train` catches its own, to say where its checkpoint stands
        return interrupted(command)
    except (ValueError, OSError) as exc:  # bad input, a missing or unreadable file: one line
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
