"""Triton flash-attention forward on MXFP8 inputs: block scales applied inside the tile loop.

Flash attention computes ``softmax(QKᵀ/√d)·V`` one ``[BLOCK_M, BLOCK_N]`` tile of scores at a
time with the *online softmax* (a running maximum and sum per query row, the accumulator
rescaled when the maximum grows). MXFP8 operands change the two products, not the softmax.
``QKᵀ`` reduces over ``head_dim``, so Q and K arrive blocked along it; ``P·V`` reduces over the
keys, so V arrives blocked along the keys, and the kernel quantizes each tile of probabilities
``p = exp(s - m)`` to MXFP8 along the keys itself (integer arithmetic of
`moe_lab.kernels.mx_quantize`; the row sum uses the unquantized ``p``, as FP8 attention does).

Both products go through `moe_lab.kernels.mx_gemm.mx_dot`: ``tl.dot_scaled`` compiled (the
block-scaled ``tcgen05.mma`` on Blackwell, FP8 ``wgmma`` per 32-wide block on Hopper),
exactly decoded fp32 and an IEEE ``tl.dot`` under the interpreter (``MX_MMA`` of `mx_dot`).
Grid: ``(cdiv(T_q, BLOCK_M), B·H)``. Requirements: causal, ``T_q <= T_k`` (query ``i`` sees
keys ``<= i + T_k - T_q``), Q/K head_dim and V's keys padded to multiples of 32 (what
`quantize_qkv` makes). Backward is not a kernel: `moe_lab.attention` differentiates through
the reference emulation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moe_lab.checks import one_of
from moe_lab.kernels.common import INTERPRETED
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.kernels.mx_gemm import check_mma, e4m3_to_fp32, e8m0_to_fp32, mx_dot
from moe_lab.kernels.mx_quantize import mx_block_codes, mx_quantize
from moe_lab.quant.mx import BLOCK_SIZE, E4M3, SCALE_MODES, MXTensor, padded_size

Tensor = torch.Tensor
LOG2E = 1.4426950408889634


@triton.jit
def _mx_attention_fwd_kernel(
    q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, o_ptr,
    H, KV_GROUP, T_Q, T_K, T_K_PAD, D, D_PAD, sm_scale_log2,
    s_qb, s_qh, s_qt, s_qd, s_qsb, s_qsh, s_qst, s_qsd,
    s_kb, s_kh, s_kt, s_kd, s_ksb, s_ksh, s_kst, s_ksd,
    s_vb, s_vh, s_vt, s_vd, s_vsb, s_vsh, s_vst, s_vsd,
    s_ob, s_oh, s_ot, s_od,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    N_DB: tl.constexpr, MX: tl.constexpr, QUANT_P: tl.constexpr, RCEIL: tl.constexpr,
    MX_MMA: tl.constexpr,
):
    # q codes [B, H, T_Q, D_PAD] u8, q scales [B, H, T_Q, D_PAD/32] u8 (k likewise, H_kv heads);
    # v codes [B, H_kv, T_K_PAD, D] u8 blocked along keys, v scales [B, H_kv, T_K_PAD/32, D];
    # o [B, H, T_Q, D] float32. N_DB: head-dim blocks, rounded up to a power of two; the
    # blocks past D_PAD load as zero codes (they add nothing to a score).
    # Offsets in int64: [B, H, T, d] passes 2^31 elements at a few dozen sequences of 4,096
    # tokens with 128 heads, where int32 offset arithmetic would wrap around.
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b, h = pid_bh // H, pid_bh % H
    hk = h // KV_GROUP
    q_ptr += b * s_qb + h * s_qh
    qs_ptr += b * s_qsb + h * s_qsh
    k_ptr += b * s_kb + hk * s_kh
    ks_ptr += b * s_ksb + hk * s_ksh
    v_ptr += b * s_vb + hk * s_vh
    vs_ptr += b * s_vsb + hk * s_vsh
    BLOCK_DK: tl.constexpr = N_DB * MX  # the QKᵀ reduction, head_dim padded
    N_KB: tl.constexpr = BLOCK_N // MX  # the P·V reduction's scale blocks per key tile
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK).to(tl.int64)
    db = tl.arange(0, N_DB).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    kb = tl.arange(0, N_KB).to(tl.int64)

    # Q: codes [BLOCK_M, BLOCK_DK] and scale bytes [BLOCK_M, N_DB], loaded once.
    q_codes = tl.load(q_ptr + offs_m[:, None] * s_qt + offs_dk[None, :] * s_qd,
                      mask=(offs_m[:, None] < T_Q) & (offs_dk[None, :] < D_PAD), other=0)
    q_scale = tl.load(qs_ptr + offs_m[:, None] * s_qst + db[None, :] * s_qsd,
                      mask=(offs_m[:, None] < T_Q) & (db[None, :] < D_PAD // MX), other=127)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    offset = T_K - T_Q  # causal: query i sees keys j <= i + offset
    hi = tl.minimum(T_K, (pid_m + 1) * BLOCK_M + offset)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # Kᵀ: codes [BLOCK_DK, BLOCK_N], scale bytes [BLOCK_N, N_DB] (blocked along head_dim).
        k_codes = tl.load(k_ptr + offs_n[None, :] * s_kt + offs_dk[:, None] * s_kd,
                          mask=(offs_n[None, :] < T_K) & (offs_dk[:, None] < D_PAD), other=0)
        k_scale = tl.load(ks_ptr + offs_n[:, None] * s_kst + db[None, :] * s_ksd,
                          mask=(offs_n[:, None] < T_K) & (db[None, :] < D_PAD // MX), other=127)
        # The scores accumulate onto the causal mask's bias (0 where a query sees the key,
        # -inf elsewhere) rather than onto zeros: Triton 3.7 fails to compile a block-scaled
        # tcgen05 dot that has no accumulator to start from. The where() after it still
        # masks, so a NaN from a hidden key cannot leak in.
        causal = (offs_n[None, :] <= offs_m[:, None] + offset) & (offs_n[None, :] < T_K)
        s = mx_dot(q_codes, q_scale, k_codes, k_scale, tl.where(causal, 0.0, float("-inf")),
                   BLOCK_M, BLOCK_N, BLOCK_DK, MX_MMA)
        s = tl.where(causal, s * sm_scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N], in [0, 1]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]

        # V: codes [BLOCK_N, BLOCK_D] and scale bytes [BLOCK_D, N_KB] (blocked along the keys).
        v_codes = tl.load(v_ptr + offs_n[:, None] * s_vt + offs_d[None, :] * s_vd,
                          mask=(offs_n[:, None] < T_K_PAD) & (offs_d[None, :] < D), other=0)
        vblk = start_n // MX + kb
        v_scale = tl.load(vs_ptr + vblk[None, :] * s_vst + offs_d[:, None] * s_vsd,
                          mask=(vblk[None, :] < T_K_PAD // MX) & (offs_d[:, None] < D), other=127)
        if QUANT_P:
            # P to MXFP8 along the keys, in integer arithmetic (the bits do not depend on
            # the device's float casts): [BLOCK_M, N_KB, 32] blocks, one scale byte each.
            p_bits = tl.reshape(p, (BLOCK_M, N_KB, MX)).to(tl.int32, bitcast=True)
            # E4M3: largest power of two 2^8, 3 mantissa bits, bias 7
            p_codes, p_scale = mx_block_codes(p_bits, 2, 8, RCEIL, 3, 7, 0x7E, 0x7F)
            p_codes = tl.reshape(p_codes, (BLOCK_M, BLOCK_N)).to(tl.uint8)
            acc = mx_dot(p_codes, p_scale.to(tl.uint8), v_codes, v_scale, acc,
                         BLOCK_M, BLOCK_D, BLOCK_N, MX_MMA)
        else:
            # P stays float32 all the way into an IEEE float32 dot: a float16 or TF32
            # tensor-core dot would round it to 11 significant bits on the way in.
            v_vals = tl.reshape(tl.reshape(e4m3_to_fp32(v_codes), (N_KB, MX, BLOCK_D))
                                * tl.trans(e8m0_to_fp32(v_scale))[:, None, :], (BLOCK_N, BLOCK_D))
            acc = tl.dot(p, v_vals, acc, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]
    o_ok = (offs_m[:, None] < T_Q) & (offs_d[None, :] < D)
    o_ptr += b * s_ob + h * s_oh
    tl.store(o_ptr + offs_m[:, None] * s_ot + offs_d[None, :] * s_od, out, mask=o_ok)


def mode_constexprs(quantize_p: bool, scale_mode: str, mma: str) -> dict[str, object]:
    """The kernel's constexprs besides the tile. ``MX_MMA`` (``mma``): the MXFP8 products
    through ``tl.dot_scaled`` (sm_100), FP8 ``wgmma`` per 32-wide block (sm_90) or decomposed
    into exact fp32 (Triton's interpreter): see `moe_lab.kernels.mx_gemm.mx_dot`."""
    return {"MX": BLOCK_SIZE, "QUANT_P": quantize_p, "RCEIL": scale_mode == "rceil", "MX_MMA": mma}


def launch_config(t_q: int, t_k: int, d: int, interpreted: bool, mma: str = "scaled") -> LaunchConfig:
    """Tiles and warps for ``t_q`` queries over ``t_k`` keys at head_dim ``d``, for the
    ``MX_MMA`` ``mma`` (`moe_lab.kernels.mx_gemm.mx_dot`).

    ``BLOCK_D`` (the output's columns) and ``N_DB`` (head-dim blocks of 32 in a Q/K row) are
    ``d`` and its padding rounded up to powers of two, as ``tl.arange`` needs. Interpreted:
    one tile as large as the problem up to 128 (each program instance costs a Python round
    trip). Compiled, 32 keys per step: one MX block of the ``P·V`` reduction, which keeps the
    score tile and the probabilities' quantization (integer work on ``[rows, 32]`` values)
    small. ``"scaled"`` (Blackwell): 128 queries on 8 warps, 3 stages; 128 rows is the M of
    one block-scaled ``tcgen05.mma`` (at 64 rows Triton does not use the native instruction
    and upcasts the FP8 tiles to bf16 instead). ``"fp8_promote"`` (Hopper): 64 queries on 8
    warps, 3 stages. The promoted product keeps an fp32 partial beside each accumulator
    (``P·V``'s is ``[rows, BLOCK_D]``), and at 128 rows the two spill from head_dim 128 on
    (the compile report); 64 rows is one ``wgmma`` M, and the two warpgroups split its N, so
    each thread holds half of its share at 128 rows; so does ``"bf16"``'s decoded tiles (64 too).
    """
    head = {"BLOCK_D": max(16, triton.next_power_of_2(d)),
            "N_DB": triton.next_power_of_2(padded_size(d) // BLOCK_SIZE)}
    if interpreted:
        block_n = min(128, max(32, triton.next_power_of_2(t_k)))
        block_m = min(block_n, max(16, triton.next_power_of_2(t_q)))
        return LaunchConfig({"BLOCK_M": block_m, "BLOCK_N": block_n, **head}, num_warps=4, num_stages=1)
    block_m = 64 if mma in ("fp8_promote", "bf16") else 128
    return LaunchConfig({"BLOCK_M": block_m, "BLOCK_N": BLOCK_SIZE, **head}, num_warps=8, num_stages=3)


def mx_attention_forward(
    q: MXTensor, k: MXTensor, v: MXTensor, *, quantize_p: bool = True, scale_mode: str = "rceil",
    mma: str | None = None,
) -> Tensor:
    """Causal attention ``softmax(QKᵀ/√d)·V`` on MXFP8 operands, one flash-attention pass.

    Args:
        q: MXTensor of ``[B, H, T_q, d]`` blocked along head_dim (``dim=3``).
        k: MXTensor of ``[B, H_kv, T_k, d]`` blocked along head_dim; ``H_kv`` divides ``H``.
        v: MXTensor of ``[B, H_kv, T_k, d]`` blocked along the keys (``dim=2``).
        quantize_p: quantize the probabilities to MXFP8 along the keys (the recipe);
            ``False`` keeps them float32 into an IEEE float32 ``P·V`` dot, compiled as
            interpreted (to study where the error comes from; slow on a GPU, no tensor
            cores).
        scale_mode: the scale rule for the probabilities (``"rceil"`` or ``"floor"``).
        mma: the ``MX_MMA`` of `moe_lab.kernels.mx_gemm.mx_dot`; ``None``: `mx_mma_mode`'s.

    Returns:
        ``[B, H, T_q, d]`` float32, on q's device.
    """
    for name, mx, dim in (("q", q, 3), ("k", k, 3), ("v", v, 2)):
        if not isinstance(mx, MXTensor):
            raise TypeError(f"{name} must be an MXTensor, got {type(mx).__name__}")
        if mx.elem_dtype != E4M3 or mx.block_size != BLOCK_SIZE or len(mx.shape) != 4 or mx.dim != dim:
            raise ValueError(
                f"{name} must be a [batch, heads, seq, head_dim] MXFP8 E4M3 MXTensor (block_size "
                f"{BLOCK_SIZE}) blocked along dim {dim}, got {mx.elem_dtype} (block_size {mx.block_size}) "
                f"of shape {tuple(mx.shape)} blocked along dim {mx.dim}")
    one_of(scale_mode, "scale_mode", SCALE_MODES)
    bq, h, t_q, d = q.shape
    bk, h_kv, t_k, dk = k.shape
    if (bk, dk) != (bq, d) or tuple(v.shape) != tuple(k.shape):
        raise ValueError(
            f"q, k, v must agree: q [B, H, T_q, d], k and v [B, H_kv, T_k, d]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if h % h_kv:
        raise ValueError(f"k heads ({h_kv}) must divide q heads ({h})")
    if t_q > t_k:
        raise ValueError(f"T_q = {t_q} must be <= T_k = {t_k} (causal: every query sees a key)")
    device = q.data.device
    mma = check_mma("q", device, mma, k=k.data, v=v.data)
    out = torch.empty((bq, h, t_q, d), dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out
    cfg = launch_config(t_q, t_k, d, INTERPRETED, mma)
    # Codes and scale bytes of q, k, v, then the output: the kernel's pointers and strides.
    tensors = [t.view(torch.uint8) for mx in (q, k, v) for t in (mx.data, mx.scale)] + [out]
    grid = (triton.cdiv(t_q, cfg.blocks["BLOCK_M"]), bq * h)
    _mx_attention_fwd_kernel[grid](
        *tensors,
        h, h // h_kv, t_q, t_k, v.data.shape[2], d, padded_size(d), LOG2E / math.sqrt(d),
        *[stride for t in tensors for stride in t.stride()],
        **mode_constexprs(quantize_p, scale_mode, mma),
        **cfg.blocks,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def quantize_qkv(q: Tensor, k: Tensor, v: Tensor, scale_mode: str = "rceil"
                 ) -> tuple[MXTensor, MXTensor, MXTensor]:
    """MXFP8 copies for attention with the Triton quantizer: Q and K blocked along
    head_dim, V along the keys (each padded with zeros to a multiple of 32).

    ``q``: ``[B, H, T_q, d]``; ``k``, ``v``: ``[B, H_kv, T_k, d]``; float32 or bfloat16.
    """
    def blocked(name: str, x: Tensor, dim: int) -> MXTensor:
        if x.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seq, head_dim], got {tuple(x.shape)}")
        b, h, t, d = x.shape
        row, col = mx_quantize(x.reshape(b * h, t, d), rowwise=dim == 3, colwise=dim == 2,
                               scale_mode=scale_mode, pad=True)
        mx = row if dim == 3 else col
        return MXTensor(mx.data.unflatten(0, (b, h)), mx.scale.unflatten(0, (b, h)), E4M3, BLOCK_SIZE, dim,
                        x.shape)

    return blocked("q", q, 3), blocked("k", k, 3), blocked("v", v, 2)
