"""Pictures of notebook 04's GPU internals, one idea each, and the numbers behind its table of
down-projection settings.

Each picture is a schematic drawn from a few lines of data kept here, not a measurement:

- `plot_tensor_core_paths`: where a tensor-core instruction takes its operands from and keeps
  its accumulator, and who issues it (`TENSOR_CORE_PATHS`: ``mma.sync``, ``wgmma``,
  ``tcgen05.mma``);
- `plot_tma_vs_cp_async`: a tile copied by every thread in 16-byte pieces (``cp.async``)
  against one thread handing a descriptor to the copy engine (TMA), an mbarrier counting the
  bytes in;
- `persistent_schedule` / `plot_persistent_grid`: one program per output tile, in waves,
  against one program per SM looping over the tiles;
- `plot_tile_order`: which output tiles run at the same time in a row-fastest or a grouped
  tile order, and how many operand tiles they share.

`down_projection_rows` computes a roofline projection of DeepSeek-V3's down projection in
several settings (all experts on one GPU, or a share of them under expert parallelism), so one
table can put them side by side with their assumptions.

Every plotting function draws on an Axes (created if not given) and returns it, like
`moe_lab.workbench.figures.charts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Rectangle

from moe_lab.perf import hardware
from moe_lab.perf.traffic import grouped_order
from moe_lab.workbench.figures.charts import arrow, ax_or_new, box

# ----------------------------------------------------------------------------------- (b)
#: For each tensor-core instruction: (GPU generation, who issues it, where the operands travel
#: from HBM to the tensor cores, where the accumulator lives).
TENSOR_CORE_PATHS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "mma.sync": ("Ampere (sm_80), and the fallback", "every warp, its own tile",
                 ("HBM", "shared memory", "registers", "tensor cores"), "registers"),
    "wgmma.mma_async": ("Hopper (sm_90)", "a warpgroup (4 warps)",
                        ("HBM", "shared memory", "tensor cores"), "registers"),
    "tcgen05.mma": ("Blackwell (sm_100)", "one thread, for the block",
                    ("HBM", "shared memory", "tensor cores"), "tensor memory"),
}
_PLACE_COLOR = {"HBM": "#f2d7d5", "shared memory": "#d6eaf8", "registers": "#fdebd0",
                "tensor cores": "#d5f5e3", "tensor memory": "#e8daef"}


def plot_tensor_core_paths(ax: Axes | None = None) -> Axes:
    """One column per instruction of `TENSOR_CORE_PATHS`: the operands' way from HBM to the
    tensor cores (top to bottom), the accumulator's home beside the tensor cores, and who
    issues the instruction. A schematic, not a measurement."""
    ax = ax_or_new(ax, (10, 4.2))
    w, h, gap = 1.5, 0.42, 0.78
    for col, (name, (gen, issuer, path, acc)) in enumerate(TENSOR_CORE_PATHS.items()):
        x = col * 3.2
        ax.text(x + w / 2 + 0.45, 0.75, f"{name}\n{gen}", ha="center", va="bottom", fontsize=9,
                weight="bold")
        ax.text(x + w / 2 + 0.45, 0.2, f"issued by {issuer}", ha="center", va="bottom",
                fontsize=8, style="italic")
        ys = [-i * gap for i in range(len(path))]
        for place, y in zip(path, ys, strict=True):
            box(ax, x, y - h, w, h, place, _PLACE_COLOR[place])
        for y0, y1 in zip(ys, ys[1:], strict=False):
            arrow(ax, (x + w / 2, y0 - h), (x + w / 2, y1))
        y_tc = ys[-1] - h / 2
        box(ax, x + w + 0.35, y_tc - h / 2, 1.05, h, f"acc. in\n{acc}", _PLACE_COLOR[acc], 7)
        arrow(ax, (x + w, y_tc), (x + w + 0.35, y_tc))
    ax.set(xlim=(-0.3, 3 * 3.2 - 0.2), ylim=(-3 * gap - h - 0.15, 1.5))
    ax.axis("off")
    ax.set_title("tensor-core instructions: where operands and accumulator live (a schematic)",
                 fontsize=10)
    return ax


# ----------------------------------------------------------------------------------- (c)
def plot_tma_vs_cp_async(tile: int = 8, threads: int = 16, ax: Axes | None = None) -> Axes:
    """Left: a ``tile × tile`` operand tile copied with ``cp.async``, each cell a 16-byte piece
    coloured by the thread that copies it (``threads`` threads, each computing its own
    addresses). Right: the same tile copied by TMA: one thread hands the copy engine a
    descriptor and the tile's coordinates, the tile lands whole, and an mbarrier, told how many
    bytes to expect, lets the waiting warps go once they have all arrived. A schematic."""
    ax = ax_or_new(ax, (11, 4.0))
    cmap = plt.get_cmap("tab20")
    cell = 2.6 / tile
    for i in range(tile):
        for j in range(tile):
            piece = i * tile + j
            ax.add_patch(Rectangle((j * cell, 2.6 - (i + 1) * cell), cell, cell,
                                   facecolor=cmap(piece % threads % 20), edgecolor="white", lw=0.5))
    ax.text(1.3, 2.75, f"cp.async: {threads} threads, each copies\n"
            f"{tile * tile // threads} pieces of 16 B and computes their addresses",
            ha="center", va="bottom", fontsize=8)
    ax.text(1.3, -0.15, "then: commit_group, wait_group N, barrier", ha="center", va="top",
            fontsize=8, style="italic")
    x0 = 4.1
    box(ax, x0, 2.0, 1.6, 0.55, "1 thread:\ndescriptor + (row, col)", "#fdebd0", 7.5)
    box(ax, x0 + 2.3, 2.0, 1.3, 0.55, "TMA unit\n(copy engine)", "#d5f5e3", 7.5)
    ax.add_patch(Rectangle((x0 + 4.2, 0.9), 2.0, 1.65, facecolor=cmap(0), edgecolor="0.3"))
    ax.text(x0 + 5.2, 1.72, "tile in\nshared memory", ha="center", va="center", fontsize=8)
    box(ax, x0 + 2.3, 0.35, 1.3, 0.55, "mbarrier:\nexpects N bytes", "#e8daef", 7.5)
    box(ax, x0, 0.35, 1.6, 0.55, "warps: wait(phase),\nthen MMA", "#d6eaf8", 7.5)
    arrow(ax, (x0 + 1.6, 2.27), (x0 + 2.3, 2.27))
    arrow(ax, (x0 + 3.6, 2.27), (x0 + 4.2, 2.0))
    arrow(ax, (x0 + 4.2, 1.05), (x0 + 3.6, 0.7))
    ax.text(x0 + 4.3, 0.62, "bytes arrive", fontsize=7, va="center", color="0.25")
    arrow(ax, (x0 + 2.3, 0.62), (x0 + 1.6, 0.62))
    ax.text(x0 + 1.95, 0.2, "phase flips", fontsize=7, ha="center", va="center", color="0.25")
    ax.text(x0 + 3.1, 2.75, "TMA: one instruction per tile, no address math per thread;\n"
            "rows past the descriptor's shape read as zeros", ha="center", va="bottom", fontsize=8)
    ax.set(xlim=(-0.2, x0 + 6.4), ylim=(-0.5, 3.4), aspect="equal")
    ax.axis("off")
    return ax


# ----------------------------------------------------------------------------------- (d)
def persistent_schedule(n_tiles: int, n_sms: int, setup: float, tile: float,
                        persistent: bool) -> list[list[tuple[float, float, str, int]]]:
    """When each SM works, in a toy model (equal tiles, one program at a time per SM):
    ``[sm] -> [(start, end, kind, tile index)]`` with ``kind`` ``"setup"`` (a program's start:
    reading its arguments and the offsets, finding its tile, building descriptors) or
    ``"tile"``. One program per tile (``persistent=False``): tile ``t`` runs on SM
    ``t % n_sms`` in wave ``t // n_sms``, each program paying ``setup``. Persistent: SM ``s``
    runs one program that pays ``setup`` once and then takes tiles ``s, s + n_sms, …``."""
    out: list[list[tuple[float, float, str, int]]] = [[] for _ in range(n_sms)]
    for sm in range(n_sms):
        t = 0.0
        for k, index in enumerate(range(sm, n_tiles, n_sms)):
            if setup and (k == 0 or not persistent):
                out[sm].append((t, t + setup, "setup", index))
                t += setup
            out[sm].append((t, t + tile, "tile", index))
            t += tile
    return out


def plot_persistent_grid(n_tiles: int = 10, n_sms: int = 4, setup: float = 0.4, tile: float = 1.0,
                         ax: Axes | None = None) -> Axes:
    """`persistent_schedule` both ways, one row per SM: one program per tile on top, one
    persistent program per SM below; setups hatched, tiles numbered. A toy model."""
    ax = ax_or_new(ax, (9, 0.9 + 0.45 * 2 * n_sms))
    for block, persistent in enumerate((False, True)):
        sched = persistent_schedule(n_tiles, n_sms, setup, tile, persistent)
        base = (1 - block) * (n_sms + 1.2)
        end = max(s[-1][1] for s in sched if s)
        for sm, spans in enumerate(sched):
            y = base + n_sms - 1 - sm
            for start, stop, kind, index in spans:
                style = (dict(facecolors="white", edgecolor="0.4", hatch="///", linewidth=0.6)
                         if kind == "setup" else dict(facecolors=f"C{index % 10}", edgecolor="white"))
                ax.broken_barh([(start, stop - start)], (y + 0.15, 0.7), **style)
                if kind == "tile":
                    ax.text((start + stop) / 2, y + 0.5, str(index), ha="center", va="center",
                            fontsize=7, color="white")
            ax.text(-0.1, y + 0.5, f"SM {sm}", ha="right", va="center", fontsize=7)
        label = ("persistent: one program per SM, tiles pid, pid + SMs, …" if persistent else
                 "one program per tile, launched in waves")
        ax.text(0, base + n_sms + 0.05, f"{label}  (ends at {end:g})", fontsize=8, va="bottom")
    ax.set(yticks=[], ylim=(-0.2, 2 * n_sms + 2.2), xlim=(-0.9, None),
           xlabel=f"time (one tile = {tile:g}; hatched: a program's start-up; a toy model, not measured)")
    ax.set_title(f"{n_tiles} output tiles on {n_sms} SMs", fontsize=10, loc="left")
    return ax


# ----------------------------------------------------------------------------------- (e)
def plot_tile_order(t_m: int, t_n: int, group_m: int, in_flight: int, ax: Axes | None = None) -> Axes:
    """The ``t_m × t_n`` output tiles, each labelled with the program that computes it in
    grouped order (`moe_lab.perf.traffic.grouped_order`; ``group_m >= t_m``: row fastest); the
    first ``in_flight`` are filled, and the title counts the operand tiles they read: the row
    tiles of x and the column tiles of w. Programs in flight together that share an operand
    tile can find it in L2; each distinct one is a trip to HBM."""
    ax = ax_or_new(ax, (0.5 * t_n + 1.5, 0.45 * t_m + 1.2))
    first = {grouped_order(pid, t_m, t_n, group_m) for pid in range(min(in_flight, t_m * t_n))}
    a_tiles, b_tiles = len({m for m, _ in first}), len({n for _, n in first})
    for pid in range(t_m * t_n):
        m, n = grouped_order(pid, t_m, t_n, group_m)
        ax.add_patch(Rectangle((n, t_m - 1 - m), 1, 1, edgecolor="white", lw=1.0,
                               facecolor="tab:orange" if (m, n) in first else "0.88"))
        ax.text(n + 0.5, t_m - 0.5 - m, str(pid), ha="center", va="center", fontsize=7)
    ax.set(xlim=(0, t_n), ylim=(0, t_m), aspect="equal", xticks=[], yticks=[],
           xlabel="N tiles (columns of w)", ylabel="row tiles (rows of x)")
    head = "row fastest" if group_m >= t_m else f"grouped, GROUP_M={group_m}"
    ax.set_title(f"{head}: first {len(first)} programs read\n{a_tiles} row tile{'s' * (a_tiles != 1)} + "
                 f"{b_tiles} weight tile{'s' * (b_tiles != 1)} = {a_tiles + b_tiles}", fontsize=9)
    return ax


# ------------------------------------------------------------------------ the projections
def down_projection_rows(n_experts: int, d_model: int, d_expert: int, rows_per_gpu: int,
                         experts_per_gpu: Sequence[int], gpus: Sequence[str],
                         bytes_per_element: int = 2) -> list[dict[str, Any]]:
    """A roofline projection of one GPU's down projection (``[rows, d_expert] @ w[e]:
    [d_expert, d_model]`` for each of its experts) in each setting, on each GPU.

    ``experts_per_gpu`` lists the settings: ``n_experts`` is every expert on one GPU, a
    smaller number the share of one GPU under expert parallelism (``EP = n_experts /
    experts_per_gpu``). In every setting the GPU holds ``rows_per_gpu`` routed rows, spread
    evenly over its experts. Bytes are the compulsory traffic (x, each expert's weights and y
    once each, ``bytes_per_element`` per value); time is ``FLOPs / min(peak, bandwidth ×
    intensity)`` with the GPU's published bf16 peak and HBM bandwidth
    (`moe_lab.perf.hardware`). A projection, not a measurement.
    """
    out = []
    for local in experts_per_gpu:
        flops = 2 * rows_per_gpu * d_expert * d_model
        weight_bytes = bytes_per_element * local * d_expert * d_model
        moved = weight_bytes + bytes_per_element * rows_per_gpu * (d_expert + d_model)
        intensity = flops / moved
        for name in gpus:
            gpu = hardware.gpu_spec(name)
            attainable = hardware.roofline(gpu.peak_flops("bf16"), gpu.bandwidth, intensity)
            out.append({
                "setting": "all experts on one GPU" if local == n_experts else
                           f"EP{n_experts // local}: {local} experts per GPU",
                "ep": n_experts // local, "experts_per_gpu": local, "gpu": gpu.name,
                "rows_per_expert": rows_per_gpu / local, "weight_bytes": weight_bytes,
                "moved_bytes": moved, "flops": flops, "intensity": intensity,
                "ridge": gpu.ridge_intensity,
                "bound": "memory" if intensity < gpu.ridge_intensity else "compute",
                "time_s": flops / attainable, "source": gpu.source,
            })
    return out


def projection_markdown(rows: Sequence[dict[str, Any]], unrealistic: str = "") -> str:
    """`down_projection_rows` as a Markdown table; the all-experts rows carry ``unrealistic``
    (a marker such as ``"⚠"``) beside their setting."""
    head = ("| setting | GPU | rows per expert | weight bytes | FLOPs | FLOP/byte (ridge) | bound "
            "| projected time |\n|---|---|---:|---:|---:|---:|---|---:|\n")
    lines = []
    for r in rows:
        setting = r["setting"] + (f" {unrealistic}" if unrealistic and r["ep"] == 1 else "")
        time = r["time_s"] * 1e3
        lines.append(f"| {setting} | {r['gpu']} | {r['rows_per_expert']:,.0f} | "
                     f"{r['weight_bytes'] / 1e9:.2f} GB | {r['flops'] / 1e12:.2f} TFLOP | "
                     f"{r['intensity']:.0f} ({r['ridge']:.0f}) | {r['bound']} | "
                     + (f"{time:.2f} ms" if time >= 1 else f"{time * 1e3:.0f} µs") + " |")
    return head + "\n".join(lines) + "\n"
