"""The paged stash's pool drawn page by page (notebook 08)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moe_lab.moe.stash import page_table, pages_per_expert
from moe_lab.workbench.figures.charts import ax_or_new


def plot_page_map(counts, page_rows: int, n_pages: int, ax=None):
    """Draw the pool a step fills: one cell per page, coloured and labelled by its expert,
    filled as far as the page is full; the trash page is hatched and pages past the end of
    the pool (an overflow) are outlined in red, 16 pages a row. ``counts``: rows per expert."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    offsets = F.pad(torch.as_tensor(counts, dtype=torch.int64).cumsum(0), (1, 0))
    pages = pages_per_expert(offsets, page_rows)
    used = int(pages.sum())
    page_expert = torch.repeat_interleave(torch.arange(len(pages)), pages).tolist()
    page_of_row, _, _ = page_table(offsets, page_rows, int(offsets[-1]))  # the lesson's own page table
    page_fill = [rows / page_rows for rows in torch.bincount(page_of_row, minlength=used).tolist()]
    cells = max(n_pages, used) + 1  # + the trash page
    per_row = 16
    n_rows = math.ceil(cells / per_row)
    ax = ax_or_new(ax, (0.55 * per_row, 0.7 + 0.6 * n_rows))
    cmap = plt.get_cmap("tab10")
    for p in range(cells):
        r, c = divmod(p, per_row)
        x, y = c, -r
        if p < used:
            colour = cmap(page_expert[p] % 10)
            ax.add_patch(Rectangle((x, y), 0.92, 0.85, facecolor=colour, alpha=0.2))
            ax.add_patch(Rectangle((x, y), 0.92 * page_fill[p], 0.85, facecolor=colour))
            ax.text(x + 0.46, y + 0.42, f"e{page_expert[p]}", ha="center", va="center", fontsize=8)
            if p >= n_pages:
                ax.add_patch(Rectangle((x, y), 0.92, 0.85, fill=False, edgecolor="red", lw=2))
        elif p < n_pages:
            ax.add_patch(Rectangle((x, y), 0.92, 0.85, fill=False, edgecolor="0.6"))
        if p == max(n_pages, used):
            ax.add_patch(Rectangle((x, y), 0.92, 0.85, facecolor="0.9", hatch="xx",
                                   edgecolor="0.5"))
    ax.set(xlim=(-0.1, per_row + 0.1), ylim=(-n_rows + 0.9, 0.95))
    ax.set_aspect("equal")
    ax.axis("off")
    status = f"{used} of {n_pages} pages used" + (" — OVERFLOW" if used > n_pages else "")
    ax.set_title(f"page pool, {page_rows} rows per page: {status} (hatched: trash page)", fontsize=10)
    return ax
