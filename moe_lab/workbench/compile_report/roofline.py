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

from pathlib import Path

import numpy as np

from moe_lab.perf.hardware import gpu_spec, roofline
from moe_lab.workbench.compile_report import traffic


def projections(rows: list[dict]) -> list[dict]:
    """One projection row per `moe_lab.workbench.compile_report.traffic.tables` row: FLOPs,
    compulsory and modelled (grouped order) bytes, the intensity against the ridge, the projected
    time and bound of the grouped order and of the row-fastest (old) order, the compute floor at
    the 8-bit rate and the wave efficiency at the launch's programs in flight.

    The 8-bit rate is the MXFP8 one where the GPU has block-scaled FP8 units; otherwise (Hopper)
    the FP8 rate, which is the rate of `moe_lab.kernels.mx_attention`'s ``fp8_promote`` path (MXFP8
    on FP8 wgmma, scales applied in float32)."""
    out = []
    for row in rows:
        spec = gpu_spec(row["gpu"])
        peak = spec.peak_flops("bf16")
        # [m, k] @ [k, n] per expert over the launch's routed rows, for each of its B panels
        flops = 2 * row["per_expert"] * row["experts"] * row["n"] * row["k"] * row["panels"]
        compute_s = flops / peak
        memory_s = {order: row[f"{order}_bytes"] / spec.bandwidth for order in ("grouped", "row")}
        eight_bit = "MXFP8" if spec.native_mxfp8 else "FP8, the fp8_promote path"
        waves = -(-row["programs"] // row["in_flight"])
        out.append(dict(gpu=spec.name, model=row["model"], launch=row["launch"], flops=flops,
                        compulsory=row["compulsory"], modelled=row["grouped_bytes"],
                        old_bytes=row["row_bytes"], intensity=flops / row["grouped_bytes"],
                        old_intensity=flops / row["row_bytes"], ridge=spec.ridge_intensity,
                        bound="compute" if compute_s >= memory_s["grouped"] else "memory",
                        time_s=max(compute_s, memory_s["grouped"]),
                        old_bound="compute" if compute_s >= memory_s["row"] else "memory",
                        old_time_s=max(compute_s, memory_s["row"]), eight_bit=eight_bit,
                        eight_bit_compute_s=flops / spec.peak_flops("mxfp8" if spec.native_mxfp8 else "fp8"),
                        wave_efficiency=row["programs"] / (waves * row["in_flight"]),
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
             "| ridge | bound | projected µs (grouped, new) | projected µs (row-fastest, old) "
             "| bound (old) | 8-bit compute floor µs | wave efficiency |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['gpu']} | {r['model']} | {r['launch']} | {r['flops'] / 1e9:,.1f} "
              f"| {r['compulsory'] / 1e6:,.1f} | {r['modelled'] / 1e6:,.1f} | {r['intensity']:,.0f} "
              f"| {r['ridge']:.0f} | {r['bound']} | {r['time_s'] * 1e6:,.0f} | {r['old_time_s'] * 1e6:,.0f} "
              f"| {r['old_bound']} | {r['eight_bit_compute_s'] * 1e6:,.0f} | {r['wave_efficiency']:.3f} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def launch_projections(rows: list[dict], dw_rows: list[dict], kernel_rows: list[dict]) -> list[dict]:
    """`projections` of the traffic table's ``rows``, the dW rows
    (`moe_lab.workbench.compile_report.traffic.dw_tables`) and the kernel rows whose kernels multiply
    bf16 tiles (`moe_lab.workbench.compile_report.traffic.kernel_tables`: all but the 8-bit MMAs), in
    one list, each GPU's and model's launches together, dW after the forward launches."""
    launches = rows + dw_rows + [row for row in kernel_rows if row["mma"] == "bf16"]
    gpus = {gpu: i for i, gpu in enumerate(dict.fromkeys(r["gpu"] for r in launches))}
    models = {entry[0]: i for i, entry in enumerate(traffic.ACCEPTANCE)}
    return projections(sorted(launches, key=lambda r: (gpus[r["gpu"]], models[r["model"]])))


def write_tables(results: Path = traffic.RESULTS) -> list[Path]:
    """Write ``traffic.md`` (the traffic table's launches, the dW and the other grouped kernels,
    `moe_lab.workbench.compile_report.traffic.kernel_tables`) and ``roofline.md`` (all but the
    8-bit MMAs, `launch_projections`) into
    ``results`` from the compile reports there (`moe_lab.workbench.compile_report.traffic.reports`);
    the traffic model runs once for both. Returns the paths written."""
    rows, dw_rows = traffic.tables(results), traffic.dw_tables(results)
    kernel_rows = traffic.kernel_tables(results)
    texts = {Path(results) / "traffic.md": traffic.markdown(rows, dw_rows, kernel_rows),
             Path(results) / "roofline.md": markdown(launch_projections(rows, dw_rows, kernel_rows))}
    for path, text in texts.items():
        path.write_text(text)
    return list(texts)


def plot(rows: list[dict]):
    """The roofline of every GPU in ``rows`` (`projections`' rows): attainable FLOP/s against
    intensity, dashed (a projection), with each launch at its intensity and attainable rate in
    the grouped order (filled) and the row-fastest order (hollow). Returns the axes."""
    import matplotlib.pyplot as plt

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
