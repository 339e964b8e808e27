"""Triton MXFP8 quantizer: one read of a tensor, row-wise and column-wise MX copies out.

A GEMM wants its operands blocked along the dim it reduces over: a linear layer's forward needs
``X`` in MX blocks along rows, its weight gradient along columns. The two copies are not
transposes of each other (each block has its own scale), and producing both from one read of
``X`` halves the bytes of a pass per direction — the kernel is memory bound, so that is the whole
game. Each program (grid: ``(cdiv(M, BLOCK_M), cdiv(K, BLOCK_K), B)``) loads one tile, reshapes
it into 32-element blocks each way, and writes the E8M0 scales and the FP8 codes; the
column-wise copy is written transposed, as the weight-gradient GEMM reads it.

The key trick: every step is integer arithmetic on the float32 bit pattern — ``|x|`` is ``bits &
0x7FFFFFFF`` (whose integer order is the float order, NaN above Inf), the scale is the block
maximum's exponent field (plus one under ``rceil`` when its mantissa exceeds 1.75), the code the
significand shifted right with round-to-nearest-even by hand. So the bits do not depend on how a
device rounds or casts to FP8 (Triton's interpreter rounds float8 casts wrongly when the rounding
carries into the exponent): the same on a GPU and a CPU, and equal to `moe_lab.quant.mx.quantize`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_lab.checks import one_of
from moe_lab.kernels.common import INTERPRETED, check_device
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.quant.mx import (
    BLOCK_SIZE,
    E4M3,
    E8M0,
    SCALE_MODES,
    MXTensor,
    elem_format,
    padded_size,
)

Tensor = torch.Tensor
KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def mx_scale_byte(amax_bits, EMAX_POW2: tl.constexpr, RCEIL: tl.constexpr):
    """Biased E8M0 scale (int32 0..255) from the int32 bits of a block's ``|x|`` maximum."""
    exp_field = amax_bits >> 23
    unbiased = exp_field - 127 - EMAX_POW2
    if RCEIL:
        # ceil(log2(amax / max_pos)): one binade up when amax's mantissa exceeds 1.75.
        unbiased += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        # The one amax whose fp32 quotient amax/max_pos rounds down onto 2^-127.
        unbiased = tl.where(amax_bits == ((EMAX_POW2 << 23) | 0x600000) + 1, -127, unbiased)
    unbiased = tl.minimum(tl.maximum(unbiased, -127), 127)
    biased = unbiased + 127
    if RCEIL:
        biased = tl.where(amax_bits == 0x7F800000, 254, biased)
    return tl.where(amax_bits > 0x7F800000, 255, biased)


