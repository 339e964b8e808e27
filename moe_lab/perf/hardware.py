"""Datasheet figures of the GPUs the MLPerf MoE results ran on, and the roofline.

These are *not measurements*: they are per-GPU dense (no sparsity) peaks as vendors or
third parties publish them (``docs/references.md``, "Hardware rates", gives the pages).
Each row says where its numbers come from in its ``source`` field (``"datasheet"`` or
``"third-party"``, with a note); a figure drawn from this table must be labelled as such.
What this machine can really do is measured by `moe_lab.workbench.measure.ceilings`.

`ARCHS` holds what each GPU architecture a reader may have — sm_75 (T4) to sm_100 (B200) —
offers the kernels (the tensor-core types, TMA, block-scaled MMA) and what one SM of it can
keep resident (registers, warps, blocks, shared memory): the kernels choose their paths and
tiles by it, and the compile report computes a kernel's theoretical occupancy from it.

The roofline model: a kernel that performs ``intensity`` FLOPs for every byte it moves
between memory and the chip can go no faster than ``min(peak_flops, bandwidth *
intensity)``. Below the ridge point ``peak_flops / bandwidth`` it is memory-bound; above,
compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_lab.checks import one_of, positive_int, positive_number

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class GPUSpec:
    """One GPU's published per-device figures (dense, no sparsity).

    ``bf16_tflops``, ``fp8_tflops``: tensor-core peaks (``None``: no FP8 units, the A100).
    ``mxfp8_tflops``: peak with MX block-scaled FP8 in hardware, ``None`` where there are
    no such units (Hopper).
    ``hbm_gb`` capacity, ``hbm_tbps`` bandwidth (TB/s). ``source``: ``"datasheet"`` or
    ``"third-party"``.
    ``sms``: streaming multiprocessors. ``l2_mb``: L2 cache in MiB (the cache of
    `moe_lab.perf.traffic`). ``None`` where not tabulated; the row's comment gives the source.
    """

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    mxfp8_tflops: float | None
    hbm_gb: float
    hbm_tbps: float
    source: str
    note: str = ""
    l2_mb: float | None = None
    sms: int | None = None

    @property
    def l2_bytes(self) -> int:
        """L2 cache in bytes (of a row that tabulates it)."""
        return int(self.l2_mb * 2**20)

    @property
    def native_mxfp8(self) -> bool:
        return self.mxfp8_tflops is not None

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Peak FLOP/s for ``dtype`` in ``{"bf16", "fp8", "mxfp8"}``."""
        values = {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops, "mxfp8": self.mxfp8_tflops}
        one_of(dtype, "dtype", values)
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
    for spec in (  # dense figures: half the datasheets' "with sparsity" ones
        # [a100]: 80 GB SXM; no FP8 tensor cores (fp8 None); L2 40 MB, 108 SMs ([a100-whitepaper]).
        GPUSpec("A100", 312, None, None, 80, 2.039, "datasheet", "NVIDIA A100 datasheet; NVLink 3",
                l2_mb=40, sms=108),
        # [l4]: 24 GB GDDR6, PCIe (no NVLink); L2 48 MB and 58 SMs of its AD104 ([ada-whitepaper]).
        GPUSpec("L4", 121, 242, None, 24, 0.3, "datasheet", "NVIDIA L4 datasheet; PCIe only", l2_mb=48,
                sms=58),
        # [h100]; L2 (50 MB) and 132 SMs: the H100 SXM5 in NVIDIA's Hopper whitepaper ([hopper-whitepaper]).
        GPUSpec("H100 SXM", 989, 1979, None, 80, 3.35, "datasheet",
                "NVIDIA H100 datasheet; NVLink 4", l2_mb=50, sms=132),
        # [h200]: H100's tensor cores, larger and faster HBM3e; L2 and SMs of the same GH100 die.
        GPUSpec("H200 SXM", 989, 1979, None, 141, 4.8, "datasheet",
                "NVIDIA H200 datasheet; NVLink 4", l2_mb=50, sms=132),
        # [b200] (1,000 W) as third parties tabulate it; 126 MB L2, 148 SMs ([chipsandcheese-b200]).
        GPUSpec("B200", 2250, 4500, 4500, 180, 8.0, "third-party",
                "HGX B200 per-GPU figures as tabulated by third parties; NVLink 5", l2_mb=126, sms=148),
        # [gb300] (B300 in NVL72), third-party tables, HBM quoted 279-288 GB; L2 assumed B200's (unverified).
        GPUSpec("GB300", 2500, 5000, 5000, 279, 8.0, "third-party",
                "Blackwell Ultra per-GPU figures from third-party tables; 130 TB/s per NVL72", l2_mb=126),
    )
}

_ALIASES = {"H100": "H100 SXM", "H200": "H200 SXM"}


def gpu_spec(name: str) -> GPUSpec:
    """The table row for ``name`` (case-insensitive; ``"H200"`` means ``"H200 SXM"``)."""
    known = {canonical.upper(): canonical for canonical in GPUS} | _ALIASES
    key = name.strip().upper().replace("NVIDIA ", "")
    if key not in known:
        raise ValueError(f"name must be one of {sorted(GPUS) + sorted(_ALIASES)}, got {name!r}")
    return GPUS[known[key]]


