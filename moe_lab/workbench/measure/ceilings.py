"""Ceilings measured on this machine: how fast it multiplies matrices and moves bytes.

A datasheet peak is a promise about ideal conditions; what a kernel can reach here is
bounded by what the best library kernel reaches here. So moe_lab measures two ceilings
with `moe_lab.workbench.measure.timing` on random data (never zeros: some hardware skips work on them):

* ``matmul_peak(dtype)``: FLOP/s of one large square ``torch.matmul`` (``2 n^3`` FLOPs);
* ``copy_bandwidth()``: bytes per second of a large tensor copy, counting the bytes read
  *and* the bytes written (``2 * nbytes`` per copy), larger than the last-level cache.

Together they give this machine's roofline: ``min(peak, bandwidth * intensity)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_lab.perf.capabilities import capabilities
from moe_lab.workbench.measure.timing import BenchResult, bench

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPES = {name: dtype for dtype, name in _NAMES.items()}

# profile -> (matmul n, copy bytes, min_time_s) per device. The CPU smoke sizes keep the
# run short on a laptop CPU; every copy is larger than a typical last-level cache, so it
# measures memory bandwidth, not cache bandwidth.
PROFILES = {
    "smoke": {"cpu": (2048, 128 * 2**20, 0.3), "cuda": (4096, 512 * 2**20, 0.2)},
    "full": {"cpu": (4096, 512 * 2**20, 1.0), "cuda": (8192, 2 * 2**30, 0.5)},
}


@dataclass(frozen=True)
class Ceiling:
    """One measured ceiling: ``value`` in ``unit`` (``"FLOP/s"`` or ``"B/s"``), with the
    timing it came from and the sizes used."""

    name: str
    value: float
    unit: str
    result: BenchResult = field(repr=False)
    params: dict = field(default_factory=dict)
    hardware: str = ""

    @property
    def giga(self) -> float:
        """``value`` / 1e9: GFLOP/s or GB/s."""
        return self.value / 1e9

    def __str__(self) -> str:
        return f"{self.name}: {self.giga:,.1f} G{self.unit} on {self.hardware} ({self.result})"


def matmul_operands(dtype: str | torch.dtype = "fp32", n: int = 1024, *,
                    device: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ceiling's problem: ``a, b`` random normal ``[n, n]`` and ``out``, for
    ``torch.matmul(a, b, out=out)`` (``2 n^3`` FLOPs) — for timing it beside other work.
    ``dtype``: a float dtype or its name (``"fp32"``, ``"bf16"``, ``"fp16"``)."""
    dt, dev = _DTYPES.get(dtype, dtype), device or capabilities().device
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=dev, dtype=dt)
    b = torch.randn(n, n, generator=gen).to(device=dev, dtype=dt)
    return a, b, torch.empty(n, n, device=dev, dtype=dt)


def matmul_peak(dtype: str | torch.dtype = "fp32", n: int = 1024, *, device: str | None = None,
                min_time_s: float = 0.3) -> Ceiling:
    """Measured FLOP/s of ``[n, n] @ [n, n]`` in ``dtype`` on random normal data.

    ``device`` defaults to this machine's (`capabilities`). ``2 n^3`` FLOPs per call.
    """
    a, b, out = matmul_operands(dtype, n, device=device)
    result = bench(torch.matmul, a, b, out=out, warmup=2, min_time_s=min_time_s)
    dt, dev = _NAMES[a.dtype], a.device.type
    return Ceiling(f"matmul_{dt}", result.per_second(2.0 * n**3), "FLOP/s", result,
                   {"n": n, "dtype": dt, "device": dev}, _hardware(dev))


def copy_bandwidth(nbytes: int = 128 * 2**20, *, device: str | None = None,
                   min_time_s: float = 0.3) -> Ceiling:
    """Measured bytes/s of copying a random fp32 tensor of ``nbytes`` into another:
    ``2 * nbytes`` (read + write) per copy."""
    dev = device or capabilities().device
    numel = nbytes // 4
    src = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dev)
    dst = torch.empty_like(src)
    result = bench(dst.copy_, src, warmup=2, min_time_s=min_time_s)
    return Ceiling("copy", result.per_second(2 * numel * 4), "B/s", result,
                   {"nbytes": numel * 4, "device": dev}, _hardware(dev))


def _hardware(device: str) -> str:
    return capabilities().hardware_label() if device == capabilities().device else device


def measure_ceilings(profile: str = "smoke") -> dict[str, Ceiling]:
    """This machine's ceilings: ``matmul_fp32``, ``matmul_bf16`` and ``copy``.

    ``profile="smoke"`` uses sizes that keep a small CPU busy for seconds, not minutes;
    ``"full"`` uses larger ones.
    """
    dev = capabilities().device
    n, nbytes, min_time_s = PROFILES[profile][dev]
    out = {f"matmul_{dt}": matmul_peak(dt, n, device=dev, min_time_s=min_time_s) for dt in ("fp32", "bf16")}
    out["copy"] = copy_bandwidth(nbytes, device=dev, min_time_s=min_time_s)
    return out
