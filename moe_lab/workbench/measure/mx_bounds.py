"""How far Hopper's MXFP8 GEMM may be from the exact product: the bound its results are
checked against (`scripts/gpu_check.py`, the MXFP8 GEMM tests).

`moe_lab.kernels.mx_gemm.mx_dot` in ``MX_MMA="fp8_promote"`` (sm_90) runs one FP8 ``wgmma``
per 32-wide K block and adds each block's partial to an fp32 accumulator. Under Triton's
interpreter every dot is IEEE fp32, and the fp32 summation bound holds; on the hardware
the ``wgmma`` sums a block's products in a narrower accumulator, and `fp8_promote_bound`
says how much that may cost.
"""

from __future__ import annotations

import torch

from moe_lab.quant.mx import BLOCK_SIZE, E4M3

Tensor = torch.Tensor

# Significand bits Hopper's FP8 wgmma keeps while it sums products: "around 14 bits"
# (DeepSeek-V3 Technical Report, arXiv:2412.19437, "Increasing Accumulation Precision",
# measured on H800), read as 14 significand bits, the leading one included (the reading
# with the larger error). `fp8_promote_bound` takes it as the width of the per-block sum.
HOPPER_FP8_ACCUMULATOR_BITS = 14


def _abs_product(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor) -> Tensor:
    """``|dequant(a)| · |dequant(b)|ᵀ`` in float64: per output, the sum over K of every
    product's magnitude (each block's ``Σ|aᵢbᵢ|`` times its two scales, summed over blocks)."""
    def magnitudes(codes: Tensor, scales: Tensor) -> Tensor:  # [rows, K] float64, exact
        values = (codes.view(torch.uint8) & 0x7F).view(E4M3).double()  # sign cleared; 0x7F stays NaN
        s = scales.view(torch.uint8).double()
        scale = torch.where(s == 0xFF, float("nan"), torch.exp2(s - 127))
        return (values.unflatten(-1, (-1, BLOCK_SIZE)) * scale[..., None]).flatten(-2)

    return magnitudes(a, a_scale) @ magnitudes(b, b_scale).T


def fp8_promote_bound(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offsets: Tensor | None = None,
                      *, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """Elementwise bound on ``|hardware fp8_promote result − exact product|``: float64 ``[M, N]``.

    Arguments as `mx_gemm`'s (``offsets`` given: as `grouped_mx_gemm`'s, ``b`` ``[E, N, K]``;
    rows of no expert bound 0, their output being exact zeros). ``out_dtype``: the result's
    dtype (float32 or bfloat16, as `mx_gemm` writes). ``p``, the significand bits the FP8
    ``wgmma`` sums in, is `HOPPER_FP8_ACCUMULATOR_BITS`.

    Derived, per output and per 32-wide K block ``j`` with terms ``yᵢ = aᵢbᵢ`` (codes) and
    scale ``s_j = 2^(sa + sb - 254)``; ``u_p = 2^(1-p)``, ``γ_p(n) = n·u_p / (1 - n·u_p)``:

    1. Every product of two E4M3 values is exact (8 significand bits ≤ p).
    2. Model of the ``wgmma``: its sum keeps p bits. Either each addition rounds or truncates
       to p bits (Higham's recursive-summation bound, Accuracy and Stability of Numerical
       Algorithms 4.2: ``γ_p(31)``), or the products are aligned to the largest and cut below
       its p-th bit, as Fasi, Higham, Mikaitis & Pranesh, "Numerical behavior of NVIDIA tensor
       cores" (PeerJ Comput. Sci. 2021) found on earlier tensor cores (at most 32 cuts, each
       under ``u_p · max|·|``). Both: ``|e_j| ≤ γ_p(32) · Σ|yᵢ|``.
    3. The partial to fp32 (p ≤ 24) and times ``s_j`` are exact (barring fp32 over/underflow).
    4. The ``K/32`` scaled partials summed in fp32 (``u = 2^-24``): within
       ``γ(K/32) · Σ_j s_j |partial_j| ≤ γ(K/32) · (1 + γ_p(32)) · Σ_j s_j Σ|yᵢ|``.
    5. The store rounds to ``out_dtype`` (bf16: ``2^-8`` of the result; fp32: already there).

    Every term is a multiple of ``Σ_j s_j Σ|yᵢ| = (|A|·|B|ᵀ)``, so the bound is one factor
    times it, about ``32 · 2^(1-p)`` (``2^-8`` at p = 14): a worst case, which a truncating
    accumulator can come within a factor two of; a wrong scale or a lost block, moving the
    result by a block's whole sum, falls outside it.
    """
    k = a.shape[-1]
    if offsets is None:
        magnitude = _abs_product(a, a_scale, b, b_scale)
    else:
        bounds = [min(max(int(v), 0), a.shape[0]) for v in offsets.tolist()]
        magnitude = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
        for e in range(b.shape[0]):  # each expert's rows against its weight; no expert's: 0
            lo, hi = bounds[e], max(bounds[e], bounds[e + 1])
            magnitude[lo:hi] = _abs_product(a[lo:hi], a_scale[lo:hi], b[e], b_scale[e])

    def gamma(n: int, unit: float) -> float:
        return n * unit / (1 - n * unit)

    block = gamma(BLOCK_SIZE, 2.0 ** (1 - HOPPER_FP8_ACCUMULATOR_BITS))  # steps 1-3
    relative = block + gamma(k // BLOCK_SIZE, 2.0**-24) * (1 + block)  # step 4
    u_out = 0.0 if out_dtype == torch.float32 else 2.0**-8  # step 5
    return (relative * (1 + u_out) + u_out) * magnitude
