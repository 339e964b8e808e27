"""What this machine can do, detected once.

Every notebook and kernel in moe_lab asks the same few questions before it picks a path:
is there a CUDA device, do Triton kernels run compiled or under the interpreter, is
Transformer Engine importable, does the GPU have native MXFP8 matrix units (SM 10.x,
Blackwell)? `capabilities()` answers them once per process and caches the answer, so a
notebook can print one line about its hardware and every figure it records can carry the
same label. The small predicates below (`is_cuda()`, `native_mxfp8()`,
`triton_interpreted()`) are what code branches on; nothing else should read
``torch.cuda`` or ``TRITON_INTERPRET`` directly.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import platform
import re
from dataclasses import asdict, dataclass, field

import torch

from moe_lab.perf.hardware import gpu_arch, mx_mma_of
from moe_lab.registry import TRITON_MISSING

# Blackwell data-centre parts (SM 10.0, 10.3) are the first with block-scaled (MX) FP8
# tensor-core instructions; Transformer Engine's MXFP8BlockScaling recipe requires them.
MXFP8_MIN_CAPABILITY = (10, 0)


@dataclass(frozen=True)
class Capabilities:
    """The hardware and software this process runs on.

    ``device`` is ``"cuda"`` or ``"cpu"``; ``device_name`` the GPU name or the CPU model;
    ``n_threads`` torch's intra-op thread count; ``cuda_capability`` ``(major, minor)`` or
    ``None``; ``triton_mode`` ``"compiled"``, ``"interpreted"``, ``"absent"`` (no Triton:
    `moe_lab.kernels.TRITON_MISSING`) or ``"unsupported on sm_75"`` (a GPU older than Triton's
    sm_80: `moe_lab.kernels.common.check_device` refuses its kernels there); ``versions`` maps
    library names to version strings.
    """

    device: str
    device_name: str
    n_threads: int
    n_devices: int
    cuda_capability: tuple[int, int] | None
    triton_mode: str
    transformer_engine: bool
    native_mxfp8: bool
    has_grouped_mm: bool
    cpu_bf16: bool = False  # the CPU has bf16 matmul instructions (AVX512-BF16, AMX, Arm BF16)
    versions: dict[str, str] = field(default_factory=dict)

    def hardware_label(self) -> str:
        """A short label for figures and the ledger: ``"H200"``, ``"H200 x8"``, or
        ``"cpu:AMD EPYC x2"`` (CPU model and thread count)."""
        if self.device == "cuda":
            # "NVIDIA H200" -> "H200"; "NVIDIA GB300" -> "GB300"; "NVIDIA H100 80GB HBM3" -> "H100"
            name = re.sub(r"^NVIDIA\s+", "", self.device_name.strip())
            label = name.split()[0] if name else "cuda"
            return f"{label} x{self.n_devices}" if self.n_devices > 1 else label
        # "Intel(R) Xeon(R) Platinum 8488C CPU @ 2.4GHz" -> "Intel Xeon Platinum 8488C"
        name = re.sub(r"\((R|TM|tm|r)\)", "", self.device_name)
        name = re.sub(r"\s+(CPU|Processor)\b.*$", "", name)
        name = re.sub(r"\s+\d+-Core.*$", "", name)
        return f"cpu:{' '.join(name.split()) or 'unknown'} x{self.n_threads}"

    def summary(self) -> str:
        """One line: device, Triton mode, Transformer Engine, MXFP8, library versions."""
        version = self.versions.get("transformer_engine", "present")
        te = f"TE {version}" if self.transformer_engine else "no TE"
        mx = "native MXFP8" if self.native_mxfp8 else "MXFP8 emulated"
        cc = ""
        if self.cuda_capability:  # what this GPU's row of the architecture table lets the kernels run
            major, minor = self.cuda_capability
            a = gpu_arch(self.cuda_capability)
            cc = (f" sm_{major}{minor}: kernels as {a.arch}, {a.mma}, MXFP8 product {mx_mma_of(a)}, "
                  f"{'' if a.tma else 'no '}TMA")
        return (f"{self.hardware_label()} ({self.device_name}{cc}, {self.n_threads} threads); "
                f"triton {self.triton_mode}; {te}; {mx}; torch {self.versions.get('torch', '?')}, "
                f"triton {self.versions.get('triton', '?')}, python {self.versions.get('python', '?')}")

    def to_dict(self) -> dict:
        """A JSON-ready dict of the fields, in their order, with the hardware label after the
        device name."""
        return {"device": self.device, "device_name": self.device_name,
                "hardware_label": self.hardware_label(), **asdict(self)}


# CPU flags of bf16 matmul instructions: with them a CPU's bf16 GEMMs run about twice its
# fp32 rate (`moe_lab.workbench.measure.ceilings.matmul_peak`); without them bf16 is emulated, slower.
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name and feature flags from ``/proc/cpuinfo`` (empty where absent)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:  # x86, Arm
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags


def library_versions() -> dict[str, str]:
    """Versions of python, torch, triton, numpy and (when installed) Transformer Engine."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("triton", "numpy", "transformer_engine"):  # the lookup reads "-" and "_" alike
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def interprets_triton(cuda: bool | None = None) -> bool:
    """moe_lab's rule for its Triton kernels: ``TRITON_INTERPRET`` when it is set (read as
    Triton reads it: 1, true, yes, on), else interpreted exactly when there is no CUDA device
    (``cuda``: whether there is one, probed when not given). So ``TRITON_INTERPRET=0`` on a
    machine without CUDA means compiled, as the compile report's process wants."""
    if "TRITON_INTERPRET" in os.environ:
        from triton.knobs import getenv_bool

        return getenv_bool("TRITON_INTERPRET", False)
    return not (torch.cuda.is_available() if cuda is None else cuda)


