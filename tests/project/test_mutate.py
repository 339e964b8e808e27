"""scripts/mutate.py plants one bug at a time in a scratch copy and tells killed from survived."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mutate():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["mutate"]


TOY = '''
def f(x, n):
    """Docstring: 7 is not a constant to mutate."""
    if n < 0:
        raise ValueError("n")
    total = x + 2
    if total >= n and x:
        log(total)
    return total * n
'''


def test_each_kind_of_mutant_changes_exactly_one_spot(mutate):
    found = mutate.mutants_of("toy.py", TOY)
    kinds = sorted({(m.kind, m.change) for m in found})
    assert ("arithmetic", "+ -> -") in kinds and ("arithmetic", "* -> /") in kinds
    assert ("compare", ">= -> >") in kinds and ("boolean", "and -> or") in kinds
    assert ("constant", "2 -> 3") in kinds and ("call removed", "log(total)") in kinds
    assert not any(m.change.startswith("7") for m in found)  # not in the docstring
    assert not any(m.line == 4 for m in found)  # the argument check that raises is left alone
    plain = ast.unparse(ast.parse(TOY))
    for m in found:
        mutated = mutate.apply(TOY, m)
        ast.parse(mutated)
        assert mutated != plain
        # One spot: the mutated and plain sources differ on one line.
        assert sum(a != b for a, b in zip(mutated.splitlines(), plain.splitlines(), strict=True)) == 1


def test_every_target_names_files_and_tests_that_exist(mutate):
    for name, (files, tests) in mutate.TARGETS.items():
        for path in (*files, *tests):
            assert (ROOT / path).exists(), (name, path)
        assert sum(len(mutate.mutants_of(p, (ROOT / p).read_text())) for p in files) > 0, name


def test_a_removed_fsync_is_killed_and_the_checkout_is_untouched(mutate):
    path = "moe_lab/workbench/training/checkpoint.py"
    before = (ROOT / path).read_text()
    fsync = next(m for m in mutate.mutants_of(path, before) if m.change == "os.fsync(f.fileno())")
    equivalent = next(m for m in mutate.mutants_of(path, before) if m.change == "os.close(fd)")
    scratch = mutate._scratch_copy()
    try:
        tests = ("tests/workbench/training/test_checkpoint_durability.py",)
        assert mutate.run_mutant(scratch, fsync, tests, timeout_s=120) == "killed"
        # Not closing the folder's descriptor is not observable by these tests: a survivor.
        assert mutate.run_mutant(scratch, equivalent, tests, timeout_s=120) == "survived"
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    assert (ROOT / path).read_text() == before
