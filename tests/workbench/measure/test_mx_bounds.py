"""The bound Hopper's MXFP8 GEMM is checked against (`moe_lab.workbench.measure.mx_bounds`).

On sm_90 each 32-wide block's dot is an FP8 wgmma whose sum keeps about 14 significand bits,
not fp32's 24, so a GPU's ``fp8_promote`` result is not within the fp32 summation bound the
interpreted tests use (tests/lesson/kernels/test_mx_gemm.py): `fp8_promote_bound` is the
bound for that hardware. It must hold the interpreter's results (IEEE inside) and a
simulation of the narrow accumulator, and reject real bugs.
"""

from __future__ import annotations

import pytest
import torch
from support import abs_product, grouped_mx_operands, mx_operands

from moe_lab.kernels.mx_gemm import grouped_mx_gemm, grouped_mx_gemm_reference, mx_gemm, mx_gemm_reference
from moe_lab.quant.mx import E4M3
from moe_lab.workbench.measure.mx_bounds import HOPPER_FP8_ACCUMULATOR_BITS, fp8_promote_bound


def assert_within_bound(c: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    err = (c.cpu().double() - want.cpu()).abs()
    assert torch.isfinite(want).all()
    assert (err <= bound.cpu()).all(), f"max excess {(err - bound.cpu()).max().item():.3g}"


def _to_bits(x: torch.Tensor, bits: int, mode: str) -> torch.Tensor:
    """float64 ``x`` rounded to nearest, or truncated toward zero, to ``bits`` significand bits."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa · 2^exponent, |mantissa| in [0.5, 1)
    scaled = mantissa * 2.0**bits
    return torch.ldexp(torch.trunc(scaled) if mode == "truncate" else torch.round(scaled), exponent - bits)


def simulated_hopper(a, a_s, b, b_s, mode: str, bits: int = 14) -> torch.Tensor:
    """fp8_promote as a Hopper with a ``bits``-wide wgmma accumulator would compute it: per
    32-wide K block, the exact code products summed with every partial sum rounded
    (``"nearest"``) or truncated (``"truncate"``) to ``bits`` bits, or (``"align"``) each product
    cut toward zero below the ``bits``-th bit of the block's largest; then the partial times
    its two scales, added block by block to an fp32 accumulator. fp32 ``[M, N]``."""
    y = (a.cpu().double().unflatten(1, (-1, 32))[:, None]
         * b.cpu().double().unflatten(1, (-1, 32))[None])  # [M, N, K/32, 32], exact products
    if mode == "align":
        top = torch.frexp(y.abs().amax(-1, keepdim=True)).exponent  # largest < 2^top
        quantum = torch.exp2((top - bits).double())
        partial = (torch.trunc(y / quantum) * quantum).sum(-1)  # exact: few bits
    else:
        partial = torch.zeros(y.shape[:-1], dtype=torch.float64)
        for i in range(32):
            partial = _to_bits(partial + y[..., i], bits, mode)
    exps = a_s.cpu().view(torch.uint8).double()[:, None] + b_s.cpu().view(torch.uint8).double()[None]
    terms = (partial * torch.exp2(exps - 254)).float()  # exact: a p-bit value times a power of two
    acc = torch.zeros(terms.shape[:2], dtype=torch.float32)
    for j in range(terms.shape[-1]):
        acc = acc + terms[..., j]  # fp32, one rounding per block
    return acc


@pytest.mark.parametrize("m, n, k", [(70, 45, 96), (1, 3, 32), (33, 20, 160)])
def test_interpreted_results_are_within_the_hardware_bound(device, m, n, k):
    a, a_s = mx_operands(m, k, device, spread=64.0)
    b, b_s = mx_operands(n, k, device)
    bound = fp8_promote_bound(a, a_s, b, b_s)
    ieee = (k + 2) * 2.0**-24 * abs_product(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu())
    assert bound.shape == (m, n) and bound.dtype == torch.float64
    assert (bound.cpu() > ieee).all()  # the narrow accumulator's bound is the looser
    want = mx_gemm_reference(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu())
    for mma in ("fp8_promote", "emulate"):
        assert_within_bound(mx_gemm(a, a_s, b, b_s, mma=mma), want, bound)
    c16 = mx_gemm(a, a_s, b, b_s, out_dtype=torch.bfloat16, mma="fp8_promote")
    assert_within_bound(c16, want, fp8_promote_bound(a, a_s, b, b_s, out_dtype=torch.bfloat16))


def test_interpreted_grouped_results_are_within_the_hardware_bound(device):
    gen = torch.Generator().manual_seed(44)
    a, a_s, b, b_s, offsets = grouped_mx_operands(gen, [5, 0, 37, 1], 48, 96, device)
    offsets[-2:] = 40  # rows 40..42 belong to no expert (the last is empty): zeros, bound 0
    bound = fp8_promote_bound(a, a_s, b, b_s, offsets)
    assert (bound[40:] == 0).all() and (bound[:40] > 0).all()
    want = grouped_mx_gemm_reference(a, a_s, b, b_s, offsets)
    for mma in ("fp8_promote", "emulate"):
        assert_within_bound(grouped_mx_gemm(a, a_s, b, b_s, offsets, mma=mma), want, bound)


@pytest.mark.parametrize("mode", ["nearest", "truncate", "align"])
@pytest.mark.parametrize("m, n, k, spread", [(9, 7, 32, 4.0), (12, 10, 128, 64.0), (5, 16, 256, 1024.0)])
def test_a_simulated_14_bit_accumulator_is_within_the_hardware_bound(m, n, k, spread, mode):
    a, a_s = mx_operands(m, k, "cpu", spread=spread)
    b, b_s = mx_operands(n, k, "cpu")
    want = mx_gemm_reference(a, a_s, b, b_s)
    hopper = simulated_hopper(a, a_s, b, b_s, mode, HOPPER_FP8_ACCUMULATOR_BITS)
    assert_within_bound(hopper, want, fp8_promote_bound(a, a_s, b, b_s))
    if mode == "truncate":  # what the hardware bound is for: the fp32 bound rejects it
        ieee = (k + 2) * 2.0**-24 * abs_product(a, a_s, b, b_s)
        assert not ((hopper.double() - want).abs() <= ieee).all()


@pytest.mark.parametrize("mode", ["nearest", "truncate", "align"])
def test_a_simulated_grouped_14_bit_accumulator_is_within_the_hardware_bound(mode):
    gen = torch.Generator().manual_seed(3)
    a, a_s, b, b_s, offsets = grouped_mx_operands(gen, [6, 0, 11, 3], 9, 128, "cpu")
    hopper = torch.zeros(a.shape[0], b.shape[1])
    bounds = offsets.tolist()
    for e in range(b.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        hopper[lo:hi] = simulated_hopper(a[lo:hi], a_s[lo:hi], b[e], b_s[e], mode)
    want = grouped_mx_gemm_reference(a, a_s, b, b_s, offsets)
    assert_within_bound(hopper, want, fp8_promote_bound(a, a_s, b, b_s, offsets))


def test_the_hardware_bound_rejects_one_scale_for_the_whole_tile_and_a_lost_block():
    """Loose as it is, the bound still rejects block 0's scales applied to every K block, and
    a result missing one whole K block's contribution."""

    a, a_s = mx_operands(16, 128, "cpu")
    b, b_s = mx_operands(8, 128, "cpu")
    a_s, b_s = a_s.view(torch.uint8).clone(), b_s.view(torch.uint8).clone()
    a_s[:, 1] = a_s[:, 0] + 3  # the second block 8x the first's scale
    bound = fp8_promote_bound(a, a_s, b, b_s)
    want = mx_gemm_reference(a, a_s, b, b_s)
    one_a, one_b = a_s[:, :1].expand(-1, 4), b_s[:, :1].expand(-1, 4)
    with pytest.raises(AssertionError):
        assert_within_bound(mx_gemm_reference(a, one_a, b, one_b).float(), want, bound)
    for j in range(4):
        block = slice(32 * j, 32 * (j + 1))
        lost = want - mx_gemm_reference(a[:, block], a_s[:, j:j + 1], b[:, block], b_s[:, j:j + 1])
        with pytest.raises(AssertionError):
            assert_within_bound(lost.float(), want, bound)


@pytest.mark.parametrize("mode", ["truncate", "align"])
def test_the_hardware_bound_is_within_twice_an_attainable_error(mode):
    """Not loose: one block of products 448·448 then 31 of 15, each 15 below the 14-bit
    accumulator's last bit (16 at 448² ≈ 2^17.6), so truncation drops all 31 — an error over
    half the bound. A bound many times looser would pass lost blocks and wrong scales."""

    a = torch.tensor([[448.0] + [3.0] * 31]).to(E4M3)
    b = torch.tensor([[448.0] + [5.0] * 31]).to(E4M3)
    scale = torch.full((1, 1), 127, dtype=torch.uint8)  # 2^0
    want = mx_gemm_reference(a, scale, b, scale)
    hopper = simulated_hopper(a, scale, b, scale, mode)
    assert hopper.item() == 448.0**2 and want.item() == 448.0**2 + 31 * 15
    bound = fp8_promote_bound(a, scale, b, scale)
    assert bound / 2 < want - hopper <= bound
