"""Measurement: timers, capabilities, ceilings, the hardware table, FLOPs/MFU, the ledger.

``from moe_lab.perf import bench, compare, capabilities, ledger`` is what a notebook needs.
The timers and the capability report load with the package; the other submodules load
on first use.

- `bench`, `compare`, `BenchResult` — all timing (``moe_lab.perf.bench``)
- `capabilities` — the machine, detected once (``moe_lab.perf.capabilities``)
- ``ceilings`` — measured matmul and copy peaks of this machine
- ``hardware`` — datasheet figures of H100/H200/B200/GB200/GB300, the roofline
- ``flops`` — training FLOPs per token, TFLOPS per GPU, MFU
- ``mlperf`` — the MLPerf Training v6.0 results as data
- ``ledger`` — the results ledger every reported figure goes into
- ``breakdown`` — where a training step's time goes (profiled, by phase and kind)
- ``compile_report`` — every Triton kernel compiled for sm_90 and sm_100 without a GPU
  (registers, spills, shared memory, occupancy, tensor-core instructions, async copies);
  ``compile_worker`` runs the compiles in a child process, ``compile_reading`` reads them
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Imported eagerly, not lazily: the functions `bench` and `capabilities` share their names
# with their submodules, and the first import of a submodule sets the package attribute to
# the module. Binding the functions here, after those imports, keeps the names meaning
# the functions however the submodules are imported later.
from moe_lab.perf.bench import BenchResult, bench, compare
from moe_lab.perf.capabilities import Capabilities, capabilities

__all__ = [
    "BenchResult", "Capabilities", "bench", "capabilities", "compare",
    "breakdown", "ceilings", "flops", "hardware", "ledger", "mlperf",
]

_MODULES = ("breakdown", "ceilings", "flops", "hardware", "ledger", "mlperf")

if TYPE_CHECKING:
    from moe_lab.perf import breakdown, ceilings, flops, hardware, ledger, mlperf  # noqa: F401


def __getattr__(name: str):
    # Lazy submodules: `moe_lab.perf.ledger` loads only when first used.
    if name in _MODULES:
        value = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
