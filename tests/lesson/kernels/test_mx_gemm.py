"""The MXFP8 GEMM (moe_lab.kernels.mx_gemm) against its reference, and what it compiles to.

On a CPU the kernel runs under Triton's interpreter with ``MX_MMA="emulate"``: the scaled
dot decomposed into an exact E4M3/E8M0 decode and an IEEE fp32 ``tl.dot``. The decoded
operands equal `MXTensor.dequantize`'s bit for bit, so the only difference from the
float64 reference is fp32 accumulation in another order, bounded by the standard
summation bound ``|C − C₆₄| ≤ γ · (|A|·|B|ᵀ)`` with ``γ = (K + 2)·2⁻²⁴`` (one rounding per
product and per addition, K terms). Where every product and partial sum is an integer
below 2²⁴, no order rounds at all, and the kernel must equal the reference exactly.
Hopper's FP8 ``wgmma`` sums each block in about 14 bits, outside that bound: its own is
`moe_lab.workbench.measure.mx_bounds` (tests/workbench/measure/test_mx_bounds.py).
(The compiled paths, ``MX_MMA="scaled"``/``"fp8_promote"``, are
tests/workbench/compile_report/test_specs.py's.)
"""

from __future__ import annotations

import pytest
import torch
from support import abs_product, grouped_mx_operands, mx_operands

from moe_lab.kernels.mx_gemm import mx_gemm, mx_gemm_reference
from moe_lab.quant.mx import E4M3, E8M0

E4M3_MAX_CODE, E4M3_NAN_CODE, E8M0_NAN = 0x7E, 0x7F, 0xFF


def assert_within_fp32_bound(c: torch.Tensor, a, a_s, b, b_s) -> None:
    ref = mx_gemm_reference(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu())
    absolute = abs_product(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu())
    k = a.shape[1]
    bound = (k + 2) * 2.0**-24 * absolute
    err = (c.cpu().double() - ref).abs()
    assert torch.isfinite(ref).all()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("m, n, k", [
    (70, 45, 96),    # M, N not multiples of the block, K a multiple of 32 but not of BLOCK_K
    (1, 3, 32),      # one row, K = 32: a single scale per row
    (130, 66, 256),  # several tiles in M and N, several K steps
    (64, 64, 64),    # exactly one tile
])
def test_matches_the_reference_within_the_fp32_summation_bound(device, m, n, k):
    a, a_s = mx_operands(m, k, device)
    b, b_s = mx_operands(n, k, device)
    assert_within_fp32_bound(mx_gemm(a, a_s, b, b_s), a, a_s, b, b_s)