@functools.cache
def capabilities() -> Capabilities:
    """Detect the machine once per process (cached)."""
    cuda = torch.cuda.is_available()
    if cuda:
        device_name = torch.cuda.get_device_name(0)
        cc = tuple(torch.cuda.get_device_capability(0))
        n_devices = torch.cuda.device_count()
    else:
        device_name = cpuinfo()[0] or platform.processor() or platform.machine() or "unknown cpu"
        cc, n_devices = None, 1
    triton_mode = "absent" if TRITON_MISSING else "interpreted" if interprets_triton(cuda) else "compiled"
    if triton_mode == "compiled" and cc and not gpu_arch(cc).bf16_mma:  # Triton supports sm_80 on
        triton_mode = f"unsupported on sm_{cc[0]}{cc[1]}"
    return Capabilities(
        device="cuda" if cuda else "cpu",
        device_name=device_name,
        n_threads=torch.get_num_threads(),
        cuda_capability=cc,
        n_devices=n_devices,
        triton_mode=triton_mode,
        # find_spec, not import: Transformer Engine loads CUDA libraries at import time.
        transformer_engine=importlib.util.find_spec("transformer_engine") is not None,
        native_mxfp8=cc is not None and cc >= MXFP8_MIN_CAPABILITY,
        has_grouped_mm=hasattr(torch, "_grouped_mm"),
        versions=library_versions(),
        cpu_bf16=bool(cpuinfo()[1] & CPU_BF16_FLAGS),
    )


def is_cuda() -> bool:
    """True when a CUDA device is present."""
    return capabilities().device == "cuda"


def native_mxfp8() -> bool:
    """True on GPUs with MX block-scaled FP8 tensor cores (SM 10.0 and newer)."""
    return capabilities().native_mxfp8


def native_bf16_cpu() -> bool:
    """True when the CPU has bf16 matmul instructions (see ``CPU_BF16_FLAGS``)."""
    return capabilities().cpu_bf16


def triton_interpreted() -> bool:
    """True when moe_lab's Triton kernels run under the interpreter (`interprets_triton`)."""
    return capabilities().triton_mode == "interpreted"
