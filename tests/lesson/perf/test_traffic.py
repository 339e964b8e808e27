"""The tile-traffic model on cases computed by hand, its tile order against the kernels' own
(`moe_lab.kernels.common.tile_order`, run under the interpreter), and the input check it keeps."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moe_lab.kernels.common import expert_tile_order, tile_order
from moe_lab.kernels.grouped_gemm import expert_grid, tile_group
from moe_lab.perf.traffic import LRU, expert_fastest, expert_order, grouped_order, simulate, simulate_dw

BM = BN = BK = 32
CHUNK = BM * BK * 2  # bytes of one A chunk = one B chunk in bf16 at these tiles
ORDERS = ("row", "n", 2)


@pytest.mark.parametrize("order", ORDERS, ids=["row", "n", "group2"])
@pytest.mark.parametrize("in_flight", [1, 3, 1000])
def test_an_l2_larger_than_everything_moves_the_compulsory_bytes(order, in_flight):
    rows, n, k = [70, 0, 5, 128], 72, 80  # skewed, an empty expert, partial tiles in M, N and K
    t = simulate(rows, n, k, BM, BN, BK, in_flight=in_flight, l2_bytes=10**9, order=order)
    m = sum(rows)
    assert (t.a, t.b, t.c) == (m * k * 2, 3 * k * n * 2, m * n * 2)  # the empty expert reads no B
    assert t.total == t.compulsory and t.ratio == 1.0


@pytest.mark.parametrize("order", ORDERS, ids=["row", "n", "group2"])
@pytest.mark.parametrize("in_flight", [1, 4])
def test_an_l2_of_one_tile_reads_a_once_per_n_tile_and_b_once_per_row_tile(order, in_flight):
    rows, n, k = [64, 0, 32, 96], 3 * BN, 2 * BK  # whole tiles: every chunk is CHUNK bytes
    t = simulate(rows, n, k, BM, BN, BK, in_flight=in_flight, l2_bytes=CHUNK, order=order)
    row_tiles = sum(rows) // BM
    assert t.a == sum(rows) * k * 2 * (n // BN)
    assert t.b == row_tiles * k * n * 2
    assert t.c == sum(rows) * n * 2  # the output, written once


def test_two_tiles_of_l2_by_hand():
    """One expert of 2 row tiles, 2 N tiles, one K step; the L2 holds two chunks (S bytes each).

    Row fastest, one program at a time: A0 B0 | A1 B0 | A0 B1 | A1 B1. LRU after each touch:
    A0 miss [A0]; B0 miss [A0 B0]; A1 miss, evicts A0 [B0 A1]; B0 hit [A1 B0]; A0 miss, evicts
    A1 [B0 A0]; B1 miss, evicts B0 [A0 B1]; A1 miss, evicts A0 [B1 A1]; B1 hit. A: 4 S, B: 2 S.
    N fastest: A0 B0 | A0 B1 | A1 B0 | A1 B1 is the mirror image: A: 2 S, B: 4 S.
    """
    args = ([2 * BM], 2 * BN, BK, BM, BN, BK)
    row = simulate(*args, in_flight=1, l2_bytes=2 * CHUNK, order="row")
    assert (row.a, row.b) == (4 * CHUNK, 2 * CHUNK)
    n_fastest = simulate(*args, in_flight=1, l2_bytes=2 * CHUNK, order="n")
    assert (n_fastest.a, n_fastest.b) == (2 * CHUNK, 4 * CHUNK)
    assert row.ratio == n_fastest.ratio == (6 * CHUNK + row.c) / (4 * CHUNK + row.c)


def test_a_wave_takes_its_k_steps_together():
    """One row tile, 2 N tiles, 2 K steps, an L2 of two chunks.

    One program at a time: A0 B00 A1 B01 | A0 B10 A1 B11, every touch a miss (each chunk is
    two other chunks old when it comes back): A: 4 S. Both in one wave, step by step:
    A0 B00 A0(hit) B10 | A1 B01 A1(hit) B11: A: 2 S. B misses 4 S either way.
    """
    args = ([BM], 2 * BN, 2 * BK, BM, BN, BK)
    alone = simulate(*args, in_flight=1, l2_bytes=2 * CHUNK, order="n")
    together = simulate(*args, in_flight=2, l2_bytes=2 * CHUNK, order="n")
    assert (alone.a, alone.b) == (4 * CHUNK, 4 * CHUNK)
    assert (together.a, together.b) == (2 * CHUNK, 4 * CHUNK)


def test_grouped_order_visits_every_tile_once_and_its_limits_are_the_two_plain_orders():
    t_m, t_n = 7, 5
    for group in (1, 2, 3, 7, 9):
        tiles = [grouped_order(pid, t_m, t_n, group) for pid in range(t_m * t_n)]
        assert sorted(tiles) == [(i, j) for i in range(t_m) for j in range(t_n)]
    assert [grouped_order(p, t_m, t_n, t_m) for p in range(t_m * t_n)] == [
        (p % t_m, p // t_m) for p in range(t_m * t_n)]
    assert [grouped_order(p, t_m, t_n, 1) for p in range(t_m * t_n)] == [
        (p // t_n, p % t_n) for p in range(t_m * t_n)]


@triton.jit
def _order_kernel(out_ptr, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    tile_m, tile_n = tile_order(N, BLOCK_N, GROUP_M)
    pid = tl.program_id(0)
    tl.store(out_ptr + 2 * pid, tile_m)
    tl.store(out_ptr + 2 * pid + 1, tile_n)


@pytest.mark.parametrize("group", [1, 2, 4, 16])
def test_the_kernels_tile_order_is_the_models(group):
    t_m, n, block_n = 6, 70, 16  # 5 N tiles, the last partial
    t_n = triton.cdiv(n, block_n)
    out = torch.full((t_m * t_n, 2), -1, dtype=torch.int32)
    _order_kernel[(t_m * t_n,)](out, n, BLOCK_N=block_n, GROUP_M=group)
    assert [tuple(r) for r in out.tolist()] == [grouped_order(p, t_m, t_n, group)
                                                 for p in range(t_m * t_n)]


def test_tile_group_is_an_experts_row_tiles_as_a_power_of_two():
    assert tile_group(65536, 32, 128) == 16
    assert tile_group(32768, 32, 128) == 8
    assert tile_group(3 * 128 * 4, 4, 128) == 2  # 3 tiles per expert -> 2
    assert tile_group(10, 4, 128) == 1


def test_a_scaled_operand_needs_whole_mx_blocks_along_k():
    args = dict(rows=[4, 8], n=16, k=16, block_m=8, block_n=8, block_k=16, in_flight=2, l2_bytes=1024)
    with pytest.raises(ValueError, match="block_k must be a multiple of 32"):
        simulate(**args, scaled="b")


def test_mxfp8_scales_and_an_epilogue_by_hand():
    """Scaled operands carry one byte per 32 elements: A and B along K, C along N; an epilogue read
    counts once in both the modelled and the compulsory bytes."""
    rows, n, k = [70, 0, 5, 128], 72, 96  # 3 K blocks of 32; N = 72 has 3 blocks, the last partial
    m = sum(rows)
    t = simulate(rows, n, k, BM, BN, BK, in_flight=3, l2_bytes=10**9, order=2, a_bytes=1, b_bytes=1,
                 c_bytes=1, scaled="abc", epilogue_bytes=2)
    assert (t.a, t.b, t.c, t.epilogue) == (m * (k + 3), 3 * n * (k + 3), m * (n + 3), m * n * 2)
    assert t.total == t.compulsory and t.ratio == 1.0
    # An L2 of nothing: every A chunk (codes and its rows' scales) comes once per N tile.
    none = simulate(rows, n, k, BM, BN, BK, in_flight=3, l2_bytes=0, order="row", a_bytes=1,
                    scaled="a", epilogue_bytes=2)
    assert none.a == m * (k + 3) * 3 and none.c == m * n * 2 and none.epilogue == m * n * 2
    plain = simulate(rows, n, k, BM, BN, BK, in_flight=3, l2_bytes=0, order="row", a_bytes=1)
    assert (plain.a, plain.b) == (m * k * 3, none.b) and plain.epilogue == 0


def _simulate_with_lru(rows, n, k, bm, bn, bk, in_flight, l2_bytes, order):
    """`simulate`'s schedule written plainly over `LRU` (bf16, one B panel, chunks keyed by
    name): the reference it must equal."""
    tiles = [(e, min(bm, r - r0)) for e, r in enumerate(rows) for r0 in range(0, r, bm)]
    t_m, t_n, steps = -(-sum(rows) // bm) + len(rows), -(-n // bn), -(-k // bk)
    of = {"row": lambda p: (p % t_m, p // t_m)}.get(order, lambda p: grouped_order(p, t_m, t_n, order))
    programs = [of(p) for p in range(t_m * t_n) if of(p)[0] < len(tiles)]
    l2, a = LRU(l2_bytes), 0
    b = 0
    for w in range(0, len(programs), in_flight):
        for s in range(steps):
            depth = min(bk, k - s * bk)
            for tm, tn in programs[w:w + in_flight]:
                e, m_rows = tiles[tm]
                a += l2.touch(("a", tm, s), m_rows * depth * 2)
                b += l2.touch(("b", e, tn, s), depth * min(bn, n - tn * bn) * 2)
    return a, b


@pytest.mark.parametrize("seed", range(6))
def test_simulate_is_the_plain_schedule_over_lru_on_random_launches(seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 200, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    rows[0] = 0 if seed % 3 == 0 else rows[0]  # an empty expert now and then
    n, k = (int(x) for x in torch.randint(1, 150, (2,), generator=g))
    in_flight = int(torch.randint(1, 9, (1,), generator=g))
    l2 = int(torch.randint(0, 12, (1,), generator=g)) * CHUNK // 2
    for order in ("row", 1, 3):
        t = simulate(rows, n, k, BM, BN, BK, in_flight=in_flight, l2_bytes=l2, order=order)
        expected = _simulate_with_lru(rows, n, k, BM, BN, BK, in_flight, l2, order)
        assert (t.a, t.b) == expected, (rows, n, k, order)


def test_a_hit_makes_a_chunk_recent():
    """One row tile, 3 N tiles, one K step, N fastest, an L2 of two chunks: A0 B0 | A0 B1 | A0 B2.
    LRU: A0 miss, B0 miss, A0 hit [B0 A0], B1 miss evicts B0 [A0 B1], A0 hit, B2 miss: A 1 S.
    (First in, first out would evict A0 for B1 and read it again: A 2 S.)"""
    t = simulate([BM], 3 * BN, BK, BM, BN, BK, in_flight=1, l2_bytes=2 * CHUNK, order="n")
    assert (t.a, t.b) == (CHUNK, 3 * CHUNK)


# ------------------------------------------------------------------ weight gradients


DW_ORDERS = ("expert_fastest", 1, 2, 8)


@pytest.mark.parametrize("order", DW_ORDERS)
@pytest.mark.parametrize("in_flight", [1, 5, 1000])
def test_dw_an_l2_larger_than_everything_moves_the_compulsory_bytes(order, in_flight):
    rows, k, n = [70, 0, 5, 128], 72, 80  # skewed, an empty expert, partial tiles everywhere
    t = simulate_dw(rows, k, n, BM, BK, BN, in_flight=in_flight, l2_bytes=10**9, order=order)
    m = sum(rows)
    assert (t.a, t.b, t.c) == (m * k * 2, m * n * 2, len(rows) * k * n * 2)  # dW of all 4 written
    assert t.ratio == 1.0


@pytest.mark.parametrize("order", DW_ORDERS)
@pytest.mark.parametrize("in_flight", [1, 4])
def test_dw_an_l2_of_one_chunk_reads_x_once_per_n_tile_and_dy_once_per_k_tile(order, in_flight):
    rows, k, n = [64, 0, 32, 96], 2 * BK, 3 * BN  # whole tiles: every chunk is CHUNK bytes
    t = simulate_dw(rows, k, n, BM, BK, BN, in_flight=in_flight, l2_bytes=CHUNK, order=order)
    assert t.a == sum(rows) * k * 2 * (n // BN)
    assert t.b == sum(rows) * n * 2 * (k // BK)


def test_dw_orders_by_hand():
    """Two experts of one row step, one K tile, 2 N tiles, an L2 of two chunks, one program at a
    time. Expert fastest: (0,0,0) (1,0,0) (0,0,1) (1,0,1): X0 D00 | X1 D10 | X0 D01 | X1 D11 —
    X0 comes back after two other chunks, evicted: X 4 S, dY 4 S. Expert after expert: X0 D00 |
    X0(hit) D01 | X1 D10 | X1(hit) D11: X 2 S, dY 4 S."""
    args = ([BM, BM], BK, 2 * BN, BM, BK, BN)
    old = simulate_dw(*args, in_flight=1, l2_bytes=2 * CHUNK, order="expert_fastest")
    new = simulate_dw(*args, in_flight=1, l2_bytes=2 * CHUNK, order=1)
    assert (old.a, old.b) == (4 * CHUNK, 4 * CHUNK)
    assert (new.a, new.b) == (2 * CHUNK, 4 * CHUNK)


def _simulate_dw_with_lru(rows, k, n, bm, bk, bn, in_flight, l2_bytes, order):
    """`simulate_dw`'s schedule written plainly over `LRU` (bf16, chunks keyed by name): the
    reference it must equal."""
    t_k, t_n = -(-k // bk), -(-n // bn)
    programs = [expert_fastest(p, len(rows), t_k, t_n) if order == "expert_fastest"
                else expert_order(p, t_k, t_n, order) for p in range(len(rows) * t_k * t_n)]
    l2, x, dy = LRU(l2_bytes), 0, 0
    for w in range(0, len(programs), in_flight):
        wave = programs[w:w + in_flight]
        for r0 in range(0, max(rows[e] for e, _, _ in wave), bm):
            for e, tk, tn in wave:
                if r0 < rows[e]:
                    m_rows = min(bm, rows[e] - r0)
                    x += l2.touch(("x", e, r0, tk), m_rows * min(bk, k - tk * bk) * 2)
                    dy += l2.touch(("dy", e, r0, tn), m_rows * min(bn, n - tn * bn) * 2)
    return x, dy


@pytest.mark.parametrize("seed", range(6))
def test_simulate_dw_is_the_plain_schedule_over_lru_on_random_launches(seed):
    g = torch.Generator().manual_seed(100 + seed)
    rows = torch.randint(0, 200, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    rows[-1] = 0 if seed % 2 else rows[-1]  # an empty expert now and then
    k, n = (int(x) for x in torch.randint(1, 150, (2,), generator=g))
    in_flight = int(torch.randint(1, 9, (1,), generator=g))
    l2 = int(torch.randint(0, 12, (1,), generator=g)) * CHUNK // 2
    for order in ("expert_fastest", 1, 3):
        t = simulate_dw(rows, k, n, BM, BK, BN, in_flight=in_flight, l2_bytes=l2, order=order)
        expected = _simulate_dw_with_lru(rows, k, n, BM, BK, BN, in_flight, l2, order)
        assert (t.a, t.b) == expected, (rows, k, n, order)


def test_dw_orders_visit_every_tile_once():
    e, t_k, t_n = 3, 5, 4
    every = sorted((a, b, c) for a in range(e) for b in range(t_k) for c in range(t_n))
    assert sorted(expert_fastest(p, e, t_k, t_n) for p in range(e * t_k * t_n)) == every
    for group in (1, 2, 3, 5, 9):
        order = [expert_order(p, t_k, t_n, group) for p in range(e * t_k * t_n)]
        assert sorted(order) == every
        assert [x[0] for x in order] == sorted(x[0] for x in order)  # expert after expert


@triton.jit
def _expert_order_kernel(out_ptr, K, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                         GROUP_K: tl.constexpr):
    e, tile_k, tile_n = expert_tile_order(K, N, BLOCK_K, BLOCK_N, GROUP_K)
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)  # the order of dispatch
    tl.store(out_ptr + 3 * pid, e)
    tl.store(out_ptr + 3 * pid + 1, tile_k)
    tl.store(out_ptr + 3 * pid + 2, tile_n)


@pytest.mark.parametrize("group", [1, 2, 8])
def test_the_dw_kernels_tile_order_is_the_models(group):
    n_experts, k, n, block_k, block_n = 3, 80, 70, 16, 32  # 5 K tiles, 3 N tiles, both partial
    grid = expert_grid(n_experts, k, n, block_k, block_n)
    t_k, t_n = triton.cdiv(k, block_k), triton.cdiv(n, block_n)
    assert grid == (t_k * t_n, n_experts)
    programs = n_experts * t_k * t_n
    out = torch.full((programs, 3), -1, dtype=torch.int32)
    _expert_order_kernel[grid](out, k, n, BLOCK_K=block_k, BLOCK_N=block_n, GROUP_K=group)
    assert [tuple(r) for r in out.tolist()] == [expert_order(p, t_k, t_n, group)
                                                 for p in range(programs)]
