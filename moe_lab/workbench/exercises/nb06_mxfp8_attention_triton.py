"""The Triton exercises of notebook 06 (MXFP8 attention); the PyTorch ones are
`nb06_mxfp8_attention`.

- ``e8m0_block_scale`` (Triton): the biased E8M0 scale byte of MXFP8 (E4M3) inside a kernel,
  for a ``[ROWS, 32]`` tile of float32 values, one MX block per row, ``"floor"`` rule
  (``floor(log2(amax)) - 8``) — in integer arithmetic on the float32 bits, as
  `moe_lab.kernels.mx_quantize` does (a block maximum from ``bits & 0x7FFFFFFF``, the exponent
  field, the clamp and the bias, 255 for a NaN). Checked
  against `moe_lab.quant.mx.block_scale_exponent`.
- ``online_softmax_step`` (Triton): one step of flash attention's online softmax — given the
  running maximum ``m``, running sum ``l`` and output accumulator ``acc`` of a block of query
  rows, and the next tile of scores ``s`` and of values ``v``, return the updated
  ``(m, l, acc)``. A small causal attention kernel calls it tile by tile; checked against
  `moe_lab.attention.reference_attention`.

Each ``check_…`` runs the learner's ``@triton.jit`` function inside a small kernel on fresh random
inputs and raises `ExerciseError` when an answer differs from the reference.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from moe_lab.attention import reference_attention
from moe_lab.quant.mx import BLOCK_SIZE, E4M3, block_scale_exponent
from moe_lab.workbench.exercises import ExerciseError, exercise
from moe_lab.workbench.exercises.kernel_checks import (
    interpreted,
    kernel_device,
    launch_answer,
    where_differs,
)

# ------------------------------------------------------- Triton: the E8M0 block scale


@triton.jit
def e8m0_block_scale(x):
    """``x: [ROWS, 32]`` float32, one MX block per row → ``[ROWS]`` int32 biased E8M0 bytes,
    OCP's ``floor`` rule for E4M3: ``clamp(floor(log2(amax)) - 8, -127, 127) + 127``, 255 for
    a block holding a NaN."""
    bits = x.to(tl.int32, bitcast=True)
    amax = tl.max(bits & 0x7FFFFFFF, 1)  # |x| as integers: same order as the floats, NaN above Inf
    unbiased = (amax >> 23) - 127 - 8  # floor(log2(amax)) from the exponent field; E4M3: 2^8
    biased = tl.minimum(tl.maximum(unbiased, -127), 127) + 127
    return tl.where(amax > 0x7F800000, 255, biased)


@triton.jit
def _block_scale_kernel(x_ptr, out_ptr, ROWS, FN: tl.constexpr, BLOCK_R: tl.constexpr,
                        MX: tl.constexpr):
    # x: [ROWS, MX] float32 contiguous; out: [ROWS] int32. Grid: (cdiv(ROWS, BLOCK_R),).
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, MX)
    x = tl.load(x_ptr + r[:, None] * MX + c[None, :], mask=(r < ROWS)[:, None], other=0.0)
    tl.store(out_ptr + r, FN(x).to(tl.int32), mask=r < ROWS)


@exercise(e8m0_block_scale)
def check_e8m0_block_scale(fn: Callable) -> None:
    """Raise `ExerciseError` unless the learner's ``@triton.jit`` ``fn`` gives every block of
    a fresh random tile `block_scale_exponent`'s floor-rule byte."""
    device = kernel_device()
    g = torch.Generator().manual_seed(random.randrange(2**31))
    # 96 blocks over 2^-140 .. 2^120, with zeros, subnormals, NaNs and maxima on powers of two.
    scale = torch.exp2(torch.randint(-140, 121, (96, 1), generator=g).float())
    x = torch.randn(96, BLOCK_SIZE, generator=g) * scale
    x[0].zero_()
    x[1] = torch.randn(BLOCK_SIZE, generator=g) * 2.0**-140  # every value subnormal
    x[2, 5] = float("nan")
    x[3] = 0.0
    x[3, 7] = -(2.0**20)  # a negative maximum, exactly a power of two
    x[4] = torch.full((BLOCK_SIZE,), 448.0)
    x[5, 0] = float("nan")
    want = block_scale_exponent(x.abs().amax(1), E4M3, "floor")
    got = torch.full((x.shape[0],), -1, dtype=torch.int32, device=device)
    launch_answer("e8m0_block_scale", _block_scale_kernel, (triton.cdiv(x.shape[0], 64),),
                  x.to(device), got, x.shape[0], FN=fn, BLOCK_R=64, MX=BLOCK_SIZE)
    got = got.cpu()
    if torch.equal(got, want):
        print("✓ e8m0_block_scale gives every block the reference's E8M0 byte")
        return
    r = int((got != want).nonzero()[0])
    amax = x[r].abs().amax().item()
    largest = x[r][x[r].abs().argmax()].item()
    # The same offset on every block without a NaN: the exponent is right, its bias is not.
    finite = ~torch.isnan(x).any(1)
    offsets = (got - want)[finite].unique()
    hint = ""
    if math.isnan(amax):  # first: 255 - 127 is also a byte a NaN-blind answer can give
        hint = " (a block holding a NaN gets 255, the E8M0 NaN)"
    elif got[r] == want[r] - 127 or got[r] == want[r] + 127:
        hint = " (the byte is biased: unbiased exponent + 127)"
    elif len(offsets) == 1 and int(offsets[0]) != 8:
        hint = (f" (every block's byte is off by {int(offsets[0]):+d}: the bias is wrong — the byte is the "
                "clamped unbiased exponent + 127)")
    elif largest < 0:
        hint = (f" (the block's largest magnitude is a negative value, {largest:.6g}: its float32 "
                "bits read as a negative int32, so clear the sign bit, bits & 0x7FFFFFFF, before "
                "taking the maximum)")
    elif got[r] == want[r] + 8:
        hint = " (E4M3's largest power of two is 2^8: subtract 8 so that amax / scale fits)"
    elif amax == 0 or amax < 2.0**-126:
        hint = " (a zero or subnormal maximum has exponent field 0: clamp to -127, the byte 0)"
    raise ExerciseError(f"block {r} (amax {amax:.6g}): your byte is {int(got[r])}, expected "
                        f"{int(want[r])}{hint}")


