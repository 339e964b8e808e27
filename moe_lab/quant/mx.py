"""The MX (microscaling) format: 8-bit elements that share one power-of-two scale per block.

An FP8 number alone covers too little range for a whole tensor. E4M3 — 1 sign bit,
4 exponent bits (bias 7), 3 mantissa bits — spans 2^-9 (its smallest subnormal) to 448
and has no infinity (the code ``S.1111.111`` is NaN); E5M2 — 5 exponent bits (bias 15),
2 mantissa bits — spans 2^-16 to 57,344 and keeps IEEE's infinities. A tensor whose values
range over 20 binades will not fit either. The OCP Microscaling (MX) v1.0 format fixes
this locally: consecutive runs of 32 values along one dimension (a *block*) share one
scale ``X = 2^e`` stored as E8M0 — an 8-bit biased exponent (bias 127, ``2^-127 .. 2^127``,
byte ``0xFF`` is NaN, no sign, no mantissa, no zero). Element ``i`` of a block is stored
as the FP8 value ``P_i ≈ V_i / X`` and read back as ``X * P_i``. Because ``X`` is a power of
two, scaling only shifts exponents; precision is lost once, when ``V_i / X`` is rounded
to FP8 (round-to-nearest-even, saturating at ±max). MXFP8 costs 8 + 8/32 = 8.25 bits per
value, and an outlier only hurts the 31 neighbours in its own block, not the whole tensor.

How the scale is chosen (``scale_mode``):

* ``"floor"`` — the OCP v1.0 rule ``X = 2^(floor(log2(amax)) - emax)``, where ``amax`` is
  the block's largest magnitude and ``emax`` the exponent of the element type's largest
  power of two (8 for E4M3: 2^8 = 256 ≤ 448 < 512; 15 for E5M2). ``amax / X`` then lies in
  ``[256, 512)``, so a block maximum whose mantissa exceeds 1.75 (448 = 1.75·2^8) is
  *clipped* to 448: the OCP rule saturates.
* ``"rceil"`` — NVIDIA's recipe (cuBLAS / Transformer Engine): ``X = 2^ceil(log2(amax /
  max))``, the fp32 quotient rounded *up* to a power of two (the ``cvt.rp`` instruction),
  so ``amax / X <= max`` and nothing saturates; the price is one binade less resolution
  for blocks that floor would have clipped.

Special values, as implemented here (and by torchao and Transformer Engine's recipe):
a block containing a NaN gets the NaN scale ``0xFF`` (all 32 values read back as NaN;
its elements are stored as NaN too); ±Inf has no E4M3 code, so an infinite value
saturates to ±max with the largest scale (floor: from Inf's exponent field, ``2^120`` for
E4M3; rceil: ``2^127``) — ``448 · 2^120`` is beyond float32's range, so it reads back as
±Inf, while the block's finite values read back finite (most of them as zero); an
all-zero block gets scale ``2^-127`` and zero elements; with ``rceil``, a block whose
``amax / max`` is at most ``2^-127`` is flushed to (signed) zero, as Transformer Engine
does. Where the blocked dimension is not a multiple of the block size, `quantize`
refuses with an error, or with ``pad=True`` pads it with zeros (zeros never change a
block's ``amax``) and drops the padding again on `MXTensor.dequantize`.

This module is the reference (plain PyTorch, readable as the definition):
`quantize` → `MXTensor` → `MXTensor.dequantize`; `fake_quantize` (quantize→dequantize
with a straight-through gradient, for training with emulated MXFP8) and `mx_error_stats`.
It agrees bit for bit with torchao's ``to_mx`` on the CPU, except in two corners where
torchao's CPU path is, we believe, wrong (see ``tests/lesson/quant/test_mx.py``): floor-mode blocks
with scale ``2^-127`` (torchao divides by ``2^-126`` but stores ``2^-127``, halving those
values), and rceil blocks whose ``amax / max`` lies within a few ulps above a power of two
(torchao takes ``ceil`` of a float ``log2`` that rounds down to the integer; the exact
rounding up used here is what the hardware's ``cvt.rp`` does). Inside a NaN-scaled block
the element bytes differ too (here all NaN; torchao's depend on the mode); both read back
as NaN. The Triton kernel in `moe_lab.kernels.mx_quantize` computes the same bits in integer
arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from moe_lab.checks import int_in, one_of, positive_int

Tensor = torch.Tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E8M0 = torch.float8_e8m0fnu
SCALE_MODES = ("floor", "rceil")
E8M0_NAN = 0xFF
BLOCK_SIZE = 32


@dataclass(frozen=True)
class ElemFormat:
    """One FP8 element type: name, mantissa bits, exponent bias, largest finite value and its
    codes (the exponent takes the ``7 - mbits`` bits left after the sign).

    ``emax_pow2`` is ``floor(log2(max_pos))`` (the floor rule's offset); ``max_code`` and
    ``nan_code`` are the (positive) byte codes of ``max_pos`` and of NaN.
    """

    name: str
    mbits: int
    bias: int
    max_pos: float
    emax_pow2: int
    max_code: int
    nan_code: int

    @property
    def min_normal_exp(self) -> int:
        """Exponent of the smallest normal value (``1 - bias``)."""
        return 1 - self.bias


ELEM_FORMATS: dict[torch.dtype, ElemFormat] = {
    # E4M3 "fn": finite only; 0x7F/0xFF is NaN, 0x7E = 1.75 * 2^8 = 448 the largest value.
    E4M3: ElemFormat("e4m3", mbits=3, bias=7, max_pos=448.0, emax_pow2=8,
                     max_code=0x7E, nan_code=0x7F),
    # E5M2: IEEE-like; 0x7C = Inf, 0x7D..0x7F NaN, 0x7B = 1.75 * 2^15 = 57344 the largest.
    E5M2: ElemFormat("e5m2", mbits=2, bias=15, max_pos=57344.0, emax_pow2=15,
                     max_code=0x7B, nan_code=0x7F),
}


def padded_size(size: int, block_size: int = BLOCK_SIZE) -> int:
    """``size`` rounded up to a multiple of ``block_size``."""
    return -(-size // block_size) * block_size


def exp2_int(e: Tensor) -> Tensor:
    """``2.0 ** e`` as float32, exactly, for integer ``e`` in ``[-127, 127]``: the E8M0 byte
    ``e + 127`` read as float32 (a normal number's exponent field, or the subnormal ``2^-127``)."""
    return (e + 127).to(torch.uint8).view(E8M0).to(torch.float32)


def block_scale_exponent(amax: Tensor, elem_dtype: torch.dtype, scale_mode: str) -> Tensor:
    """The biased E8M0 scale byte (int32 in ``[0, 255]``) for blocks with maxima ``amax``.

    ``amax``: float32, any shape (``|x|`` maxima, NaN where a block holds a NaN).
    ``floor``: ``clamp(floor(log2(amax)) - emax, -127, 127) + 127`` read off the exponent
    field (so ``amax = 0`` or subnormal gives ``0``; Inf gives ``128 - emax``).
    ``rceil``: ``clamp(ceil(log2(q)), -127, 127) + 127`` with ``q = amax / max_pos`` rounded
    to float32, the ceiling taken exactly (``torch.frexp``: what ``cvt.rp`` does); Inf gives 254.
    NaN gives 255 in both modes.
    """
    fmt = ELEM_FORMATS[elem_dtype]
    amax = amax.to(torch.float32)
    if scale_mode == "floor":
        # floor(log2(amax)) from the exponent field (-127 for 0), less the format's offset
        unbiased = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - fmt.emax_pow2
    else:  # rceil
        q = amax / fmt.max_pos
        # q = m * 2^e with m in [0.5, 1), exactly (subnormal q too): the ceiling of log2(q) is e,
        # or e - 1 when q is a power of two (m = 0.5). q = 0 takes the smallest scale.
        mantissa, exponent = torch.frexp(q)
        unbiased = torch.where(mantissa == 0.5, exponent - 1, exponent)
        unbiased = torch.where(q == 0, -127, unbiased)
        unbiased = torch.where(torch.isinf(q), 127, unbiased)
    biased = unbiased.clamp(-127, 127) + 127
    return torch.where(torch.isnan(amax), E8M0_NAN, biased).to(torch.int32)


def element_shift(biased: Tensor, scale_mode: str) -> Tensor:
    """The power of two ``s`` each element is divided by: ``biased - 127``, except that
    with ``rceil`` a scale byte of 0 divides by 1 (Transformer Engine's reciprocal rule,
    which flushes such blocks to zero). NaN blocks (255) get 0; their elements become NaN."""
    no_shift = (biased == E8M0_NAN) | ((biased == 0) & (scale_mode == "rceil"))
    return torch.where(no_shift, 0, biased - 127)


@dataclass
class MXTensor:
    """A tensor in MX format: FP8 elements and one E8M0 scale per block along ``dim``.

    ``data``: ``elem_dtype``, the input's shape with ``dim`` padded to a multiple of
    ``block_size`` (it may be a non-contiguous view, e.g. column-major for ``dim=0``);
    ``scale``: ``torch.float8_e8m0fnu``, the input's shape with ``dim`` replaced by the
    number of blocks; ``shape``: the unpadded shape; ``dim``: non-negative.
    """

    data: Tensor
    scale: Tensor
    elem_dtype: torch.dtype
    block_size: int
    dim: int
    shape: torch.Size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``X * P`` for every element, as ``dtype``, with the input's (unpadded) shape.

        Exact in float32 (an FP8 value times a power of two always fits); NaN-scaled
        blocks read back as NaN.
        """
        data = self.data.movedim(self.dim, -1).to(torch.float32)
        # E8M0 → float32 is exact: 2^(byte - 127), the subnormal 2^-127 for byte 0, NaN for 0xFF.
        factor = self.scale.movedim(self.dim, -1).to(torch.float32)
        blocks = data.reshape(*data.shape[:-1], factor.shape[-1], self.block_size)
        values = (blocks * factor.unsqueeze(-1)).reshape(data.shape)
        values = values[..., : self.shape[self.dim]].movedim(-1, self.dim)
        return values.to(dtype)


def quantize(
    x: Tensor,
    elem_dtype: torch.dtype = E4M3,
    block_size: int = BLOCK_SIZE,
    dim: int = -1,
    scale_mode: str = "floor",
    *,
    pad: bool = False,
) -> MXTensor:
    """Quantize ``x`` to MX: blocks of ``block_size`` consecutive values along ``dim``.

    Args:
        x: float32, bfloat16 or float16, any shape ``[..., n, ...]`` (``n`` along ``dim``).
        elem_dtype: ``torch.float8_e4m3fn`` (MXFP8 default) or ``torch.float8_e5m2``.
        block_size: values per shared scale (the MX spec: 32).
        dim: the dimension the blocks run along (a GEMM's reduction dimension).
        scale_mode: ``"floor"`` (OCP v1.0) or ``"rceil"`` (NVIDIA's recipe).
        pad: when ``n`` is not a multiple of ``block_size``, pad with zeros instead of
            raising.

    Returns:
        `MXTensor` with ``data`` ``[..., ceil(n / block_size) * block_size, ...]`` and
        ``scale`` ``[..., ceil(n / block_size), ...]``.
    """
    one_of(x.dtype, "x.dtype", (torch.float32, torch.bfloat16, torch.float16))
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension to block along, got a 0-d tensor")
    positive_int(block_size, "block_size")
    one_of(scale_mode, "scale_mode", SCALE_MODES)
    fmt = ELEM_FORMATS[one_of(elem_dtype, "elem_dtype", ELEM_FORMATS)]
    dim = int_in(dim, "dim", -x.dim(), x.dim() - 1) % x.dim()
    size = x.shape[dim]
    full = padded_size(size, block_size)
    if full != size and not pad:
        raise ValueError(f"x.shape[{dim}] = {size} must be a multiple of block_size={block_size} "
                         f"(or pass pad=True to pad it with zeros to {full})")
    rows = F.pad(x.movedim(dim, -1).to(torch.float32), (0, full - size))
    blocks = rows.reshape(*rows.shape[:-1], full // block_size, block_size)

    amax = blocks.abs().amax(dim=-1, keepdim=True)  # NaN if the block holds a NaN
    biased = block_scale_exponent(amax, elem_dtype, scale_mode)
    shift = element_shift(biased, scale_mode)
    # Multiplying by 2^-shift is exact in float32 (no result the FP8 cast keeps is
    # subnormal in float32); then saturate (Inf too) and round to nearest even once.
    scaled = (blocks * exp2_int(-shift)).clamp(-fmt.max_pos, fmt.max_pos)
    scaled = torch.where(biased == E8M0_NAN, math.nan, scaled)
    data = scaled.to(elem_dtype).reshape(rows.shape).movedim(-1, dim)
    scale = biased.squeeze(-1).to(torch.uint8).view(E8M0).movedim(-1, dim)
    return MXTensor(data, scale, elem_dtype, block_size, dim, x.shape)


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, dim: int, scale_mode: str, pad: bool,
                quantize_grad: bool) -> Tensor:
        ctx.args = (dim, scale_mode, pad, quantize_grad)
        return quantize(x, E4M3, BLOCK_SIZE, dim, scale_mode, pad=pad).dequantize(x.dtype)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        dim, scale_mode, pad, quantize_grad = ctx.args
        if quantize_grad and grad.numel():
            grad = quantize(grad, E4M3, BLOCK_SIZE, dim, scale_mode, pad=pad).dequantize(grad.dtype)
        return grad, None, None, None, None


def fake_quantize(x: Tensor, dim: int = -1, scale_mode: str = "rceil", *, pad: bool = False,
                  quantize_grad: bool = True) -> Tensor:
    """Quantize to MXFP8 (E4M3 elements, blocks of 32) along ``dim`` and straight back: same
    shape and dtype as ``x``.

    This is how MXFP8 training is emulated where there are no MX matrix units: a GEMM
    on ``fake_quantize``-d operands sees exactly the values the FP8 tensor cores would
    see, and accumulates in high precision as they do.

    Gradient: straight-through (``d out / d x = 1``; saturated values are not masked).
    With ``quantize_grad=True`` (default) the incoming gradient is itself quantized along
    the same ``dim`` — the recipe quantizes gradients to MXFP8 too (E4M3 in Transformer
    Engine's ``MXFP8BlockScaling``) before the backward GEMMs. For an activation whose
    ``dim`` is the reduction dim of the layer that consumes it, this is the copy the
    *previous* layer's data-gradient GEMM reads; the weight-gradient GEMM reads a copy
    quantized along the tokens instead, which this per-tensor op does not model
    (`moe_lab.quant.linear.MXLinear` does). Pass ``quantize_grad=False`` for weights:
    the recipe keeps weight gradients in high precision.

    Args:
        x: ``[..., n, ...]`` float32/bfloat16/float16; ``n`` (along ``dim``) a multiple of
            32 unless ``pad=True``.
    """
    return _FakeQuantize.apply(x, dim, scale_mode, pad, quantize_grad)


@torch.no_grad()
def mx_error_stats(
    x: Tensor,
    dim: int = -1,
    elem_dtype: torch.dtype = E4M3,
    block_size: int = BLOCK_SIZE,
    scale_mode: str = "rceil",
    *,
    pad: bool = True,
) -> dict:
    """How much quantizing ``x`` to MX along ``dim`` costs.

    Returns a dict of plain numbers over the finite elements of ``x``:
    ``rel_error`` = ||deq(q(x)) - x||₂ / ||x||₂ (0 for an all-zero ``x``; dominated by the
    largest values); ``mean_rel_error``: the mean of |deq(q(x)) - x| / |x| over non-zero
    values (every value counts alike: a value flushed to zero counts 1); ``max_abs_error``;
    ``saturated``: values with ``|x| / X > max_pos`` (clipped to ±max; only ``floor`` clips
    finite values); ``underflow``: non-zero values that read back as zero; ``numel``;
    ``nonfinite``: NaN/Inf elements; ``nan_block_values``: finite values lost because their
    block holds a NaN (both excluded from the other figures); ``bits_per_value``.
    """
    mx = quantize(x, elem_dtype, block_size, dim, scale_mode, pad=pad)
    fmt = ELEM_FORMATS[elem_dtype]
    xf = x.to(torch.float32)
    back = mx.dequantize(torch.float32)
    # The scale byte of each element's block, broadcast back to x's shape.
    scale = mx.scale.movedim(mx.dim, -1).view(torch.uint8).to(torch.int32)
    scale = scale.repeat_interleave(block_size, dim=-1)[..., : x.shape[mx.dim]]
    scale = scale.movedim(-1, mx.dim)
    finite = torch.isfinite(xf)
    in_nan_block = scale == E8M0_NAN
    valid = finite & ~in_nan_block
    diff = torch.where(valid, back - xf, 0.0)
    norm = torch.linalg.vector_norm(torch.where(valid, xf, 0.0).double()).item()
    err = torch.linalg.vector_norm(diff.double()).item()
    saturated = valid & (xf.abs() / exp2_int(element_shift(scale, scale_mode)) > fmt.max_pos)
    underflow = valid & (xf != 0) & (back == 0)
    nonzero = valid & (xf != 0)
    per_value = (diff.abs() / xf.abs())[nonzero]
    return {
        "rel_error": err / norm if norm > 0 else 0.0,
        "mean_rel_error": per_value.mean().item() if per_value.numel() else 0.0,
        "max_abs_error": diff.abs().max().item() if diff.numel() else 0.0,
        "saturated": int(saturated.sum().item()),
        "underflow": int(underflow.sum().item()),
        "numel": x.numel(),
        "nonfinite": int((~finite).sum().item()),
        "nan_block_values": int((finite & in_nan_block).sum().item()),
        # one byte per element and per scale
        "bits_per_value": (8 * (mx.data.numel() + mx.scale.numel()) / x.numel()) if x.numel() else 0.0,
    }
