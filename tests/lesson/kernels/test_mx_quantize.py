"""The Triton MX quantizer (moe_lab.kernels.mx_quantize) is bit-identical to the reference
``moe_lab.quant.mx.quantize``, row-wise and column-wise, on every kind of input.

The kernel runs where the ``device`` fixture says: compiled on CUDA, under the interpreter
on a CPU. There each program instance costs a Python round trip, so the tensors here are
small and the tiles large; every test runs in a few seconds on a CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from moe_lab.kernels.mx_quantize import launch_config, mx_quantize
from moe_lab.quant.mx import E4M3, E5M2, ELEM_FORMATS, quantize

MODES = ("floor", "rceil")


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_same_bits(kernel_mx, ref_mx) -> None:
    assert kernel_mx.data.shape == ref_mx.data.shape
    assert kernel_mx.scale.shape == ref_mx.scale.shape
    assert kernel_mx.dim == ref_mx.dim and kernel_mx.shape == ref_mx.shape
    assert torch.equal(u8(kernel_mx.scale), u8(ref_mx.scale))
    assert torch.equal(u8(kernel_mx.data), u8(ref_mx.data))


def both_ways(x: torch.Tensor, elem_dtype=E4M3, mode="rceil", pad=False) -> None:
    row, col = mx_quantize(x, elem_dtype=elem_dtype, scale_mode=mode, pad=pad)
    assert_same_bits(row, quantize(x, elem_dtype, 32, -1, mode, pad=pad))
    assert_same_bits(col, quantize(x, elem_dtype, 32, x.dim() - 2, mode, pad=pad))


def mixed(m: int, k: int, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """Normal values whose magnitude varies by up to 2^±30 between blocks, heavy tails,
    subnormals, NaN, ±Inf, ±0 and an all-zero tile."""
    x = torch.randn(m, k, generator=gen)
    x *= torch.randn(m // 32 + 1, k // 32 + 1, generator=gen).mul(10).exp2().repeat_interleave(
        32, 0).repeat_interleave(32, 1)[:m, :k]
    x[::7] = torch.randn(k, generator=gen) ** 7
    x[3, :32] = torch.randn(32, generator=gen) * 1e-40
    x[32:64, 32:64] = 0.0
    flat = x.view(-1)
    where = torch.randint(0, flat.numel(), (30,), generator=gen)
    flat[where] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45]).repeat(5)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("mode", MODES)
def test_rowwise_and_colwise_match_the_reference(dtype, elem_dtype, mode, device):
    gen = torch.Generator().manual_seed(11)
    both_ways(mixed(96, 160, gen, dtype).to(device), elem_dtype, mode)


@pytest.mark.parametrize(("dtype", "elem_dtype", "mode"),
                         [(torch.bfloat16, E4M3, "rceil"), (torch.float32, E5M2, "floor")])
def test_second_tiles_along_k_and_m(dtype, elem_dtype, mode, device, interpreted):
    # Blocks in a program's second tile along K and along M land where they belong.
    gen = torch.Generator().manual_seed(17)
    x = mixed(160, 320, gen, dtype).to(device)
    cfg = launch_config(160, 320, interpreted)
    assert triton.cdiv(160, cfg.blocks["BLOCK_M"]) > 1 and triton.cdiv(320, cfg.blocks["BLOCK_K"]) > 1
    both_ways(x, elem_dtype, mode)


def test_quantized_transpose_is_not_transpose_of_quantized(device):
    # The lesson behind producing both copies: blocks along rows and along columns are
    # different blocks, so the column-wise copy cannot be had by transposing the row-wise.
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(64, 64, generator=gen) * torch.randn(64, 1, generator=gen).exp2()).to(device)
    row, col = mx_quantize(x)
    assert not torch.equal(row.dequantize(), col.dequantize())
    assert not torch.equal(u8(row.data), u8(col.data))


@pytest.mark.parametrize("mode", MODES)
def test_every_bfloat16_bit_pattern(mode, device):
    # All 65,536 bfloat16 values, 32 to a block in a random order (so they meet scales
    # set by their neighbours), and every positive one alone in its block (amax = itself).
    gen = torch.Generator().manual_seed(13)
    everything = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    shuffled = everything[torch.randperm(everything.numel(), generator=gen)]
    x = shuffled.view(torch.bfloat16).reshape(256, 256).to(device)
    both_ways(x, E4M3, mode)
    alone = torch.zeros(2**15, 32, dtype=torch.int16)
    alone[:, 0] = torch.arange(2**15, dtype=torch.int32).to(torch.int16)
    alone = alone.view(torch.bfloat16).to(device)
    row, _ = mx_quantize(alone, colwise=False, scale_mode=mode)
    assert_same_bits(row, quantize(alone, E4M3, 32, -1, mode))


@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2])
def test_random_float32_bit_patterns(elem_dtype, device):
    # Uniform over all 2^32 patterns: every exponent, subnormals, NaN payloads, ±Inf.
    gen = torch.Generator().manual_seed(14)
    bits = torch.randint(-(2**31), 2**31, (128, 256), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32).to(device)
    x[:, ::3] = 0.0  # fewer NaNs per block, so most blocks are not NaN blocks
    for mode in MODES:
        both_ways(x, elem_dtype, mode)


@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2])
def test_rceil_boundaries(elem_dtype, device):
    # Block maxima at and a few ulps around max_pos * 2^k for every k, where rceil's
    # rounding up happens, including the tiny ones whose quotient is float32-subnormal.
    fmt = ELEM_FORMATS[elem_dtype]
    base = torch.tensor([fmt.max_pos * 2.0**k for k in range(-135, 110) if
                         fmt.max_pos * 2.0**k < 3e38 and fmt.max_pos * 2.0**k > 1e-44])
    steps = torch.arange(-3, 4, dtype=torch.int32)
    amax = (base.view(torch.int32)[:, None] + steps[None, :]).reshape(-1).view(torch.float32)
    x = torch.zeros(amax.numel(), 32, device=device)
    x[:, 0] = amax
    x[:, 1] = -amax / 3
    x[:, 2] = amax * 2.0**-12
    for mode in MODES:
        row, _ = mx_quantize(x, colwise=False, elem_dtype=elem_dtype, scale_mode=mode)
        assert_same_bits(row, quantize(x, elem_dtype, 32, -1, mode))


def test_every_e4m3_value_round_trips(device):
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    vals = codes[torch.isfinite(codes)]
    vals = torch.cat([vals, torch.zeros((-vals.numel()) % 31)]).reshape(-1, 31)
    x = torch.cat([torch.full((vals.shape[0], 1), 448.0), vals], dim=1)
    x = torch.cat([x, torch.zeros(32 - x.shape[0], 32)]).to(device)  # 32 rows for the column copy
    row, _ = mx_quantize(x, colwise=True)
    assert torch.equal(row.dequantize(), x)


def test_ragged_shapes_pad_or_refuse(device):
    gen = torch.Generator().manual_seed(15)
    x = mixed(70, 45, gen).to(device)
    both_ways(x, E4M3, "rceil", pad=True)
    row, col = mx_quantize(x, pad=True)
    assert row.data.shape == (70, 64) and col.data.shape == (96, 45)
    assert torch.equal(row.dequantize().nan_to_num(), quantize(x, pad=True, scale_mode="rceil")
                       .dequantize().nan_to_num())
    with pytest.raises(ValueError, match="K = 45 must be a multiple of 32"):
        mx_quantize(x)
    with pytest.raises(ValueError, match="M = 70 must be a multiple of 32"):
        mx_quantize(x[:, :32])
    row, col = mx_quantize(x[:, :32], colwise=False)  # the row copy alone needs K only
    assert col is None and row.data.shape == (70, 32)


def test_non_contiguous_and_batched_inputs(device):
    gen = torch.Generator().manual_seed(16)
    base = mixed(192, 96, gen).to(device)
    both_ways(base.t())  # column-major
    both_ways(base[::2, :64])  # strided rows
    both_ways(base[:, 32:].contiguous().view(6, 32, 64)[:, :, 32:])  # batched, sliced
    batched = mixed(96, 64, gen).to(device).reshape(3, 32, 64).transpose(1, 2)  # [3, 64, 32]
    both_ways(batched)
    both_ways(mixed(96, 64, gen, torch.bfloat16).to(device).reshape(3, 32, 64)[:, :, 16:48],
              pad=True)


def test_empty_inputs(device):
    for shape in ((0, 64), (64, 0), (2, 0, 32), (0, 32, 32)):
        x = torch.empty(shape, device=device)
        row, col = mx_quantize(x, pad=True)
        assert row.data.numel() == 0 or row.data.shape[-2] == 0 or x.shape[-1] == 0
        assert row.dequantize().shape == x.shape and col.dequantize().shape == x.shape


def test_layouts_are_gemm_friendly(device):
    x = torch.randn(64, 96, device=device)
    row, col = mx_quantize(x)
    assert row.data.is_contiguous() and row.scale.is_contiguous()
    # Column-wise copy: stored [K, M] contiguous (K-major for the weight-gradient GEMM).
    assert col.data.t().is_contiguous() and col.data.shape == (64, 96)
    assert col.scale.shape == (2, 96) and col.scale.t().is_contiguous()


@pytest.mark.parametrize(
    ("x", "kwargs", "message"),
    [
        (torch.randn(32, 32).half(), {}, "x.dtype must be one of"),
        (torch.randn(32), {}, r"x must be \[M, K\] or \[B, M, K\]"),
        (torch.randn(32, 32), {"scale_mode": "even"}, "scale_mode must be one of"),
        (torch.randn(32, 32), {"elem_dtype": torch.int8}, "elem_dtype must be one of"),
    ],
)
def test_bad_arguments(x, kwargs, message):
    with pytest.raises(ValueError, match=message):
        mx_quantize(x, **kwargs)


def test_no_copy_asked_for():
    assert mx_quantize(torch.randn(32, 32), rowwise=False, colwise=False) == (None, None)


def test_bench_mxfp8_runs_and_records():
    import argparse

    from moe_lab.workbench.benchmarks import mxfp8
    from moe_lab.workbench.measure import ledger

    parser = argparse.ArgumentParser()
    mxfp8.add_arguments(parser)
    before = len(ledger.read())
    result = mxfp8.run(parser.parse_args(["--size", "64", "128", "--attention", "1", "1", "64",
                                          "32"]))
    rows = result["rows"]
    assert {r["kind"] for r in rows} >= {"measured", "computed", "projection"}
    by = {(r["what"], r["provider"]): r["value"] for r in rows}
    assert by[("attention fwd bytes", "mxfp8, [1, 1, 64, 32]")] == pytest.approx(
        (3 * 64 * 32 * (1 + 1 / 32) + 2 * 64 * 32) / 2**20)
    assert by[("attention fwd time", "GB300 mxfp8")] < by[("attention fwd time", "GB300 bf16")]
    assert all(r["value"] > 0 for r in rows)
    assert len(ledger.read()) == before + len(rows)
    assert mxfp8.run(parser.parse_args(["--size", "32", "32", "--attention", "1", "1", "32", "32",
                                        "--no-record"]))["rows"]
    assert len(ledger.read()) == before + len(rows)
