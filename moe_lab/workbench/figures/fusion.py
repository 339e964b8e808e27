"""Figures of the fused grouped GEMMs (notebook 07_fused_grouped_gemm): the data flow of the
unfused and the fused expert path, the bytes per layer, and their projected memory time.
Each function draws on an Axes (created if not given) and returns it."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from moe_lab.perf import fusion

# (label, kind) per lane: kind "k" a kernel launch, "m" a tensor in memory (HBM). Each lane is the
# forward of one `moe_lab.perf.fusion` variant, one "k" box per launch that variant counts.
LANES = {
    "swiglu_epilogue": [("x [T, d]", "m"), ("permute", "k"), ("x perm. [Tk, d]", "m"),
                        ("GEMM1 + SwiGLU", "k"), ("h [Tk, F]", "m"), ("GEMM2", "k"),
                        ("y perm. [Tk, d]", "m"), ("unpermute ·w", "k"), ("out [T, d]", "m")],
    "scatter_epilogue": [("x [T, d]", "m"), ("row source: fill", "k"), ("row source: scatter", "k"),
                         ("source ids [Tk]", "m"), ("gather ▸ GEMM1 + SwiGLU", "k"), ("h [Tk, F]", "m"),
                         ("GEMM2 ▸ ·w scatter", "k"), ("y [T, k, d]", "m"), ("sum over top-k", "k"),
                         ("out [T, d]", "m")],
}


_LANE_NAMES = {"swiglu_epilogue": "notebook 04's chain (SwiGLU epilogue)",
               "scatter_epilogue": "gather prologue + scatter epilogue"}


def lane_counts(variant: str) -> tuple[int, int]:
    """(launches, tensors written between two of them) of ``variant``'s lane as drawn."""
    lane = LANES[variant]
    return sum(kind == "k" for _, kind in lane), sum(kind == "m" for _, kind in lane[1:-1])


def _lane_title(variant: str) -> str:
    kernels, between = lane_counts(variant)
    return f"{_LANE_NAMES[variant]}: {kernels} launches, {between} tensors between them"


def plot_dataflow(ax=None):
    """The forward expert path as kernels (boxes) and the tensors they write to memory
    (rounded labels): notebook 04's chain (its SwiGLU epilogue already fused) above, the gather
    prologue with the deterministic scatter epilogue below, one box per launch that
    `moe_lab.perf.fusion` counts for each. The fused forward does not launch fewer kernels:
    the gather trades the permuted copy of ``x`` (``[Tk, d]``) for an index array of ``Tk``
    integers, built by two small launches; the scatter writes ``y`` token-major so that the
    combine is a plain sum. What it removes is bytes, most of them in the backward."""
    if ax is None:
        _, ax = plt.subplots(figsize=(13, 3.2))
    for y, variant in ((1.0, "swiglu_epilogue"), (0.0, "scatter_epilogue")):
        lane = LANES[variant]
        xs = np.linspace(0.5, 11.5, len(lane))
        width = min(1.1, 0.92 * (xs[1] - xs[0]))
        ax.text(0.0, y + 0.38, _lane_title(variant), fontsize=9, weight="bold")
        for i, (label, kind) in enumerate(lane):
            color = "#cfe2f3" if kind == "k" else "#fff2cc"
            style = "square,pad=0.25" if kind == "k" else "round,pad=0.25"
            ax.add_patch(FancyBboxPatch((xs[i] - width / 2, y - 0.16), width, 0.32, boxstyle=style, fc=color,
                                        ec="0.3", lw=0.8))
            ax.text(xs[i], y, label.replace(": ", ":\n").replace(" ▸ ", " ▸\n"), ha="center", va="center",
                    fontsize=6.8)
            if i:
                ax.add_patch(FancyArrowPatch((xs[i - 1] + width / 2 + 0.07, y), (xs[i] - width / 2 - 0.07, y),
                                             arrowstyle="-|>", mutation_scale=9, color="0.3"))
    ax.text(11.9, 0.5, "kernel (blue)\ntensor in HBM (yellow)", fontsize=7.5, va="center")
    ax.set_xlim(-0.2, 13.5)
    ax.set_ylim(-0.4, 1.5)
    ax.axis("off")
    return ax


def plot_bytes(table: list[dict], preset: str, ax=None, variants: tuple[str, ...] = fusion.VARIANTS):
    """Stacked bars of one preset's bytes per MoE layer (activations, weights), one bar per
    variant, the launches written on top: forward + backward for `fusion.VARIANTS` (the
    default), forward only for `fusion.MX_VARIANTS`; the axis says which, so the two kinds
    are not drawn on one axis."""
    kinds = {v in fusion.MX_VARIANTS for v in variants}
    if len(kinds) != 1:
        raise ValueError(f"variants: draw fusion.VARIANTS (forward + backward) or fusion.MX_VARIANTS "
                         f"(forward only), not a mix of both; got {variants}")
    rows = [r for r in table if r["preset"] == preset and r["variant"] in variants]
    if not rows:
        raise ValueError(f"preset: no rows of {preset!r} with variants {variants} in the table")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6))
    x = np.arange(len(rows))
    act = np.array([r["activation_bytes"] for r in rows]) / 1e9
    wts = np.array([r["weight_bytes"] for r in rows]) / 1e9
    ax.bar(x, act, color="tab:orange", label="activations")
    ax.bar(x, wts, bottom=act, color="tab:gray", label="weights")
    for i, r in enumerate(rows):
        ax.text(i, act[i] + wts[i], f"{r['launches']} launches", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [r["label"] for r in rows], rotation=25, ha="right", fontsize=7.5)
    ax.set_ylabel(f"GB per layer ({'fwd only' if kinds == {True} else 'fwd + bwd'}), counted")
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
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / (len(presets) * len(gpus))
    x = np.arange(len(labels))
    i = 0
    for preset in presets:
        for gpu in gpus:
            by = {r["label"]: r[f"projected_ms_{gpu}"] for r in rows if r["preset"] == preset}
            offset = (i - (len(presets) * len(gpus) - 1) / 2) * width
            ax.bar(x + offset, [by.get(lab, 0) for lab in labels], width, hatch="//", alpha=0.75,
                   label=f"{preset} · {gpu}")
            i += 1
    ax.set_xticks(x, labels, rotation=25, ha="right", fontsize=7.5)
    ax.set_ylabel("ms per layer (projection)")
    ax.set_title("PROJECTION: counted bytes / datasheet HBM bandwidth — not measured", fontsize=9)
    ax.legend(fontsize=7)
    return ax
