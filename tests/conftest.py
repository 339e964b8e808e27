"""Shared test setup.

On a machine without CUDA the test session runs every Triton kernel under Triton's
interpreter: it sets ``TRITON_INTERPRET=1`` (unless the caller set it) before any test module
defines a kernel — the tests' own kernels and the exercises' included. Every test session
gets its own results ledger in a temporary directory (tests never write into the user's
``build/``), and every test starts from ``torch.manual_seed(0)``. ``pytest -m gpu`` collects
tests/gpu alone, so it runs where only torch, triton, numpy and pytest are installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# `make test` runs the tests in parallel processes (pytest-xdist, one per core): each gets its
# share of the cores for its own threads and for the notebooks' kernels and child processes it
# starts, which inherit OMP_NUM_THREADS. Two processes each running OpenMP on every core slow
# each other down many times over. A count set by the caller is kept.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))

import torch  # noqa: E402  (after OMP_NUM_THREADS: its thread pool reads it)

if WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

GPU_TESTS = Path(__file__).resolve().parent / "gpu"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``pytest -m gpu`` collects tests/gpu only: its tests need torch, triton and pytest, so
    they run on a GPU machine that has nothing else installed (the other test files import the
    test extras as they are collected). Any other selection collects everything."""
    if config.getoption("markexpr") != "gpu":
        return None
    path = collection_path.resolve()
    if path == GPU_TESTS or GPU_TESTS in path.parents or path in GPU_TESTS.parents:
        return None
    return True


# Test files whose tests share work through caches, kept on one pytest-xdist worker, one after
# another: the full compile writes its tables from the tile-traffic simulations that the
# roofline and traffic-table tests run as well (a cache in the process); the time-to-train and
# router tests compile the same graphs with torch.compile more than once (Inductor's cache on
# disk: run side by side, each would compile them cold); the others build a costly module-scoped
# fixture (compiled kernels, executed notebooks) that each worker would build again.
SAME_WORKER = {
    "compile_report": ("tests/workbench/compile_report/test_report.py",
                       "tests/workbench/compile_report/test_roofline.py",
                       "tests/workbench/compile_report/test_traffic_table.py"),
    "time_to_train": ("tests/workbench/benchmarks/test_ttt.py",),
    "router": ("tests/lesson/moe/test_router.py", "tests/lesson/moe/test_megatron_oracle.py"),
    "mx_compiled": ("tests/workbench/compile_report/test_mx_compiled.py",),
    "tma_compiled": ("tests/workbench/compile_report/test_grouped_gemm_tma_compiled.py",),
    "workbook": ("tests/workbench/lab/test_workbook.py",),
    "no_triton": ("tests/workbench/lab/test_notebook_without_triton.py",),
}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, called only where it runs
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadgroup``: each test a unit of its own, handed to whichever worker is free,
    except `SAME_WORKER`'s files, each group one unit. (pytest-xdist's own ``loadgroup`` reads
    ``xdist_group`` marks by renaming tests, which pytest 9 no longer lets it do.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    group_of = {path: group for group, paths in SAME_WORKER.items() for path in paths}

    class SameWorkerGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of.get(nodeid.partition("::")[0], nodeid)

    return SameWorkerGroups(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``slow`` tests first (in their order, the rest in theirs): with several workers the
    long runs start at once rather than leaving one worker busy after the rest are done."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def _session_results_dir(tmp_path_factory: pytest.TempPathFactory):
    """Point the ledger (and notebook kernels, which inherit the environment) at a tmp dir."""
    results = tmp_path_factory.mktemp("results")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOE_LAB_RESULTS_DIR", str(results))
        patch.setenv("MOE_LAB_HEADLESS", "1")  # notebooks draw static figures, not widgets
        yield results


@pytest.fixture(autouse=True)
def _seed() -> None:
    """The same random numbers in every test, whatever ran before it."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def cpu_plugin() -> None:
    """The CPU plug-in's names registered (``moe_lab.workbench.cpu.register``); skipped where there is
    no C++ compiler at all. A compiler that fails to build the kernels fails the test."""
    import moe_lab.workbench.cpu

    if moe_lab.workbench.cpu.build.compiler() is None:
        pytest.skip("no C++ compiler: moe_lab's CPU kernels cannot be built")
    assert moe_lab.workbench.cpu.register(), moe_lab.workbench.cpu.unavailable_reason()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernel tests run: CUDA when present (Triton kernels compiled), else the CPU
    (Triton's interpreter). Tests of Triton kernels take their device from here, so that
    ``make test`` on a CUDA machine tests every kernel compiled."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def interpreted() -> bool:
    """Whether the Triton kernels run under the interpreter in this session."""
    from moe_lab.perf.capabilities import triton_interpreted

    return triton_interpreted()
