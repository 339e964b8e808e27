"""Datasheet figures of the GPUs the MLPerf MoE results ran on, and the roofline.

These are *not measurements*: they are per-GPU dense (no sparsity) peaks as vendors or
third parties publish them (``docs/references.md``, "Hardware rates", gives the pages).
Each row says where its numbers come from in its ``source`` field (``"datasheet"`` or
``"third-party"``, with a note); a figure drawn from this table must be labelled as such.
What this machine can really do is measured by `moe_lab.workbench.measure.ceilings`.

`SM_LIMITS` holds what one SM of compute capability 9.0 (Hopper) and 10.0 (Blackwell) can
keep resident — registers, warps, blocks, shared memory — from NVIDIA's programming guide;
`moe_lab.workbench.compile_report.report` computes a compiled kernel's theoretical occupancy from them.

The roofline model: a kernel that performs ``intensity`` FLOPs for every byte it moves
between memory and the chip can go no faster than ``min(peak_flops, bandwidth *
intensity)``. Below the ridge point ``peak_flops / bandwidth`` it is memory-bound; above,
compute-bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_lab.checks import positive_int

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class GPUSpec:
    """One GPU's published per-device figures (dense, no sparsity).

    ``bf16_tflops``, ``fp8_tflops``: tensor-core peaks. ``mxfp8_tflops``: peak with MX
    block-scaled FP8 in hardware, ``None`` where there are no such units (Hopper).
    ``hbm_gb`` capacity, ``hbm_tbps`` bandwidth (TB/s), ``nvlink_gbps`` per-GPU NVLink
    bandwidth (GB/s, both directions). ``source``: ``"datasheet"`` or ``"third-party"``.
    ``sms``: streaming multiprocessors. ``l2_mb``: L2 cache in MiB (the cache of
    `moe_lab.perf.traffic`). ``None`` where not tabulated; the row's comment gives the source.
    """

    name: str
    bf16_tflops: float
    fp8_tflops: float
    mxfp8_tflops: float | None
    hbm_gb: float
    hbm_tbps: float
    nvlink_gbps: float
    source: str
    note: str = ""
    l2_mb: float | None = None
    sms: int | None = None

    @property
    def l2_bytes(self) -> int:
        """L2 cache in bytes."""
        if self.l2_mb is None:
            raise ValueError(f"{self.name} has no L2 size in the table (l2_mb=None)")
        return int(self.l2_mb * 2**20)

    @property
    def native_mxfp8(self) -> bool:
        return self.mxfp8_tflops is not None

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Peak FLOP/s for ``dtype`` in ``{"bf16", "fp8", "mxfp8"}``."""
        values = {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops, "mxfp8": self.mxfp8_tflops}
        if dtype not in values:
            raise ValueError(f"dtype must be one of {sorted(values)}, got {dtype!r}")
        if values[dtype] is None:
            raise ValueError(f"{self.name} has no native {dtype} tensor cores (dtype={dtype!r})")
        return values[dtype] * 1e12

    @property
    def bandwidth(self) -> float:
        """HBM bandwidth in bytes/s."""
        return self.hbm_tbps * 1e12

    @property
    def ridge_intensity(self) -> float:
        """FLOP/byte where bf16 compute and HBM bandwidth balance."""
        return self.peak_flops("bf16") / self.bandwidth


GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        # NVIDIA H100 SXM datasheet (dense figures: half the "with sparsity" ones).
        # L2 (50 MB) and 132 SMs: the H100 SXM5 in NVIDIA's Hopper whitepaper ([hopper-whitepaper]).
        GPUSpec("H100 SXM", 989, 1979, None, 80, 3.35, 900, "datasheet",
                "NVIDIA H100 datasheet; NVLink 4", l2_mb=50, sms=132),
        # NVIDIA H200 datasheet: same tensor cores as H100, larger and faster HBM3e.
        # L2 and SMs: the H100 SXM5's GH100 die, 50 MB and 132 SMs ([hopper-whitepaper]).
        GPUSpec("H200 SXM", 989, 1979, None, 141, 4.8, 900, "datasheet",
                "NVIDIA H200 datasheet; NVLink 4", l2_mb=50, sms=132),
        # NVIDIA HGX B200 (1,000 W) figures as third parties tabulate them.
        # L2: 126 MB over its two dies, 148 SMs, as Chips and Cheese report them ([chipsandcheese-b200]).
        GPUSpec("B200", 2250, 4500, 4500, 180, 8.0, 1800, "third-party",
                "HGX B200 per-GPU figures as tabulated by third parties; NVLink 5", l2_mb=126,
                sms=148),
        # GB200 NVL72 rack datasheet divided by its 72 GPUs (a derived, unverified figure).
        GPUSpec("GB200", 2500, 5000, 5000, 186, 8.0, 1800, "third-party",
                "GB200 NVL72 rack figures / 72 GPUs; unverified"),
        # GB300 (B300 in NVL72): third-party per-GPU tables; HBM quoted as 279-288 GB.
        # L2: assumed the B200's 126 MB (no published figure found; unverified).
        GPUSpec("GB300", 2500, 5000, 5000, 279, 8.0, 1800, "third-party",
                "Blackwell Ultra per-GPU figures from third-party tables; 130 TB/s per NVL72",
                l2_mb=126),
    )
}

