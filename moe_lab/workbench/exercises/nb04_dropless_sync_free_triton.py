"""The Triton exercises of notebook 04 (dropless, sync-free); the PyTorch ones are
`nb04_dropless_sync_free`.

- ``unpermute_kernel`` (Triton): the combine, ``out[t] = Σ_j w[t, j] · y[row_id_map[t, j]]``.
  The learner writes the lines that load each token's rows *through the row-id map*: the
  row id of slot ``j``, a mask that keeps a bad id from addressing memory, the row, its
  weight. Checked against `moe_lab.kernels.permute.unpermute_reference` (padding rows of
  ``y`` hold NaN, so reading one shows), and on a map holding ids outside ``[0, N_ROWS)``
  (``y`` sits between NaN rows in memory, so an id the mask lets through shows).
- ``tile_schedule`` (Triton): which expert and which rows program ``tile`` of the grouped
  GEMM owns, ``(segment, first row, end row)``, read from the offsets on the device — segment
  ``E`` is the padding after ``offsets[E]``, a segment above ``E`` means no work. Checked
  program by program against `moe_lab.kernels.common.tile_schedule`, then as the
  schedule of a small grouped GEMM against `moe_lab.kernels.grouped_gemm.grouped_gemm_reference`.

Each ``check_…`` runs the learner's ``@triton.jit`` function in a small kernel on fresh random
inputs (and awkward ones) and raises `ExerciseError` when an answer differs from the reference.
"""

from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from moe_lab.kernels import common
from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels.permute import make_row_id_map_reference, unpermute_reference
from moe_lab.workbench.exercises import ExerciseError, exercise, offsets_of, random_routing
from moe_lab.workbench.exercises.kernel_checks import kernel_device, launch_answer, where_differs

# ------------------------------------------------------------------ Triton: the combine


