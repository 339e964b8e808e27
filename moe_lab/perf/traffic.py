"""How many HBM bytes a grouped GEMM's tile order moves: an LRU model of the L2.

A grouped GEMM (`moe_lab.kernels.grouped_gemm`) multiplies each expert's rows ``A_e:
[rows_e, K]`` by its weight ``B_e: [K, N]``, one program per output tile ``BLOCK_M x
BLOCK_N``. Every program walks K in ``BLOCK_K`` steps, reading its A chunk ``[BLOCK_M,
BLOCK_K]`` and its B chunk ``[BLOCK_K, BLOCK_N]``. Whether a chunk comes from HBM or from
the L2 depends on which programs run at the same time, which is the *tile order*: the map
from program number to ``(row tile, N tile)``. The model runs programs in waves of
``in_flight`` (SMs x resident blocks per SM, from the compile report); the members of a wave
take their K steps together (step k of every program, then step k+1), each output tile
is written once at its program's end. The L2 is a least-recently-used cache of
``l2_bytes`` holding whole chunks. A miss costs the chunk's bytes. Written outputs are
not kept in the model's L2 (they are written once whatever the order).

The compulsory bytes read each operand once and write the output once; their ratio to the
modelled bytes is what an order costs. Rows are numbered as `moe_lab.kernels.common.tile_schedule`
numbers them: expert after expert, ``cdiv(rows, BLOCK_M) + E`` row tiles in the grid. Programs
past the experts' tiles do no work and take no slot. ``b_panels=2`` models the SwiGLU kernels,
whose B chunk holds gate and up columns for one output tile.

Usage: ``python -m moe_lab.perf.traffic`` prints the acceptance table (today's row-fastest order
against the order `moe_lab.kernels.common.tile_group` picks) and writes
``results/compile/traffic.md``.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from moe_lab.checks import non_negative_int, positive_int

Order = str | int | Callable[[int, int, int], tuple[int, int]]


def grouped_order(pid: int, t_m: int, t_n: int, group_m: int) -> tuple[int, int]:
    """``(row tile, N tile)`` of program ``pid`` in grouped rasterisation: ``group_m`` row tiles
    take every N tile before the next group starts, row tile fastest inside a group. ``group_m=1``
    walks N fastest; ``group_m >= t_m`` is the row-fastest order. The Python twin of
    `moe_lab.kernels.common.tile_order`."""
    per_group = group_m * t_n
    first = (pid // per_group) * group_m
    size = min(t_m - first, group_m)
    return first + (pid % per_group) % size, (pid % per_group) // size


def _order_fn(order: Order) -> Callable[[int, int, int], tuple[int, int]]:
    if callable(order):
        return order
    if order == "row":
        return lambda pid, t_m, t_n: (pid % t_m, pid // t_m)
    if order == "n":
        return lambda pid, t_m, t_n: grouped_order(pid, t_m, t_n, 1)
    if isinstance(order, int) and not isinstance(order, bool) and order > 0:
        return lambda pid, t_m, t_n: grouped_order(pid, t_m, t_n, order)
    raise ValueError(f"order must be 'row', 'n', a group size > 0 or a function, got {order!r}")


@dataclass(frozen=True)
class Traffic:
    """Modelled HBM bytes per operand (``a``, ``b`` read, ``c`` written) and the compulsory
    ones (each operand once)."""

    a: int
    b: int
    c: int
    compulsory_a: int
    compulsory_b: int
    compulsory_c: int

    @property
    def total(self) -> int:
        return self.a + self.b + self.c

    @property
    def compulsory(self) -> int:
        return self.compulsory_a + self.compulsory_b + self.compulsory_c

    @property
    def ratio(self) -> float:
        """Modelled over compulsory bytes (1.0 when there is no work)."""
        return self.total / self.compulsory if self.compulsory else 1.0


def simulate(rows: Sequence[int], n: int, k: int, block_m: int, block_n: int, block_k: int, *,
             in_flight: int, l2_bytes: int, order: Order = "row", a_bytes: int = 2,
             b_bytes: int = 2, c_bytes: int = 2, b_panels: int = 1) -> Traffic:
    """Modelled HBM traffic of one grouped GEMM launch.

    ``rows``: routed rows per expert (any skew, zeros allowed); ``n`` output columns, ``k``
    the reduction depth; ``block_*`` the tile; ``in_flight`` programs resident at once;
    ``l2_bytes`` the cache; ``order`` ``"row"`` (row tile fastest, today's 2-D grid), ``"n"``
    (N fastest), a group size (`grouped_order`) or ``f(pid, t_m, t_n) -> (row tile, N tile)``;
    ``*_bytes`` element sizes; ``b_panels`` B columns read per output column.
    """
    rows = [non_negative_int(r, f"rows[{e}]") for e, r in enumerate(rows)]
    for name, value in (("n", n), ("k", k), ("block_m", block_m), ("block_n", block_n),
                        ("block_k", block_k), ("in_flight", in_flight), ("a_bytes", a_bytes),
                        ("b_bytes", b_bytes), ("c_bytes", c_bytes), ("b_panels", b_panels)):
        positive_int(value, name)
    non_negative_int(l2_bytes, "l2_bytes")
    tile_of = _order_fn(order)
    tiles = []  # (expert, rows in tile) per real row tile, numbered as tile_schedule does
    for e, r in enumerate(rows):
        tiles += [(e, min(block_m, r - r0)) for r0 in range(0, r, block_m)]
    t_m = -(-sum(rows) // block_m) + len(rows)
    t_n, steps = -(-n // block_n), -(-k // block_k)
    widths = [min(block_n, n - j * block_n) for j in range(t_n)]
    depths = [min(block_k, k - s * block_k) for s in range(steps)]
    programs = []
    for pid in range(t_m * t_n):
        tm, tn = tile_of(pid, t_m, t_n)
        if not (0 <= tm < t_m and 0 <= tn < t_n):
            raise ValueError(f"order maps program {pid} to tile {(tm, tn)}, outside {t_m} x {t_n}")
        if tm < len(tiles):
            programs.append((tm, tn))
    cache: OrderedDict[int, int] = OrderedDict()
    used = moved_a = moved_b = 0
    b_base = len(tiles) * steps  # B keys follow the A keys

    def touch(key: int, size: int) -> int:
        nonlocal used
        if key in cache:
            cache.move_to_end(key)
            return 0
        if size <= l2_bytes:
            cache[key] = size
            used += size
            while used > l2_bytes:
                used -= cache.popitem(last=False)[1]
        return size

    for w in range(0, len(programs), in_flight):
        wave = programs[w:w + in_flight]
        for s, depth in enumerate(depths):
            for tm, tn in wave:
                e, m_rows = tiles[tm]
                moved_a += touch(tm * steps + s, m_rows * depth * a_bytes)
                moved_b += touch(b_base + (e * t_n + tn) * steps + s,
                                 depth * widths[tn] * b_panels * b_bytes)
    m = sum(rows)
    experts = sum(1 for r in rows if r)  # an expert without rows never reads its weight
    return Traffic(a=moved_a, b=moved_b, c=m * n * c_bytes, compulsory_a=m * k * a_bytes,
                   compulsory_b=experts * k * n * b_panels * b_bytes, compulsory_c=m * n * c_bytes)


# The acceptance launches: (model, routed rows per expert on one rank, experts, d_model,
# d_expert). DeepSeek-V3 at EP8: 256 experts over 8 ranks, 8192 tokens x top-8 = 65,536 routed
# rows per rank over its 32 local experts; GPT-OSS-20B on one rank: 8192 tokens x top-4.
ACCEPTANCE = (("DeepSeek-V3 EP8", 2048, 32, 7168, 2048), ("GPT-OSS-20B", 1024, 32, 2880, 2880))
REPORT = Path(__file__).resolve().parents[2] / "results" / "compile" / "sm_90.json"  # the sm_90 report


def blocks_per_sm(report: dict, kernel: str, blocks: dict, warps: int) -> int:
    """Resident blocks per SM of ``kernel`` compiled at ``blocks`` on ``warps`` warps (bf16), as the
    compile report gives them (the fewest, if several rows match)."""
    found = [r["blocks_per_sm"] for r in report["rows"] if r["kernel"].endswith(":" + kernel)
             and r["blocks"] == blocks and r["num_warps"] == warps and "bf16" in r["label"]]
    if not found:
        raise ValueError(f"the compile report has no bf16 row of {kernel} at {blocks}, {warps} warps")
    return min(found)


def acceptance(gpu: str = "H200", report_path: Path = REPORT) -> list[dict]:
    """Modelled / compulsory bytes of the grouped GEMM forward (down projection), its dX and the
    gather + SwiGLU forward at `ACCEPTANCE`'s shapes on ``gpu``'s L2: today's row-fastest order
    and the grouped order `moe_lab.kernels.common.tile_group` picks. Tiles are `choose_config`'s,
    resident blocks the compile report's (``report_path``)."""
    import torch

    from moe_lab.kernels.common import tile_group
    from moe_lab.kernels.grouped_gemm import choose_config
    from moe_lab.perf.hardware import gpu_spec

    spec, report = gpu_spec(gpu), json.loads(Path(report_path).read_text())
    out = []
    for model, per_expert, experts, d, f in ACCEPTANCE:
        m = per_expert * experts
        for launch, kind, kernel, n, k, panels in (
                ("forward (down)", "gemm", "_grouped_gemm_kernel", d, f, 1),
                ("dX (down)", "gemm", "_grouped_gemm_kernel", f, d, 1),
                ("gather + SwiGLU forward", "swiglu", "_gather_swiglu_kernel", f, d, 2)):
            cfg = choose_config(kind, m, n, k, experts, torch.bfloat16)
            b = cfg.blocks
            in_flight = spec.sms * blocks_per_sm(report, kernel, b, cfg.num_warps)
            group = tile_group(m, experts, b["BLOCK_M"])
            ratios = [simulate([per_expert] * experts, n, k, b["BLOCK_M"], b["BLOCK_N"], b["BLOCK_K"],
                               in_flight=in_flight, l2_bytes=spec.l2_bytes, order=order,
                               b_panels=panels).ratio for order in ("row", group)]
            # The least one wave touches over its K sweep (g row tiles x in_flight / g N tiles): above
            # the L2, nothing a wave reads survives to the next, whatever the order.
            wave = min(k * 2 * (g * b["BLOCK_M"] + -(-in_flight // g) * b["BLOCK_N"] * panels)
                       for g in (1 << i for i in range(in_flight.bit_length())))
            out.append(dict(model=model, launch=launch, n=n, k=k, tiles="x".join(map(str, b.values())),
                            in_flight=in_flight, group_m=group, wave_l2=wave / spec.l2_bytes,
                            row=ratios[0], grouped=ratios[1]))
    return out


def markdown(rows: list[dict], gpu: str = "H200") -> str:
    """`acceptance`'s rows as the table of ``results/compile/traffic.md``."""
    lines = [f"# Modelled HBM bytes / compulsory bytes, {gpu} L2 (`python -m moe_lab.perf.traffic`)",
             "", "A model (`moe_lab.perf.traffic`), not a measurement.", "",
             "Least wave / L2: the fewest bytes one wave of programs reads over K, any wave shape, "
             "over the L2 (above 1, no order keeps data from one wave to the next).", "",
             "| model | launch | N | K | tile MxNxK | in flight | least wave / L2 | GROUP_M "
             "| row-fastest (old) | grouped (new) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['launch']} | {r['n']} | {r['k']} | {r['tiles']} | {r['in_flight']} "
              f"| {r['wave_l2']:.2f} | {r['group_m']} | {r['row']:.3f} | {r['grouped']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    table = markdown(acceptance())
    print(table, end="")
    (REPORT.parent / "traffic.md").write_text(table)


__all__ = ["ACCEPTANCE", "Traffic", "acceptance", "blocks_per_sm", "grouped_order", "markdown", "simulate"]
