"""Benchmarks behind ``python -m moe_lab bench <name>``.

One module per benchmark. Each exposes ``DESCRIPTION``, ``add_arguments(parser)`` and
``run(args) -> dict``; the dict is printed as one JSON object with ``--json`` and as a table
otherwise, and every figure in it is also appended to the results ledger by the module.
"""

BENCHMARKS = {
    # name -> module (imported only when that benchmark is asked for)
    "moe-layer": "moe_lab.bench.moe_layer",
    "mxfp8": "moe_lab.bench.mxfp8",
    "router": "moe_lab.bench.router_bench",
    "step": "moe_lab.bench.step",
    "ep": "moe_lab.bench.ep",
    "time-to-train": "moe_lab.bench.ttt",
}
