#!/usr/bin/env python
"""A mutation check: plant one plausible bug at a time and see whether the tests notice.

    python scripts/mutate.py                         # every target, 8 mutants each (seed 0)
    python scripts/mutate.py --target router --per-target 20 --seed 3
    python scripts/mutate.py --list                  # the mutants it would try, nothing run

Each mutant changes one spot of one module of the lesson, the way a hurried edit would:
a comparison's strictness (``<`` ↔ ``<=``, ``==`` ↔ ``!=``), an arithmetic operator
(``+`` ↔ ``-``, ``*`` ↔ ``/``), a small integer constant (``n`` → ``n + 1``), a boolean
(``and`` ↔ ``or``, ``True`` ↔ ``False``), or a call statement removed (an ``all_reduce``,
an ``fsync``, a ``zero_()``). The mutant is written into a scratch copy of the checkout —
the checkout itself is never modified — and the tests that cover that module (`TARGETS`)
run against it under a timeout. A mutant is *killed* when a test fails or the run times out,
*survives* when every test passes; the report lists each survivor with its file, line and
change, and ends with the survival rate. ``--json PATH`` writes the whole report.

A survivor is either a missing test (write one that fails on it) or a change that cannot be
observed here (an equivalent mutant, or code reachable only on a GPU): say which.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: target name -> (the module files mutated, the tests that cover them)
TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "router": (("moe_lab/moe/router.py",),
               ("tests/lesson/moe/test_router.py", "tests/lesson/moe/test_megatron_oracle.py")),
    "dispatch": (("moe_lab/moe/dispatch.py",),
                 ("tests/lesson/moe/test_dispatch.py", "tests/lesson/moe/test_moe_layer.py")),
    "stash": (("moe_lab/moe/stash.py",), ("tests/lesson/moe/test_stash.py",)),
    "mx": (("moe_lab/quant/mx.py",), ("tests/lesson/quant",)),
    "kernels-grouped": (("moe_lab/kernels/grouped_gemm.py",),
                        ("tests/lesson/kernels/test_grouped_gemm.py",)),
    "kernels-mx": (("moe_lab/kernels/mx_gemm.py", "moe_lab/kernels/mx_quantize.py"),
                   ("tests/lesson/kernels/test_mx_gemm.py", "tests/lesson/kernels/test_mx_quantize.py")),
    "kernels-router": (("moe_lab/kernels/fused_router.py",),
                       ("tests/lesson/kernels/test_router_kernel.py",)),
    "kernels-fused": (("moe_lab/kernels/fused_moe.py",), ("tests/lesson/kernels/test_fused_moe.py",)),
    "kernels-permute": (("moe_lab/kernels/permute.py",), ("tests/lesson/kernels/test_permute.py",)),
    "balance": (("moe_lab/moe/balance.py",), ("tests/lesson/moe/test_balance.py",)),
    "parallel": (("moe_lab/parallel/ep.py",),
                 ("tests/lesson/parallel/test_ep.py", "tests/lesson/parallel/test_clip_grad_norm_ep.py")),
    "parallel-overlap": (("moe_lab/parallel/chunks.py", "moe_lab/parallel/merged.py"),
                         ("tests/lesson/parallel/test_overlap.py", "tests/lesson/parallel/test_merged.py",
                          "tests/lesson/parallel/test_merged_streams.py")),
    "schedule": (("moe_lab/sim/schedule.py",), ("tests/lesson/sim/test_schedule.py",)),
    "checkpoint": (("moe_lab/workbench/training/checkpoint.py",),
                   ("tests/workbench/training/test_checkpoint_durability.py",
                    "tests/workbench/training/test_checkpoint_temporaries.py",
                    "tests/workbench/training/test_train.py")),
}

_COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                  ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
_BINOP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
                ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv}
_SYMBOL = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
           ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.And: "and", ast.Or: "or"}


@dataclass(frozen=True)
class Mutant:
    """One planted bug: ``path``'s node number ``index`` (in `ast.walk` order) changed."""

    path: str
    line: int
    index: int
    kind: str
    change: str


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _is_check(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Inside a ``raise`` or an argument-checking ``if`` that raises: mutating a message or
    a bad-input guard tells little about the lesson's computations."""
    while id(node) in parents:
        node = parents[id(node)]
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.If) and any(isinstance(s, ast.Raise) for s in node.body):
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
    return False


