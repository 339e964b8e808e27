"""Figures of the fused grouped GEMMs (notebook 07_fused_grouped_gemm): the data flow of the
unfused and the fused expert path, the bytes per layer, and their projected memory time.
Each function draws on an Axes (created if not given) and returns it."""

from __future__ import annotations

import itertools
import textwrap

import numpy as np

from moe_lab.perf import fusion
from moe_lab.workbench.figures.charts import arrow, ax_or_new, box

# (label, kind) per lane: kind "k" a kernel launch, "m" a tensor in memory (HBM). Each lane is the
# forward of one `moe_lab.perf.fusion` variant, one "k" box per launch that variant counts, in
# the order the data flows (left to right).
LANES = {
    "swiglu_epilogue": [("x [T, d]", "m"), ("permute", "k"), ("x perm. [Tk, d]", "m"),
                        ("GEMM1 + SwiGLU", "k"), ("h [Tk, F]", "m"), ("GEMM2", "k"),
                        ("y perm. [Tk, d]", "m"), ("unpermute ·w", "k"), ("out [T, d]", "m")],
    "scatter_epilogue": [("row-id map [T, k]", "m"), ("row source: fill", "k"), ("row source: scatter", "k"),
                         ("source ids [Tk]", "m"), ("gather ▸ GEMM1 + SwiGLU", "k"), ("h [Tk, F]", "m"),
                         ("GEMM2 ▸ ·w scatter", "k"), ("y [T, k, d]", "m"), ("sum over top-k", "k"),
                         ("out [T, d]", "m")],
}
# Inputs a lane's kernel also reads, drawn under it: the gather reads the token rows of x
# themselves, through the source ids.
SIDE_INPUTS = {"scatter_epilogue": {"gather ▸ GEMM1 + SwiGLU": "x [T, d]"}}


_LANE_NAMES = {"swiglu_epilogue": "notebook 04's chain (SwiGLU epilogue)",
               "scatter_epilogue": "gather prologue + scatter epilogue"}

_SLOT = 1.45  # distance between the centres of two neighbouring boxes
_BOX_W, _BOX_H, _PAD = 1.1, 0.34, 0.03  # a box's width and height, and its rounded border


def lane_counts(variant: str) -> tuple[int, int]:
    """(launches, tensors written between two of them) of ``variant``'s lane as drawn."""
    lane = LANES[variant]
    return sum(kind == "k" for _, kind in lane), sum(kind == "m" for _, kind in lane[1:-1])


def dataflow_note() -> str:
    """What the launch counts of `plot_dataflow` mean, from the lanes it draws."""
    unfused, _ = lane_counts("swiglu_epilogue")
    fused, _ = lane_counts("scatter_epilogue")
    more = fused - unfused  # the lanes are fixed: the fused one has more launches
    return (f"Forward launches only. The fused path has {more} launch{'es' * (more != 1)} more "
            f"({unfused} → {fused}): the permute and "
            "the combine are gone into the GEMMs, but the gather needs its row source (two small launches "
            "over Tk integers) and the token-major scatter a sum over top-k.\nWhat fusion removes is bytes, "
            "not launches: the permuted copy of x [Tk, d] becomes an index of Tk integers, and y is "
            "summed as one contiguous stream instead of gathered row by row.")


def _box(ax, x: float, y: float, label: str, kind: str) -> None:
    """A kernel (square) or a tensor (rounded) box centred on ``(x, y)``."""
    color = "#cfe2f3" if kind == "k" else "#fff2cc"
    style = f"square,pad={_PAD}" if kind == "k" else f"round,pad={_PAD}"
    text = label.replace(": ", ":\n").replace(" ▸ ", " ▸\n")
    box(ax, x - _BOX_W / 2, y - _BOX_H / 2, _BOX_W, _BOX_H, text, color, 6.8, style)


