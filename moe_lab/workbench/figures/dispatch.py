"""Figures of the dispatch notebooks (02 capacity, 04 dropless): padded expert buffers,
where drops fall, the expert-sorted permutation and the grouped GEMM's tile schedule.

Each plotting function draws on an Axes (created if not given) and returns it, like
`moe_lab.workbench.figures.charts`. `tile_schedule` is a plain-PyTorch mirror of the schedule the Triton
grouped GEMM computes in each program (``moe_lab.kernels.common.tile_schedule``),
so the figure can be drawn without running the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Rectangle

from moe_lab.moe.experts import sort_by_expert
from moe_lab.workbench.figures.charts import ax_or_new

_CMAP = plt.get_cmap("tab20")


def expert_color(e: int):
    """A stable colour per expert id (20 distinct, then repeating)."""
    return _CMAP(int(e) % 20)


def plot_capacity_buffer(counts: Sequence[int], capacity: int, ax=None):
    """The padded ``[n_experts, capacity]`` buffer, one row per expert: slots holding a
    token (blue), empty slots that are computed anyway (grey, the padding waste) and the
    assignments past the capacity line that are dropped (red)."""
    counts = np.asarray(counts, dtype=int)
    n = len(counts)
    ax = ax_or_new(ax, (7, 0.28 * n + 1.4))
    used = np.minimum(counts, capacity)
    ax.barh(range(n), used, color="tab:blue", label="token in a slot")
    ax.barh(range(n), capacity - used, left=used, color="0.85", hatch="//", edgecolor="0.6",
            lw=0, label="empty slot (padding)")
    ax.barh(range(n), np.maximum(counts - capacity, 0), left=capacity, color="tab:red",
            label="dropped")
    ax.axvline(capacity, color="k", ls="--", lw=1)
    ax.annotate(f"C = {capacity}", (capacity, n - 0.4), xytext=(3, 0), textcoords="offset points",
                fontsize=8, va="bottom")
    if capacity <= 48:  # draw the slots themselves when they are few enough to see
        for c in range(1, capacity):
            ax.axvline(c, color="white", lw=0.4)
    ax.set_yticks(range(n), [f"expert {e}" for e in range(n)], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("slot")
    ax.set_title(f"[E={n}, C={capacity}] buffer: {int(used.sum())} tokens, "
                 f"{int((capacity - used).sum())} empty slots, "
                 f"{int(np.maximum(counts - capacity, 0).sum())} dropped", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return ax


def plot_drops_by_position(dropped: dict[str, torch.Tensor], title: str, ax=None):
    """``dropped``: policy name -> ``[T, k]`` bool (True = dropped). Share of each of 16 bins
    of consecutive tokens whose assignments were dropped, one line per policy."""
    ax = ax_or_new(ax, (7, 3.5))
    n_bins = 16
    for name, mask in dropped.items():
        per_token = mask.float().mean(dim=1)  # share of this token's k assignments dropped
        bins = per_token.tensor_split(n_bins)
        centres = [(i + 0.5) / n_bins for i in range(n_bins)]
        ax.plot(centres, [100 * float(b.mean()) for b in bins], marker="o", ms=3, label=name)
    ax.set(xlabel="position of the token in the batch (0 = first, 1 = last)",
           ylabel="assignments dropped (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_permutation(topk_ids: torch.Tensor, n_experts: int, ax=None):
    """The (token, choice) assignments in token order (top) and sorted by expert (bottom),
    each cell coloured by its expert, a line from every assignment to its sorted row, and
    the offsets marked where each expert's segment begins."""
    tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order, offsets = sort_by_expert(topk_ids, n_experts)  # the lesson's own permutation
    counts = offsets.diff()
    n = flat.numel()
    ax = ax_or_new(ax, (max(6.0, 0.32 * n), 3.0))
    destination = torch.empty_like(order).scatter_(0, order, torch.arange(n))
    for i in range(n):
        e, j = int(flat[i]), int(destination[i])
        for x, y in ((i, 2), (j, 0)):  # the assignment in token order, then in its sorted row
            ax.add_patch(Rectangle((x, y), 1, 0.8, facecolor=expert_color(e), edgecolor="white"))
            ax.text(x + 0.5, y + 0.4, f"{i // k}", ha="center", va="center", fontsize=6)
        ax.plot([i + 0.5, j + 0.5], [2, 0.8], color=expert_color(e), lw=0.6, alpha=0.7)
    for e in range(n_experts + 1):
        x = int(offsets[e])
        ax.plot([x, x], [-0.15, 0.95], color="k", lw=1)
        if e < n_experts and counts[e] > 0:
            ax.text(x + counts[e] / 2, -0.45, f"e{e}", ha="center", fontsize=7)
    ax.text(-0.3, 2.4, "token order", ha="right", va="center", fontsize=8)
    ax.text(-0.3, 0.4, "sorted by expert", ha="right", va="center", fontsize=8)
    ax.set_xticks([int(o) for o in offsets], [f"{int(o)}" for o in offsets], fontsize=7)
    ax.set(xlim=(-0.2, n + 0.2), ylim=(-0.8, 3.0), yticks=[],
           xlabel="offsets (row where each expert's segment starts); numbers in cells: token")
    ax.spines[["top", "right", "left"]].set_visible(False)
    return ax