def test_exact_where_no_summation_order_rounds(device):
    """Integer E4M3 values (1..15) with scales 2^0..2^3 per block: every product and partial
    sum is an integer below 2^24, so any correct tiling and scale indexing gives the
    reference's bits — a wrong scale index or mask cannot hide in a tolerance."""
    m, n, k = 67, 35, 160
    a = torch.randint(1, 16, (m, k)).float() * torch.where(torch.rand(m, k) < 0.5, -1.0, 1.0)
    b = torch.randint(1, 16, (n, k)).float()
    a_s = torch.randint(127, 131, (m, k // 32), dtype=torch.uint8)
    b_s = torch.randint(127, 131, (n, k // 32), dtype=torch.uint8)
    a8, b8 = a.to(E4M3), b.to(E4M3)
    assert torch.equal(a8.float(), a) and torch.equal(b8.float(), b)  # exact codes
    args = (a8.to(device), a_s.view(E8M0).to(device), b8.to(device), b_s.to(device))
    c = mx_gemm(*args)
    assert torch.equal(c.cpu().double(), mx_gemm_reference(a8, a_s, b8, b_s))


def _smallest_scale_mx_operands(m, n, k):
    """Integer codes 1..15 whose a-blocks alternate between scale bytes 0 (2^-127, the E8M0
    value that is an fp32 subnormal) and 100 (2^-27), against b-scales 2^100 and 2^0: every
    product is an integer times 2^-27, every partial sum exact, so the kernel must give the
    reference's bits. A decode of byte 0 to 0.0 (or to 2^-126) cannot hide here."""
    a = torch.randint(1, 16, (m, k)).float()
    b = torch.randint(1, 16, (n, k)).float() * torch.where(torch.rand(n, k) < 0.5, -1.0, 1.0)
    blocks = torch.arange(k // 32) % 2 == 0
    a_s = torch.where(blocks, 0, 100).to(torch.uint8).expand(m, -1).contiguous()
    b_s = torch.where(blocks, 227, 127).to(torch.uint8).expand(n, -1).contiguous()
    return a.to(E4M3), a_s, b.to(E4M3), b_s


def test_the_smallest_scale_byte_decodes_to_two_to_the_minus_127(device):
    a8, a_s, b8, b_s = _smallest_scale_mx_operands(37, 19, 128)
    want = mx_gemm_reference(a8, a_s, b8, b_s)
    only_small = mx_gemm_reference(a8[:, :32], a_s[:, :1], b8[:, :32], b_s[:, :1])
    assert (only_small != 0).all()  # the 2^-127 blocks contribute
    c = mx_gemm(a8.to(device), a_s.to(device), b8.to(device), b_s.to(device))
    assert torch.equal(c.cpu().double(), want)


def test_bf16_output_is_the_rounded_fp32_result(device):
    a, a_s = mx_operands(33, 64, device)
    b, b_s = mx_operands(17, 64, device)
    c32 = mx_gemm(a, a_s, b, b_s)
    c16 = mx_gemm(a, a_s, b, b_s, out_dtype=torch.bfloat16)
    assert c16.dtype == torch.bfloat16 and torch.equal(c16, c32.to(torch.bfloat16))


def test_zero_blocks_and_max_magnitude_codes(device):
    m, n, k = 40, 24, 128
    a, a_s = mx_operands(m, k, device)
    b, b_s = mx_operands(n, k, device)
    a, a_s, b, b_s = (t.view(torch.uint8).clone() for t in (a, a_s, b, b_s))
    a[:, 32:64] = 0  # a zero block, with the all-zero scale 2^-127
    a_s[:, 1] = 0
    a[5] = E4M3_MAX_CODE  # ±448 everywhere in row 5, scale 2^20 (products stay finite)
    a[5, ::3] |= 0x80
    a_s[5] = 127 + 20
    b[:, 96:] = E4M3_MAX_CODE | 0x80
    args = (a.view(E4M3), a_s, b.view(E4M3), b_s)
    assert_within_fp32_bound(mx_gemm(*args), *args)


def test_nan_codes_and_nan_scales_poison_their_row_or_column(device):
    m, n, k = 20, 12, 64
    a, a_s = (t.view(torch.uint8).clone() for t in mx_operands(m, k, device))
    b, b_s = (t.view(torch.uint8).clone() for t in mx_operands(n, k, device))
    a[3, 40] = E4M3_NAN_CODE | 0x80  # -NaN code in row 3
    b_s[7, 1] = E8M0_NAN  # NaN scale for column 7's second block
    c = mx_gemm(a.view(E4M3), a_s, b.view(E4M3), b_s).cpu()
    nan = torch.zeros(m, n, dtype=torch.bool)
    nan[3, :] = True
    nan[:, 7] = True
    assert torch.equal(torch.isnan(c), nan)
    ref = mx_gemm_reference(a.view(E4M3).cpu(), a_s.cpu(), b.view(E4M3).cpu(), b_s.cpu())
    assert torch.equal(torch.isnan(ref), nan)


def test_a_nan_scale_reaches_only_its_own_column_when_k_ends_mid_tile(device):
    """K = 96 ends a 64-wide K tile half way: the last tile's second scale slot lies past the
    row's scales, where the next row's first scale byte sits. A mask off by one there reads
    it, and a NaN there poisons the column before it (0 × NaN is NaN)."""
    m, n, k = 9, 6, 96
    a, a_s = (t.view(torch.uint8).clone() for t in mx_operands(m, k, device))
    b, b_s = (t.view(torch.uint8).clone() for t in mx_operands(n, k, device))
    b_s[4, 0] = E8M0_NAN  # column 4's first block; column 3's row of scales ends just before it
    a_s[6, 0] = E8M0_NAN  # row 6's first block; row 5's scales end just before it
    c = mx_gemm(a.view(E4M3), a_s, b.view(E4M3), b_s).cpu()
    nan = torch.zeros(m, n, dtype=torch.bool)
    nan[:, 4] = True
    nan[6, :] = True
    assert torch.equal(torch.isnan(c), nan)



def test_a_nan_code_reaches_only_its_own_column_when_k_ends_mid_tile(device):
    """The same for the codes: past a row's last code (K = 96, mid tile) lies the next row's
    first, and a K mask off by one reads it (times a masked zero: NaN where it is NaN)."""
    m, n, k = 9, 6, 96
    a, a_s = (t.view(torch.uint8).clone() for t in mx_operands(m, k, device))
    b, b_s = (t.view(torch.uint8).clone() for t in mx_operands(n, k, device))
    b[4, 0] = E4M3_NAN_CODE  # column 4's first code; column 3's codes end just before it
    a[6, 0] = E4M3_NAN_CODE  # row 6's first code; row 5's codes end just before it
    c = mx_gemm(a.view(E4M3), a_s, b.view(E4M3), b_s).cpu()
    nan = torch.zeros(m, n, dtype=torch.bool)
    nan[:, 4] = True
    nan[6, :] = True
    assert torch.equal(torch.isnan(c), nan)

def test_empty_rows_give_an_empty_result(device):
    a, a_s = mx_operands(0, 32, device)
    b, b_s = mx_operands(5, 32, device)
    assert mx_gemm(a, a_s, b, b_s).shape == (0, 5)


@pytest.mark.parametrize("change, message", [
    (lambda a, a_s, b, b_s: (a.float(), a_s, b, b_s), "a.dtype must be"),
    (lambda a, a_s, b, b_s: (a, a_s.view(E4M3), b, b_s), "a_scale.dtype must be"),
    (lambda a, a_s, b, b_s: (a[:, :48], a_s[:, :1], b, b_s), "K = 48 must be a positive multiple of 32"),
    (lambda a, a_s, b, b_s: (a, a_s[:, :1], b, b_s), r"a_scale must have shape \(8, 2\)"),
    (lambda a, a_s, b, b_s: (a, a_s, b[:, :32], b_s[:, :1]), "a and b must share K"),
    (lambda a, a_s, b, b_s: (a[None], a_s, b, b_s), "a must be 2-D"),
    (lambda a, a_s, b, b_s: (a, a_s, b, b_s.tolist()), "must be torch.Tensors"),
])
def test_bad_inputs_name_the_argument(change, message):
    a, a_s = mx_operands(8, 64, "cpu")
    b, b_s = mx_operands(4, 64, "cpu")
    with pytest.raises((ValueError, TypeError), match=message):
        mx_gemm(*change(a, a_s, b, b_s))


def test_bad_output_dtype():
    a, a_s = mx_operands(8, 64, "cpu")
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        mx_gemm(a, a_s, a, a_s, out_dtype=torch.float16)


# ------------------------------------------------------------------ grouped over experts


@pytest.mark.parametrize("counts", [
    [5, 0, 37, 1],          # an empty expert, ragged segments
    [0, 0, 70, 0],          # one expert takes every row
    [33],                   # one expert
    [0, 0, 0],              # no rows at all
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_grouped_mx_gemm_matches_its_reference(counts, out_dtype, device):
    from moe_lab.kernels.mx_gemm import grouped_mx_gemm, grouped_mx_gemm_reference

    gen = torch.Generator().manual_seed(sum(counts) + len(counts))
    a, a_s, b, b_s, offsets = grouped_mx_operands(gen, counts, 48, 96, device)
    got = grouped_mx_gemm(a, a_s, b, b_s, offsets, out_dtype=out_dtype)
    want = grouped_mx_gemm_reference(a, a_s, b, b_s, offsets)
    assert got.shape == want.shape and got.dtype == out_dtype
    tol = {"rtol": 1e-6, "atol": 1e-5} if out_dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-2}
    torch.testing.assert_close(got.double(), want, **tol)


def test_grouped_mx_gemm_decodes_the_smallest_scale_byte(device):
    from moe_lab.kernels.mx_gemm import grouped_mx_gemm, grouped_mx_gemm_reference

    a8, a_s, b8, b_s = _smallest_scale_mx_operands(40, 24, 96)
    b3 = torch.stack([b8.view(torch.uint8), b8.view(torch.uint8).flip(0)]).view(E4M3)
    b3_s = torch.stack([b_s, b_s])
    offsets = torch.tensor([0, 15, 40], dtype=torch.int32)
    args = [t.to(device) for t in (a8, a_s, b3, b3_s, offsets)]
    got = grouped_mx_gemm(*args)
    assert torch.equal(got.cpu().double(), grouped_mx_gemm_reference(*[t.cpu() for t in args]))


def test_grouped_mx_gemm_padding_rows_special_values_and_errors(device):
    from moe_lab.kernels.mx_gemm import grouped_mx_gemm, grouped_mx_gemm_reference

    gen = torch.Generator().manual_seed(7)
    a, a_s, b, b_s, offsets = grouped_mx_operands(gen, [10, 20, 6], 40, 64, device)
    offsets[-1] = 30  # rows 30..35 belong to no expert: zeros
    a_s = a_s.clone()
    a_s.view(torch.uint8)[3, 1] = 0xFF  # a NaN scale: that row's outputs are NaN, no other row's
    got = grouped_mx_gemm(a, a_s, b, b_s, offsets)
    assert torch.equal(got[30:], torch.zeros_like(got[30:]))
    assert torch.isnan(got[3]).all() and not torch.isnan(got[torch.arange(36, device=device) != 3]).any()
    want = grouped_mx_gemm_reference(a, a_s, b, b_s, offsets)
    keep = torch.arange(36, device=device) != 3
    torch.testing.assert_close(got[keep].double(), want[keep], rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="offsets must be an int32 tensor of shape"):
        grouped_mx_gemm(a, a_s, b, b_s, offsets.long())
    with pytest.raises(ValueError, match="b must be 3-D"):
        grouped_mx_gemm(a, a_s, b[0], b_s, offsets)
    with pytest.raises(ValueError, match="a and b must share K"):
        grouped_mx_gemm(a[:, :32], a_s[:, :1], b, b_s, offsets)


# ------------------------------------------------------------------ fp8_promote (Hopper's mode)
# `mx_dot(MX_MMA="fp8_promote")`: one E4M3 x E4M3 tl.dot per 32-wide K block (fp32 out),
# scaled by its two E8M0 scales in fp32. Products and power-of-two scalings are exact, so it
# is the same K exact terms summed in another fp32 order: the bound above holds for it too.


@pytest.mark.parametrize("m, n, k", [(70, 45, 96), (1, 3, 32), (64, 64, 64), (33, 20, 160)])
def test_fp8_promote_is_within_the_fp32_summation_bound(device, m, n, k):
    a, a_s = mx_operands(m, k, device, spread=64.0)  # 13 binades between blocks
    b, b_s = mx_operands(n, k, device)
    c = mx_gemm(a, a_s, b, b_s, mma="fp8_promote")
    assert_within_fp32_bound(c, a, a_s, b, b_s)
    # Both modes within the bound of the exact product: within twice it of each other.
    err = (c - mx_gemm(a, a_s, b, b_s, mma="emulate")).abs().cpu().double()
    assert (err <= 2 * (k + 2) * 2.0**-24 * abs_product(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu())).all()


def test_the_bound_rejects_one_scale_for_the_whole_tile(device):
    """A plausible fp8_promote bug, block 0's scales applied to every K block, fails the check."""
    a, a_s = mx_operands(16, 64, device)
    b, b_s = mx_operands(8, 64, device)
    a_s, b_s = a_s.view(torch.uint8).clone(), b_s.view(torch.uint8).clone()
    a_s[:, 1] = a_s[:, 0] + 3  # the second block 8x the first's scale
    one_a, one_b = a_s[:, :1].expand(-1, 2).cpu(), b_s[:, :1].expand(-1, 2).cpu()
    wrong = mx_gemm_reference(a.cpu(), one_a, b.cpu(), one_b)
    with pytest.raises(AssertionError):
        assert_within_fp32_bound(wrong.float(), a, a_s, b, b_s)


def test_fp8_promote_special_values_non_contiguous_and_grouped(device):
    from moe_lab.kernels.mx_gemm import grouped_mx_gemm, grouped_mx_gemm_reference

    m, n, k = 20, 12, 128
    a, a_s = (t.view(torch.uint8).clone() for t in mx_operands(m, k, device))
    b, b_s = (t.view(torch.uint8).clone() for t in mx_operands(n, k, device))
    a_s[:, 1] = 0  # 2^-127: the block's partial underflows to (almost) nothing, as emulated
    b_s[7, 2] = E8M0_NAN  # (no NaN code: the interpreter's float8 dot reads 0x7F as 480)
    args = (a.view(E4M3), a_s, b.view(E4M3), b_s)
    got, want = mx_gemm(*args, mma="fp8_promote"), mx_gemm(*args, mma="emulate")
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got).sum() == m
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=2 * (k + 2) * 2.0**-24, atol=0)
    bt = b.view(E4M3).T.contiguous().T  # a column-major view: the wrapper copies it
    assert torch.equal(mx_gemm(a.view(E4M3), a_s, bt, b_s, mma="fp8_promote").isnan(), got.isnan())
    gen = torch.Generator().manual_seed(34)
    a, a_s, b, b_s, offsets = grouped_mx_operands(gen, [5, 0, 37, 1], 48, 96, device)
    got = grouped_mx_gemm(a, a_s, b, b_s, offsets, mma="fp8_promote")
    torch.testing.assert_close(got.double(), grouped_mx_gemm_reference(a, a_s, b, b_s, offsets),
                               rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_every_tile_order_gives_the_same_bits(device, group, monkeypatch):
    """The dense GEMM walks its tiles in grouped order (`dense_group` picks ``GROUP_M``); at any
    group — N fastest, groups that do not divide the 5 row tiles, one group of them all — every
    output tile is computed once and lands where it belongs: integer values, exact sums."""
    import moe_lab.kernels.mx_gemm as mg
    monkeypatch.setattr(mg, "dense_group", lambda *args: group)
    m, n, k = 300, 150, 96  # 5 x 3 tiles of 64 under the interpreter, both edges partial
    gen = torch.Generator().manual_seed(group)
    a = torch.randint(1, 16, (m, k), generator=gen).float()
    b = torch.randint(1, 16, (n, k), generator=gen).float() * -1
    a_s = torch.randint(127, 130, (m, k // 32), dtype=torch.uint8, generator=gen)
    b_s = torch.randint(127, 130, (n, k // 32), dtype=torch.uint8, generator=gen)
    a8, b8 = a.to(E4M3), b.to(E4M3)
    c = mg.mx_gemm(a8.to(device), a_s.to(device), b8.to(device), b_s.to(device))
    assert torch.equal(c.cpu().double(), mx_gemm_reference(a8, a_s, b8, b_s))


def test_dense_group_fits_its_a_panels_in_the_budget():
    from moe_lab.kernels.common import DENSE_GROUP_BYTES, dense_group
    panel = 128 * 7168  # one row tile's A panel of E4M3 bytes
    g = dense_group(8192, 7168, 128, 1)
    assert g & (g - 1) == 0 and g * panel <= DENSE_GROUP_BYTES < 2 * g * panel
    assert dense_group(8192, 7168, 128, 2) == g // 2  # bf16 panels are twice the bytes
    assert dense_group(100, 7168, 128, 1) == 1  # one row tile
    assert dense_group(3 * 128, 64, 128, 1) == 2  # 3 row tiles, all fit: the power of two below
    assert dense_group(1 << 20, 1 << 30, 128, 1) == 1  # not one panel fits: N fastest
    assert dense_group(0, 64, 128, 1) == 1
