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
whose B chunk holds gate and up columns for one output tile. MXFP8 operands (``scaled``) carry
one E8M0 byte per `MX_BLOCK` elements beside their codes, read or written with them; an
epilogue that reads a tensor of the output's shape (``epilogue_bytes`` per output element: the
saved ``dh`` of the SwiGLU backward, ``h`` of the combine backward) reads it once per output
tile, whatever the order, so it counts in the modelled and the compulsory bytes alike and is not
kept in the model's L2.

Usage: ``python -m moe_lab.workbench.compile_report.traffic`` prints the acceptance table (today's
row-fastest order against the order `moe_lab.kernels.grouped_gemm.tile_group` picks, at the compile
report's tiles and occupancy) and writes ``results/compile/traffic.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Elements per E8M0 scale of an MXFP8 operand (the OCP MX block).
MX_BLOCK = 32


def grouped_order(pid: int, t_m: int, t_n: int, group_m: int) -> tuple[int, int]:
    """``(row tile, N tile)`` of program ``pid`` in grouped rasterisation: ``group_m`` row tiles
    take every N tile before the next group starts, row tile fastest inside a group. ``group_m=1``
    walks N fastest; ``group_m >= t_m`` is the row-fastest order. The Python twin of
    `moe_lab.kernels.common.tile_order`."""
    per_group = group_m * t_n
    first = (pid // per_group) * group_m
    size = min(t_m - first, group_m)
    return first + (pid % per_group) % size, (pid % per_group) // size


@dataclass(frozen=True)
class Traffic:
    """Modelled HBM bytes per operand (``a``, ``b`` read, ``c`` written); ``epilogue`` the bytes
    an epilogue reads beside the output (read once whatever the order: modelled and compulsory
    at once); ``compulsory`` the bytes of each operand once, the epilogue's included."""

    a: int
    b: int
    c: int
    compulsory: int
    epilogue: int = 0

    @property
    def total(self) -> int:
        return self.a + self.b + self.c + self.epilogue

    @property
    def ratio(self) -> float:
        """Modelled over compulsory bytes (1.0 when there is no work)."""
        return self.total / self.compulsory if self.compulsory else 1.0


class LRU:
    """A least-recently-used cache of ``l2_bytes`` holding whole chunks, as the model's L2."""

    def __init__(self, l2_bytes: int) -> None:
        self.l2_bytes, self.used = l2_bytes, 0
        self.chunks: OrderedDict[object, int] = OrderedDict()

    def touch(self, key: object, size: int) -> int:
        """Read chunk ``key`` of ``size`` bytes: the bytes it moves from HBM (0 on a hit). A hit
        makes the chunk the most recent; a missed chunk enters as the most recent (unless it is
        larger than the L2), the least recent leave until the rest fits."""
        if key in self.chunks:
            self.chunks.move_to_end(key)
            return 0
        if size <= self.l2_bytes:
            self.chunks[key] = size
            self.used += size
            while self.used > self.l2_bytes:
                self.used -= self.chunks.popitem(last=False)[1]
        return size


def simulate(rows: Sequence[int], n: int, k: int, block_m: int, block_n: int, block_k: int, *,
             in_flight: int, l2_bytes: int, order: str | int = "row", a_bytes: int = 2,
             b_bytes: int = 2, c_bytes: int = 2, b_panels: int = 1, scaled: str = "",
             epilogue_bytes: int = 0) -> Traffic:
    """Modelled HBM traffic of one grouped GEMM launch.

    ``rows``: routed rows per expert (any skew, zeros allowed); ``n`` output columns, ``k``
    the reduction depth; ``block_*`` the tile; ``in_flight`` programs resident at once;
    ``l2_bytes`` the cache; ``order`` ``"row"`` (row tile fastest, today's 2-D grid), ``"n"``
    (N fastest) or a group size (`grouped_order`);
    ``*_bytes`` element sizes; ``b_panels`` B columns read per output column; ``scaled`` the
    MXFP8 operands among ``"abc"``, each with one scale byte per `MX_BLOCK` elements (along K
    for A and B, which then needs ``block_k`` a multiple of `MX_BLOCK`; along N for C);
    ``epilogue_bytes`` read per output element by the epilogue.
    """
    if set(scaled) & set("ab") and block_k % MX_BLOCK:
        raise ValueError(f"block_k must be a multiple of {MX_BLOCK} for a scaled A or B, got {block_k}")
    steps = -(-k // block_k)
    depths = [min(block_k, k - s * block_k) for s in range(steps)]
    a_scale, b_scale = ("a" in scaled), ("b" in scaled)  # scale bytes per row (A) or column (B) per K block
    # The programs with work, in launch order: per program its A chunk's key at K step 0 and its
    # rows, its B chunk's key and its columns (B keys follow A keys).
    tiles = []  # (expert, rows in tile) per real row tile, numbered as tile_schedule does
    for e, r in enumerate(rows):
        tiles += [(e, min(block_m, r - r0)) for r0 in range(0, r, block_m)]
    t_m = -(-sum(rows) // block_m) + len(rows)
    t_n = -(-n // block_n)
    widths = [min(block_n, n - j * block_n) for j in range(t_n)]
    group = {"row": t_m, "n": 1}.get(order, order)  # row fastest is one group of every row tile
    launched = (grouped_order(pid, t_m, t_n, group) for pid in range(t_m * t_n))
    b_base = len(tiles) * steps
    programs = [(tm * steps, tiles[tm][1], b_base + (tiles[tm][0] * t_n + tn) * steps, widths[tn] * b_panels)
                for tm, tn in launched if tm < len(tiles)]
    # Per step, the bytes of one A row and one B column (codes and scales).
    row_bytes = [depth * a_bytes + a_scale * -(-depth // MX_BLOCK) for depth in depths]
    col_bytes = [depth * b_bytes + b_scale * -(-depth // MX_BLOCK) for depth in depths]
    touch, moved_a, moved_b = LRU(l2_bytes).touch, 0, 0
    for w in range(0, len(programs), in_flight):
        wave = programs[w:w + in_flight]
        for s, (a_row, b_col) in enumerate(zip(row_bytes, col_bytes)):
            for a_key, m_rows, b_key, cols in wave:  # the A chunk, then the B chunk
                moved_a += touch(a_key + s, m_rows * a_row)
                moved_b += touch(b_key + s, cols * b_col)
    m, k_blocks = sum(rows), -(-k // MX_BLOCK)
    experts = sum(1 for r in rows if r)  # an expert without rows never reads its weight
    c = m * (n * c_bytes + ("c" in scaled) * -(-n // MX_BLOCK))
    epilogue = m * n * epilogue_bytes
    compulsory = (m * (k * a_bytes + a_scale * k_blocks) + c + epilogue
                  + experts * n * b_panels * (k * b_bytes + b_scale * k_blocks))
    return Traffic(moved_a, moved_b, c, compulsory, epilogue)


def expert_order(pid: int, t_k: int, t_n: int, group: int) -> tuple[int, int, int]:
    """``(expert, K tile, N tile)`` of program ``pid`` in a weight gradient's grid: expert after
    expert, `grouped_order` inside (``group`` K tiles take every N tile). The Python twin of
    `moe_lab.kernels.common.expert_tile_order`."""
    e, local = divmod(pid, t_k * t_n)
    return (e, *grouped_order(local, t_k, t_n, group))


def expert_fastest(pid: int, n_experts: int, t_k: int, t_n: int) -> tuple[int, int, int]:
    """``(expert, K tile, N tile)`` of program ``pid`` in a 3-D grid ``(E, K tiles, N tiles)``,
    whose first axis the hardware walks fastest (the weight gradients' grid before
    `expert_order`)."""
    return pid % n_experts, pid // n_experts % t_k, pid // (n_experts * t_k)


def simulate_dw(rows: Sequence[int], k: int, n: int, block_m: int, block_k: int, block_n: int, *,
                in_flight: int, l2_bytes: int, order: str | int = "expert_fastest",
                x_bytes: int = 2, dy_bytes: int = 2, dw_bytes: int = 2) -> Traffic:
    """Modelled HBM traffic of one grouped weight gradient ``dW[e] = X_eᵀ·dY_e``.

    ``rows``: routed rows per expert; ``X: [M, k]``, ``dY: [M, n]``, ``dW: [E, k, n]``. A program
    owns one ``block_k x block_n`` tile of one expert's ``dW`` and walks that expert's rows in
    ``block_m`` steps, reading an ``X`` chunk ``[block_m, block_k]`` and a ``dY`` chunk
    ``[block_m, block_n]`` per step (an expert without rows reads nothing and writes zeros).
    ``order``: ``"expert_fastest"`` (`expert_fastest`) or a group size (`expert_order`). Waves
    and the L2 as in `simulate`; a wave's programs take their row steps together, one that has
    run out of rows takes none. In the result ``a`` is X, ``b`` dY, ``c`` dW.
    """
    n_experts, t_k, t_n = len(rows), -(-k // block_k), -(-n // block_n)
    programs = [expert_fastest(pid, n_experts, t_k, t_n) if order == "expert_fastest"
                else expert_order(pid, t_k, t_n, order)
                for pid in range(n_experts * t_k * t_n)]
    # Integer chunk keys: X chunks even, dY chunks odd.
    steps = max((-(-r // block_m) for r in rows), default=0)
    touch, moved_x, moved_dy = LRU(l2_bytes).touch, 0, 0
    for w in range(0, len(programs), in_flight):
        wave = [(rows[e], 2 * (e * steps * t_k + tk), 2 * (e * steps * t_n + tn) + 1,
                 min(block_k, k - tk * block_k) * x_bytes, min(block_n, n - tn * block_n) * dy_bytes)
                for e, tk, tn in programs[w:w + in_flight]]
        for i, r0 in enumerate(range(0, max((r for r, *_ in wave), default=0), block_m)):
            for r, x_key, dy_key, x_row, dy_row in wave:
                if r0 < r:
                    m_rows = min(block_m, r - r0)
                    moved_x += touch(x_key + 2 * i * t_k, m_rows * x_row)
                    moved_dy += touch(dy_key + 2 * i * t_n, m_rows * dy_row)
    m = sum(rows)
    dw = n_experts * k * n * dw_bytes
    return Traffic(moved_x, moved_dy, dw, m * k * x_bytes + m * n * dy_bytes + dw)

