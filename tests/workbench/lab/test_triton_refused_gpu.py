"""On a GPU older than Triton's sm_80 (a T4, the free tier of hosted notebooks) the notebooks'
Triton cells say why in one line naming the GPU, and the rest run on PyTorch: the same label
as where Triton is not installed."""

from __future__ import annotations

import dataclasses
import importlib

from moe_lab.perf.capabilities import capabilities
from moe_lab.workbench.lab import triton_mode


def test_a_t4_is_named_and_its_triton_cells_are_labelled(monkeypatch):
    t4 = dataclasses.replace(capabilities(), device="cuda", device_name="Tesla T4", cuda_capability=(7, 5),
                             triton_mode="unsupported on sm_75")
    # the module (moe_lab.perf binds the name `capabilities` to the function)
    monkeypatch.setattr(importlib.import_module("moe_lab.perf.capabilities"), "capabilities", lambda: t4)
    assert triton_mode.why_no_triton() == ("Triton's kernels need compute capability 8.0 or newer; "
                                           "this Tesla T4 is sm_75")

    class Shell:  # IPython's, as far as label_triton_cells uses it
        input_transformers_cleanup: list = []

    monkeypatch.setattr("IPython.get_ipython", lambda: Shell)
    assert triton_mode.label_triton_cells()
    (skip,) = Shell.input_transformers_cleanup
    assert skip(["# needs Triton\n", "import triton\n"]) == [
        "print(\"this cell was skipped: Triton's kernels need compute capability 8.0 or newer; "
        "this Tesla T4 is sm_75\")\n"]
    assert skip(["x = 1\n"]) == ["x = 1\n"]  # the others run
    assert not triton_mode.interpret_without_cuda()  # nothing set to interpret on a T4


def test_where_triton_runs_nothing_is_labelled():
    assert triton_mode.why_no_triton() is None and not triton_mode.label_triton_cells()


def test_a_benchmark_on_a_t4_says_why_its_triton_rows_are_missing():
    from moe_lab.workbench.benchmarks import untimed_triton

    note = untimed_triton("dropless triton", "unsupported on sm_75")
    assert note == ("dropless triton: Triton's kernels need compute capability 8.0 or newer, "
                    "unsupported on sm_75; not run")