_ALIASES = {"H100": "H100 SXM", "H200": "H200 SXM", "B300": "GB300"}


def gpu_spec(name: str) -> GPUSpec:
    """The table row for ``name`` (case-insensitive; ``"H200"`` means ``"H200 SXM"``)."""
    if not isinstance(name, str):
        raise ValueError(f"name must be a GPU name string, got {name!r}")
    key = name.strip().upper().replace("NVIDIA ", "")
    for canonical in GPUS:
        if key == canonical.upper():
            return GPUS[canonical]
    if key in _ALIASES:
        return GPUS[_ALIASES[key]]
    raise ValueError(f"name must be one of {sorted(GPUS) + sorted(_ALIASES)}, got {name!r}")


def roofline(peak_flops: float, bandwidth: float, intensity: float | np.ndarray) -> float | np.ndarray:
    """Attainable FLOP/s = ``min(peak_flops, bandwidth * intensity)``: ``peak_flops`` in FLOP/s,
    ``bandwidth`` in bytes/s, ``intensity`` in FLOP/byte (a number or an array of them; the
    result has the same shape)."""
    for arg, value in (("peak_flops", peak_flops), ("bandwidth", bandwidth)):
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"{arg} must be a finite number > 0, got {value!r}")
    import numpy as np  # here, not at the top: the GPU check imports this module without NumPy
    arr = np.asarray(intensity, dtype=float)
    if np.any(~(arr >= 0)):
        raise ValueError(f"intensity must be >= 0 FLOP/byte, got {intensity!r}")
    attainable = np.minimum(float(peak_flops), float(bandwidth) * arr)
    return float(attainable) if attainable.ndim == 0 else attainable


def matmul_intensity(m: int, n: int, k: int, bytes_per_element: float = 2.0) -> float:
    """FLOP/byte of ``[m, k] @ [k, n]``: ``2mnk`` FLOPs over reading A and B and writing C
    once each (``(mk + kn + mn) * bytes_per_element`` bytes) — the best case, perfect reuse."""
    for arg, value in (("m", m), ("n", n), ("k", k)):
        positive_int(value, arg)
    if not bytes_per_element > 0:
        raise ValueError(f"bytes_per_element must be > 0, got {bytes_per_element!r}")
    return 2.0 * m * n * k / ((m * k + k * n + m * n) * bytes_per_element)


@dataclass(frozen=True)
class SMLimits:
    """What one streaming multiprocessor (SM) of a compute capability can hold at once: the
    limits a kernel's theoretical occupancy is computed from (`moe_lab.workbench.compile_report.reading`).

    ``arch``: the compile target (``"sm_90"``); ``gpu``: the table row (`GPUS`) it stands for
    in reports. Per SM: ``registers_per_sm`` 32-bit registers, ``max_warps_per_sm`` and
    ``max_blocks_per_sm`` resident warps and thread blocks, ``shared_per_sm`` bytes of shared
    memory, of which one block may use ``max_shared_per_block``; the difference,
    ``reserved_shared_per_block``, is kept by the system for every resident block. The
    allocation units round a block's request up: registers are handed out per warp in
    units of ``register_alloc_unit``, shared memory in units of ``shared_alloc_unit`` bytes.
    """

    arch: str
    gpu: str
    registers_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    shared_per_sm: int
    max_shared_per_block: int
    register_alloc_unit: int
    shared_alloc_unit: int
    source: str

    @property
    def reserved_shared_per_block(self) -> int:
        return self.shared_per_sm - self.max_shared_per_block

    @property
    def capability(self) -> int:
        """The compute capability as Triton's ``GPUTarget`` takes it: ``"sm_90"`` → 90."""
        return int(self.arch.removeprefix("sm_"))


_KIB = 1024
_SM_LIMITS_SOURCE = (
    "NVIDIA CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability' "
    "(registers, resident warps and blocks, shared memory per SM and per block; the 1 KB "
    "difference is reserved for system use per block); allocation units as NVIDIA's CUDA "
    "Occupancy Calculator applies them"
)

SM_LIMITS: dict[str, SMLimits] = {
    limits.arch: limits
    for limits in (
        SMLimits("sm_90", "H200 SXM", 65536, 64, 32, 228 * _KIB, 227 * _KIB, 256, 128,
                 f"compute capability 9.0: {_SM_LIMITS_SOURCE}"),
        SMLimits("sm_100", "B200", 65536, 64, 32, 228 * _KIB, 227 * _KIB, 256, 128,
                 f"compute capability 10.0: {_SM_LIMITS_SOURCE}"),
    )
}


def sm_limits(arch: str) -> SMLimits:
    """The per-SM limits of ``arch`` (``"sm_90"``, ``"sm_100"``)."""
    if arch not in SM_LIMITS:
        raise ValueError(f"arch must be one of {sorted(SM_LIMITS)}, got {arch!r}")
    return SM_LIMITS[arch]
