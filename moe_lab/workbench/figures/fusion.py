"""Figures of the fused grouped GEMMs (notebook 03_fused_grouped_gemm): the data flow of the
unfused and the fused expert path, the bytes per layer, and their projected memory time.
Each function draws on an Axes (created if not given) and returns it."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

# (label, kind) per lane: kind "k" a kernel launch, "m" a tensor in memory (HBM).
_UNFUSED = [("x [T, d]", "m"), ("permute", "k"), ("x perm. [Tk, d]", "m"), ("GEMM1 + SwiGLU", "k"),
            ("h [Tk, F]", "m"), ("GEMM2", "k"), ("y perm. [Tk, d]", "m"), ("unpermute ·w", "k"),
            ("out [T, d]", "m")]
_FUSED = [("x [T, d]", "m"), ("gather ▸ GEMM1 + SwiGLU", "k"), ("h [Tk, F]", "m"),
          ("GEMM2 ▸ ·w scatter", "k"), ("out [T, d]", "m")]


def plot_dataflow(ax=None):
    """The forward expert path as kernels (boxes) and the tensors they write to memory
    (rounded labels): the unfused chain above, the fused one below. Every tensor between
    two kernels is a round trip through HBM; the fused path has two fewer."""
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 3.2))
    for y, lane, title in ((1.0, _UNFUSED, "unfused: 4 launches, 3 intermediate tensors"),
                           (0.0, _FUSED, "fused: 2 launches, 1 intermediate tensor")):
        xs = np.linspace(0.5, 11.5, len(lane))
        ax.text(0.0, y + 0.38, title, fontsize=9, weight="bold")
        for i, (label, kind) in enumerate(lane):
            color = "#cfe2f3" if kind == "k" else "#fff2cc"
            style = "square,pad=0.25" if kind == "k" else "round,pad=0.25"
            ax.add_patch(FancyBboxPatch((xs[i] - 0.55, y - 0.16), 1.1, 0.32, boxstyle=style, fc=color,
                                        ec="0.3", lw=0.8))
            ax.text(xs[i], y, label, ha="center", va="center", fontsize=7.5)
            if i:
                ax.add_patch(FancyArrowPatch((xs[i - 1] + 0.62, y), (xs[i] - 0.62, y),
                                             arrowstyle="-|>", mutation_scale=9, color="0.3"))
    ax.text(11.9, 0.5, "kernel (blue)\ntensor in HBM (yellow)", fontsize=7.5, va="center")
    ax.set_xlim(-0.2, 13.5)
    ax.set_ylim(-0.4, 1.5)
    ax.axis("off")
    return ax


def plot_bytes(table: list[dict], preset: str, ax=None, variants: tuple[str, ...] | None = None):
    """Stacked bars of one preset's bytes per MoE layer (activations, weights), forward +
    backward, one bar per variant, the launches written on top."""
    rows = [r for r in table if r["preset"] == preset and (variants is None or r["variant"] in variants)]
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
