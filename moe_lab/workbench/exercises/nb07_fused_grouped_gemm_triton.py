"""The Triton exercise of notebook 07_fused_grouped_gemm; the PyTorch one is `nb07_fused_grouped_gemm`.

- ``gather_tile`` (Triton): the prologue of a grouped GEMM that reads its A tile straight
  from the token rows. Given the permuted rows ``rows`` of one tile (``row_end`` the end of
  its expert's segment) and the row source ``src`` (``src[r] = t·k + j``, ``-1`` for a row
  no (token, slot) maps to), load ``x[src[r] // TOP_K, ks]`` for every row of the tile:
  rows past ``row_end`` and rows without a source read as zero, never as memory. Checked
  tile by tile against `moe_lab.kernels.permute.permute_reference` (the rows the unfused
  chain would have written), then as the prologue of a small grouped GEMM against the
  unfused chain; ``x`` sits between NaN rows in memory, so a row loaded through a bad
  index shows, and the probe keeps the tile's columns past ``K`` (which must be zero).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from moe_lab.kernels.common import gather_rows, row_source
from moe_lab.kernels.grouped_gemm import grouped_gemm_reference
from moe_lab.kernels.permute import make_row_id_map_reference, permute_reference
from moe_lab.workbench.exercises import ExerciseError, exercise, random_routing
from moe_lab.workbench.exercises.kernel_checks import kernel_device, launch_answer, where_differs

# ------------------------------------------------------------- Triton: the gather prologue


@triton.jit
def gather_tile(x_ptr, src_ptr, rows, row_end, ks, K, TOP_K):
    """``[BLOCK_M, BLOCK_K]`` tile ``x[src[rows] // TOP_K, ks]`` (``x: [T, K]`` contiguous),
    zero where ``rows >= row_end``, ``src < 0`` or ``ks >= K``."""
    token, _, ok = gather_rows(src_ptr, rows, rows < row_end, TOP_K)  # the lesson's prologue
    return tl.load(x_ptr + token[:, None] * K + ks[None, :], mask=ok[:, None] & (ks[None, :] < K), other=0.0)


@triton.jit
def _gather_probe(x_ptr, src_ptr, out_ptr, offsets_ptr, M_ROWS, K, K_PAD, TOP_K, gather,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program per (expert e, row tile, K tile): the tile of e's rows, gathered by the
    # learner's function, stored whole at those permuted rows of out: [M_ROWS, K_PAD], K_PAD
    # the K tiles' width (its columns past K show what the tile holds there).
    e = tl.program_id(0)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    rows = (start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ks = (tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    tile = gather(x_ptr, src_ptr, rows, end, ks, K, TOP_K)
    tl.store(out_ptr + rows[:, None] * K_PAD + ks[None, :], tile,
             mask=(rows[:, None] < end) & (ks[None, :] < K_PAD))


@triton.jit
def _gather_gemm(x_ptr, src_ptr, w_ptr, y_ptr, offsets_ptr, N, K, TOP_K, gather,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[rows of e] = gathered x rows · w[e] (w: [E, K, N], y: [M_ROWS, N], contiguous).
    e = tl.program_id(0)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    rows = (start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        a = gather(x_ptr, src_ptr, rows, end, ks, K, TOP_K)
        b = tl.load(w_ptr + e.to(tl.int64) * K * N + ks[:, None] * N + cols[None, :],
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=(rows[:, None] < end) & (cols[None, :] < N))


@exercise(gather_tile)
def check_gather_tile(gather: Callable, block_m: int = 16, block_k: int = 16) -> None:
    """Raise `ExerciseError` unless ``gather`` loads the tiles of fresh routings (skewed,
    experts left empty, segments padded to an alignment, widths not multiples of the
    block) as the unfused permute would have written them, and unless a grouped GEMM with
    it as its prologue equals the unfused chain."""
    device = kernel_device()
    g = torch.Generator().manual_seed(random.randrange(2**31))
    cases = [(37, 40, 8, 2, 1), (29, 24, 16, 4, 8), (9, 16, 4, 4, 1), (33, 8, 6, 1, 4)]
    for tokens, k_dim, n_experts, top_k, align in cases:
        ids = random_routing(g, tokens, n_experts, top_k)
        row_id_map, offsets = make_row_id_map_reference(ids, n_experts, align)
        n_rows = int(offsets[-1])
        # x between rows of NaN: a token index below 0 or past T reads NaN, not zeros. The rows
        # after x reach past T·TOP_K, so a row source used as a token index (src, not
        # src // TOP_K) reads NaN too, never memory outside the buffer.
        nan_rows = torch.full((4, k_dim), float("nan"))
        nan_tail = torch.full((4 + tokens * (top_k - 1), k_dim), float("nan"))
        memory = torch.cat([nan_rows, torch.randn(tokens, k_dim, generator=g), nan_tail]).to(device)
        x_d = memory[4:4 + tokens]
        x = x_d.cpu()
        src = row_source(row_id_map, n_rows)
        want = permute_reference(x, row_id_map, n_rows)
        k_pad = triton.cdiv(k_dim, block_k) * block_k
        counts = (offsets[1:] - offsets[:-1]).tolist()
        grid = (n_experts, max(1, triton.cdiv(max(counts), block_m)), triton.cdiv(k_dim, block_k))
        got_d = torch.full((n_rows, k_pad), float("nan"), device=device)
        launch_answer("gather_tile", _gather_probe, grid, x_d, src.to(device), got_d,
                      offsets.to(device), n_rows, k_dim, k_pad, top_k, gather, BLOCK_M=block_m,
                      BLOCK_K=block_k)
        got_padded = got_d.cpu()
        got = got_padded[:, :k_dim]
        where = (f"{tokens} tokens of width {k_dim}, top-{top_k} of {n_experts} experts, "
                 f"segments aligned to {align}")
        bad = where_differs(got, want, rtol=0, atol=0)
        if bad is not None:
            r, c = bad
            hint = ""
            src_r = int(src[r]) if r < len(src) else -1
            if top_k > 1 and src_r >= 0 and (src_r >= tokens or torch.equal(got[r], x[src_r])) \
                    and src_r // top_k != src_r:
                hint = (f" — row {r}'s source is {src_r} = t·TOP_K + j, a (token, slot) pair: its token is "
                        f"src // TOP_K = {src_r // top_k}; load x[src // TOP_K], not x[src]")
            elif torch.isnan(got[r, c]):
                hint = (" — NaN: a row past T was loaded (a row without a source must be masked, "
                        "src < 0) or the tile was not returned in full")
            elif want[r].abs().sum() == 0:
                hint = " — this row has no source (src = -1, alignment padding): it must read as zero"
            raise ExerciseError(f"({where}): permuted row {r}, column {c} = {got[r, c].item():.6g}, "
                                f"expected {want[r, c].item():.6g}{hint}")
        past_k = got_padded[:, k_dim:]
        if past_k.numel() and not bool((past_k == 0).all()):
            r, c = (past_k != 0).nonzero()[0].tolist()
            raise ExerciseError(
                f"({where}): permuted row {r}, column {k_dim + c} of the last K tile (K = {k_dim}, "
                f"BLOCK_K = {block_k}) = {past_k[r, c].item():.6g}: the tile's columns past K must "
                "read as zero — mask the load with ks < K (there the tile would read the next row "
                "of x, which the GEMM multiplies by zeros: 0 · NaN is NaN)")
        # As a grouped GEMM's prologue: y = (gathered rows) · w[e], against the unfused chain.
        n = 16
        w = torch.randn(n_experts, k_dim, n, generator=g)
        y = torch.full((n_rows, n), float("nan"), device=device)
        launch_answer("gather_tile", _gather_gemm, grid[:2], x_d, src.to(device), w.to(device),
                      y, offsets.to(device), n, k_dim, top_k, gather, BLOCK_M=block_m, BLOCK_N=n,
                      BLOCK_K=block_k)
        ref = grouped_gemm_reference(want, w, offsets)
        if where_differs(y.cpu(), ref, rtol=1e-4, atol=1e-4) is not None:
            raise ExerciseError(f"({where}): the tiles are right, but a grouped GEMM using them differs from "
                                "the unfused chain — are its columns past K zero (mask ks < K), and does "
                                "it depend on nothing but its arguments?")
    print("✓ gather_tile loads every row through the row source: a grouped GEMM with it as its "
          "prologue equals permute → grouped GEMM")
