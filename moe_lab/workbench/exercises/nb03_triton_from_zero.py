"""Exercises of notebook 03 (Triton from zero): a masked row softmax, and the grouped
matmul's offset lookup. Both are Triton code the learner writes.

- ``row_softmax_kernel(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N)``: one
  program per row of ``x: [M, N]`` float32 writes ``softmax(x[row])`` to the same row of
  ``out``; ``BLOCK_N`` is a power of two ``>= N``, so a row fits one block and the lanes
  ``N..BLOCK_N-1`` are masked. Rows are ``x_row_stride`` (``out_row_stride``) elements apart,
  which need not be ``N``. Checked against ``torch.softmax`` on rows of awkward widths, in
  views of wider buffers (their padding poisoned, so a read or write past a row's end
  shows), and on large logits (where ``exp`` overflows unless the row's max is subtracted).
- ``expert_rows(offsets_ptr, e, t, BLOCK_M)`` (a ``@jit`` helper): ``(rows, row_ok)`` of
  tile ``t`` of expert ``e`` in the grouped matmul whose grid is ``(E, cdiv(M, BLOCK_M),
  cdiv(N, BLOCK_N))``: ``rows = offsets[e] + t·BLOCK_M + [0, BLOCK_M)``, ``row_ok = rows <
  offsets[e + 1]``, both read from ``offsets_ptr`` (``[E + 1]`` int32, on the device).
  Checked by a probe in which every program claims its rows (each row must be claimed
  once, by its own expert; padding rows after ``offsets[E]`` by none), then by the grouped
  matmul the lookup drives, against `moe_lab.kernels.grouped_gemm.grouped_gemm_reference`.

Each ``check_…`` launches the learner's code compiled on a GPU and under Triton's
interpreter on a CPU (`moe_lab.workbench.exercises.kernel_checks`), on fresh random inputs,
and raises `ExerciseError` naming what is wrong.
"""

from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from moe_lab.kernels import common
from moe_lab.kernels.grouped_gemm import grouped_gemm_reference
from moe_lab.workbench.exercises import ExerciseError, exercise, offsets_of
from moe_lab.workbench.exercises.kernel_checks import kernel_device, launch_answer, where_differs

# ------------------------------------------------------------------ Triton: a masked row softmax


