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
from moe_lab.quant.mx import BLOCK_SIZE, E4M3, E8M0, ELEM_FORMATS, SCALE_MODES, MXTensor, padded_size

Tensor = torch.Tensor


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
    into MX blocks of 32 along ``AXIS``: each block's biased E8M0 scale (0..255) from the bits of
    its ``|x|`` maximum, each element's code `fp8_code` of ``x`` over the scale (a NaN scale: every
    element NaN)."""
    amax_bits = tl.max(bits & 0x7FFFFFFF, axis=AXIS)
    unbiased = (amax_bits >> 23) - 127 - EMAX_POW2
    if RCEIL:
        # ceil(log2(amax / max_pos)): one binade up when amax's mantissa exceeds 1.75.
        unbiased += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        # The one amax whose fp32 quotient amax/max_pos rounds down onto 2^-127.
        unbiased = tl.where(amax_bits == ((EMAX_POW2 << 23) | 0x600000) + 1, -127, unbiased)
        unbiased = tl.where(amax_bits == 0x7F800000, 127, unbiased)  # Inf: the largest scale
    scale = tl.minimum(tl.maximum(unbiased, -127), 127) + 127
    scale = tl.where(amax_bits > 0x7F800000, 255, scale)  # NaN
    shift = scale - 127
    if RCEIL:
        shift = tl.where(scale == 0, 0, shift)
    code = fp8_code(bits, tl.expand_dims(shift, AXIS), tl.expand_dims(scale == 255, AXIS),
                    MBITS, BIAS, MAX_CODE, NAN_CODE)
    return code, scale


@triton.jit
def _store_copy(code, scale, data_ptr, scale_ptr, b, r, c, cb, R, C_PAD, MX_BLOCK: tl.constexpr):
    """Stores one MX copy of a tile, blocked along ``c``: the codes at ``[b, r, c]`` of
    ``[B, R, C_PAD]``, the scales at ``[b, r, cb]`` of ``[B, R, C_PAD / 32]`` (``r``, ``c`` and ``cb``
    broadcast to the codes' and the scales' tile shapes)."""
    tl.store(data_ptr + (b * R + r) * C_PAD + c, code.to(tl.uint8), mask=(r < R) & (c < C_PAD))
    n_scales = C_PAD // MX_BLOCK
    tl.store(scale_ptr + (b * R + r) * n_scales + cb, scale.to(tl.uint8), mask=(r < R) & (cb < n_scales))


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
    bits = tl.load(ptrs, mask=inside, other=0).to(tl.int32)
    if IS_BF16:  # bf16 bits are the top half of the float32 bits
        bits = bits << 16

    if ROWWISE:
        n_kb: tl.constexpr = BLOCK_K // MX_BLOCK
        code, scale = mx_block_codes(tl.reshape(bits, (BLOCK_M, n_kb, MX_BLOCK)), 2, EMAX_POW2, RCEIL,
                                     MBITS, BIAS, MAX_CODE, NAN_CODE)
        offs_kb = pid_k * n_kb + tl.arange(0, n_kb)
        _store_copy(tl.reshape(code, (BLOCK_M, BLOCK_K)), scale, row_data_ptr, row_scale_ptr, pid_b,
                    offs_m[:, None], offs_k[None, :], offs_kb[None, :], M, K_PAD, MX_BLOCK)

    if COLWISE:  # blocks along M, stored transposed: rows K, columns M_PAD
        n_mb: tl.constexpr = BLOCK_M // MX_BLOCK
        code, scale = mx_block_codes(tl.reshape(bits, (n_mb, MX_BLOCK, BLOCK_K)), 1, EMAX_POW2, RCEIL,
                                     MBITS, BIAS, MAX_CODE, NAN_CODE)
        offs_mb = pid_m * n_mb + tl.arange(0, n_mb)
        _store_copy(tl.reshape(code, (BLOCK_M, BLOCK_K)), scale, col_data_ptr, col_scale_ptr, pid_b,
                    offs_k[None, :], offs_m[:, None], offs_mb[:, None], K, M_PAD, MX_BLOCK)


def format_constexprs(dtype: torch.dtype, rowwise: bool, colwise: bool,
                      elem_dtype: torch.dtype, scale_mode: str) -> dict[str, object]:
    """The kernel's constexprs besides the tile: input width, which copies, element format,
    scale rule."""
    fmt = ELEM_FORMATS[one_of(elem_dtype, "elem_dtype", ELEM_FORMATS)]
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
        rowwise, colwise: which copies to produce (neither: nothing is read).
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
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [M, K] or [B, M, K], got shape {tuple(x.shape)}")
    one_of(x.dtype, "x.dtype", (torch.float32, torch.bfloat16))
    one_of(scale_mode, "scale_mode", SCALE_MODES)
    constexprs = format_constexprs(x.dtype, rowwise, colwise, elem_dtype, scale_mode)  # checks elem_dtype
    check_device("x", x.device)
    *batch, m, k = x.shape
    m_pad, k_pad = padded_size(m), padded_size(k)
    for flag, name, size, padded in ((rowwise, "row", k, k_pad), (colwise, "column", m, m_pad)):
        if flag and size != padded and not pad:
            raise ValueError(f"x's {'K' if name == 'row' else 'M'} = {size} must be a multiple of "
                             f"{BLOCK_SIZE} for {name}-wise blocks (or pass pad=True)")
    row_data = x.new_empty((*batch, m, k_pad if rowwise else 0), dtype=torch.uint8)
    row_scale = x.new_empty((*batch, m, k_pad // BLOCK_SIZE if rowwise else 0), dtype=torch.uint8)
    col_data = x.new_empty((*batch, k, m_pad if colwise else 0), dtype=torch.uint8)
    col_scale = x.new_empty((*batch, k, m_pad // BLOCK_SIZE if colwise else 0), dtype=torch.uint8)
    if x.numel() and (rowwise or colwise):
        # Read raw bits, [B, M, K]: float32 as int32, bfloat16 as int16 (widened in the kernel).
        bits = x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32).reshape(-1, m, k)
        grid_m, grid_k = m_pad if colwise else m, k_pad if rowwise else k
        cfg = launch_config(grid_m, grid_k, INTERPRETED)
        grid = (triton.cdiv(grid_m, cfg.blocks["BLOCK_M"]), triton.cdiv(grid_k, cfg.blocks["BLOCK_K"]),
                len(bits))
        _mx_quantize_kernel[grid](bits, row_data, row_scale, col_data, col_scale, m, k, m_pad, k_pad,
                                  *bits.stride(), **constexprs, **cfg.blocks, num_warps=cfg.num_warps,
                                  num_stages=cfg.num_stages)
    row = MXTensor(row_data.view(elem_dtype), row_scale.view(E8M0), elem_dtype, BLOCK_SIZE, x.dim() - 1,
                   x.shape)
    col = MXTensor(col_data.mT.view(elem_dtype), col_scale.mT.view(E8M0), elem_dtype, BLOCK_SIZE,
                   x.dim() - 2, x.shape)
    return (row if rowwise else None), (col if colwise else None)
