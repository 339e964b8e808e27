"""Plots the notebooks share. Each function draws on an Axes (created if not given)
and returns it, so a notebook can compose figures."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch


def ax_or_new(ax=None, figsize=(6, 3.5)):
    """``ax``, or the Axes of a new figure of ``figsize`` when it is None."""
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def box(ax, x: float, y: float, w: float, h: float, text: str, color: str, fontsize: float = 8,
        style: str = "round,pad=0.02") -> None:
    """A labelled box of a schematic, its lower-left corner at ``(x, y)``."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=color, edgecolor="0.3",
                                linewidth=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def arrow(ax, start: tuple[float, float], end: tuple[float, float]) -> None:
    """An arrow of a schematic from ``start`` to ``end`` (data coordinates), tip at ``end``."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10, color="0.3",
                                 shrinkA=0, shrinkB=0))


def plot_tokens_per_expert(counts: Sequence[float], capacity: float | None = None, ax=None,
                           title: str = "tokens per expert"):
    """Bar chart of the load of each expert, with the capacity line if given."""
    ax = ax_or_new(ax)
    counts = np.asarray(counts, dtype=float)
    colors = ["tab:red" if capacity is not None and c > capacity else "tab:blue" for c in counts]
    ax.bar(np.arange(len(counts)), counts, color=colors)
    ax.axhline(counts.mean(), color="k", ls=":", lw=1, label=f"mean {counts.mean():.0f}")
    if capacity is not None:
        ax.axhline(capacity, color="tab:red", ls="--", lw=1, label=f"capacity {capacity:.0f}")
    ax.set(xlabel="expert", ylabel="tokens", title=title)
    ax.legend(fontsize=8)
    return ax


def plot_routing_heatmap(matrix, row_labels: Sequence[str], ax=None,
                         title: str = "share of each domain's tokens per expert"):
    """Heat map ``[domains, experts]``; rows are normalised to sum to one."""
    ax = ax_or_new(ax, (7, 0.45 * len(row_labels) + 1.5))
    m = np.asarray(matrix, dtype=float)
    m = m / np.maximum(m.sum(axis=1, keepdims=True), 1e-12)
    im = ax.imshow(m, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(row_labels)), row_labels)
    ax.set(xlabel="expert", title=title)
    plt.colorbar(im, ax=ax, fraction=0.03)
    return ax


def plot_curves(curves: dict[str, tuple[Sequence[float], Sequence[float]]], ax=None,
                xlabel: str = "step", ylabel: str = "loss", title: str = ""):
    """Several named (x, y) curves on one Axes."""
    ax = ax_or_new(ax)
    for name, (x, y) in curves.items():
        ax.plot(x, y, label=name)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


def plot_bars(values: dict[str, float], ax=None, ylabel: str = "", title: str = "",
              fmt: str = "{:.3g}"):
    """A labelled bar per entry, the value written on each bar."""
    ax = ax_or_new(ax)
    bars = ax.bar(list(values), list(values.values()), color="tab:blue")
    for b, v in zip(bars, values.values(), strict=True):
        ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set(ylabel=ylabel, title=title)
    ax.tick_params(axis="x", rotation=20)
    return ax