def tile_schedule(offsets: torch.Tensor, block_m: int, m_rows: int) -> list[tuple[int, int, int]]:
    """``(segment, first row, segment's end row)`` of every program along the grid's row
    axis; the program multiplies rows ``first row : min(first row + block_m, end row)``.

    The grid has ``cdiv(m_rows, block_m) + E`` programs — a bound known from shapes alone.
    Program ``p`` counts the tiles of every segment (experts ``0..E-1``, then the padding
    rows ``offsets[E]:m_rows`` as segment ``E``), takes their running sum and finds the
    segment its number falls in; a segment number above ``E`` means "no work, exit" (the
    kernel counts lanes of a power-of-two block there, so its number may be larger than
    ``E + 1``; only "above ``E``" matters). This mirrors the kernel's ``tile_schedule``,
    one program at a time; such a program's rows are reported as ``(-1, -1)``.
    """
    n_experts = offsets.numel() - 1
    start = offsets.long().cpu()
    end = torch.cat([start[1:], torch.tensor([m_rows])])
    n_tiles = (end - start + block_m - 1) // block_m
    last = n_tiles.cumsum(0)  # tiles in segments 0..s
    schedule = []
    for p in range(-(-m_rows // block_m) + n_experts):
        seg = int((last <= p).sum())
        if seg > n_experts:
            schedule.append((seg, -1, -1))
            continue
        first_tile = int(last[seg] - n_tiles[seg])
        row0 = int(start[seg]) + (p - first_tile) * block_m
        schedule.append((seg, row0, int(end[seg])))
    return schedule


def plot_tile_schedule(offsets: torch.Tensor, block_m: int, m_rows: int, ax=None):
    """Top: the expert-sorted rows, coloured by expert. Bottom: the grid's programs, each
    coloured by the expert whose rows it multiplies (a partial tile is drawn part-filled),
    grey for padding rows, hatched white for a program that finds no work and exits."""
    schedule = tile_schedule(offsets, block_m, m_rows)
    n_experts = offsets.numel() - 1
    ax = ax_or_new(ax, (9, 3.2))
    bounds = [int(o) for o in offsets] + [m_rows]
    for e in range(n_experts + 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            color = expert_color(e) if e < n_experts else "0.8"
            ax.add_patch(Rectangle((lo, 2.0), hi - lo, 0.8, color=color))
            label = f"e{e}" if e < n_experts else "pad"
            ax.text((lo + hi) / 2, 2.4, label, ha="center", va="center", fontsize=7)
    width = m_rows / len(schedule)
    for p, (seg, row0, row_end) in enumerate(schedule):
        x = p * width
        if seg > n_experts:
            ax.add_patch(Rectangle((x, 0), width * 0.92, 0.8, facecolor="white", edgecolor="0.5",
                                   hatch="xx", lw=0.6))
            continue
        color = expert_color(seg) if seg < n_experts else "0.8"
        fill = (min(row0 + block_m, row_end) - row0) / block_m
        ax.add_patch(Rectangle((x, 0), width * 0.92, 0.8, facecolor="white", edgecolor=color, lw=1))
        ax.add_patch(Rectangle((x, 0), width * 0.92 * fill, 0.8, color=color))
        ax.plot([x + width * 0.46, row0 + min(block_m, row_end - row0) / 2], [0.8, 2.0],
                color=color, lw=0.6)
        ax.plot([row0, row0], [2.0, 2.8], color="white", lw=0.8)  # where this tile starts
    ax.text(-0.01 * m_rows, 2.4, f"{m_rows} sorted rows", ha="right", va="center", fontsize=8)
    ax.text(-0.01 * m_rows, 0.4, f"{len(schedule)} programs", ha="right", va="center", fontsize=8)
    ax.set(xlim=(0, m_rows), ylim=(-0.2, 3.0), xticks=[], yticks=[])
    live = sum(1 for s in schedule if s[0] < n_experts)
    pad = sum(1 for s in schedule if s[0] == n_experts)
    ax.set_title(f"BLOCK_M = {block_m}: grid of cdiv({m_rows}, {block_m}) + {n_experts} = "
                 f"{len(schedule)} programs: {live} multiply, {pad} zero the padding, "
                 f"{len(schedule) - live - pad} exit at once", fontsize=9)
    ax.spines[["top", "right", "left", "bottom"]].set_visible(False)
    return ax


def pipeline_schedule(steps: int, load: float, mma: float,
                      stages: int) -> list[tuple[float, float, float, float]]:
    """When each step of a GEMM tile's ``K`` loop loads and multiplies, with ``stages`` shared
    memory buffers (Triton's ``num_stages``): a toy model for the picture, not a GPU's timing.

    A load takes ``load`` (its latency: loads overlap one another), an MMA takes ``mma``, the
    MMAs run one after another, each once its own operands have arrived. Load ``k`` is issued
    in order and only when its buffer is free — once MMA ``k - stages`` has finished with it
    — so ``stages=1`` serialises everything and more stages keep copies in flight while the
    tensor cores work. Returns ``(load_start, load_end, mma_start, mma_end)`` per step.
    """
    out: list[tuple[float, float, float, float]] = []
    for k in range(steps):
        issue = out[k - 1][0] if k else 0.0
        if k >= stages:
            issue = max(issue, out[k - stages][3])
        arrived = issue + load
        start = max(arrived, out[k - 1][3] if k else 0.0)
        out.append((issue, arrived, start, start + mma))
    return out


def plot_pipeline(load: float, mma: float, stages: Sequence[int] = (1, 2, 4), steps: int = 8, ax=None):
    """A Gantt chart of `pipeline_schedule` for each number of ``stages``: loads in grey,
    MMAs in blue, one pair of rows per choice (a toy model; time in units of one MMA)."""
    ax = ax_or_new(ax, (8, 0.9 + 0.9 * len(stages)))
    labels = []
    for i, s in enumerate(stages):
        sched = pipeline_schedule(steps, load, mma, s)
        y = 2 * (len(stages) - 1 - i)
        for k, (l0, l1, m0, m1) in enumerate(sched):
            ax.add_patch(Rectangle((l0, y + 1 + 0.1 + 0.6 * (k % 2) / 2), l1 - l0, 0.3, color="0.6"))
            ax.add_patch(Rectangle((m0, y + 0.15), m1 - m0, 0.7, color="tab:blue"))
            ax.text((m0 + m1) / 2, y + 0.5, str(k), ha="center", va="center", color="white", fontsize=7)
        labels += [(y + 0.5, f"stages={s}: MMA"), (y + 1.5, f"stages={s}: loads")]
        ax.text(sched[-1][3] + 0.2, y + 0.5, f"{sched[-1][3] / steps:.2f} per step", va="center", fontsize=8)
    end = max(pipeline_schedule(steps, load, mma, s)[-1][3] for s in stages)
    ax.set_yticks([y for y, _ in labels], [name for _, name in labels], fontsize=8)
    ax.set(xlim=(0, end * 1.18), ylim=(0, 2 * len(stages)),
           xlabel="time (one MMA = 1; a toy model, not measured)",
           title=f"a tile's K loop: a load takes {load:g}x an MMA")
    return ax