# ---------------------------------------------------- Triton: the online softmax update


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v):
    """One tile of flash attention. ``m_i, l_i: [BLOCK_M]`` the running maximum and sum of
    ``exp(s - m)``, ``acc: [BLOCK_M, D]`` the unnormalised output, ``s: [BLOCK_M, BLOCK_N]``
    the tile's scores (natural-log units, -inf where masked), ``v: [BLOCK_N, D]``: the
    updated ``(m, l, acc)``; the output is ``acc / l`` after the last tile."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)  # rescales what was summed under the old maximum
    p = tl.exp(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v)
    return m_new, l_new, acc


@triton.jit
def _online_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, T, sm_scale, FN: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    # One head, causal: q, k, v, o [T, D] float32 contiguous. Grid: (cdiv(T, BLOCK_M),).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=(rows < T)[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    hi = tl.minimum(T, (tl.program_id(0) + 1) * BLOCK_M)
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + cols[:, None] * D + d[None, :], mask=(cols < T)[:, None], other=0.0)
        v = tl.load(v_ptr + cols[:, None] * D + d[None, :], mask=(cols < T)[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        s = tl.where((cols[None, :] <= rows[:, None]) & (cols[None, :] < T), s, float("-inf"))
        m_i, l_i, acc = FN(m_i, l_i, acc, s, v)
    tl.store(o_ptr + rows[:, None] * D + d[None, :], acc / l_i[:, None], mask=(rows < T)[:, None])


@exercise(online_softmax_step)
def check_online_softmax_step(fn: Callable) -> None:
    """Raise `ExerciseError` unless a causal attention that calls the learner's ``@triton.jit``
    ``fn`` tile by tile matches `reference_attention` on fresh random heads: several key tiles
    per query block, a length that is not a multiple of the tile, and sharp scores (where
    an update that forgets to subtract the maximum overflows)."""
    device = kernel_device()
    g = torch.Generator().manual_seed(random.randrange(2**31))
    tol = 1e-4 if interpreted() else 1e-2  # compiled, tl.dot may take float32 as TF32
    for tokens, d, sharp in ((40, 16, 1.0), (64, 32, 1.0), (50, 16, 30.0)):
        q, k, v = (torch.randn(tokens, d, generator=g) for _ in range(3))
        q = q * sharp
        want = reference_attention(q[None, None], k[None, None], v[None, None])[0, 0]
        out = torch.full((tokens, d), float("nan"), device=device)
        launch_answer("online_softmax_step", _online_attention_kernel, (triton.cdiv(tokens, 16),),
                      q.to(device), k.to(device), v.to(device), out, tokens, 1.0 / math.sqrt(d),
                      FN=fn, BLOCK_M=16, BLOCK_N=16, D=d)
        got = out.cpu()
        bad = where_differs(got, want, rtol=tol, atol=tol)
        if bad is None:
            continue
        row, col = bad
        scaled = f', scores scaled by {sharp:g}' if sharp != 1 else ''
        where = f"{tokens} tokens, head_dim {d}{scaled}"
        if not torch.isfinite(got[row]).all():
            hint = (" — not finite: subtract the running maximum before exp (and use "
                    "exp(m_old - m_new) to rescale)")
        elif row < 16:
            hint = " — query rows in the first tile are wrong too: check p, l and acc for one tile"
        else:
            hint = (" — the first tile is right, later ones are not: when the maximum grows, "
                    "rescale l and acc by exp(m_old - m_new)")
        raise ExerciseError(f"({where}): out[{row}, {col}] = {got[row, col].item():.6g}, expected "
                            f"{want[row, col].item():.6g}{hint}")
    print("✓ online_softmax_step: tile by tile, the same attention as the reference")
