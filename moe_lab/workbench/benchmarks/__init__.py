"""Benchmarks behind ``python -m moe_lab bench <name>``.

One module per benchmark. Each exposes ``DESCRIPTION``, ``add_arguments(parser)`` and
``run(args) -> dict``; the dict is printed as one JSON object with ``--json`` and as a table
otherwise, and every figure in it is also appended to the results ledger by the module.
"""

BENCHMARKS = {
    # name -> module (imported only when that benchmark is asked for)
    "moe-layer": "moe_lab.workbench.benchmarks.moe_layer",
    "mxfp8": "moe_lab.workbench.benchmarks.mxfp8",
    "router": "moe_lab.workbench.benchmarks.router",
    "step": "moe_lab.workbench.benchmarks.step",
    "ep": "moe_lab.workbench.benchmarks.ep",
    "time-to-train": "moe_lab.workbench.benchmarks.ttt",
}


def untimed_triton(names: str, triton_mode: str) -> str:
    """The note of a benchmark whose Triton providers ``names`` are not timed here, where
    `capabilities().triton_mode` is ``"interpreted"``, ``"absent"`` or ``"unsupported on
    sm_75"`` (a GPU older than Triton's sm_80)."""
    if triton_mode == "interpreted":
        return f"{names}: Triton is interpreted here; checked in tests, not timed"
    if triton_mode.startswith("unsupported"):
        return f"{names}: Triton's kernels need compute capability 8.0 or newer, {triton_mode}; not run"
    return f"{names}: Triton is not installed here (Linux only); not run"
