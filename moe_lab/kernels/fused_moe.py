"""Memory-bound work fused into the grouped GEMM: a gather prologue, a weighted-scatter
epilogue, an MXFP8-quantize epilogue.

The unfused dropless layer (`moe_lab.moe.dispatch`, ``"dropless"`` with the ``"triton"``
experts) is a chain of launches, each reading its inputs from memory and writing its
output back: ``permute`` copies every token row to its ``k`` rows of an expert-sorted
buffer, the first grouped GEMM (SwiGLU in its epilogue, `moe_lab.kernels.grouped_gemm`)
reads that buffer, the second writes ``[T·k, d]`` rows in expert order, and ``unpermute``
reads them back, weights them and sums each token's ``k`` rows. The two copies do no
arithmetic; at fine-grained shapes (many small experts, ``k = 8``) they move about as many
bytes as the GEMMs themselves. Here they are folded into the GEMMs:

* **gather prologue** — the first GEMM loads row ``r`` of its A tile straight from the
  token rows, ``x[token(r)]``, through the *row source* ``src[r] = t·k + j`` (the inverse of
  `moe_lab.kernels.permute.make_row_id_map`'s map; ``-1`` for a row nobody maps to). The
  permuted copy of ``x`` is never written. Its backward gathers the same way (the weight
  gradient ``dW1[e] = x[tokens of e]ᵀ·dpre``).
* **weighted-scatter epilogue** — the second GEMM multiplies each output row by its
  routing weight and sends it to its token, so the expert-ordered output is never read
  back by a separate combine. Two schemes (``scatter=``):

  - ``"deterministic"`` (the default): the epilogue stores row ``(t, j)`` at position
    ``t·k + j`` of a token-major ``[T·k, d]`` buffer (a scatter *store*: every element has
    one writer), then one contiguous sum over ``k`` accumulates in float32. Bit-for-bit
    reproducible. It saves the combine's gather (random row reads become a streaming
    reduction) and its weight loads, not the ``[T·k, d]`` round trip — the scheme
    ScatterMoE uses.
  - ``"atomic"``: the epilogue adds ``w·row`` into a float32 ``[T, d]`` accumulator with
    ``tl.atomic_add`` (reductions performed in L2), so no ``[T·k, d]`` buffer exists at all;
    a bfloat16 output then costs one more cast pass. Float addition is not associative and
    the ``k`` contributions of a token arrive in whatever order the tiles finish, so with
    ``k >= 3`` the result can differ between runs in the last bits of float32 (with ``k <=
    2`` it cannot: ``0 + a + b`` is the same sum in either order).

  The backward of the combine is a gather prologue too: ``dh = w·(dout[token]·W2ᵀ)``,
  with the routing weights' gradient ``<dout[t], y[r]> = <dout[t]·W2ᵀ, h[r]>`` summed in
  the same epilogue (per column tile, then over tiles: deterministic), and the first
  GEMM's ``dX`` scattered back to the tokens like the forward's combine.
* **MXFP8-quantize epilogue** — the first GEMM's SwiGLU output leaves as E4M3 codes and
  E8M0 scales (32-element blocks along ``F``, the reduction dim of the second GEMM) rather
  than as bfloat16: about 1.03 bytes per element written instead of 2, and no separate
  quantizer pass. The codes equal `moe_lab.quant.mx.quantize` of the unfused output bit
  for bit (the epilogue rounds to the activation dtype first, then quantizes with the
  integer arithmetic of `moe_lab.kernels.mx_quantize`). The second GEMM reads them
  (`fused_moe_mlp_mxfp8`): its prologue decodes codes and scales in registers and feeds the
  tensor cores in the activation dtype — emulated MXFP8, on Hopper and Blackwell alike,
  with the weights unquantized. `fused_moe_mlp_mxfp8_native` instead quantizes the weights
  too and hands both to the grouped block-scaled GEMM (`moe_lab.kernels.mx_gemm`,
  ``tl.dot_scaled``: native on Blackwell). Forward only.
* the **SwiGLU epilogue** that `moe_lab.kernels.grouped_gemm` already has is measured
  beside these (`moe_lab.perf.fusion`).

Every fused function is registered in `FUSIONS` beside the unfused chain it replaces; the
tests run each against its chain. Tiles, warps and stages come from the grouped GEMM's
`moe_lab.kernels.grouped_gemm.launch_config` (a prologue or epilogue does not change the
MMA's tile), and `compile_specs` lists every kernel here at the DeepSeek-V3 and
GPT-OSS-20B shapes for the compile report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_lab.config import preset
from moe_lab.kernels.grouped_gemm import (
    FP32_NOTE,
    KERNEL_DTYPES,
    SPEC_DTYPES,
    _block_e,
    _dot_bf16,
    _interpreted,
    _mma,
    _tile_schedule,
    cast_for_store,
    describe,
    launch_config,
)
from moe_lab.kernels.launch import SPEC_PRESETS, SPEC_TOKENS, CompileSpec, LaunchConfig, int_args, merge_specs
from moe_lab.kernels.mx_gemm import e4m3_to_fp32, e8m0_to_fp32
from moe_lab.kernels.mx_quantize import fp8_code, mx_scale_byte
from moe_lab.registry import Registry

Tensor = torch.Tensor
SCATTER_MODES = ("deterministic", "atomic")


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _gather_rows(src_ptr, rows, row_ok, TOP_K):
    """``(token, valid)`` of permuted rows ``rows``: ``src[r] = t·k + j`` gives ``t``; a row
    no (token, slot) maps to (``src < 0``: alignment padding) is not valid."""
    src = tl.load(src_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    ok = row_ok & (src >= 0)
    return tl.where(ok, src // TOP_K, 0), src, ok


@triton.jit
def _gather_swiglu_kernel(
    x_ptr, src_ptr, w_ptr, out_ptr, dh_ptr, scale_ptr, offsets_ptr,
    M_ROWS, F, K, E, TOP_K,
    s_xm, s_xk, s_we, s_wk, s_wn, s_om, s_on, s_dm, s_dn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, DOT_BF16: tl.constexpr, BACKWARD: tl.constexpr,
    MX_OUT: tl.constexpr, IS_BF16: tl.constexpr,
):
    # x: [T, K] token rows; src: [M_ROWS] int32 (t·k + j of each permuted row, -1: none);
    # w: [E, K, 2F]; offsets: [E + 1]. The A tile's rows are x[src // TOP_K] (the gather
    # prologue). Forward: out = h = silu(gate)·up [M, F], or with MX_OUT its E4M3 codes
    # (out: u8 [M, F]) and E8M0 scales (scale: u8 [M, F/32]). Backward: dh [M, F] in,
    # out = [dgate, dup] [M, 2F]. Grid: (cdiv(M_ROWS, BLOCK_M) + E, cdiv(F, BLOCK_N)).
    seg, row0, row_end = _tile_schedule(offsets_ptr, tl.program_id(0), E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg > E:
        return
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < row_end
    mask = row_ok[:, None] & (cols[None, :] < F)
    out_ptrs = out_ptr + rows[:, None] * s_om + cols[None, :] * s_on
    up_out_ptrs = out_ptr + rows[:, None] * s_om + (cols + F)[None, :] * s_on
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if seg < E:  # the padding segment (seg == E) keeps zero accumulators: zero rows out
        token, _src, a_ok = _gather_rows(src_ptr, rows, row_ok, TOP_K)
        w_ptr += seg.to(tl.int64) * s_we
        for k0 in range(0, K, BLOCK_K):
            ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
            a = tl.load(x_ptr + token[:, None] * s_xm + ks[None, :] * s_xk,
                        mask=a_ok[:, None] & (ks[None, :] < K), other=0.0)
            w_mask = (ks[:, None] < K) & (cols[None, :] < F)
            bg = tl.load(w_ptr + ks[:, None] * s_wk + cols[None, :] * s_wn, mask=w_mask, other=0.0)
            bu = tl.load(w_ptr + ks[:, None] * s_wk + (cols + F)[None, :] * s_wn, mask=w_mask, other=0.0)
            gate = _mma(gate, a, bg, DOT_BF16)
            up = _mma(up, a, bu, DOT_BF16)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    if BACKWARD:
        dh = tl.load(dh_ptr + rows[:, None] * s_dm + cols[None, :] * s_dn,
                     mask=mask, other=0.0).to(tl.float32)
        dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(out_ptrs, cast_for_store(dgate, out_ptr), mask=mask)
        tl.store(up_out_ptrs, cast_for_store(dh * silu, out_ptr), mask=mask)
    elif MX_OUT:
        h = silu * up
        # Round to the activation dtype first (the unfused chain stores h there), then
        # quantize its bits: 32-element blocks along F, E4M3 codes, rceil E8M0 scales.
        if IS_BF16:
            hb = h.to(tl.uint32, bitcast=True)
            hb = (hb + 0x7FFF + ((hb >> 16) & 1)) >> 16
            hb = tl.where(h != h, (h.to(tl.uint32, bitcast=True) >> 16) | 0x40, hb)
            bits = (hb << 16).to(tl.int32, bitcast=True)
        else:
            bits = h.to(tl.int32, bitcast=True)
        n_blocks: tl.constexpr = BLOCK_N // 32
        amax = tl.max(tl.reshape(bits & 0x7FFFFFFF, (BLOCK_M, n_blocks, 32)), axis=2)
        scale = mx_scale_byte(amax, 8, True)  # E4M3: largest power of two 2^8
        shift = tl.where(scale == 0, 0, scale - 127)
        code = fp8_code(tl.reshape(bits, (BLOCK_M, n_blocks, 32)), shift[:, :, None],
                        (scale == 255)[:, :, None], 3, 7, 0x7E, 0x7F)
        tl.store(out_ptrs, tl.reshape(code, (BLOCK_M, BLOCK_N)).to(tl.uint8), mask=mask)
        blocks = tl.program_id(1) * n_blocks + tl.arange(0, n_blocks)
        n_scales = F // 32
        tl.store(scale_ptr + rows[:, None] * n_scales + blocks[None, :], scale.to(tl.uint8),
                 mask=row_ok[:, None] & (blocks[None, :] < n_scales))
    else:
        tl.store(out_ptrs, cast_for_store(silu * up, out_ptr), mask=mask)


@triton.jit
def _gemm_scatter_kernel(
    a_ptr, a_scale_ptr, w_ptr, out_ptr, src_ptr, weight_ptr, offsets_ptr,
    M_ROWS, N, K, E, TOP_K,
    s_am, s_ak, s_we, s_wk, s_wn, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, DOT_BF16: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    ATOMIC: tl.constexpr, A_MX: tl.constexpr,
):
    # a: [M, K] expert-sorted rows; w: [E, K, N] (any strides); src: [M_ROWS] int32;
    # weight: [T·k] float32 routing weights (if HAS_WEIGHTS). Row r's product, times
    # weight[src[r]], goes to its token: ATOMIC, added into out: fp32 [T, N] at row
    # src // TOP_K; else stored at row src of out: [T·k, N] (token-major, one writer per
    # element). Rows without a source and the padding segment write nothing. A_MX: a holds
    # E4M3 codes (u8 [M, K]) and a_scale their E8M0 scales (u8 [M, K/32], contiguous), as
    # the MXFP8 epilogue wrote them: decoded in registers (emulated MXFP8; the weights stay
    # in the activation dtype). Grid: (cdiv(M_ROWS, BLOCK_M) + E, cdiv(N, BLOCK_N)).
    seg, row0, row_end = _tile_schedule(offsets_ptr, tl.program_id(0), E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg >= E:
        return
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < row_end
    token, src, ok = _gather_rows(src_ptr, rows, row_ok, TOP_K)
    w_ptr += seg.to(tl.int64) * s_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        if A_MX:
            codes = tl.load(a_ptr + rows[:, None] * s_am + ks[None, :] * s_ak,
                            mask=row_ok[:, None] & (ks[None, :] < K), other=0)
            ss = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            sc = tl.load(a_scale_ptr + rows[:, None] * (K // 32) + ss[None, :],
                         mask=row_ok[:, None] & (ss[None, :] < K // 32), other=127)
            a = tl.reshape(tl.reshape(e4m3_to_fp32(codes), (BLOCK_M, BLOCK_K // 32, 32))
                           * e8m0_to_fp32(sc)[:, :, None], (BLOCK_M, BLOCK_K))
            if DOT_BF16:  # E4M3 × 2^s is exact in bfloat16 (4 significant bits)
                a = a.to(tl.bfloat16)
        else:
            a = tl.load(a_ptr + rows[:, None] * s_am + ks[None, :] * s_ak,
                        mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
        b = tl.load(w_ptr + ks[:, None] * s_wk + cols[None, :] * s_wn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = _mma(acc, a, b, DOT_BF16)
    if HAS_WEIGHTS:
        acc = acc * tl.load(weight_ptr + src, mask=ok, other=0.0).to(tl.float32)[:, None]
    mask = ok[:, None] & (cols[None, :] < N)
    if ATOMIC:
        tl.atomic_add(out_ptr + token[:, None] * s_om + cols[None, :] * s_on, acc, mask=mask)
    else:
        dest = tl.where(ok, src, 0)
        tl.store(out_ptr + dest[:, None] * s_om + cols[None, :] * s_on, cast_for_store(acc, out_ptr),
                 mask=mask)


@triton.jit
def _gather_gemm_kernel(
    g_ptr, src_ptr, w_ptr, h_ptr, weight_ptr, out_ptr, part_ptr, offsets_ptr,
    M_ROWS, N, K, E, TOP_K, N_TILES,
    s_gm, s_gk, s_we, s_wk, s_wn, s_hm, s_hn, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, DOT_BF16: tl.constexpr,
):
    # The combine's backward. g: [T, K] token rows (dout); w: [E, K, N] (W2ᵀ as a view);
    # h: [M, N] (the second GEMM's saved input); weight: [T·k] fp32. Row r:
    # c = g[src // TOP_K]·W[e] (the gather prologue); out[r] = weight[src]·c (dh) and
    # part[r, tile] = <c, h[r]> over this tile's columns (summed over tiles on the host
    # side of the launch: the routing weight's gradient, deterministic).
    # Grid: (cdiv(M_ROWS, BLOCK_M) + E, N_TILES).
    seg, row0, row_end = _tile_schedule(offsets_ptr, tl.program_id(0), E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg > E:
        return
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < row_end
    mask = row_ok[:, None] & (cols[None, :] < N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    wt = tl.zeros((BLOCK_M,), tl.float32)
    if seg < E:
        token, src, ok = _gather_rows(src_ptr, rows, row_ok, TOP_K)
        w_ptr += seg.to(tl.int64) * s_we
        for k0 in range(0, K, BLOCK_K):
            ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
            a = tl.load(g_ptr + token[:, None] * s_gm + ks[None, :] * s_gk,
                        mask=ok[:, None] & (ks[None, :] < K), other=0.0)
            b = tl.load(w_ptr + ks[:, None] * s_wk + cols[None, :] * s_wn,
                        mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
            acc = _mma(acc, a, b, DOT_BF16)
        wt = tl.load(weight_ptr + src, mask=ok, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + rows[:, None] * s_hm + cols[None, :] * s_hn, mask=mask, other=0.0).to(tl.float32)
    tl.store(part_ptr + rows * N_TILES + tl.program_id(1), tl.sum(acc * h, 1), mask=row_ok)
    tl.store(out_ptr + rows[:, None] * s_om + cols[None, :] * s_on,
             cast_for_store(acc * wt[:, None], out_ptr), mask=mask)


@triton.jit
def _gather_dw_kernel(
    x_ptr, dy_ptr, dw_ptr, src_ptr, weight_ptr, offsets_ptr,
    M_ROWS, N, K, TOP_K,
    s_xm, s_xk, s_ym, s_yn, s_we, s_wk, s_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr, GATHER_X: tl.constexpr,
):
    # dw[e] = X_eᵀ·DY_e over expert e's rows, one operand read through the row source:
    # GATHER_X: X row r = x[src // TOP_K] (x: [T, K] tokens), DY row r = dy[r] (dy: [M, N]);
    # else X row r = x[r] (x: [M, K]) and DY row r = weight[src]·dy[src // TOP_K]
    # (dy: [T, N] token gradients, weight: [T·k] fp32). Grid: (E, cdiv(K, BLOCK_K), cdiv(N, BLOCK_N)).
    e = tl.program_id(0)
    start = tl.minimum(tl.maximum(tl.load(offsets_ptr + e), 0), M_ROWS)
    end = tl.minimum(tl.maximum(tl.load(offsets_ptr + e + 1), start), M_ROWS)
    ks = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    ns = (tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    # The row sources of the next row tile are loaded one iteration ahead (carried through
    # the loop), so the gathered loads' addresses never wait on a load of the same
    # iteration: the software pipeliner can then keep several tiles' copies in flight.
    rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
    src = tl.load(src_ptr + rows, mask=rows < end, other=-1).to(tl.int64)
    for _m0 in range(start, end, BLOCK_M):  # no rows: no iterations, dW[e] = 0
        ok = (rows < end) & (src >= 0)
        token = tl.where(ok, src // TOP_K, 0)
        if GATHER_X:
            a = tl.load(x_ptr + token[:, None] * s_xm + ks[None, :] * s_xk,
                        mask=ok[:, None] & (ks[None, :] < K), other=0.0)
            g = tl.load(dy_ptr + rows[:, None] * s_ym + ns[None, :] * s_yn,
                        mask=ok[:, None] & (ns[None, :] < N), other=0.0)
        else:
            a = tl.load(x_ptr + rows[:, None] * s_xm + ks[None, :] * s_xk,
                        mask=ok[:, None] & (ks[None, :] < K), other=0.0)
            g = tl.load(dy_ptr + token[:, None] * s_ym + ns[None, :] * s_yn,
                        mask=ok[:, None] & (ns[None, :] < N), other=0.0)
            wt = tl.load(weight_ptr + src, mask=ok, other=0.0).to(tl.float32)
            g = cast_for_store(g.to(tl.float32) * wt[:, None], dy_ptr)  # the weighted dY, rounded
        acc = _mma(acc, tl.trans(a), g, DOT_BF16)
        rows += BLOCK_M
        src = tl.load(src_ptr + rows, mask=rows < end, other=-1).to(tl.int64)
    dw_ptrs = dw_ptr + e.to(tl.int64) * s_we + ks[:, None] * s_wk + ns[None, :] * s_wn
    tl.store(dw_ptrs, cast_for_store(acc, dw_ptr), mask=(ks[:, None] < K) & (ns[None, :] < N))


# --------------------------------------------------------------------------------------
# Launches (custom ops: FakeTensorMode and torch.compile see the shapes, not the kernel)
# --------------------------------------------------------------------------------------


def _new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Outputs the kernels write completely start uninitialised. (Tests replace this with a
    NaN fill to prove it.)"""
    return torch.empty(shape, dtype=dtype, device=device)