@triton.jit
def row_softmax_kernel(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    """``out[row] = softmax(x[row])`` in float32, one program per row; ``BLOCK_N >= N``.
    Grid: ``(M,)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=float("-inf"))
    z = x - tl.max(x, axis=0)  # exp of at most 0: no overflow
    num = tl.exp(z)  # a masked lane is exp(-inf) = 0
    tl.store(out_ptr + row * out_row_stride + cols, num / tl.sum(num, axis=0), mask=mask)


# What the check's buffers hold past each row's N columns: a lane read there swamps the sum
# (exp of it), a lane written there changes it.
_X_PADDING = 1.0e4
_OUT_PADDING = -7.0


def run_row_softmax(kernel: object, x: torch.Tensor, out: torch.Tensor | None = None,
                    block_n: int | None = None) -> torch.Tensor:
    """Launch ``kernel`` (the learner's ``row_softmax_kernel``) over the rows of the 2-d
    float32 ``x`` (its columns contiguous, its rows any stride apart) into ``out`` (made
    when not given; else float32, the shape of ``x``, its columns contiguous); ``block_n``
    (at least the width) defaults to the next power of two of the width."""
    if x.dim() != 2 or x.dtype != torch.float32 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be a 2-d float32 tensor with contiguous rows, got {x.dtype} "
                         f"of shape {tuple(x.shape)}, strides {x.stride()}")
    rows, width = x.shape
    out = torch.empty(rows, width, device=x.device) if out is None else out
    block_n = block_n or triton.next_power_of_2(max(width, 1))
    if rows:
        launch_answer("row_softmax_kernel", kernel, (rows,), x, out, width, x.stride(0), out.stride(0),
                      BLOCK_N=block_n)
    return out


def _softmax_hint(got: torch.Tensor, x: torch.Tensor, block_n: int) -> str:
    """Which plausible slip gives ``got`` for rows ``x`` (`check_row_softmax`'s hints)."""
    width = x.shape[1]
    if torch.isnan(got).any() or torch.isinf(got).any():
        return (" — NaN or inf: exp overflowed. Subtract the row's max before exp "
                "(softmax(x) = softmax(x - max x))")
    zeros_in = torch.cat([x, x.new_zeros(x.shape[0], block_n - width)], dim=1).softmax(1)[:, :width]
    if block_n > width and torch.allclose(got, zeros_in, rtol=1e-4, atol=1e-6):
        return (f" — the {block_n - width} masked lanes of the block count in the sum as exp(0 - max): "
                "load them as -inf (other=float('-inf')), so that exp makes them 0")
    if bool((got.abs() < 1e-6).all()):
        return (" — every value ~0: the lanes past the row's N columns were read (here they hold "
                f"{_X_PADDING:g}): load with mask=cols < N")
    right = [bool(torch.allclose(got[r], want, rtol=1e-5, atol=1e-6))
             for r, want in enumerate(x.softmax(dim=1))]
    if right[0] and not all(right):
        return (f" — row 0 is right, row {right.index(False)} is not: row r of x starts at "
                "x_ptr + r · x_row_stride, of out at out_ptr + r · out_row_stride (neither is N here)")
    return ""


@exercise(row_softmax_kernel)
def check_row_softmax(kernel: object) -> None:
    """Raise `ExerciseError` unless ``kernel`` writes ``softmax(x[row])`` for every row of
    fresh random ``x`` like ``torch.softmax``: widths that are not powers of two (and a
    ``BLOCK_N`` wider than needed), a single column, a single row, large logits; rows in
    views of wider buffers (``x`` and ``out`` rows a different number of elements apart,
    neither ``N``), whose padding the kernel must neither read nor write."""
    device = kernel_device()
    g = torch.Generator().manual_seed(random.randrange(2**31))
    # (rows, width, BLOCK_N or None: the next power of two, scale of the logits)
    cases = [(6, 37, None, 1.0), (5, 64, None, 1.0), (3, 100, 256, 1.0), (1, 5, None, 1.0),
             (4, 1, None, 1.0), (7, 24, None, 1.0), (4, 50, None, 300.0)]
    for rows, width, block_n, scale in cases:
        block_n = block_n or triton.next_power_of_2(width)
        # Rows of x are block_n + 8 elements apart, of out block_n + 3: an unmasked load or
        # store stays inside its own row's padding.
        x_buffer = torch.full((rows, block_n + 8), _X_PADDING)
        x_buffer[:, :width] = scale * torch.randn(rows, width, generator=g)
        out_buffer = torch.full((rows, block_n + 3), _OUT_PADDING, device=device)
        got_out = run_row_softmax(kernel, x_buffer.to(device)[:, :width], out_buffer[:, :width], block_n)
        x, got = x_buffer[:, :width], got_out.cpu()
        want = x.softmax(dim=1)
        where = (f"{rows} rows of {width} columns, BLOCK_N {block_n}, rows {block_n + 8} elements "
                 f"apart in x and {block_n + 3} in out"
                 + (f", logits {scale:g} × randn" if scale != 1 else ""))
        bad = where_differs(got, want, rtol=1e-5, atol=1e-6)
        if bad is not None:
            r, c = bad
            raise ExerciseError(f"({where}): out[{r}, {c}] = {got[r, c].item():.6g}, expected "
                                f"{want[r, c].item():.6g}{_softmax_hint(got, x, block_n)}")
        past = out_buffer.cpu()[:, width:]
        if not bool((past == _OUT_PADDING).all()):
            r, c = (past != _OUT_PADDING).nonzero()[0].tolist()
            raise ExerciseError(f"({where}): your kernel wrote past the end of row {r} (column "
                                f"{width + c} of a row of {width}): store with mask=cols < N")
    print("✓ row_softmax_kernel matches torch.softmax on every row, masked lanes included")


# ------------------------------------------------------- Triton: the grouped matmul's rows


@triton.jit
def expert_rows(offsets_ptr, e, t, BLOCK_M: tl.constexpr):
    """``(rows, row_ok)`` of tile ``t`` of expert ``e``: ``BLOCK_M`` rows from
    ``offsets[e] + t·BLOCK_M`` (int64), those before ``offsets[e + 1]`` its expert's."""
    start = tl.load(offsets_ptr + e).to(tl.int64)
    end = tl.load(offsets_ptr + e + 1).to(tl.int64)
    rows = start + t * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, rows < end


@triton.jit
def _claim_rows(offsets_ptr, claims_ptr, M_ROWS, BLOCK_M: tl.constexpr, EXPERT_ROWS: tl.constexpr):
    # claims: [E, M_ROWS] int32. Program (e, t) adds 1 to claims[e, r] for each row r its
    # tile owns. Rows outside [0, M_ROWS) are not written (a wrong lookup must not address
    # memory outside the buffers).
    e = tl.program_id(0)
    rows, row_ok = EXPERT_ROWS(offsets_ptr, e, tl.program_id(1), BLOCK_M)
    rows = rows.to(tl.int64)
    ok = row_ok & (rows >= 0) & (rows < M_ROWS)
    tl.atomic_add(claims_ptr + e.to(tl.int64) * M_ROWS + rows, tl.full((BLOCK_M,), 1, tl.int32), mask=ok)


@triton.jit
def grouped_matmul_kernel(x_ptr, w_ptr, y_ptr, offsets_ptr, M_ROWS, N, K,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          EXPERT_ROWS: tl.constexpr):
    """``y[offsets[e]:offsets[e+1]] = x[...] @ w[e]`` on contiguous float32 ``x: [M_ROWS, K]``,
    ``w: [E, K, N]``, ``y: [M_ROWS, N]``, each program's rows from ``EXPERT_ROWS``. Grid:
    ``(E, cdiv(M_ROWS, BLOCK_M), cdiv(N, BLOCK_N))``."""
    e = tl.program_id(0)
    rows, row_ok = EXPERT_ROWS(offsets_ptr, e, tl.program_id(1), BLOCK_M)
    rows = rows.to(tl.int64)
    row_ok = row_ok & (rows >= 0) & (rows < M_ROWS)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    # The lesson's K loop (float32 tiles, IEEE float32 products) against w[e].
    acc = common.gemm_k_loop(x_ptr, rows, row_ok, w_ptr + e.to(tl.int64) * K * N, cols, N, K, K, 1, N, 1,
                             BLOCK_M, BLOCK_N, BLOCK_K, False)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc, mask=row_ok[:, None] & (cols[None, :] < N))


GROUPED_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}


def run_grouped_matmul(lookup: object, x: torch.Tensor, w: torch.Tensor,
                       offsets: torch.Tensor) -> torch.Tensor:
    """``grouped_matmul_kernel`` with ``lookup`` as its ``EXPERT_ROWS``, at `GROUPED_BLOCKS`:
    ``y: [M, N]`` float32, rows past ``offsets[E]`` NaN (no program owns them)."""
    (m_rows, k), (n_experts, _, n) = x.shape, w.shape
    y = torch.full((m_rows, n), float("nan"), device=x.device)
    grid = (n_experts, triton.cdiv(m_rows, GROUPED_BLOCKS["BLOCK_M"]),
            triton.cdiv(n, GROUPED_BLOCKS["BLOCK_N"]))
    if m_rows and n_experts:
        launch_answer("expert_rows", grouped_matmul_kernel, grid, x.contiguous(), w.contiguous(), y,
                      offsets, m_rows, n, k, EXPERT_ROWS=lookup, **GROUPED_BLOCKS)
    return y


def _check_claims(claims: torch.Tensor, offsets: torch.Tensor, where: str) -> None:
    """`ExerciseError` unless ``claims[e, r]`` (how many programs of expert ``e`` claimed row
    ``r``) is 1 where ``offsets[e] <= r < offsets[e + 1]`` and 0 elsewhere."""
    bounds = offsets.tolist()
    for r in range(claims.shape[1]):
        by = {e: int(n) for e, n in enumerate(claims[:, r].tolist()) if n}
        if r >= bounds[-1]:
            if by:
                e = min(by)
                raise ExerciseError(
                    f"({where}): row {r} is padding (past offsets[E] = {bounds[-1]}), yet expert {e}'s "
                    f"programs claimed it: a tile's rows stop at offsets[e + 1] (row_ok = rows < end)")
            continue
        own = next(e for e in range(len(bounds) - 1) if bounds[e] <= r < bounds[e + 1])
        span = f"offsets[{own}] = {bounds[own]} ≤ {r} < offsets[{own + 1}] = {bounds[own + 1]}"
        others = sorted(set(by) - {own})
        if others:
            e = others[0]
            why = (f"a tile's rows stop at offsets[e + 1] = {bounds[e + 1]} (row_ok = rows < end)" if e < own
                   else f"expert e's tiles start at offsets[e] = {bounds[e]}, read from offsets_ptr")
            raise ExerciseError(f"({where}): row {r} is expert {own}'s ({span}), yet expert {e}'s programs "
                                f"claimed it: {why}")
        if own not in by:
            raise ExerciseError(
                f"({where}): row {r} (expert {own}'s: {span}) is claimed by no program: tile t of "
                "expert e holds rows offsets[e] + t·BLOCK_M + [0, BLOCK_M)")
        if by[own] > 1:
            raise ExerciseError(
                f"({where}): row {r} (expert {own}'s: {span}) is claimed by {by[own]} of its programs: "
                "tile t of expert e holds rows offsets[e] + t·BLOCK_M + [0, BLOCK_M), one tile "
                "after the other")


@exercise(expert_rows)
def check_expert_rows(lookup: object) -> None:
    """Raise `ExerciseError` unless ``lookup`` gives every row of fresh offsets (empty
    experts, one expert with every row, segments shorter and longer than a tile, padding
    rows after ``offsets[E]``) to exactly one program, of its own expert, and drives the
    grouped matmul to `grouped_gemm_reference`'s result."""
    device = kernel_device()
    block_m = GROUPED_BLOCKS["BLOCK_M"]  # the probe's tiles are the grouped matmul's
    rng = random.Random()
    cases = [[5, 0, 37, 16, 1, 0], [40], [0, 0, 23], [16, 16], [0],
             [rng.choice([0, 1, 7, 16, 17, 33]) for _ in range(6)]]
    for counts in cases:
        pad = rng.choice([0, 3, 19])
        offsets = offsets_of(counts)
        total = sum(counts)
        m_rows = total + pad
        where = f"rows per expert {counts}, {pad} padding rows, BLOCK_M {block_m}"
        claims = torch.zeros(len(counts), m_rows, dtype=torch.int32, device=device)
        grid = (len(counts), triton.cdiv(max(m_rows, 1), block_m))
        launch_answer("expert_rows", _claim_rows, grid, offsets.to(device), claims, m_rows,
                      BLOCK_M=block_m, EXPERT_ROWS=lookup)
        _check_claims(claims.cpu(), offsets, where)
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        x = torch.randn(m_rows, 24, generator=g)
        w = torch.randn(len(counts), 24, 40, generator=g)
        y = run_grouped_matmul(lookup, x.to(device), w.to(device), offsets.to(device)).cpu()
        want = grouped_gemm_reference(x, w, offsets)
        bad = where_differs(y[:total], want[:total], rtol=1e-4, atol=1e-4)
        if bad is not None:
            raise ExerciseError(f"({where}): with your lookup the grouped matmul's y[{bad[0]}, {bad[1]}] "
                                f"= {y[bad].item():.6g}, expected {want[bad].item():.6g}")
    print("✓ expert_rows gives every row to one program of its own expert, and the grouped matmul "
          "it drives matches the reference")