def roofline(peak_flops: float, bandwidth: float, intensity: float | np.ndarray) -> float | np.ndarray:
    """Attainable FLOP/s = ``min(peak_flops, bandwidth * intensity)``: ``peak_flops`` in FLOP/s,
    ``bandwidth`` in bytes/s, ``intensity`` in FLOP/byte (a number or an array of them; the
    result has the same shape)."""
    positive_number(peak_flops, "peak_flops")
    positive_number(bandwidth, "bandwidth")
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
    positive_number(bytes_per_element, "bytes_per_element")
    return 2.0 * m * n * k / ((m * k + k * n + m * n) * bytes_per_element)


@dataclass(frozen=True)
class GPUArch:
    """What one GPU architecture offers the kernels, and what one of its SMs holds at once (a
    kernel's occupancy follows: `moe_lab.workbench.compile_report.reading`). ``gpu``: one a
    reader may have; ``mma``: the instruction a Triton dot becomes. Features: tensor cores
    for ``bf16_mma``, ``fp8_mma``, ``block_scaled_mma`` (MX scales applied by the MMA);
    ``tma``; ``warp_specialize`` (moe_lab's persistent kernel splits its warps by role). Per
    SM: registers, warps, blocks, ``shared_per_sm`` bytes of which a block may use
    ``max_shared_per_block``; allocation units of registers (per warp) and shared bytes."""

    arch: str
    gpu: str
    mma: str
    bf16_mma: bool
    fp8_mma: bool
    block_scaled_mma: bool
    tma: bool
    warp_specialize: bool
    registers_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    shared_per_sm: int
    max_shared_per_block: int
    register_alloc_unit: int
    shared_alloc_unit: int
    l2_mb: float

    @property
    def reserved_shared_per_block(self) -> int:
        return self.shared_per_sm - self.max_shared_per_block

    @property
    def capability(self) -> int:
        """The compute capability as Triton's ``GPUTarget`` takes it: ``"sm_90"`` → 90."""
        return int(self.arch.removeprefix("sm_"))


_KIB = 1024
# Sources of every row: NVIDIA CUDA C++ Programming Guide, 'Technical Specifications per Compute
# Capability', and the CUDA Occupancy Calculator's allocation units (SM limits); NVIDIA's Turing,
# Ampere, Ada, Hopper and Blackwell whitepapers (tensor-core types, TMA from Hopper); PTX ISA,
# tcgen05.mma kind::mxf8f6f4 on sm_100a (block-scaled MMA); the named GPU's datasheet (L2).

ARCHS: dict[str, GPUArch] = {
    a.arch: a
    for a in (  # arch, gpu, mma; bf16 fp8 block-scaled TMA warp-specialised; per SM: registers,
        #     warps, blocks, shared bytes, per block; allocation units (registers, shared), L2 MB
        GPUArch("sm_75", "T4", "none", False, False, False, False, False,
                65536, 32, 16, 64 * _KIB, 64 * _KIB, 256, 256, 4),
        GPUArch("sm_80", "A100", "mma.sync", True, False, False, False, False,
                65536, 64, 32, 164 * _KIB, 163 * _KIB, 256, 128, 40),
        GPUArch("sm_86", "A10G", "mma.sync", True, False, False, False, False,
                65536, 48, 16, 100 * _KIB, 99 * _KIB, 256, 128, 6),
        GPUArch("sm_89", "L4", "mma.sync", True, True, False, False, False,
                65536, 48, 24, 100 * _KIB, 99 * _KIB, 256, 128, 48),
        GPUArch("sm_90", "H200 SXM", "wgmma", True, True, False, True, False,
                65536, 64, 32, 228 * _KIB, 227 * _KIB, 256, 128, 50),
        GPUArch("sm_100", "B200", "tcgen05.mma", True, True, True, True, True,
                65536, 64, 32, 228 * _KIB, 227 * _KIB, 256, 128, 126),
    )
}


# `moe_lab.kernels.mx_gemm.mx_dot`'s MXFP8 products (``MX_MMA``), best first: what each needs.
MX_MMA_NEEDS = {"scaled": "block_scaled_mma", "fp8_promote": "fp8_mma", "bf16": "bf16_mma"}


def mx_mma_of(arch: GPUArch) -> str:
    """The MXFP8 product the kernels compile on ``arch`` (``"none"`` below sm_80: no Triton)."""
    return next((mode for mode, needs in MX_MMA_NEEDS.items() if getattr(arch, needs)), "none")


def gpu_arch(arch: str | tuple[int, int]) -> GPUArch:
    """The row of ``arch``: a name (``"sm_90"``) or a compute capability (``(8, 6)``): the
    nearest row at or below it of its major version (an sm_87 is an sm_86); older than the
    table, sm_75; newer, sm_89, whose features every later GPU has (``wgmma`` and
    ``tcgen05`` are sm_90a's and sm_100a's alone: an sm_120 is no sm_100)."""
    if isinstance(arch, str):
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
        return ARCHS[arch]
    same = [a for a in ARCHS.values() if a.capability // 10 == arch[0] and a.capability % 10 <= arch[1]]
    return same[-1] if same else ARCHS["sm_75" if arch[0] < 8 else "sm_89"]