# The gathered weight gradient in float32 (CUDA cores): the grouped GEMM's 32 x 64 x 64 on
# 4 warps spills once the row sources ride along, so 8 warps share the tile.
GATHER_DW_FP32 = LaunchConfig({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=8, num_stages=3)


def fused_launch_config(kernel: str, m: int, n: int, k: int, n_experts: int, *, interpreted: bool,
                        dtype: torch.dtype = torch.bfloat16) -> LaunchConfig:
    """The launch of a fused kernel: the tile `moe_lab.kernels.grouped_gemm.launch_config`
    gives the unfused ``kernel`` ("gemm", "swiglu", "dw") it replaces — a prologue or an
    epilogue does not change the MMA — except the gathered ``dw`` in float32 compiled
    (`GATHER_DW_FP32`)."""
    if kernel == "dw" and dtype == torch.float32 and not interpreted:
        return GATHER_DW_FP32
    return launch_config(kernel, m, n, k, n_experts, interpreted=interpreted, dtype=dtype)


def _cfg(kernel: str, m: int, n: int, k: int, n_experts: int, dtype: torch.dtype) -> LaunchConfig:
    return fused_launch_config(kernel, m, n, k, n_experts, interpreted=_interpreted(), dtype=dtype)


def _mx_k_config(cfg: LaunchConfig) -> LaunchConfig:
    """A GEMM reading MXFP8 operands decodes 32-element scale blocks along K: ``BLOCK_K``
    at least 32."""
    if cfg.blocks["BLOCK_K"] >= 32:
        return cfg
    return LaunchConfig({**cfg.blocks, "BLOCK_K": 32}, cfg.num_warps, cfg.num_stages)


def _mx_config(cfg: LaunchConfig) -> LaunchConfig:
    """The MX epilogue quantizes 32-column blocks: ``BLOCK_N`` at least 32."""
    if cfg.blocks["BLOCK_N"] >= 32:
        return cfg
    return LaunchConfig({**cfg.blocks, "BLOCK_N": 32}, cfg.num_warps, cfg.num_stages)


def _launch_gather_swiglu(x: Tensor, src: Tensor, w: Tensor, offsets: Tensor, top_k: int,
                          out: Tensor, dh: Tensor | None, scale: Tensor | None) -> None:
    m, (n_experts, k, two_f) = src.shape[0], w.shape
    f = two_f // 2
    if not (m and f):
        return
    interpreted = _interpreted()
    cfg = _cfg("swiglu", m, f, k, n_experts, x.dtype)
    if scale is not None:
        cfg = _mx_config(cfg)
    grid = (triton.cdiv(m, cfg.blocks["BLOCK_M"]) + n_experts, triton.cdiv(f, cfg.blocks["BLOCK_N"]))
    dh_arg = out if dh is None else dh
    scale_arg = out if scale is None else scale
    _gather_swiglu_kernel[grid](
        x, src, w, out, dh_arg, scale_arg, offsets, m, f, k, n_experts, top_k,
        *x.stride(), *w.stride(), *out.stride(), *dh_arg.stride(),
        **cfg.blocks, BLOCK_E=_block_e(n_experts), DOT_BF16=_dot_bf16(x.dtype, interpreted),
        BACKWARD=dh is not None, MX_OUT=scale is not None, IS_BF16=x.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


@torch.library.custom_op("moe_lab::gather_swiglu", mutates_args=())
def _gather_swiglu_op(x: Tensor, src: Tensor, w: Tensor, offsets: Tensor, top_k: int) -> Tensor:
    out = _new_output((src.shape[0], w.shape[2] // 2), x.dtype, x.device)
    _launch_gather_swiglu(x, src, w, offsets, top_k, out, None, None)
    return out


@_gather_swiglu_op.register_fake
def _(x: Tensor, src: Tensor, w: Tensor, offsets: Tensor, top_k: int) -> Tensor:
    return x.new_empty((src.shape[0], w.shape[2] // 2))


@torch.library.custom_op("moe_lab::gather_swiglu_bwd", mutates_args=())
def _gather_swiglu_bwd_op(x: Tensor, src: Tensor, w: Tensor, offsets: Tensor, dh: Tensor,
                          top_k: int) -> Tensor:
    out = _new_output((src.shape[0], w.shape[2]), x.dtype, x.device)
    _launch_gather_swiglu(x, src, w, offsets, top_k, out, dh, None)
    return out


@_gather_swiglu_bwd_op.register_fake
def _(x: Tensor, src: Tensor, w: Tensor, offsets: Tensor, dh: Tensor, top_k: int) -> Tensor:
    return x.new_empty((src.shape[0], w.shape[2]))


@torch.library.custom_op("moe_lab::gather_swiglu_mx", mutates_args=())
def _gather_swiglu_mx_op(x: Tensor, src: Tensor, w: Tensor, offsets: Tensor,
                         top_k: int) -> tuple[Tensor, Tensor]:
    m, f = src.shape[0], w.shape[2] // 2
    codes = _new_output((m, f), torch.uint8, x.device)
    scales = _new_output((m, f // 32), torch.uint8, x.device)
    _launch_gather_swiglu(x, src, w, offsets, top_k, codes, None, scales)
    return codes, scales


@_gather_swiglu_mx_op.register_fake
def _(x: Tensor, src: Tensor, w: Tensor, offsets: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    m, f = src.shape[0], w.shape[2] // 2
    return x.new_empty((m, f), dtype=torch.uint8), x.new_empty((m, f // 32), dtype=torch.uint8)


def _launch_scatter(a: Tensor, a_scale: Tensor | None, w: Tensor, src: Tensor, weights: Tensor | None,
                    offsets: Tensor, tokens: int, top_k: int, atomic: bool) -> Tensor:
    (m, k), (n_experts, _, n) = a.shape, w.shape
    dtype = w.dtype  # the activations' dtype (a is u8 codes with a_scale)
    if atomic:
        out = torch.zeros((tokens, n), dtype=torch.float32, device=a.device)
    else:  # every (token, slot) has its row in some expert's segment: every element written
        out = _new_output((tokens * top_k, n), dtype, a.device)
    if m and n and tokens:
        interpreted = _interpreted()
        cfg = _cfg("gemm", m, n, k, n_experts, dtype)
        if a_scale is not None:
            cfg = _mx_k_config(cfg)
        grid = (triton.cdiv(m, cfg.blocks["BLOCK_M"]) + n_experts, triton.cdiv(n, cfg.blocks["BLOCK_N"]))
        w_arg = src if weights is None else weights
        _gemm_scatter_kernel[grid](
            a, a if a_scale is None else a_scale, w, out, src, w_arg, offsets, m, n, k, n_experts, top_k,
            *a.stride(), *w.stride(), *out.stride(),
            **cfg.blocks, BLOCK_E=_block_e(n_experts), DOT_BF16=_dot_bf16(dtype, interpreted),
            HAS_WEIGHTS=weights is not None, ATOMIC=atomic, A_MX=a_scale is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if atomic:
        return out.to(dtype)  # float32: no pass at all; bfloat16: one cast
    return out.view(tokens, top_k, n).sum(1, dtype=torch.float32).to(dtype)


@torch.library.custom_op("moe_lab::gemm_scatter", mutates_args=())
def _gemm_scatter_op(a: Tensor, w: Tensor, src: Tensor, weights: Tensor | None, offsets: Tensor,
                     tokens: int, top_k: int, atomic: bool) -> Tensor:
    """Token rows ``[tokens, N]``: the scattered, weighted products summed over each
    token's ``top_k`` rows (float32 accumulation; the output in ``a``'s dtype)."""
    return _launch_scatter(a, None, w, src, weights, offsets, tokens, top_k, atomic)


@torch.library.custom_op("moe_lab::gemm_scatter_mx", mutates_args=())
def _gemm_scatter_mx_op(codes: Tensor, scales: Tensor, w: Tensor, src: Tensor, weights: Tensor,
                        offsets: Tensor, tokens: int, top_k: int) -> Tensor:
    """`_gemm_scatter_op` (deterministic, weighted) with A as MXFP8 codes and scales (u8)."""
    return _launch_scatter(codes, scales, w, src, weights, offsets, tokens, top_k, False)


@_gemm_scatter_mx_op.register_fake
def _(codes: Tensor, scales: Tensor, w: Tensor, src: Tensor, weights: Tensor, offsets: Tensor, tokens: int,
      top_k: int) -> Tensor:
    return w.new_empty((tokens, w.shape[2]))


@_gemm_scatter_op.register_fake
def _(a: Tensor, w: Tensor, src: Tensor, weights: Tensor | None, offsets: Tensor, tokens: int,
      top_k: int, atomic: bool) -> Tensor:
    return a.new_empty((tokens, w.shape[2]))


@torch.library.custom_op("moe_lab::gather_gemm_combine_bwd", mutates_args=())
def _gather_gemm_op(g: Tensor, src: Tensor, w: Tensor, h: Tensor, weights: Tensor, offsets: Tensor,
                    top_k: int) -> tuple[Tensor, Tensor]:
    """``(dh: [M, N], dweights: [T·k] float32)`` of the weighted combine."""
    (m, n), (n_experts, k, _) = h.shape, w.shape
    interpreted = _interpreted()
    cfg = _cfg("gemm", m, n, k, n_experts, g.dtype)
    n_tiles = triton.cdiv(n, cfg.blocks["BLOCK_N"]) if n else 0
    dh = _new_output((m, n), g.dtype, g.device)
    part = _new_output((m, n_tiles), torch.float32, g.device)
    if m and n:
        grid = (triton.cdiv(m, cfg.blocks["BLOCK_M"]) + n_experts, n_tiles)
        _gather_gemm_kernel[grid](
            g, src, w, h, weights, dh, part, offsets, m, n, k, n_experts, top_k, n_tiles,
            *g.stride(), *w.stride(), *h.stride(), *dh.stride(),
            **cfg.blocks, BLOCK_E=_block_e(n_experts), DOT_BF16=_dot_bf16(g.dtype, interpreted),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    per_row = part.sum(1)
    # Back from permuted rows to (token, slot) entries; rows without a source are dropped.
    dweights = torch.zeros(weights.shape[0] + 1, dtype=torch.float32, device=g.device)
    dweights.index_copy_(0, torch.where(src >= 0, src, weights.shape[0]).long(), per_row)
    return dh, dweights[:-1]


@_gather_gemm_op.register_fake
def _(g: Tensor, src: Tensor, w: Tensor, h: Tensor, weights: Tensor, offsets: Tensor,
      top_k: int) -> tuple[Tensor, Tensor]:
    return h.new_empty(h.shape), weights.new_empty(weights.shape, dtype=torch.float32)


@torch.library.custom_op("moe_lab::gather_dw", mutates_args=())
def _gather_dw_op(x: Tensor, dy: Tensor, src: Tensor, weights: Tensor | None, offsets: Tensor,
                  top_k: int, gather_x: bool) -> Tensor:
    k, n, n_experts, m = x.shape[1], dy.shape[1], offsets.shape[0] - 1, src.shape[0]
    dw = _new_output((n_experts, k, n), x.dtype, x.device)
    if k and n:
        interpreted = _interpreted()
        cfg = _cfg("dw", m, n, k, n_experts, x.dtype)
        grid = (n_experts, triton.cdiv(k, cfg.blocks["BLOCK_K"]), triton.cdiv(n, cfg.blocks["BLOCK_N"]))
        w_arg = src if weights is None else weights
        _gather_dw_kernel[grid](
            x, dy, dw, src, w_arg, offsets, m, n, k, top_k,
            *x.stride(), *dy.stride(), *dw.stride(),
            **cfg.blocks, DOT_BF16=_dot_bf16(x.dtype, interpreted), GATHER_X=gather_x,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return dw


@_gather_dw_op.register_fake
def _(x: Tensor, dy: Tensor, src: Tensor, weights: Tensor | None, offsets: Tensor, top_k: int,
      gather_x: bool) -> Tensor:
    return x.new_empty((offsets.shape[0] - 1, x.shape[1], dy.shape[1]))


# --------------------------------------------------------------------------------------
# Autograd and the public functions
# --------------------------------------------------------------------------------------


def row_source(row_id_map: Tensor, n_rows: int) -> Tensor:
    """The inverse of the row-id map: ``src[r] = t·k + j`` for ``r = row_id_map[t, j]``, and
    ``-1`` for a row no (token, slot) maps to. ``[n_rows]`` int32, on the device, no sync
    (one scatter of ``T·k`` int32)."""
    src = torch.full((n_rows,), -1, dtype=torch.int32, device=row_id_map.device)
    entries = torch.arange(row_id_map.numel(), dtype=torch.int32, device=row_id_map.device)
    return src.scatter_(0, row_id_map.reshape(-1).long(), entries)


class GatherSwiGLU(torch.autograd.Function):
    """``h[r] = swiglu(x[token(r)]·W1[e])``: the first GEMM with the gather prologue."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, src: Tensor, offsets: Tensor, top_k: int) -> Tensor:
        ctx.save_for_backward(x, w, src, offsets)
        ctx.top_k = top_k
        return _gather_swiglu_op(x, src, w, offsets, top_k)

    @staticmethod
    def backward(ctx, dh: Tensor):
        x, w, src, offsets = ctx.saved_tensors
        dpre = _gather_swiglu_bwd_op(x, src, w, offsets, dh.contiguous(), ctx.top_k)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dX back to the tokens: the scatter epilogue, unweighted
            dx = _gemm_scatter_op(dpre, w.transpose(1, 2), src, None, offsets, x.shape[0],
                                  ctx.top_k, False)
        if ctx.needs_input_grad[1]:
            dw = _gather_dw_op(x, dpre, src, None, offsets, ctx.top_k, True)
        return dx, dw, None, None, None


class GemmScatter(torch.autograd.Function):
    """``out[t] = Σ_j w[t, j]·(h[row(t, j)]·W2[e])``: the second GEMM with the weighted
    scatter epilogue (the combine)."""

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, weights: Tensor, src: Tensor, offsets: Tensor,
                tokens: int, top_k: int, atomic: bool) -> Tensor:
        ctx.save_for_backward(h, w, weights, src, offsets)
        ctx.top_k = top_k
        return _gemm_scatter_op(h, w, src, weights, offsets, tokens, top_k, atomic)

    @staticmethod
    def backward(ctx, dout: Tensor):
        h, w, weights, src, offsets = ctx.saved_tensors
        dout = dout.contiguous()
        dh, dweights = _gather_gemm_op(dout, src, w.transpose(1, 2), h, weights, offsets, ctx.top_k)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = _gather_dw_op(h, dout, src, weights, offsets, ctx.top_k, False)
        return dh, dw, dweights, None, None, None, None, None


def _check(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor, offsets: Tensor,
           topk_weights: Tensor) -> None:
    if x.dim() != 2 or x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"x must be [T, d] float32 or bfloat16, got {tuple(x.shape)} {x.dtype}")
    t, d = x.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] != d or w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up must be [E, d={d}, 2F], got {tuple(w_gate_up.shape)}")
    n_experts, f = w_gate_up.shape[0], w_gate_up.shape[2] // 2
    if tuple(w_down.shape) != (n_experts, f, d):
        raise ValueError(f"w_down must be [E={n_experts}, F={f}, d={d}], got {tuple(w_down.shape)}")
    for name, wt in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if wt.dtype != x.dtype or wt.device != x.device:
            raise ValueError(f"{name} must be {x.dtype} on {x.device}, got {wt.dtype} on {wt.device}")
    if row_id_map.dim() != 2 or row_id_map.shape[0] != t or row_id_map.dtype != torch.int32:
        raise ValueError(f"row_id_map must be [T={t}, k] int32, got {tuple(row_id_map.shape)} "
                         f"{row_id_map.dtype}")
    if tuple(topk_weights.shape) != tuple(row_id_map.shape):
        raise ValueError(f"topk_weights must be {tuple(row_id_map.shape)}, got {tuple(topk_weights.shape)}")
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (n_experts + 1,):
        raise ValueError(f"offsets must be [E + 1 = {n_experts + 1}] int32, got "
                         f"{tuple(offsets.shape)} {offsets.dtype}")
    if x.device.type != "cuda" and not _interpreted():
        raise ValueError(f"x must be on a CUDA device for compiled Triton, got {x.device} "
                         "(set TRITON_INTERPRET=1 before importing triton to run on the CPU)")


def fused_moe_mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor, offsets: Tensor,
                  topk_weights: Tensor, *, n_rows: int | None = None,
                  scatter: str = "deterministic") -> Tensor:
    """The dropless experts and their combine in two fused launches (and their backward):
    ``out[t] = Σ_j w[t, j]·down_e(swiglu(x[t]·W1[e]))`` with ``e = topk_ids[t, j]``.

    Args:
        x: ``[T, d]`` token rows (float32 or bfloat16), never permuted.
        w_gate_up: ``[E, d, 2F]`` (gate ``[..., :F]``, up ``[..., F:]``); w_down:
            ``[E, F, d]``; both in ``x``'s dtype.
        row_id_map, offsets: from `moe_lab.kernels.permute.make_row_id_map`.
        topk_weights: ``[T, k]`` routing weights (any float dtype; used in float32).
        n_rows: rows of the expert-sorted layout (default ``T·k``; larger with aligned segments).
        scatter: ``"deterministic"`` or ``"atomic"`` (see the module docstring).

    Returns ``[T, d]`` in ``x``'s dtype. Differentiable in ``x``, both weights and
    ``topk_weights``; no host sync.
    """
    _check(x, w_gate_up, w_down, row_id_map, offsets, topk_weights)
    if scatter not in SCATTER_MODES:
        raise ValueError(f"scatter must be one of {SCATTER_MODES}, got {scatter!r}")
    tokens, top_k = row_id_map.shape
    n_rows = tokens * top_k if n_rows is None else n_rows
    src = row_source(row_id_map, n_rows)
    offsets = offsets.contiguous()
    h = GatherSwiGLU.apply(x, w_gate_up, src, offsets, top_k)
    weights = topk_weights.reshape(-1).float()
    return GemmScatter.apply(h, w_down, weights, src, offsets, tokens, top_k, scatter == "atomic")


def gather_swiglu(x: Tensor, w_gate_up: Tensor, row_id_map: Tensor, offsets: Tensor, *,
                  n_rows: int | None = None) -> Tensor:
    """The first expert GEMM with the gather prologue: ``h[r] = swiglu(x[t]·W1[e])`` for
    ``r = row_id_map[t, j]`` in ``e``'s segment; ``[n_rows, F]``, zero rows where no
    (token, slot) maps. Differentiable in ``x`` and ``w_gate_up``."""
    tokens, top_k = row_id_map.shape
    src = row_source(row_id_map, tokens * top_k if n_rows is None else n_rows)
    return GatherSwiGLU.apply(x, w_gate_up, src, offsets.contiguous(), top_k)


def gemm_scatter(h: Tensor, w_down: Tensor, row_id_map: Tensor, offsets: Tensor, topk_weights: Tensor,
                 *, scatter: str = "deterministic") -> Tensor:
    """The second expert GEMM with the weighted-scatter epilogue: ``out[t] = Σ_j w[t, j]·
    (h[row_id_map[t, j]]·W2[e])``; ``[T, d]``. Differentiable in ``h``, ``w_down`` and
    ``topk_weights``."""
    if scatter not in SCATTER_MODES:
        raise ValueError(f"scatter must be one of {SCATTER_MODES}, got {scatter!r}")
    tokens, top_k = row_id_map.shape
    src = row_source(row_id_map, h.shape[0])
    return GemmScatter.apply(h, w_down, topk_weights.reshape(-1).float(), src, offsets.contiguous(),
                             tokens, top_k, scatter == "atomic")


def gather_swiglu_mxfp8(x: Tensor, w_gate_up: Tensor, row_id_map: Tensor, offsets: Tensor, *,
                        n_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """The first expert GEMM with the gather prologue and the MXFP8-quantize epilogue:
    ``(codes: [n_rows, F] float8_e4m3fn, scales: [n_rows, F/32] float8_e8m0fnu)``, equal bit
    for bit to `moe_lab.quant.mx.quantize` (rceil) of `gather_swiglu`'s output. ``F`` a
    multiple of 32. Forward only (not differentiable)."""
    from moe_lab.quant.mx import E4M3, E8M0

    if (w_gate_up.shape[2] // 2) % 32:
        raise ValueError(f"the MXFP8 epilogue needs F a multiple of 32, got F = {w_gate_up.shape[2] // 2}")
    tokens, top_k = row_id_map.shape
    src = row_source(row_id_map, tokens * top_k if n_rows is None else n_rows)
    codes, scales = _gather_swiglu_mx_op(x, src, w_gate_up, offsets.contiguous(), top_k)
    return codes.view(E4M3), scales.view(E8M0)


def fused_moe_mlp_mxfp8(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor, offsets: Tensor,
                        topk_weights: Tensor, *, n_rows: int | None = None) -> Tensor:
    """The forward of the MXFP8 path, fused: the first GEMM gathers its rows and leaves
    SwiGLU's output as MXFP8 codes and scales (`gather_swiglu_mxfp8`); the second reads
    them, decodes them in registers (emulated MXFP8: ``w_down`` stays in ``x``'s dtype) and
    combines with the deterministic weighted scatter. ``F`` a multiple of 32. Forward only."""
    _check(x, w_gate_up, w_down, row_id_map, offsets, topk_weights)
    tokens, top_k = row_id_map.shape
    n_rows = tokens * top_k if n_rows is None else n_rows
    codes, scales = gather_swiglu_mxfp8(x, w_gate_up, row_id_map, offsets, n_rows=n_rows)
    src = row_source(row_id_map, n_rows)
    return _gemm_scatter_mx_op(codes.view(torch.uint8), scales.view(torch.uint8), w_down, src,
                               topk_weights.reshape(-1).float(), offsets.contiguous(), tokens, top_k)


def fused_moe_mlp_mxfp8_native(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor,
                               offsets: Tensor, topk_weights: Tensor, *, n_rows: int | None = None) -> Tensor:
    """The MXFP8 path with both operands of the second GEMM in MXFP8, for block-scaled tensor
    cores: the first GEMM's MXFP8 epilogue (`gather_swiglu_mxfp8`) hands its codes and scales
    straight to `moe_lab.kernels.mx_gemm.grouped_mx_gemm` (``tl.dot_scaled``: block-scaled
    ``tcgen05.mma`` on Blackwell, an upcast to bf16 on Hopper), with ``w_down`` quantized
    along ``F`` (its reduction dim) by the Triton quantizer; then the weighted combine
    (`moe_lab.kernels.permute.unpermute`, not fused here). ``F`` a multiple of 32. Forward
    only. In training the weights' MXFP8 copy would be made once per optimizer step."""
    from moe_lab.kernels.mx_gemm import grouped_mx_gemm
    from moe_lab.kernels.mx_quantize import mx_quantize
    from moe_lab.kernels.permute import unpermute

    _check(x, w_gate_up, w_down, row_id_map, offsets, topk_weights)
    tokens, top_k = row_id_map.shape
    n_rows = tokens * top_k if n_rows is None else n_rows
    codes, scales = gather_swiglu_mxfp8(x, w_gate_up, row_id_map, offsets, n_rows=n_rows)
    w2, _ = mx_quantize(w_down.transpose(1, 2), colwise=False, scale_mode="rceil")  # [E, D, F] along F
    y = grouped_mx_gemm(codes, scales, w2.data, w2.scale, offsets.to(torch.int32), out_dtype=x.dtype)
    return unpermute(y, row_id_map, topk_weights.float())


def fused_moe_mlp_mxfp8_native_unfused(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor,
                                       offsets: Tensor, topk_weights: Tensor, *,
                                       n_rows: int | None = None) -> Tensor:
    """permute → GEMM + SwiGLU → MXFP8 quantizer → dequantize, ``w_down`` quantized along
    ``F`` and dequantized → GEMM → weighted unpermute, in plain PyTorch."""
    from moe_lab.quant.mx import quantize

    h = gather_swiglu_unfused(x, w_gate_up, row_id_map, offsets, n_rows=n_rows)
    hq = quantize(h, dim=-1, scale_mode="rceil").dequantize(torch.float32)
    wq = quantize(w_down, dim=1, scale_mode="rceil").dequantize(torch.float32)
    return gemm_scatter_unfused(hq, wq, row_id_map, offsets, topk_weights).to(x.dtype)


# --------------------------------------------------------------------------------------
# The unfused chains (what each fusion is tested against) and the registry
# --------------------------------------------------------------------------------------


def _permuted(x: Tensor, row_id_map: Tensor, n_rows: int | None) -> Tensor:
    from moe_lab.kernels.permute import permute_reference

    tokens, top_k = row_id_map.shape
    return permute_reference(x, row_id_map, tokens * top_k if n_rows is None else n_rows)


def _grouped(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    from moe_lab.kernels.grouped_gemm import grouped_gemm_reference

    return grouped_gemm_reference(x, w, offsets)


def gather_swiglu_unfused(x: Tensor, w_gate_up: Tensor, row_id_map: Tensor, offsets: Tensor, *,
                          n_rows: int | None = None) -> Tensor:
    """permute → grouped GEMM → SwiGLU, in plain PyTorch."""
    from moe_lab.moe.experts import swiglu

    return swiglu(_grouped(_permuted(x, row_id_map, n_rows), w_gate_up, offsets))


def gemm_scatter_unfused(h: Tensor, w_down: Tensor, row_id_map: Tensor, offsets: Tensor,
                         topk_weights: Tensor, *, scatter: str = "deterministic") -> Tensor:
    """grouped GEMM → weighted unpermute, in plain PyTorch (``scatter`` is ignored)."""
    from moe_lab.kernels.permute import unpermute_reference

    return unpermute_reference(_grouped(h, w_down, offsets), row_id_map, topk_weights.float())


def gather_swiglu_mxfp8_unfused(x: Tensor, w_gate_up: Tensor, row_id_map: Tensor, offsets: Tensor, *,
                                n_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """permute → grouped GEMM → SwiGLU → MXFP8 quantizer (rows, rceil), in plain PyTorch."""
    from moe_lab.quant.mx import quantize

    q = quantize(gather_swiglu_unfused(x, w_gate_up, row_id_map, offsets, n_rows=n_rows), dim=-1,
                 scale_mode="rceil")
    return q.data, q.scale


def fused_moe_mlp_unfused(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor,
                          offsets: Tensor, topk_weights: Tensor, *, n_rows: int | None = None,
                          scatter: str = "deterministic") -> Tensor:
    """The whole unfused chain: permute → GEMM + SwiGLU → GEMM → weighted unpermute."""
    h = gather_swiglu_unfused(x, w_gate_up, row_id_map, offsets, n_rows=n_rows)
    return gemm_scatter_unfused(h, w_down, row_id_map, offsets, topk_weights)


def fused_moe_mlp_mxfp8_unfused(x: Tensor, w_gate_up: Tensor, w_down: Tensor, row_id_map: Tensor,
                                offsets: Tensor, topk_weights: Tensor, *,
                                n_rows: int | None = None) -> Tensor:
    """permute → GEMM + SwiGLU → MXFP8 quantizer → dequantize → GEMM → weighted unpermute."""
    from moe_lab.quant.mx import quantize

    h = gather_swiglu_unfused(x, w_gate_up, row_id_map, offsets, n_rows=n_rows)
    hq = quantize(h, dim=-1, scale_mode="rceil").dequantize(torch.float32).to(h.dtype)
    return gemm_scatter_unfused(hq, w_down, row_id_map, offsets, topk_weights)


@dataclass(frozen=True)
class Fusion:
    """A fused function and the unfused chain it replaces (same arguments, same result)."""

    fused: Callable[..., object]
    unfused: Callable[..., object]
    what: str


# name -> Fusion; tests/lesson/kernels/test_fused_moe.py runs every entry against its unfused chain.
FUSIONS: Registry[Fusion] = Registry("fusion")
FUSIONS.register("gather_prologue", Fusion(
    gather_swiglu, gather_swiglu_unfused,
    "first GEMM reads token rows through the row-id map (no permuted copy of x)"))
FUSIONS.register("scatter_epilogue", Fusion(
    gemm_scatter, gemm_scatter_unfused,
    "second GEMM weights its rows and sends them to their tokens (deterministic)"))
FUSIONS.register("scatter_epilogue_atomic", Fusion(
    lambda *a, **kw: gemm_scatter(*a, **kw, scatter="atomic"), gemm_scatter_unfused,
    "second GEMM adds its weighted rows into the tokens with float32 atomics"))
FUSIONS.register("mxfp8_epilogue", Fusion(
    gather_swiglu_mxfp8, gather_swiglu_mxfp8_unfused,
    "first GEMM's SwiGLU output leaves as MXFP8 codes and scales"))
FUSIONS.register("mxfp8_mlp_forward", Fusion(
    fused_moe_mlp_mxfp8, fused_moe_mlp_mxfp8_unfused,
    "MXFP8 epilogue feeding the second GEMM (decoded in registers) and the weighted scatter"))
FUSIONS.register("mxfp8_mlp_forward_native", Fusion(
    fused_moe_mlp_mxfp8_native, fused_moe_mlp_mxfp8_native_unfused,
    "MXFP8 epilogue feeding a grouped MXFP8 GEMM (tl.dot_scaled, W2 in MXFP8 too)"))
FUSIONS.register("fused_mlp", Fusion(
    fused_moe_mlp, fused_moe_mlp_unfused, "gather prologue + SwiGLU + weighted scatter"))


# --------------------------------------------------------------------------------------
# What a CUDA launch compiles (the compile report)
# --------------------------------------------------------------------------------------


def _spec(kernel: str, label: str, pointers: dict[str, str], cfg: LaunchConfig, ints: dict[str, int],
          dtype: str, **constexprs) -> CompileSpec:
    signature, constants = int_args(**ints)
    return CompileSpec(
        f"{__name__}:{kernel}", f"[{describe(cfg)}] {label}",
        {**pointers, "offsets_ptr": "*i32", **signature},
        {**constants, **cfg.blocks, "DOT_BF16": _dot_bf16(SPEC_DTYPES[dtype], interpreted=False),
         **constexprs},
        cfg,
        FP32_NOTE if dtype == "fp32" else "",
    )


def compile_specs() -> list[CompileSpec]:
    """Every fused kernel as a CUDA launch compiles it for one MoE layer at DeepSeek-V3's
    and GPT-OSS-20B's shapes (`moe_lab.kernels.launch.SPEC_TOKENS` tokens per GPU), in
    bfloat16 and float32, with the tile `moe_lab.kernels.grouped_gemm.launch_config`
    chooses for the unfused kernel it replaces: the gather-prologue SwiGLU GEMM forward,
    backward and with the MXFP8 epilogue (bf16), the scatter-epilogue GEMM (forward
    combine, weighted, both schemes; the first GEMM's dX, unweighted), the combine's
    backward gather GEMM, and the two gathered weight-gradient GEMMs."""
    specs = []
    for name, model in SPEC_PRESETS.items():
        moe = preset(name).moe
        n_experts, d, f, top_k = moe.n_experts, moe.d_model, moe.d_expert, moe.top_k
        m, tokens = SPEC_TOKENS * moe.top_k, SPEC_TOKENS
        block_e = _block_e(n_experts)
        for dtype, torch_dtype in SPEC_DTYPES.items():
            at = (f"{dtype}, {model}: E={n_experts}, d_model={d}, d_expert={f}, "
                  f"{tokens} tokens x top-{top_k} = {m} rows")
            p = f"*{dtype}"
            cfg = launch_config("swiglu", m, f, d, n_experts, interpreted=False, dtype=torch_dtype)
            ints = dict(M_ROWS=m, F=f, K=d, E=n_experts, TOP_K=top_k, s_xm=d, s_xk=1, s_we=2 * f * d,
                        s_wk=2 * f, s_wn=1, s_om=f, s_on=1, s_dm=f, s_dn=1)
            pointers = {"x_ptr": p, "src_ptr": "*i32", "w_ptr": p, "out_ptr": p, "dh_ptr": p,
                        "scale_ptr": p}
            for backward in (False, True):
                what = "backward (recomputed, dgate/dup epilogue)" if backward else "forward"
                specs.append(_spec(
                    "_gather_swiglu_kernel", f"gather prologue + SwiGLU GEMM {what}, {at}", pointers, cfg,
                    {**ints, "s_om": 2 * f if backward else f}, dtype, BLOCK_E=block_e,
                    BACKWARD=backward, MX_OUT=False, IS_BF16=dtype == "bf16"))
            if dtype == "bf16":
                mx_cfg = _mx_config(cfg)
                specs.append(_spec(
                    "_gather_swiglu_kernel", f"gather prologue + SwiGLU GEMM + MXFP8-quantize epilogue, {at}",
                    {**pointers, "out_ptr": "*u8", "scale_ptr": "*u8"}, mx_cfg, ints, dtype,
                    BLOCK_E=block_e, BACKWARD=False, MX_OUT=True, IS_BF16=True))
            # The scatter epilogue: the down projection's combine (weighted), and the first
            # GEMM's dX back to the tokens (unweighted, W1ᵀ as a view).
            for what, n, k, w_strides, weighted in (
                    ("down projection + weighted scatter (the combine)", d, f, (f * d, d, 1), True),
                    ("dX of the up/gate projection + scatter to tokens", d, 2 * f, (2 * f * d, 1, 2 * f),
                     False)):
                cfg = launch_config("gemm", m, n, k, n_experts, interpreted=False, dtype=torch_dtype)
                for atomic in (False, True):
                    scheme = "fp32 atomics" if atomic else "token-major store"
                    specs.append(_spec(
                        "_gemm_scatter_kernel", f"grouped GEMM {what}, {scheme}, {at}",
                        {"a_ptr": p, "a_scale_ptr": p, "w_ptr": p, "out_ptr": "*fp32" if atomic else p,
                         "src_ptr": "*i32", "weight_ptr": "*fp32" if weighted else "*i32"}, cfg,
                        dict(M_ROWS=m, N=n, K=k, E=n_experts, TOP_K=top_k, s_am=k, s_ak=1,
                             s_we=w_strides[0], s_wk=w_strides[1], s_wn=w_strides[2], s_om=n, s_on=1),
                        dtype, BLOCK_E=block_e, HAS_WEIGHTS=weighted, ATOMIC=atomic, A_MX=False))
                if weighted and dtype == "bf16":  # the MXFP8 path's second GEMM: A as codes + scales
                    mx_cfg = _mx_k_config(cfg)
                    specs.append(_spec(
                        "_gemm_scatter_kernel", f"grouped GEMM {what}, A as MXFP8 codes + scales decoded "
                        f"in registers, token-major store, {at}",
                        {"a_ptr": "*u8", "a_scale_ptr": "*u8", "w_ptr": p, "out_ptr": p, "src_ptr": "*i32",
                         "weight_ptr": "*fp32"}, mx_cfg,
                        dict(M_ROWS=m, N=n, K=k, E=n_experts, TOP_K=top_k, s_am=k, s_ak=1,
                             s_we=w_strides[0], s_wk=w_strides[1], s_wn=w_strides[2], s_om=n, s_on=1),
                        dtype, BLOCK_E=block_e, HAS_WEIGHTS=True, ATOMIC=False, A_MX=True))
            cfg = launch_config("gemm", m, f, d, n_experts, interpreted=False, dtype=torch_dtype)
            n_tiles = triton.cdiv(f, cfg.blocks["BLOCK_N"])
            specs.append(_spec(
                "_gather_gemm_kernel", f"combine backward: gathered dout·W2ᵀ, dh and weight-gradient "
                f"epilogue, {at}",
                {"g_ptr": p, "src_ptr": "*i32", "w_ptr": p, "h_ptr": p, "weight_ptr": "*fp32", "out_ptr": p,
                 "part_ptr": "*fp32"}, cfg,
                dict(M_ROWS=m, N=f, K=d, E=n_experts, TOP_K=top_k, N_TILES=n_tiles, s_gm=d, s_gk=1,
                     s_we=f * d, s_wk=1, s_wn=d, s_hm=f, s_hn=1, s_om=f, s_on=1),
                dtype, BLOCK_E=block_e))
            for what, k, n, gather_x in (("up/gate projection, gathered x", d, 2 * f, True),
                                         ("down projection, gathered weighted dout", f, d, False)):
                cfg = fused_launch_config("dw", m, n, k, n_experts, interpreted=False, dtype=torch_dtype)
                specs.append(_spec(
                    "_gather_dw_kernel", f"grouped GEMM dW per expert ({what}), {at}",
                    {"x_ptr": p, "dy_ptr": p, "dw_ptr": p, "src_ptr": "*i32",
                     "weight_ptr": "*i32" if gather_x else "*fp32"}, cfg,
                    dict(M_ROWS=m, N=n, K=k, TOP_K=top_k, s_xm=k, s_xk=1, s_ym=n if gather_x else d,
                         s_yn=1, s_we=k * n, s_wk=n, s_wn=1),
                    dtype, GATHER_X=gather_x))
    return merge_specs(specs)


__all__ = ["FUSIONS", "SCATTER_MODES", "Fusion", "compile_specs", "fused_moe_mlp", "fused_moe_mlp_mxfp8",
           "fused_moe_mlp_mxfp8_native", "fused_moe_mlp_mxfp8_native_unfused",
           "fused_moe_mlp_mxfp8_unfused", "fused_moe_mlp_unfused",
           "gather_swiglu", "gather_swiglu_mxfp8", "gather_swiglu_unfused", "gemm_scatter",
           "gemm_scatter_unfused", "row_source"]