@triton.jit
def unpermute_kernel(y_ptr, map_ptr, w_ptr, out_ptr, T, D, N_ROWS, TOP_K,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[t] = Σ_j w[t, j] · y[row_id_map[t, j]]`` in float32; all tensors contiguous,
    ``y: [N_ROWS, D]``, ``row_id_map, w: [T, TOP_K]``, ``out: [T, D]``. Grid:
    ``(cdiv(T, BLOCK_T), cdiv(D, BLOCK_D))``."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    t_ok, d_ok = t < T, d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for j in range(TOP_K):
        row = tl.load(map_ptr + t * TOP_K + j, mask=t_ok, other=-1).to(tl.int64)
        ok = t_ok & (row >= 0) & (row < N_ROWS)  # a bad id must not address memory
        v = tl.load(y_ptr + row[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + t * TOP_K + j, mask=t_ok, other=0.0)
        acc += v * w[:, None]
    tl.store(out_ptr + t[:, None] * D + d[None, :], acc, mask=t_ok[:, None] & d_ok[None, :])


UNPERMUTE_BLOCKS = {"BLOCK_T": 32, "BLOCK_D": 32}


def run_unpermute_kernel(kernel: object, y: torch.Tensor, row_id_map: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
    """Launch ``kernel`` (the learner's ``unpermute_kernel``) on contiguous tensors."""
    tokens, top_k = row_id_map.shape
    d = y.shape[1]
    out = torch.full((tokens, d), float("nan"), device=y.device)
    grid = (triton.cdiv(tokens, UNPERMUTE_BLOCKS["BLOCK_T"]), triton.cdiv(d, UNPERMUTE_BLOCKS["BLOCK_D"]))
    if tokens:
        launch_answer("unpermute_kernel", kernel, grid, y.contiguous(), row_id_map.contiguous(),
                      weights.contiguous(), out, tokens, d, y.shape[0], top_k, **UNPERMUTE_BLOCKS)
    return out


@exercise(unpermute_kernel)
def check_unpermute_kernel(kernel: object) -> None:
    """Raise `ExerciseError` unless ``kernel`` combines the expert rows of fresh random
    routings (skewed, padded segments, a token count and width that are not multiples of
    the blocks) like `unpermute_reference`, in float32 — and, on a map holding row ids
    outside ``[0, N_ROWS)`` (a padded map's), masks those slots (they add nothing; ``y``
    sits between NaN rows, so a row loaded through a bad id shows)."""
    device = kernel_device()
    g = torch.Generator().manual_seed(random.randrange(2**31))
    cases = [(37, 40, 8, 2, 1, False), (50, 24, 16, 4, 8, False), (9, 64, 4, 4, 1, False),
             (33, 8, 6, 1, 4, False), (21, 40, 8, 2, 4, True)]
    for tokens, d, n_experts, top_k, align, bad_ids in cases:
        ids = random_routing(g, tokens, n_experts, top_k)
        row_id_map, offsets = make_row_id_map_reference(ids, n_experts, align)
        n_rows = int(offsets[-1]) + 3  # 3 rows past the last expert: never read
        y = torch.randn(n_rows, d, generator=g)
        # Padding rows (no (token, slot) maps to them) hold NaN: reading one poisons the output.
        y[common.row_source(row_id_map, n_rows) < 0] = float("nan")
        weights = torch.rand(tokens, top_k, generator=g)
        if bad_ids:  # ids a padded map holds: past N_ROWS, and -1
            row_id_map = row_id_map.clone()
            every_third = torch.arange(0, row_id_map.numel(), 3)
            row_id_map.view(-1)[every_third] = torch.tensor(
                [n_rows, n_rows + 1, -1], dtype=row_id_map.dtype)[every_third // 3 % 3]
        ok = (row_id_map >= 0) & (row_id_map < n_rows)
        want = unpermute_reference(torch.cat([y, y.new_zeros(1, d)]),
                                   torch.where(ok, row_id_map, n_rows), weights)
        # y between NaN rows in memory: a row loaded through an id outside [0, N_ROWS) is NaN.
        nan_rows = torch.full((3, d), float("nan"))
        memory = torch.cat([nan_rows, y, nan_rows]).to(device)
        got = run_unpermute_kernel(kernel, memory[3:3 + n_rows], row_id_map.to(device),
                                   weights.to(device)).cpu()
        where = f"{tokens} tokens of width {d}, top-{top_k} of {n_experts} experts"
        if bad_ids:
            where += f", N_ROWS {n_rows}, row ids outside [0, N_ROWS) in the map"
        bad = where_differs(got, want, rtol=1e-5, atol=1e-5)
        if bad is None:
            continue
        t, c = bad
        hint = ""
        w_transposed = weights.view(top_k, tokens).t()  # w's memory read as [TOP_K, T]: w[j, t]
        if torch.isnan(got[t, c]) and not bool(ok[t].all()):
            bad_row = int(row_id_map[t][~ok[t]][0])
            hint = (f" — NaN: token {t} maps to row {bad_row}, outside [0, N_ROWS = {n_rows}): "
                    "row ids past N_ROWS must be masked (and negative ones), so that the slot adds "
                    "nothing: ok = t_ok & (row >= 0) & (row < N_ROWS)")
        elif torch.isnan(got[t, c]):
            hint = (" — NaN: a padding row of y was read, or the output was never written there "
                    "(y's row is row_id_map[t, j], not t·TOP_K + j; store every column of the tile)")
        elif torch.allclose(got, unpermute_reference(y, row_id_map, None), atol=1e-5, rtol=1e-5):
            hint = " — you summed the rows without multiplying by the router weights w[t, j]"
        elif top_k > 1 and torch.allclose(got, unpermute_reference(y, row_id_map, w_transposed),
                                          atol=1e-5, rtol=1e-5):
            hint = (" — the weights are read transposed, as w[j, t]: w is [T, TOP_K] contiguous, "
                    "so w[t, j] is at w_ptr + t · TOP_K + j")
        raise ExerciseError(f"({where}): out[{t}, {c}] = {got[t, c].item():.6g}, expected "
                            f"{want[t, c].item():.6g}{hint}")
    print("✓ unpermute_kernel loads every row through the row-id map, masks the ids outside "
          "[0, N_ROWS) and matches the reference")


# ------------------------------------------------------- Triton: the grouped GEMM's tiles


@triton.jit
def tile_schedule(offsets_ptr, tile, E, M_ROWS, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """``(segment, first row, end row)`` of row tile ``tile``: the kernel's own schedule."""
    return common.tile_schedule(offsets_ptr, tile, E, M_ROWS, BLOCK_M, BLOCK_E)


@triton.jit
def _schedule_probe(offsets_ptr, out_ptr, E, M_ROWS, BLOCK_M: tl.constexpr,
                    BLOCK_E: tl.constexpr, SCHEDULE: tl.constexpr):
    # out: [n_programs, 3] int32, what SCHEDULE says program p owns.
    p = tl.program_id(0)
    seg, row0, row_end = SCHEDULE(offsets_ptr, p, E, M_ROWS, BLOCK_M, BLOCK_E)
    tl.store(out_ptr + 3 * p, seg)
    tl.store(out_ptr + 3 * p + 1, row0)
    tl.store(out_ptr + 3 * p + 2, row_end)


@triton.jit
def _scheduled_gemm(x_ptr, w_ptr, y_ptr, offsets_ptr, M_ROWS, N, K, E,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_E: tl.constexpr, SCHEDULE: tl.constexpr):
    # The grouped GEMM y[rows of e] = x[rows of e] @ w[e] on contiguous float32 tensors,
    # its tiles placed by SCHEDULE. Grid: (cdiv(M_ROWS, BLOCK_M) + E, cdiv(N, BLOCK_N)).
    seg, row0, row_end = SCHEDULE(offsets_ptr, tl.program_id(0), E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg > E:
        return
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = (rows < row_end) & (rows >= 0) & (rows < M_ROWS)
    y_ptrs = y_ptr + rows[:, None] * N + cols[None, :]
    y_mask = row_ok[:, None] & (cols[None, :] < N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if seg < E:
        seg_w = tl.minimum(tl.maximum(seg, 0), E - 1).to(tl.int64)
        acc = common.gemm_k_loop(x_ptr, rows, row_ok, w_ptr + seg_w * K * N, cols, N, K, K, 1, N, 1,
                                 BLOCK_M, BLOCK_N, BLOCK_K, False)
    tl.store(y_ptrs, acc, mask=y_mask)


@exercise(tile_schedule)
def check_tile_schedule(schedule: object, block_m: int = 16) -> None:
    """Raise `ExerciseError` unless ``schedule`` gives every program of the grid
    ``cdiv(M, BLOCK_M) + E`` the kernel's ``(segment, first row, end row)`` on fresh
    offsets (empty experts, one long one, padding rows after ``offsets[E]``, none at all),
    and then drives a grouped GEMM to `grouped_gemm_reference`'s result."""
    device = kernel_device()
    rng = random.Random()
    cases = [[5, 0, 6, 64, 13, 0, 7, 0], [0, 0, 0, 37], [16, 16, 16], [0, 0],
             *([rng.choice([0, 0, 1, 3, 5, 16, 17, 40]) for _ in range(n)] for n in (8, 5))]
    for counts in cases:
        n_experts = len(counts)
        pad = rng.choice([0, 0, 5, 19])
        offsets = offsets_of(counts)
        m_rows = sum(counts) + pad
        n_programs = triton.cdiv(m_rows, block_m) + n_experts
        block_e = triton.next_power_of_2(n_experts + 1)
        got = torch.zeros(n_programs, 3, dtype=torch.int32, device=device)
        want = torch.zeros(n_programs, 3, dtype=torch.int32, device=device)
        args = (offsets.to(device),)
        launch_answer("tile_schedule", _schedule_probe, (n_programs,), *args, got, n_experts,
                      m_rows, BLOCK_M=block_m, BLOCK_E=block_e, SCHEDULE=schedule)
        _schedule_probe[(n_programs,)](*args, want, n_experts, m_rows, BLOCK_M=block_m,
                                       BLOCK_E=block_e, SCHEDULE=tile_schedule)
        where = f"rows per expert {counts}, {pad} padding rows, BLOCK_M {block_m}"
        for p, (g_row, w_row) in enumerate(zip(got.tolist(), want.tolist(), strict=True)):
            if w_row[0] > n_experts:
                if g_row[0] <= n_experts:
                    raise ExerciseError(f"({where}): program {p} has no work (every tile is "
                                        f"taken by the programs before it), but your schedule "
                                        f"gives it segment {g_row[0]}, rows {g_row[1]}:{g_row[2]}")
                continue
            if g_row != w_row:
                seg, row0, end = w_row
                what = "the padding rows" if seg == n_experts else f"expert {seg}"
                raise ExerciseError(
                    f"({where}): program {p} should own {what}, rows {row0}:{min(row0 + block_m, end)} "
                    f"(segment {seg}, first row {row0}, end {end}); your schedule says segment "
                    f"{g_row[0]}, first row {g_row[1]}, end {g_row[2]}. Number the tiles segment "
                    "after segment: an expert with r rows takes cdiv(r, BLOCK_M) tiles, an empty "
                    "one none")
        k, n = 16, 24
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        x = torch.randn(m_rows, k, generator=g)
        w = torch.randn(n_experts, k, n, generator=g)
        y = torch.full((m_rows, n), float("nan"), device=device)
        launch_answer("tile_schedule", _scheduled_gemm, (n_programs, triton.cdiv(n, 32)), x.to(device),
                      w.to(device), y, offsets.to(device), m_rows, n, k, n_experts, BLOCK_M=block_m,
                      BLOCK_N=32, BLOCK_K=16, BLOCK_E=block_e, SCHEDULE=schedule)
        ref = gg.grouped_gemm_reference(x, w, offsets)
        bad = where_differs(y.cpu(), ref, rtol=1e-4, atol=1e-4)
        if bad is not None:
            raise ExerciseError(f"({where}): with your schedule the grouped GEMM's y[{bad[0]}, "
                                f"{bad[1]}] = {y[bad].item():.6g}, expected {ref[bad].item():.6g}")
    print("✓ tile_schedule places every tile like the kernel, and the grouped GEMM it drives "
          "matches the reference")