def plot_dataflow(ax=None):
    """The forward expert path as kernels (square boxes) and the tensors they write to memory
    (rounded boxes), the data flowing left to right: notebook 04's chain (its SwiGLU
    epilogue already fused) above, the gather prologue with the deterministic scatter
    epilogue below, one box per launch that `moe_lab.perf.fusion` counts for each. A note
    under the lanes (`dataflow_note`) says what their launch counts mean."""
    ax = ax_or_new(ax, (14, 4.2))
    edge = _BOX_W / 2 + _PAD + 0.04  # an arrow starts and ends just outside a box
    for y, variant in ((2.0, "swiglu_epilogue"), (0.75, "scatter_epilogue")):
        lane = LANES[variant]
        xs = [0.7 + i * _SLOT for i in range(len(lane))]
        kernels, between = lane_counts(variant)
        ax.text(0.1, y + 0.36, f"{_LANE_NAMES[variant]}: {kernels} launches, {between} tensors between them",
                fontsize=9, weight="bold")
        for i, (label, kind) in enumerate(lane):
            _box(ax, xs[i], y, label, kind)
            if i:
                arrow(ax, (xs[i - 1] + edge, y), (xs[i] - edge, y))
            side = SIDE_INPUTS.get(variant, {}).get(label)
            if side is not None:  # an extra input, under its kernel, flowing up into it
                below = y - 0.65
                _box(ax, xs[i], below, side, "m")
                arrow(ax, (xs[i], below + _BOX_H / 2 + _PAD + 0.03), (xs[i], y - _BOX_H / 2 - _PAD - 0.03))
    for x, style, color, what in ((11.0, "square", "#cfe2f3", "kernel launch"),
                                  (12.5, "round", "#fff2cc", "tensor in HBM")):  # the legend
        box(ax, x, -0.02, 0.3, 0.14, "", color, style=f"{style},pad={_PAD}")
        ax.text(x + 0.4, 0.05, what, fontsize=7.5, va="center")
    note = "\n".join(textwrap.fill(part, 150) for part in dataflow_note().split("\n"))
    ax.text(0.1, -0.35, note, fontsize=8, va="top")
    ax.set(xlim=(0, 14.6), ylim=(-0.95, 2.5))
    ax.axis("off")
    return ax


def plot_bytes(table: list[dict], preset: str, ax=None):
    """Stacked bars of one preset's bytes per MoE layer (activations, weights, forward +
    backward), one bar per variant of `fusion.VARIANTS`, the launches written on top."""
    rows = [r for r in table if r["preset"] == preset and r["variant"] in fusion.VARIANTS]
    ax = ax_or_new(ax, (7, 3.6))
    x = np.arange(len(rows))
    act = np.array([r["activation_bytes"] for r in rows]) / 1e9
    wts = np.array([r["weight_bytes"] for r in rows]) / 1e9
    ax.bar(x, act, color="tab:orange", label="activations")
    ax.bar(x, wts, bottom=act, color="tab:gray", label="weights")
    for i, r in enumerate(rows):
        ax.text(i, act[i] + wts[i], f"{r['launches']} launches", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [r["label"] for r in rows], rotation=25, ha="right", fontsize=7.5)
    ax.set_ylabel("GB per layer (fwd + bwd), counted")
    ax.set_title(f"{preset}: {rows[0]['tokens']} tokens/GPU, {rows[0]['local_experts']} local experts "
                 f"(EP{rows[0]['ep']})", fontsize=9)
    ax.legend(fontsize=8)
    return ax


def plot_projection(table: list[dict], gpus: tuple[str, ...] = ("H200", "GB300"), ax=None,
                    variants: tuple[str, ...] | None = None):
    """The memory-time floor (bytes / HBM bandwidth) of each variant, per preset and GPU,
    hatched and titled as what it is: a projection from datasheet bandwidth."""
    rows = [r for r in table if variants is None or r["variant"] in variants]
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    ax = ax_or_new(ax, (8, 3.6))
    width = 0.8 / (len(presets) * len(gpus))
    x = np.arange(len(labels))
    for i, (preset, gpu) in enumerate(itertools.product(presets, gpus)):
        by = {r["label"]: r[f"projected_ms_{gpu}"] for r in rows if r["preset"] == preset}
        offset = (i - (len(presets) * len(gpus) - 1) / 2) * width
        ax.bar(x + offset, [by.get(lab, 0) for lab in labels], width, hatch="//", alpha=0.75,
               label=f"{preset} · {gpu}")
    ax.set_xticks(x, labels, rotation=25, ha="right", fontsize=7.5)
    ax.set_ylabel("ms per layer (projection)")
    ax.set_title("PROJECTION: counted bytes / datasheet HBM bandwidth — not measured", fontsize=9)
    ax.legend(fontsize=7)
    return ax