@triton.jit
def fp8_code(bits, shift, nan_block, MBITS: tl.constexpr, BIAS: tl.constexpr,
             MAX_CODE: tl.constexpr, NAN_CODE: tl.constexpr):
    """FP8 byte (int32 0..255) of ``x * 2^-shift``, rounded to nearest even, saturating.

    ``bits``: int32 bit patterns of float32 ``x``; ``shift``: int32, broadcastable;
    ``nan_block``: True where the block's scale is NaN (every element becomes NaN).
    """
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp_field = mag >> 23
    sig = tl.where(exp_field == 0, mag & 0x7FFFFF, (mag & 0x7FFFFF) | 0x800000)
    # x = sig * 2^e0 after the shift; sig < 2^24 converts to float exactly, and the
    # float's exponent field is floor(log2(sig)) + 127.
    e0 = tl.where(exp_field == 0, -126, exp_field - 127) - 23 - shift
    lead = ((sig.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp_v = lead + e0
    exp_q = tl.maximum(exp_v, 1 - BIAS)  # subnormal FP8 values share the min-normal quantum
    drop = exp_q - MBITS - e0  # bits of sig below the FP8 quantum
    left = tl.minimum(tl.maximum(-drop, 0), 8)
    right = tl.minimum(tl.maximum(drop, 0), 25)
    kept = (sig << left) >> right
    rem = sig & ((1 << right) - 1)
    half = (1 << right) >> 1
    round_up = (right > 0) & ((rem > half) | ((rem == half) & ((kept & 1) == 1)))
    kept += round_up.to(tl.int32)
    # Normal: ((biased exponent - 1) << MBITS) + kept, where kept includes the hidden
    # bit, so a carry out of the mantissa bumps the exponent by itself.
    code = ((exp_q + BIAS - 1) << MBITS) + kept
    code = tl.where(sig == 0, 0, tl.minimum(code, MAX_CODE))
    code = tl.where(exp_field == 255, MAX_CODE, code)  # Inf saturates (NaN set below)
    code = tl.where(mag > 0x7F800000, NAN_CODE, code | sign)
    return tl.where(nan_block, NAN_CODE, code)


@triton.jit
def mx_block_codes(bits, AXIS: tl.constexpr, EMAX_POW2: tl.constexpr, RCEIL: tl.constexpr,
                   MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, NAN_CODE: tl.constexpr):
    """``(codes, scales)`` (int32) of a 3-D tile of float32 bit patterns ``bits`` (int32) cut
    into MX blocks of 32 along ``AXIS``: each block's E8M0 scale from its ``|x|`` maximum
    (`mx_scale_byte`), each element's code `fp8_code` of ``x`` over the scale (a NaN scale: every
    element NaN)."""
    scale = mx_scale_byte(tl.max(bits & 0x7FFFFFFF, axis=AXIS), EMAX_POW2, RCEIL)
    shift = scale - 127
    if RCEIL:
        shift = tl.where(scale == 0, 0, shift)
    code = fp8_code(bits, tl.expand_dims(shift, AXIS), tl.expand_dims(scale == 255, AXIS),
                    MBITS, BIAS, MAX_CODE, NAN_CODE)
    return code, scale


@triton.jit
def _mx_quantize_kernel(
    x_ptr, row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr,
    M, K, M_PAD, K_PAD,
    stride_xb, stride_xm, stride_xk,
    IS_BF16: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, MX_BLOCK: tl.constexpr,
    EMAX_POW2: tl.constexpr, RCEIL: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
):
    # x: [B, M, K] (any strides); row data [B, M, K_PAD] u8, row scales [B, M, K_PAD/32];
    # col data [B, K, M_PAD] u8 (transposed), col scales [B, K, M_PAD/32].
    # Offsets in int64: an expert-weight stack ([256, 7168, 2048] is 3.7e9 elements) and its
    # codes pass 2^31 elements, where int32 offset arithmetic would wrap around.
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    ptrs = x_ptr + pid_b * stride_xb + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    if IS_BF16:  # bf16 bits are the top half of the float32 bits
        bits = tl.load(ptrs, mask=inside, other=0).to(tl.int32) << 16
    else:
        bits = tl.load(ptrs, mask=inside, other=0)

    if ROWWISE:
        n_kb: tl.constexpr = BLOCK_K // MX_BLOCK
        code, scale = mx_block_codes(tl.reshape(bits, (BLOCK_M, n_kb, MX_BLOCK)), 2, EMAX_POW2, RCEIL,
                                     MBITS, BIAS, MAX_CODE, NAN_CODE)
        code = tl.reshape(code, (BLOCK_M, BLOCK_K))
        out_ok = (offs_m[:, None] < M) & (offs_k[None, :] < K_PAD)
        out = row_data_ptr + (pid_b * M + offs_m[:, None]) * K_PAD + offs_k[None, :]
        tl.store(out, code.to(tl.uint8), mask=out_ok)
        offs_kb = pid_k * n_kb + tl.arange(0, n_kb)
        n_scales = K_PAD // MX_BLOCK
        s_ok = (offs_m[:, None] < M) & (offs_kb[None, :] < n_scales)
        s_out = row_scale_ptr + (pid_b * M + offs_m[:, None]) * n_scales + offs_kb[None, :]
        tl.store(s_out, scale.to(tl.uint8), mask=s_ok)

    if COLWISE:
        n_mb: tl.constexpr = BLOCK_M // MX_BLOCK
        code, scale = mx_block_codes(tl.reshape(bits, (n_mb, MX_BLOCK, BLOCK_K)), 1, EMAX_POW2, RCEIL,
                                     MBITS, BIAS, MAX_CODE, NAN_CODE)
        code = tl.reshape(code, (BLOCK_M, BLOCK_K))
        out_ok = (offs_m[:, None] < M_PAD) & (offs_k[None, :] < K)
        out = col_data_ptr + (pid_b * K + offs_k[None, :]) * M_PAD + offs_m[:, None]
        tl.store(out, code.to(tl.uint8), mask=out_ok)
        offs_mb = pid_m * n_mb + tl.arange(0, n_mb)
        n_scales = M_PAD // MX_BLOCK
        s_ok = (offs_mb[:, None] < n_scales) & (offs_k[None, :] < K)
        s_out = col_scale_ptr + (pid_b * K + offs_k[None, :]) * n_scales + offs_mb[:, None]
        tl.store(s_out, scale.to(tl.uint8), mask=s_ok)


def format_constexprs(dtype: torch.dtype, rowwise: bool, colwise: bool,
                      elem_dtype: torch.dtype, scale_mode: str) -> dict[str, object]:
    """The kernel's constexprs besides the tile: input width, which copies, element format,
    scale rule."""
    fmt = elem_format(elem_dtype)
    return {
        "IS_BF16": dtype == torch.bfloat16, "ROWWISE": rowwise, "COLWISE": colwise,
        "MX_BLOCK": BLOCK_SIZE, "EMAX_POW2": fmt.emax_pow2, "RCEIL": scale_mode == "rceil",
        "MBITS": fmt.mbits, "BIAS": fmt.bias, "MAX_CODE": fmt.max_code, "NAN_CODE": fmt.nan_code,
    }


def launch_config(m: int, k: int, interpreted: bool) -> LaunchConfig:
    """Tile and warps for quantizing an ``[m, k]`` slice (``m``, ``k`` as the grid covers them).

    Interpreted: large tiles, since each program instance costs a Python round trip.
    Compiled: 2,048 elements per tile, ``BLOCK_K`` no wider than ``k`` rounds up to (so a
    64-wide head_dim does not leave half the tile masked) and at most 64, ``BLOCK_M`` taking
    the rest; 8 warps, 8 elements a thread. The kernel only moves bytes, so what matters is
    how many loads an SM keeps in flight, and every element a thread owns holds several
    integer temporaries on its way to two codes: at 32 elements a thread the tile used every
    register a thread may have, which left room for one block per SM; at 8, several blocks
    fit (`python -m moe_lab compile` shows registers and blocks per SM). One tile per
    program and no loop, so nothing to pipeline: one stage.
    """
    if interpreted:
        bm = min(128, max(32, triton.next_power_of_2(m)))
        bk = min(256, max(32, triton.next_power_of_2(k)))
        return LaunchConfig({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=4, num_stages=1)
    bk = min(64, max(32, triton.next_power_of_2(k)))
    return LaunchConfig({"BLOCK_M": 2048 // bk, "BLOCK_K": bk}, num_warps=8, num_stages=1)


def mx_quantize(
    x: Tensor,
    *,
    rowwise: bool = True,
    colwise: bool = True,
    elem_dtype: torch.dtype = E4M3,
    scale_mode: str = "rceil",
    pad: bool = False,
) -> tuple[MXTensor | None, MXTensor | None]:
    """MX copies of ``x`` blocked along its last dim (row-wise) and along dim -2
    (column-wise), from one read of ``x``.

    Args:
        x: ``[M, K]`` or ``[B, M, K]``, float32 or bfloat16, any strides, on the device
            Triton runs on (CUDA; any device where the kernels run interpreted).
        rowwise, colwise: which copies to produce (at least one).
        elem_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale_mode: ``"floor"`` or ``"rceil"``.
        pad: zero-pad ``K`` (row-wise) / ``M`` (column-wise) to a multiple of 32 instead
            of raising.

    Returns:
        ``(row, col)``: ``row`` equals ``quantize(x, dim=-1)`` bit for bit (data
        ``[.., M, K32]`` contiguous, scale ``[.., M, K32/32]``); ``col`` equals
        ``quantize(x, dim=-2)`` (data ``[.., M32, K]`` viewed from column-major storage
        ``[.., K, M32]``, scale ``[.., M32/32, K]``). ``None`` for a copy not asked for.
    """
    _check_quantize(x, rowwise, colwise, elem_dtype, scale_mode, pad)
    x3 = x.unsqueeze(0) if x.dim() == 2 else x
    nb, m, k = x3.shape
    m_pad, k_pad = padded_size(m), padded_size(k)
    # Without a batch dim when x has none: the kernel writes [nb, ...] contiguous either way.
    batch, dev = x.shape[:-2], x.device
    row_data = torch.empty((*batch, m, k_pad if rowwise else 0), dtype=torch.uint8, device=dev)
    row_scale = torch.empty((*batch, m, k_pad // BLOCK_SIZE if rowwise else 0), dtype=torch.uint8, device=dev)
    col_data = torch.empty((*batch, k, m_pad if colwise else 0), dtype=torch.uint8, device=dev)
    col_scale = torch.empty((*batch, k, m_pad // BLOCK_SIZE if colwise else 0), dtype=torch.uint8, device=dev)
    if x3.numel():
        # Read raw bits: float32 as int32, bfloat16 as int16 (widened in the kernel).
        bits = x3.view(torch.int16) if x.dtype == torch.bfloat16 else x3.view(torch.int32)
        grid_m, grid_k = m_pad if colwise else m, k_pad if rowwise else k
        cfg = launch_config(grid_m, grid_k, INTERPRETED)
        grid = (triton.cdiv(grid_m, cfg.blocks["BLOCK_M"]),
                triton.cdiv(grid_k, cfg.blocks["BLOCK_K"]), nb)
        _mx_quantize_kernel[grid](
            bits, row_data, row_scale, col_data, col_scale,
            m, k, m_pad, k_pad, *bits.stride(),
            **format_constexprs(x.dtype, rowwise, colwise, elem_dtype, scale_mode),
            **cfg.blocks, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    row = col = None
    if rowwise:
        row = MXTensor(row_data.view(elem_dtype), row_scale.view(E8M0), elem_dtype, BLOCK_SIZE, x.dim() - 1,
                       x.shape, scale_mode)
    if colwise:  # the codes and scales were stored column-major: the transposed views
        col = MXTensor(col_data.transpose(-1, -2).view(elem_dtype), col_scale.transpose(-1, -2).view(E8M0),
                       elem_dtype, BLOCK_SIZE, x.dim() - 2, x.shape, scale_mode)
    return row, col


def _check_quantize(x: Tensor, rowwise: bool, colwise: bool, elem_dtype: torch.dtype,
                    scale_mode: str, pad: bool) -> None:
    """`mx_quantize`'s door: ``x``'s type, rank, dtype and device, the options, and the
    blocked dims' sizes (multiples of `BLOCK_SIZE` unless ``pad``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [M, K] or [B, M, K], got shape {tuple(x.shape)}")
    one_of(x.dtype, "x.dtype", KERNEL_INPUT_DTYPES)
    one_of(scale_mode, "scale_mode", SCALE_MODES)
    if not (rowwise or colwise):
        raise ValueError("at least one of rowwise and colwise must be True, got both False")
    elem_format(elem_dtype)  # raises on an unsupported element dtype
    check_device("x", x.device)
    m, k = x.shape[-2:]
    for flag, name, size in ((rowwise, "K", k), (colwise, "M", m)):
        if flag and size != padded_size(size) and not pad:
            raise ValueError(
                f"x's {name} = {size} must be a multiple of {BLOCK_SIZE} for "
                f"{'row' if name == 'K' else 'column'}-wise blocks (or pass pad=True)"
            )