def _is_guard(call: ast.Call) -> bool:
    """A call that checks arguments (``positive_int(...)``, ``REGISTRY.check(...)``): removing it
    lets bad input through, which the error tests cover, not the lesson's numerics."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    return name in _GUARDS or name.startswith("check") or name.startswith("_check")


_GUARDS = {"positive_int", "positive_ints", "non_negative_int", "non_negative_ints", "int_in",
           "positive_number", "non_negative_number", "one_of", "boolean", "integer", "check_fits"}


def mutants_of(path: str, source: str) -> list[Mutant]:
    """Every mutant this script knows for ``source`` (the file at ``path``)."""
    tree = ast.parse(source)
    docstrings = _docstring_nodes(tree)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for index, node in enumerate(ast.walk(tree)):
        line = getattr(node, "lineno", 0)
        if _is_check(node, parents):
            continue
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE_SWAPS:
            op = type(node.ops[0])
            found.append(Mutant(path, line, index, "compare",
                                f"{_SYMBOL[op]} -> {_SYMBOL[_COMPARE_SWAPS[op]]}"))
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
            op = type(node.op)
            found.append(Mutant(path, line, index, "arithmetic",
                                f"{_SYMBOL[op]} -> {_SYMBOL[_BINOP_SWAPS[op]]}"))
        elif isinstance(node, ast.BoolOp):
            other = "or" if isinstance(node.op, ast.And) else "and"
            found.append(Mutant(path, line, index, "boolean", f"{_SYMBOL[type(node.op)]} -> {other}"))
        elif (isinstance(node, ast.Constant) and id(node) not in docstrings
              and type(node.value) is int and 0 <= node.value <= 64):
            found.append(Mutant(path, line, index, "constant", f"{node.value} -> {node.value + 1}"))
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            found.append(Mutant(path, line, index, "constant", f"{node.value} -> {not node.value}"))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and not _is_guard(node.value):
            found.append(Mutant(path, line, index, "call removed", ast.unparse(node.value)[:60]))
    return found


def apply(source: str, mutant: Mutant) -> str:
    """``source`` with ``mutant`` (one of `mutants_of` this source) planted (the rest of the
    file as `ast.unparse` writes it)."""
    tree = ast.parse(source)
    node = list(ast.walk(tree))[mutant.index]
    if isinstance(node, ast.Compare):
        node.ops = [_COMPARE_SWAPS[type(node.ops[0])]()]
    elif isinstance(node, ast.BinOp):
        node.op = _BINOP_SWAPS[type(node.op)]()
    elif isinstance(node, ast.BoolOp):
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif isinstance(node, ast.Constant):
        node.value = not node.value if type(node.value) is bool else node.value + 1
    else:  # an expression statement: the call removed, a statement that does nothing left
        node.value = ast.Constant(None)
    return ast.unparse(ast.fix_missing_locations(tree))


def _scratch_copy() -> Path:
    """The checkout's sources and tests in a scratch folder (the checkout is never touched)."""
    scratch = Path(tempfile.mkdtemp(prefix="moe_lab_mutate_"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in ("moe_lab", "tests", "scripts", "notebooks", "data"):
        shutil.copytree(ROOT / name, scratch / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", scratch / "pyproject.toml")
    return scratch


def run_mutant(scratch: Path, mutant: Mutant, tests: tuple[str, ...], timeout_s: float) -> str:
    """``"killed"``, ``"survived"`` or ``"timeout"`` (counted as killed: the tests noticed)."""
    original = (ROOT / mutant.path).read_text()
    target = scratch / mutant.path
    target.write_text(apply(original, mutant))
    # The CPU plug-in, where a test loads it, is built once per run inside the scratch folder
    # (its own sources' build; removed with the folder).
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
           "TORCH_EXTENSIONS_DIR": str(scratch / ".extensions")}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               *tests], cwd=scratch, env=env, capture_output=True, timeout=timeout_s)
        return "survived" if done.returncode == 0 else "killed"
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        target.write_text(original)


def choose(per_target: int | None, seed: int, targets: list[str]) -> list[tuple[str, Mutant]]:
    rng = random.Random(seed)
    chosen = []
    for name in targets:
        pool = [m for path in TARGETS[name][0] for m in mutants_of(path, (ROOT / path).read_text())]
        picked = pool if per_target is None or per_target >= len(pool) else rng.sample(pool, per_target)
        chosen += [(name, m) for m in sorted(picked, key=lambda m: (m.path, m.line, m.index))]
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help="a target (repeatable; default: all)")
    parser.add_argument("--per-target", type=int, default=8, help="mutants per target (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="which mutants are sampled")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's tests")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--start", type=int, default=1,
                        help="run from the START-th mutant of the sample on (resumes a run cut short)")
    parser.add_argument("--count", type=int, default=0,
                        help="run at most COUNT mutants from START (0: all the rest)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.per_target < 0:
        parser.error(f"--per-target must be >= 0, got {args.per_target}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    chosen = choose(args.per_target or None, args.seed, args.target or sorted(TARGETS))
    if not 1 <= args.start <= max(len(chosen), 1):
        parser.error(f"--start must be between 1 and {len(chosen)} (the sample's size), got {args.start}")
    if args.count < 0:
        parser.error(f"--count must be >= 0, got {args.count}")
    if args.list:
        for i, (name, m) in enumerate(chosen, 1):
            print(f"{i:3d} {name:16s} {m.path}:{m.line}  {m.kind}: {m.change}")
        return 0
    scratch = _scratch_copy()
    results = []
    try:
        stop = args.start - 1 + args.count if args.count else len(chosen)
        for i, (name, m) in enumerate(chosen[args.start - 1:stop], args.start):
            start = time.monotonic()
            outcome = run_mutant(scratch, m, TARGETS[name][1], args.timeout)
            results.append({"target": name, **asdict(m), "outcome": outcome,
                            "seconds": round(time.monotonic() - start, 1)})
            print(f"[{i}/{len(chosen)}] {outcome:8s} {m.path}:{m.line}  {m.kind}: {m.change}",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("interrupted: reporting the mutants run so far", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    survivors = [r for r in results if r["outcome"] == "survived"]
    rate = len(survivors) / len(results) if results else 0.0
    print(f"{len(results)} mutants, {len(results) - len(survivors)} killed, {len(survivors)} survived "
          f"(survival rate {rate:.0%})")
    for r in survivors:
        print(f"  survived: {r['path']}:{r['line']}  {r['kind']}: {r['change']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"seed": args.seed, "per_target": args.per_target,
                                         "start": args.start,
                                         "survival_rate": rate, "mutants": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
