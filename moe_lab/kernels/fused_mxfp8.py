"""The MXFP8-quantize epilogue: the first expert GEMM's SwiGLU output leaves as MXFP8, the second reads it.

In the MXFP8 recipe the second expert GEMM multiplies ``h = swiglu(x·W1)`` in MXFP8, so the
unfused chain writes ``h`` in bfloat16 and a quantizer pass reads it back to write E4M3
codes and E8M0 scales. Here the first GEMM (with the gather prologue of
`moe_lab.kernels.fused_moe`) quantizes in its epilogue: 32-element blocks along ``F`` (the
second GEMM's reduction dim), about 1.03 bytes per element written instead of 2, and no
quantizer launch. The codes equal `moe_lab.quant.mx.quantize` of the unfused output bit for
bit: the epilogue rounds to the activation dtype first, then quantizes with the integer
arithmetic of `moe_lab.kernels.mx_quantize`.

Two second GEMMs read them. `fused_moe_mlp_mxfp8`: a prologue decodes codes and scales in
registers and feeds the tensor cores in the activation dtype (emulated MXFP8, on Hopper and
Blackwell alike, weights unquantized), then the weighted-scatter epilogue combines.
`fused_moe_mlp_mxfp8_native`: the weights are quantized too and both go to the grouped
block-scaled GEMM (`moe_lab.kernels.mx_gemm`: ``tl.dot_scaled`` on Blackwell, FP8 ``wgmma``
per 32-wide K block on Hopper). Forward only. The unfused chains close this file.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch._subclasses import FakeTensor

from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels.common import (
    INTERPRETED,
    cast_for_store,
    gather_rows,
    kernel_op,
    mma,
    row_source,
    scatter_rows,
    swiglu_k_loop,
    tile_order,
    tile_rows,
    tile_schedule,
)
from moe_lab.kernels.fused_moe import check_mlp_args, gather_swiglu_unfused, gemm_scatter_unfused
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.kernels.mx_gemm import e4m3_to_fp32, e8m0_to_fp32, grouped_mx_gemm
from moe_lab.kernels.mx_quantize import mx_block_codes, mx_quantize
from moe_lab.kernels.permute import unpermute
from moe_lab.quant.mx import E4M3, E8M0, quantize

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _gather_swiglu_mx_kernel(
    x_ptr, src_ptr, w_ptr, out_ptr, scale_ptr, offsets_ptr,
    M_ROWS, F, K, E, TOP_K,
    s_xm, s_xk, s_we, s_wk, s_wn, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, DOT_BF16: tl.constexpr, IS_BF16: tl.constexpr,
):
    # x: [T, K] token rows, gathered through src: [M_ROWS] int32; w: [E, K, 2F]. Out: the
    # E4M3 codes of h = silu(gate)·up (out: u8 [M, F]) and their E8M0 scales (scale: u8
    # [M, F/32], contiguous). Grid: 1-D, `grouped_grid` over F.
    tile_m, tile_n = tile_order(F, BLOCK_N, GROUP_M)
    seg, row0, row_end = tile_schedule(offsets_ptr, tile_m, E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg > E:
        return
    rows, cols, row_ok = tile_rows(row0, row_end, tile_n, BLOCK_M, BLOCK_N)
    mask = row_ok[:, None] & (cols[None, :] < F)
    out_ptrs = out_ptr + rows[:, None] * s_om + cols[None, :] * s_on
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if seg < E:  # the padding segment (seg == E) keeps zero accumulators: zero rows out
        token, _src, a_ok = gather_rows(src_ptr, rows, row_ok, TOP_K)
        gate, up = swiglu_k_loop(x_ptr, token, a_ok, w_ptr + seg.to(tl.int64) * s_we, cols, F, K,
                                 s_xm, s_xk, s_wk, s_wn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_BF16)
    h = gate * tl.sigmoid(gate) * up
    # Round to the activation dtype first (the unfused chain stores h there; x's dtype), then
    # quantize its bits: 32-element blocks along F, E4M3 codes, rceil E8M0 scales.
    if IS_BF16:
        bits = cast_for_store(h, x_ptr).to(tl.uint16, bitcast=True).to(tl.int32) << 16
    else:
        bits = h.to(tl.int32, bitcast=True)
    n_blocks: tl.constexpr = BLOCK_N // 32
    # E4M3: largest power of two 2^8, 3 mantissa bits, bias 7
    code, scale = mx_block_codes(tl.reshape(bits, (BLOCK_M, n_blocks, 32)), 2, 8, True, 3, 7, 0x7E, 0x7F)
    tl.store(out_ptrs, tl.reshape(code, (BLOCK_M, BLOCK_N)).to(tl.uint8), mask=mask)
    blocks = tile_n * n_blocks + tl.arange(0, n_blocks)
    n_scales = F // 32
    tl.store(scale_ptr + rows[:, None] * n_scales + blocks[None, :], scale.to(tl.uint8),
             mask=row_ok[:, None] & (blocks[None, :] < n_scales))


@triton.jit
def _gemm_scatter_mx_kernel(
    a_ptr, a_scale_ptr, w_ptr, out_ptr, src_ptr, weight_ptr, offsets_ptr,
    M_ROWS, N, K, E, TOP_K,
    s_am, s_ak, s_we, s_wk, s_wn, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, DOT_BF16: tl.constexpr,
):
    # a: E4M3 codes (u8 [M, K]) and a_scale their E8M0 scales (u8 [M, K/32], contiguous), as
    # the epilogue above wrote them, decoded in registers (emulated MXFP8; w: [E, K, N] stays
    # in the activation dtype). Then the deterministic weighted scatter of
    # `moe_lab.kernels.fused_moe`: out [T·k, N] token-major. Grid as the kernel above's.
    tile_m, tile_n = tile_order(N, BLOCK_N, GROUP_M)
    seg, row0, row_end = tile_schedule(offsets_ptr, tile_m, E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg >= E:
        return
    rows, cols, row_ok = tile_rows(row0, row_end, tile_n, BLOCK_M, BLOCK_N)
    token, src, ok = gather_rows(src_ptr, rows, row_ok, TOP_K)
    w_ptr += seg.to(tl.int64) * s_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        codes = tl.load(a_ptr + rows[:, None] * s_am + ks[None, :] * s_ak,
                        mask=row_ok[:, None] & (ks[None, :] < K), other=0)
        ss = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        sc = tl.load(a_scale_ptr + rows[:, None] * (K // 32) + ss[None, :],
                     mask=row_ok[:, None] & (ss[None, :] < K // 32), other=127)
        a = tl.reshape(tl.reshape(e4m3_to_fp32(codes), (BLOCK_M, BLOCK_K // 32, 32))
                       * e8m0_to_fp32(sc)[:, :, None], (BLOCK_M, BLOCK_K))
        if DOT_BF16:  # E4M3 × 2^s is exact in bfloat16 (4 significant bits)
            a = a.to(tl.bfloat16)
        b = tl.load(w_ptr + ks[:, None] * s_wk + cols[None, :] * s_wn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = mma(acc, a, b, DOT_BF16)
    scatter_rows(acc, out_ptr, weight_ptr, token, src, ok, cols, N, s_om, s_on, True, False)


# --------------------------------------------------------------------------------------
# Launches (custom ops, `kernel_op`: FakeTensorMode and torch.compile see the shapes, not the kernel)
# --------------------------------------------------------------------------------------


def launch_config(kernel: str, m: int, n: int, k: int, n_experts: int, *, interpreted: bool,
                  dtype: torch.dtype = torch.bfloat16) -> LaunchConfig:
    """The grouped GEMM's tile for ``kernel`` ("swiglu": the epilogue kernel, "gemm": the
    decoding one), widened to whole 32-element MX blocks: the epilogue quantizes blocks of
    ``BLOCK_N`` columns, the decoding prologue reads blocks of ``BLOCK_K``."""
    cfg = gg.launch_config(kernel, m, n, k, n_experts, interpreted=interpreted, dtype=dtype)
    axis = "BLOCK_N" if kernel == "swiglu" else "BLOCK_K"
    return dataclasses.replace(cfg, blocks={**cfg.blocks, axis: max(32, cfg.blocks[axis])})


@kernel_op("gather_swiglu_mx")
def _gather_swiglu_mx_op(x: Tensor, src: Tensor, w: Tensor, offsets: Tensor,
                         top_k: int) -> tuple[Tensor, Tensor]:
    m, (n_experts, k, two_f) = src.shape[0], w.shape
    f = two_f // 2
    codes = torch.empty((m, f), dtype=torch.uint8, device=x.device)
    scales = torch.empty((m, f // 32), dtype=torch.uint8, device=x.device)
    if m and f and not isinstance(x, FakeTensor):
        cfg = launch_config("swiglu", m, f, k, n_experts, interpreted=INTERPRETED, dtype=x.dtype)
        gg.launch(_gather_swiglu_mx_kernel, cfg, m, f, k, n_experts, x.dtype,
                  x, src, w, codes, scales, offsets, m, f, k, n_experts, top_k, *x.stride(), *w.stride(),
                  *codes.stride(), IS_BF16=x.dtype == torch.bfloat16)
    return codes, scales


@kernel_op("gemm_scatter_mx")
def _gemm_scatter_mx_op(codes: Tensor, scales: Tensor, w: Tensor, src: Tensor, weights: Tensor,
                        offsets: Tensor, tokens: int, top_k: int) -> Tensor:
    """Token rows ``[tokens, N]`` in ``w``'s dtype: the weighted products of the decoded
    ``codes`` (u8) and ``scales`` (u8), scattered and summed over each token's rows."""
    (m, k), (n_experts, _, n) = codes.shape, w.shape
    out = torch.empty((tokens * top_k, n), dtype=w.dtype, device=codes.device)
    if m and n and tokens and not isinstance(codes, FakeTensor):
        cfg = launch_config("gemm", m, n, k, n_experts, interpreted=INTERPRETED, dtype=w.dtype)
        gg.launch(_gemm_scatter_mx_kernel, cfg, m, n, k, n_experts, w.dtype,
                  codes, scales, w, out, src, weights, offsets, m, n, k, n_experts, top_k,
                  *codes.stride(), *w.stride(), *out.stride())
    return out.view(tokens, top_k, n).sum(1, dtype=torch.float32).to(w.dtype)


