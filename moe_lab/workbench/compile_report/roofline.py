"""A roofline projection of the tile-traffic table's launches on each GPU the compile report targets.

A projection, not a measurement. A launch does ``F`` FLOPs and moves ``B`` bytes between HBM and
the chip; on a GPU with peak ``P`` FLOP/s and HBM bandwidth ``W`` bytes/s it can take no less than
``max(F / P, B / W)`` seconds. Which term wins is decided by the launch's arithmetic intensity
``F / B`` against the GPU's ridge point ``P / W`` (`moe_lab.perf.hardware.GPUSpec.ridge_intensity`):
below it the launch is memory-bound, at or above it compute-bound. ``B`` here is what the tile
order moves, as `moe_lab.perf.traffic` models it (`moe_lab.workbench.compile_report.traffic`), not
the compulsory bytes: a worse order lowers the intensity and can move a launch under the ridge.

The peaks and bandwidths are `moe_lab.perf.hardware`'s datasheet and third-party figures; the
FLOPs are ``2 * M * N * K`` per matrix product (the SwiGLU forward multiplies two, gate and up;
its element-wise work is not counted). The wave efficiency ``programs / (waves * in_flight)`` says
how full the last wave of a launch is; the projected time leaves it out (a compute-bound launch
whose last wave is half empty takes up to one wave longer).

The launches are the traffic table's (forward, dX, gather + SwiGLU forward), the weight
gradients of both projections (`moe_lab.workbench.compile_report.traffic.dw_tables`) and the
other grouped kernels whose MMAs are bf16 (`moe_lab.workbench.compile_report.traffic.kernel_tables`:
the fused kernels, the fused MXFP8 ones among them, and the SwiGLU backward). The grouped MXFP8
GEMM is left out: it runs at the 8-bit rate, not on the bf16 roofline drawn here (its bytes are
in ``traffic.md``).

``python -m moe_lab.workbench.compile_report.roofline`` writes ``results/compile/roofline.md``
and ``traffic.md`` from the committed compile reports (`write_tables`; ``python -m moe_lab
compile`` does the same after it writes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_lab.perf.hardware import GPUSpec, gpu_spec, roofline
from moe_lab.workbench.compile_report import traffic


@dataclass(frozen=True)
class Projection:
    """The roofline's account of one launch: ``flops`` FLOPs and ``bytes`` HBM bytes on a GPU of
    ``peak_flops`` FLOP/s and ``bandwidth`` bytes/s."""

    flops: float
    bytes: float
    peak_flops: float
    bandwidth: float

    @property
    def intensity(self) -> float:
        """FLOP per HBM byte."""
        return self.flops / self.bytes

    @property
    def ridge(self) -> float:
        """FLOP/byte where compute and bandwidth balance: ``peak_flops / bandwidth``."""
        return self.peak_flops / self.bandwidth

    @property
    def compute_s(self) -> float:
        return self.flops / self.peak_flops

    @property
    def memory_s(self) -> float:
        return self.bytes / self.bandwidth

    @property
    def time_s(self) -> float:
        """Projected seconds: ``max(flops / peak_flops, bytes / bandwidth)``."""
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        """``"compute"`` at or above the ridge point, ``"memory"`` below it."""
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def attainable(self) -> float:
        """FLOP/s the roofline allows at this intensity (`moe_lab.perf.hardware.roofline`)."""
        return roofline(self.peak_flops, self.bandwidth, self.intensity)


def project(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> Projection:
    """The `Projection` of ``flops`` FLOPs over ``bytes_moved`` HBM bytes at ``peak_flops`` FLOP/s
    and ``bandwidth`` bytes/s (all > 0: the callers' figures from the traffic model and the datasheets)."""
    return Projection(float(flops), float(bytes_moved), float(peak_flops), float(bandwidth))


def launch_flops(m: int, n: int, k: int, panels: int = 1) -> int:
    """FLOPs of a grouped GEMM launch over ``m`` routed rows, ``[m, k] @ [k, n]`` per expert:
    ``2 * m * n * k`` for each of ``panels`` products (2 for SwiGLU's gate and up)."""
    return 2 * m * n * k * panels


def wave_efficiency(programs: int, in_flight: int) -> float:
    """``programs / (waves * in_flight)`` with ``waves = cdiv(programs, in_flight)``: 1.0 when every
    wave is full, lower when the last one is partly empty (wave quantisation)."""
    return programs / (-(-programs // in_flight) * in_flight)


def eight_bit_rate(spec: GPUSpec) -> tuple[str, float]:
    """The 8-bit tensor-core peak `moe_lab.perf.hardware` gives ``spec`` and what it stands for: the
    MXFP8 rate where the GPU has block-scaled FP8 units; otherwise (Hopper) the FP8 rate, which is
    the rate of `moe_lab.kernels.mx_attention`'s ``fp8_promote`` path (MXFP8 on FP8 wgmma, scales
    applied in float32)."""
    if spec.native_mxfp8:
        return "MXFP8", spec.peak_flops("mxfp8")
    return "FP8, the fp8_promote path", spec.peak_flops("fp8")


def projections(rows: list[dict]) -> list[dict]:
    """One projection row per `moe_lab.workbench.compile_report.traffic.tables` row: FLOPs,
    compulsory and modelled (grouped order) bytes, the intensity against the ridge, the projected
    time and bound of the grouped order and of the row-fastest (old) order, the compute floor at
    the 8-bit rate (`eight_bit_rate`) and the wave efficiency at the launch's programs in flight."""
    out = []
    for row in rows:
        spec = gpu_spec(row["gpu"])
        peak = spec.peak_flops("bf16")
        flops = launch_flops(row["per_expert"] * row["experts"], row["n"], row["k"], row["panels"])
        new = project(flops, row["grouped_bytes"], peak, spec.bandwidth)
        old = project(flops, row["row_bytes"], peak, spec.bandwidth)
        rate_name, rate = eight_bit_rate(spec)
        out.append(dict(gpu=spec.name, model=row["model"], launch=row["launch"], flops=flops,
                        compulsory=row["compulsory"], modelled=row["grouped_bytes"],
                        old_bytes=row["row_bytes"],
                        intensity=new.intensity, old_intensity=old.intensity, ridge=new.ridge,
                        bound=new.bound, time_s=new.time_s, old_bound=old.bound, old_time_s=old.time_s,
                        eight_bit=rate_name, eight_bit_compute_s=flops / rate,
                        wave_efficiency=wave_efficiency(row["programs"], row["in_flight"]),
                        peak_flops=peak, bandwidth=spec.bandwidth))
    return out


def markdown(rows: list[dict]) -> str:
    """`projections`' rows as ``results/compile/roofline.md``."""
    gpus = list(dict.fromkeys(r["gpu"] for r in rows))
    first = {r["gpu"]: r for r in reversed(rows)}
    ridges = "; ".join(f"{g}: {first[g]['peak_flops'] / 1e12:,.0f} TFLOP/s bf16 dense over "
                       f"{first[g]['bandwidth'] / 1e12:g} TB/s = {first[g]['ridge']:.0f} FLOP/byte, "
                       f"8-bit rate: {first[g]['eight_bit']} ({gpu_spec(g).source} figures)" for g in gpus)
    lines = [f"# Roofline projection of the grouped GEMM launches, {' and '.join(gpus)}", "",
             "**A projection, not a measurement.** `python -m moe_lab.workbench.compile_report.roofline` "
             "writes this file (`python -m moe_lab compile` too, after the compile reports), from "
             "`moe_lab.perf.hardware`'s peaks and the modelled bytes of `traffic.md`.", "",
             "Projected time = max(FLOPs / bf16 peak, modelled bytes / HBM bandwidth); the bound is "
             "compute where the intensity (FLOPs / modelled bytes) reaches the ridge point (bf16 peak / "
             f"HBM bandwidth), memory below it. Ridge points: {ridges}. The 8-bit column is FLOPs / "
             "that rate, the compute floor alone (the bytes stay the bf16 ones). Wave efficiency: "
             "programs / (waves x programs in flight), left out of the projected time. dW rows: old is "
             "the grid with the expert fastest, new expert after expert (`traffic.md`'s weight-gradient "
             "table). The other grouped kernels (fused, SwiGLU backward, dX of the up/gate projection) are "
             "`traffic.md`'s third table, those with bf16 MMAs; the grouped MXFP8 GEMM is not on "
             "this bf16 roofline.", "",
             "| GPU | model | launch | GFLOP | compulsory MB | modelled MB (grouped) | FLOP/byte "
             "| ridge | bound | projected µs (grouped, new) | projected µs (row-fastest, old) | bound (old) "
             "| 8-bit compute floor µs | wave efficiency |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['gpu']} | {r['model']} | {r['launch']} | {r['flops'] / 1e9:,.1f} "
              f"| {r['compulsory'] / 1e6:,.1f} | {r['modelled'] / 1e6:,.1f} | {r['intensity']:,.0f} "
              f"| {r['ridge']:.0f} | {r['bound']} | {r['time_s'] * 1e6:,.0f} | {r['old_time_s'] * 1e6:,.0f} "
              f"| {r['old_bound']} | {r['eight_bit_compute_s'] * 1e6:,.0f} | {r['wave_efficiency']:.3f} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def bf16_rows(kernel_rows: list[dict]) -> list[dict]:
    """The `moe_lab.workbench.compile_report.traffic.kernel_tables` rows whose kernels multiply bf16
    tiles: the ones this bf16 roofline projects."""
    return [row for row in kernel_rows if row["mma"] == "bf16"]


def launch_rows(rows: list[dict], dw_rows: list[dict]) -> list[dict]:
    """The traffic table's ``rows`` and the dW rows (`moe_lab.workbench.compile_report.traffic.dw_tables`)
    in one list, each GPU's and model's launches together, dW after the forward launches."""
    gpus = {gpu: i for i, gpu in enumerate(dict.fromkeys(r["gpu"] for r in rows + dw_rows))}
    models = {entry[0]: i for i, entry in enumerate(traffic.ACCEPTANCE)}
    return sorted(rows + dw_rows, key=lambda r: (gpus[r["gpu"]], models[r["model"]]))


def write_tables(results: Path = traffic.RESULTS) -> list[Path]:
    """Write ``traffic.md`` (the traffic table's launches, the dW and the other grouped kernels,
    `moe_lab.workbench.compile_report.traffic.kernel_tables`) and ``roofline.md`` (all but the
    8-bit MMAs, `bf16_rows`) into
    ``results`` from the compile reports there (`moe_lab.workbench.compile_report.traffic.reports`);
    the traffic model runs once for both. Returns the paths written."""
    rows = traffic.tables(results)
    written = []
    dw_rows, kernel_rows = traffic.dw_tables(results), traffic.kernel_tables(results)
    projected = projections(launch_rows(rows, dw_rows + bf16_rows(kernel_rows)))
    for name, text in (("traffic.md", traffic.markdown(rows, dw_rows, kernel_rows)),
                       ("roofline.md", markdown(projected))):
        path = Path(results) / name
        path.write_text(text)
        written.append(path)
    return written


def plot(rows: list[dict], ax=None):
    """The roofline of every GPU in ``rows`` (`projections`' rows): attainable FLOP/s against
    intensity, dashed (a projection), with each launch at its intensity and attainable rate in
    the grouped order (filled) and the row-fastest order (hollow). Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.5))
    gpus = list(dict.fromkeys(r["gpu"] for r in rows))
    low = min(min(r["old_intensity"], r["intensity"]) for r in rows) / 2
    high = max(max(r["intensity"], r["ridge"]) for r in rows) * 2
    xs = np.geomspace(low, high, 200)
    for i, gpu in enumerate(gpus):
        color = f"C{i}"
        mine = [r for r in rows if r["gpu"] == gpu]
        peak, bandwidth = mine[0]["peak_flops"], mine[0]["bandwidth"]
        ax.plot(xs, roofline(peak, bandwidth, xs), linestyle="--", color=color,
                label=f"{gpu} roofline (bf16)")
        for key, rate, filled, what in (("intensity", "time_s", True, "grouped (new)"),
                                        ("old_intensity", "old_time_s", False, "row-fastest (old)")):
            ax.scatter([r[key] for r in mine], [r["flops"] / r[rate] for r in mine], color=color,
                       facecolors=color if filled else "none", marker="o" if filled else "s",
                       label=f"{gpu} launches, {what}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per modelled HBM byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title("Roofline of the grouped GEMM launches: a projection, not a measurement")
    ax.legend(fontsize=7)
    return ax


if __name__ == "__main__":
    for written in write_tables():
        print(f"wrote {written}")