# --------------------------------------------------------------------------------------
# The public functions
# --------------------------------------------------------------------------------------


def gather_swiglu_mxfp8(x: Tensor, w_gate_up: Tensor, row_id_map: Tensor, offsets: Tensor, *,
                        n_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """The first expert GEMM with the gather prologue and the MXFP8-quantize epilogue:
    ``(codes: [n_rows, F] float8_e4m3fn, scales: [n_rows, F/32] float8_e8m0fnu)``, equal bit
    for bit to `moe_lab.quant.mx.quantize` (rceil) of
    `moe_lab.kernels.fused_moe.gather_swiglu`'s output. ``F`` a multiple of 32. Forward only."""
    if (w_gate_up.shape[2] // 2) % 32:
        raise ValueError(f"the MXFP8 epilogue needs F a multiple of 32, got F = {w_gate_up.shape[2] // 2}")
    tokens, top_k = row_id_map.shape
    src = row_source(row_id_map, tokens * top_k if n_rows is None else n_rows)
    codes, scales = _gather_swiglu_mx_op(x, src, w_gate_up, offsets.contiguous(), top_k)
    return codes.view(E4M3), scales.view(E8M0)


def fused_moe_mlp_mxfp8(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor, offsets: Tensor,
                        topk_weights: Tensor, *, n_rows: int | None = None) -> Tensor:
    """The forward of the MXFP8 path, fused: `gather_swiglu_mxfp8`, then a second GEMM that
    decodes the codes and scales in registers (emulated MXFP8: ``w_down`` stays in ``x``'s
    dtype) and combines with the deterministic weighted scatter. ``F`` a multiple of 32."""
    check_mlp_args(x, w_gate_up, w_down, row_id_map, offsets, topk_weights)
    codes, scales = gather_swiglu_mxfp8(x, w_gate_up, row_id_map, offsets, n_rows=n_rows)
    tokens, top_k = row_id_map.shape
    src = row_source(row_id_map, len(codes))
    return _gemm_scatter_mx_op(codes.view(torch.uint8), scales.view(torch.uint8), w_down, src,
                               topk_weights.reshape(-1).float(), offsets.contiguous(), tokens, top_k)


def fused_moe_mlp_mxfp8_native(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor,
                               offsets: Tensor, topk_weights: Tensor, *, n_rows: int | None = None) -> Tensor:
    """The MXFP8 path with both operands of the second GEMM in MXFP8, for block-scaled tensor
    cores: `gather_swiglu_mxfp8`'s codes and scales go straight to
    `moe_lab.kernels.mx_gemm.grouped_mx_gemm` (block-scaled ``tcgen05.mma`` on Blackwell; on Hopper one
    FP8 ``wgmma`` per 32-wide K block, scaled in fp32), with ``w_down`` quantized along ``F`` by the Triton
    quantizer; then the weighted combine (`moe_lab.kernels.permute.unpermute`, not fused here). ``F`` a
    multiple of 32. In training the weights' MXFP8 copy would be made once per optimizer step."""
    check_mlp_args(x, w_gate_up, w_down, row_id_map, offsets, topk_weights)
    codes, scales = gather_swiglu_mxfp8(x, w_gate_up, row_id_map, offsets, n_rows=n_rows)
    w2, _ = mx_quantize(w_down.transpose(1, 2), colwise=False, scale_mode="rceil")  # [E, D, F] along F
    y = grouped_mx_gemm(codes, scales, w2.data, w2.scale, offsets.to(torch.int32), out_dtype=x.dtype)
    return unpermute(y, row_id_map, topk_weights.float())


# --------------------------------------------------------------------------------------
# References: the unfused chains (what each fusion is tested against)
# --------------------------------------------------------------------------------------


def gather_swiglu_mxfp8_unfused(x: Tensor, w_gate_up: Tensor, row_id_map: Tensor, offsets: Tensor, *,
                                n_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """permute → grouped GEMM → SwiGLU → MXFP8 quantizer (rows, rceil), in plain PyTorch."""
    q = quantize(gather_swiglu_unfused(x, w_gate_up, row_id_map, offsets, n_rows=n_rows), dim=-1,
                 scale_mode="rceil")
    return q.data, q.scale


def fused_moe_mlp_mxfp8_unfused(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor,
                                offsets: Tensor, topk_weights: Tensor, *,
                                n_rows: int | None = None) -> Tensor:
    """permute → GEMM + SwiGLU → MXFP8 quantizer → dequantize → GEMM → weighted unpermute."""
    h = gather_swiglu_unfused(x, w_gate_up, row_id_map, offsets, n_rows=n_rows)
    hq = quantize(h, dim=-1, scale_mode="rceil").dequantize(torch.float32).to(h.dtype)
    return gemm_scatter_unfused(hq, w_down, row_id_map, offsets, topk_weights)


def fused_moe_mlp_mxfp8_native_unfused(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor,
                                       offsets: Tensor, topk_weights: Tensor, *,
                                       n_rows: int | None = None) -> Tensor:
    """permute → GEMM + SwiGLU → MXFP8 quantizer → dequantize, ``w_down`` quantized along
    ``F`` and dequantized → GEMM → weighted unpermute, in plain PyTorch."""
    h = gather_swiglu_unfused(x, w_gate_up, row_id_map, offsets, n_rows=n_rows)
    hq = quantize(h, dim=-1, scale_mode="rceil").dequantize(torch.float32)
    wq = quantize(w_down, dim=1, scale_mode="rceil").dequantize(torch.float32)
    return gemm_scatter_unfused(hq, wq, row_id_map, offsets, topk_weights).to(x.dtype)

