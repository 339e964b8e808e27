"""MXFP8 GEMM on block-scaled tensor cores: ``C = dequant(A) · dequant(B)ᵀ`` through ``tl.dot_scaled``.

An MXFP8 operand is E4M3 element codes and, for every 32 consecutive elements along the
reduction dim K, one E8M0 scale byte (``2^(byte - 127)``). Blackwell's block-scaled MMA
(``tcgen05.mma … kind::mxf8f6f4.block_scale``) takes both as stored and, per 32-wide slice of
K, adds the FP8 × FP8 products times ``2^(a_scale + b_scale - 254)`` into fp32: nothing is
dequantized in registers, operands travel at 8.25 bits a value, the MMA runs at FP8 rate.
Hopper has no such instruction (there ``tl.dot_scaled`` becomes a bf16 ``wgmma`` on
upcast tiles), so for sm_90 `mx_dot` runs one FP8 ``wgmma`` per 32-wide K block and
applies the two scales to its fp32 partial in registers.

Grid: one program per ``[BLOCK_M, BLOCK_N]`` output tile (the grouped kernel: the grouped
GEMM's tile schedule over device offsets). The constexpr ``MX_MMA`` picks the inner
product (`mx_dot`): ``"scaled"``, ``"fp8_promote"`` or ``"emulate"`` (Triton's interpreter,
which cannot run ``tl.dot_scaled``): the same tile math decomposed — codes and scale
bytes decoded to fp32 exactly, as
`moe_lab.quant.mx.MXTensor.dequantize` does, then an IEEE fp32 ``tl.dot`` — so the CPU checks
the tiling, masks and scale indexing against `mx_gemm_reference`.

Layout (row-major along K, as `moe_lab.quant.mx.quantize(x, dim=-1)` stores it): ``a: [M, K]``
E4M3, ``a_scale: [M, K/32]`` E8M0; ``b: [N, K]`` (a weight ``[out, in]``), ``b_scale: [N, K/32]``;
``c: [M, N]`` fp32 or bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_lab.checks import one_of
from moe_lab.kernels import common
from moe_lab.kernels.common import INTERPRETED, check_device, dense_group
from moe_lab.kernels.grouped_gemm import block_e, grouped_grid, tile_group
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.perf.hardware import MX_MMA_NEEDS, gpu_arch, mx_mma_of
from moe_lab.quant.mx import BLOCK_SIZE, E4M3, E8M0, MXTensor

Tensor = torch.Tensor
OUT_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def e4m3_to_fp32(code):
    """E4M3 byte (uint8) → its fp32 value, by building the fp32 bit pattern: sign, exponent
    rebiased from 7 to 127, mantissa moved up 20 bits; subnormals are ``m · 2^-9`` (exact);
    ``S.1111.111`` is NaN."""
    c = code.to(tl.int32)
    sign = (c >> 7) << 31
    exp = (c >> 3) & 0xF
    man = c & 0x7
    normal = (sign | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    subnormal = man.to(tl.float32) * 0.001953125  # 2^-9
    subnormal = tl.where(sign != 0, -subnormal, subnormal)
    value = tl.where(exp == 0, subnormal, normal)
    return tl.where((exp == 0xF) & (man == 0x7), float("nan"), value)


@triton.jit
def e8m0_to_fp32(byte):
    """E8M0 byte (uint8) → ``2^(byte - 127)`` as fp32: the byte is the fp32 exponent field,
    except 0 (``2^-127``, an fp32 subnormal: bit 22) and 0xFF (NaN)."""
    s = byte.to(tl.int32)
    bits = tl.where(s == 0, 0x00400000, s << 23)
    return tl.where(s == 0xFF, float("nan"), bits.to(tl.float32, bitcast=True))


MX_MMAS = ("scaled", "fp8_promote", "bf16", "emulate")


def mx_mma_mode(interpreted: bool, device: torch.device | None = None) -> str:
    """The ``MX_MMA`` a wrapper compiles, by the GPU's row of `moe_lab.perf.hardware.ARCHS`:
    ``"scaled"`` with block-scaled MMA (sm_100: ``tcgen05.mma``), ``"fp8_promote"`` with FP8
    tensor cores (sm_89, sm_90: an FP8 MMA per 32-wide K block, scales applied in fp32
    registers), ``"bf16"`` below (sm_80, sm_86: the operands decoded to bf16, one bf16 MMA);
    ``"emulate"`` under Triton's interpreter."""
    return "emulate" if interpreted else mx_mma_of(gpu_arch(torch.cuda.get_device_capability(device)))



def check_mma(name: str, device: torch.device, mma: str | None, **others: Tensor | None) -> str:
    """`check_device` for a wrapper's operand ``name`` (and ``others`` on its device), and a forced
    ``mma`` (one of `MX_MMAS`) this device runs: the GPU has what it needs; ``"bf16"`` runs
    compiled only (the interpreter's ``tl.dot`` multiplies bf16 bit patterns as integers).
    Returns the MMA to run: ``mma``, or `mx_mma_mode`'s where it is ``None``."""
    if mma is not None:
        one_of(mma, "mma", MX_MMAS)
        if mma == "bf16" and INTERPRETED:
            raise ValueError("mma='bf16' runs compiled only: the interpreter's tl.dot multiplies bf16 "
                             "bit patterns as integers (use 'emulate')")
    check_device(name, device, MX_MMA_NEEDS.get(mma, "bf16_mma"), f"mma={mma!r}", **others)
    return mma or mx_mma_mode(INTERPRETED, device)


@triton.jit
def _halves(x, R: tl.constexpr, C: tl.constexpr):
    """``x[:, :C/2], x[:, C/2:]`` of an ``[R, C]`` tile."""
    return tl.split(tl.permute(tl.reshape(x, (R, 2, C // 2)), (0, 2, 1)))


@triton.jit
def _promote(a, a_scale, b_t, b_scale, acc, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """``acc`` plus, per 32-wide K block, the fp32 FP8 dot of its codes times its two scales
    (``b_t`` is ``b`` as ``[N, K]``); halves K until one block is left."""
    if K == 32:
        part = tl.dot(a.to(tl.float8e4nv, bitcast=True), tl.trans(b_t).to(tl.float8e4nv, bitcast=True),
                      out_dtype=tl.float32)
        sa = e8m0_to_fp32(tl.reshape(a_scale, (M,)))
        sb = e8m0_to_fp32(tl.reshape(b_scale, (N,)))
        acc += part * sa[:, None] * sb[None, :]
    else:
        a0, a1 = _halves(a, M, K)
        b0, b1 = _halves(b_t, N, K)
        sa0, sa1 = _halves(a_scale, M, K // 32)
        sb0, sb1 = _halves(b_scale, N, K // 32)
        acc = _promote(a0, sa0, b0, sb0, acc, M, N, K // 2)
        acc = _promote(a1, sa1, b1, sb1, acc, M, N, K // 2)
    return acc


@triton.jit
def mx_dot(a, a_scale, b, b_scale, acc, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
           MX_MMA: tl.constexpr):
    """``acc + dequant(a) · dequant(b)`` for one tile: ``a`` ``[M, K]`` and ``b`` ``[K, N]``
    E4M3 bytes (uint8), ``a_scale`` ``[M, K/32]`` and ``b_scale`` ``[N, K/32]`` E8M0 bytes
    (both operands blocked along K), ``acc`` ``[M, N]`` fp32. ``K``: 32 times a power of two.

    ``MX_MMA="scaled"``: one ``tl.dot_scaled`` (block-scaled ``tcgen05.mma`` on sm_100).
    ``"fp8_promote"`` (sm_90): per 32-wide K block one E4M3 × E4M3 ``tl.dot`` (FP8 ``wgmma``,
    fp32 out), its ``[M, N]`` partial times ``2^(sa-127)`` per row and ``2^(sb-127)`` per
    column in fp32 registers, added to ``acc`` — no bf16 copy of the operands. Hopper's FP8
    wgmma accumulates with reduced internal precision ("DeepSeek-V3 Technical Report",
    arXiv:2412.19437, on increasing accumulation precision); promoting every 32 products to
    fp32 bounds that error to one 32-term sum, and `moe_lab.workbench.measure.mx_bounds`
    states the elementwise bound a GPU's result is checked against.
    Under Triton's interpreter it runs too, but its float8 dot decodes the E4M3 NaN code
    0x7F as 480 (hardware: NaN), so there only NaN scales poison.
    ``"emulate"`` (the interpreter's default): codes and scales decoded exactly to fp32, each
    scale broadcast over its 32 codes, one IEEE fp32 ``tl.dot``.

    What is exact: every product of two E4M3 values (4-bit significands, an 8-bit product)
    and every scaling by a power of two (barring fp32 overflow/underflow), so both
    "fp8_promote" and "emulate" are fp32 sums of the same K exact terms, in different orders
    (per block, then across blocks; versus one dot). A 32-term sum is not exact in general
    (products span 2^-18 to 448²: up to 41 bits); any fp32 summation order of n terms is
    within ``γ(n-1) = (n-1)u / (1 - (n-1)u)``, ``u = 2^-24``, of ``Σ|terms|``
    (Higham, Accuracy and Stability of Numerical Algorithms, 4.2), so under the interpreter,
    whose every dot is IEEE fp32, each mode is within ``γ(K_total - 1) · (|A|·|B|ᵀ)`` of the
    exact product (the interpreted tests' tolerance). On Hopper the FP8 ``wgmma`` sums each
    block in a narrower accumulator: `moe_lab.workbench.measure.mx_bounds`.
    """
    if MX_MMA == "scaled":
        acc = tl.dot_scaled(a.to(tl.float8e4nv, bitcast=True), a_scale, "e4m3",
                            b.to(tl.float8e4nv, bitcast=True), b_scale, "e4m3", acc)
    elif MX_MMA == "fp8_promote":
        acc = _promote(a, a_scale, tl.trans(b), b_scale, acc, M, N, K)
    else:  # "emulate" or "bf16"
        # [M, K] -> [M, K/32, 32] times [M, K/32, 1] -> [M, K]; b likewise as [N, K].
        a_f = tl.reshape(tl.reshape(e4m3_to_fp32(a), (M, K // 32, 32))
                         * e8m0_to_fp32(a_scale)[:, :, None], (M, K))
        b_f = tl.reshape(tl.reshape(e4m3_to_fp32(tl.trans(b)), (N, K // 32, 32))
                         * e8m0_to_fp32(b_scale)[:, :, None], (N, K))
        if MX_MMA == "bf16":  # exact: a 4-bit significand times 2^s fits bf16 (bar |x| < 2^-133)
            acc = tl.dot(a_f.to(tl.bfloat16), tl.trans(b_f).to(tl.bfloat16), acc)
        else:
            acc = tl.dot(a_f, tl.trans(b_f), acc, input_precision="ieee")
    return acc


@triton.jit
def _mx_tile(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, rm, rn, m_in, n_in, N, K,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MX_MMA: tl.constexpr):
    """``c[rm, rn] = dequant(a[rm]) · dequant(b[rn])ᵀ`` over the whole of K, one `mx_dot` per
    ``BLOCK_K`` step: rows ``rm`` of ``a: [M, K]`` and ``rn`` of ``b: [N, K]`` (int64, masked by
    ``m_in``, ``n_in``), their scale bytes ``[rows, K/32]``, ``c: [M, N]``. Masked codes and scale
    bytes read as 0: a zero element contributes nothing."""
    rk = tl.arange(0, BLOCK_K)
    rs = tl.arange(0, BLOCK_K // 32)
    n_scales = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks, ss = k0 + rk, k0 // 32 + rs
        a = tl.load(a_ptr + rm[:, None] * K + ks[None, :], mask=m_in[:, None] & (ks < K)[None, :], other=0)
        b = tl.load(b_ptr + rn[None, :] * K + ks[:, None], mask=n_in[None, :] & (ks < K)[:, None], other=0)
        a_s = tl.load(a_scale_ptr + rm[:, None] * n_scales + ss[None, :],
                      mask=m_in[:, None] & (ss < n_scales)[None, :], other=0)  # [BLOCK_M, BLOCK_K/32]
        b_s = tl.load(b_scale_ptr + rn[:, None] * n_scales + ss[None, :],
                      mask=n_in[:, None] & (ss < n_scales)[None, :], other=0)  # [BLOCK_N, BLOCK_K/32]
        acc = mx_dot(a, a_s, b, b_s, acc, BLOCK_M, BLOCK_N, BLOCK_K, MX_MMA)
    c_ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    tl.store(c_ptrs, common.cast_for_store(acc, c_ptr), mask=m_in[:, None] & n_in[None, :])


@triton.jit
def _mx_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,  # u8 [M, K], u8 [M, K/32], u8 [N, K], u8 [N, K/32], [M, N]
    M, N, K,  # K a multiple of 32; all tensors contiguous
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    MX_MMA: tl.constexpr,
):
    # Grid: 1-D, cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N) programs in grouped order (`tile_order`).
    pid_m, pid_n = common.tile_order(N, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _mx_tile(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, rm.to(tl.int64), rn.to(tl.int64), rm < M,
             rn < N, N, K, BLOCK_M, BLOCK_N, BLOCK_K, MX_MMA)


@triton.jit
def _grouped_mx_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, offsets_ptr,
    M_ROWS, N, K, E,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    MX_MMA: tl.constexpr,
):
    # a: u8 [M_ROWS, K] rows grouped by expert (offsets: [E + 1] int32), a_scale: u8 [M_ROWS, K/32];
    # b: u8 [E, N, K] (each expert's weight [out, in]), b_scale: u8 [E, N, K/32]; c: [M_ROWS, N].
    # Grid: 1-D, `grouped_grid` over N; tiles as the grouped GEMM's.
    tile_m, tile_n = common.tile_order(N, BLOCK_N, GROUP_M)
    seg, row0, row_end = common.tile_schedule(offsets_ptr, tile_m, E, M_ROWS, BLOCK_M, BLOCK_E)
    if seg > E:  # past the last tile: no work
        return
    rm, rn, m_in = common.tile_rows(row0, row_end, tile_n, BLOCK_M, BLOCK_N)
    if seg == E:  # rows past the last expert's: zeros
        zeros = common.cast_for_store(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), c_ptr)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], zeros, mask=m_in[:, None] & (rn < N)[None, :])
        return
    expert = seg.to(tl.int64)
    _mx_tile(a_ptr, a_scale_ptr, b_ptr + expert * N * K, b_scale_ptr + expert * N * (K // 32), c_ptr,
             rm, rn, m_in, rn < N, N, K, BLOCK_M, BLOCK_N, BLOCK_K, MX_MMA)


def launch_config(m: int, n: int, k: int, interpreted: bool, mma: str = "scaled") -> LaunchConfig:
    """Tiles for an ``[M, N, K]`` MXFP8 GEMM (one or grouped). Compiled: 128×128×64 (two
    scale bytes per row per step), 8 warps, 3 stages — 128 rows is the M of one block-scaled
    ``tcgen05.mma`` per CTA, and the FP8 tiles (8 KB each per stage) stay in shared memory.
    (``mma="scaled"`` forced on sm_90 lowers ``tl.dot_scaled`` to bf16 copies of both FP8
    tiles in registers, which spill in the grouped kernel at ``BLOCK_K`` 128; `mx_mma_mode`
    gives sm_90 ``"fp8_promote"``.) ``mma="fp8_promote"`` (Hopper): 128×64×32, one FP8
    ``wgmma`` K block per step straight from shared memory (a wider K tile is split in
    registers); at ``BLOCK_N`` 128 the fp32 partial spills, as "bf16"'s decoded copies do (its tile too).
    Interpreted: the interpreter pays per program, so blocks as large as the problem allows."""
    if interpreted:
        return LaunchConfig({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64 if k >= 64 else 32},
                            num_warps=4, num_stages=1)
    if mma in ("fp8_promote", "bf16"):
        return LaunchConfig({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=8, num_stages=3)
    return LaunchConfig({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3)


def _check_operand(name: str, codes: Tensor, scales: Tensor, shape: str) -> None:
    """``codes``: E4M3 of ``shape`` (``[rows, K]``, or a grouped weight's ``[E, N, K]``), K a
    positive multiple of 32; ``scales``: their E8M0 bytes, one per 32 along K."""
    if not isinstance(codes, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} and {name}_scale must be torch.Tensors, got "
                        f"{type(codes).__name__} and {type(scales).__name__}")
    if codes.dim() != len(shape.split(",")):
        raise ValueError(f"{name} must be {len(shape.split(','))}-D {shape}, got shape {tuple(codes.shape)}")
    if codes.dtype != E4M3:
        raise ValueError(f"{name}.dtype must be {E4M3} (E4M3 codes), got {codes.dtype}")
    if scales.dtype not in (E8M0, torch.uint8):
        raise ValueError(f"{name}_scale.dtype must be {E8M0} or torch.uint8 (E8M0 bytes), got {scales.dtype}")
    k = codes.shape[-1]
    if k == 0 or k % BLOCK_SIZE:
        raise ValueError(f"{name}'s K = {k} must be a positive multiple of {BLOCK_SIZE}")
    if tuple(scales.shape) != (*codes.shape[:-1], k // BLOCK_SIZE):
        raise ValueError(f"{name}_scale must have shape {(*codes.shape[:-1], k // BLOCK_SIZE)} (one byte per "
                         f"{BLOCK_SIZE} elements of {name}'s rows), got {tuple(scales.shape)}")


def _mx_gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offsets: Tensor | None,
             out_dtype: torch.dtype, mma: str | None) -> Tensor:
    """Both wrappers' door and launch: `mx_gemm` without ``offsets``, `grouped_mx_gemm` with."""
    grouped = offsets is not None
    _check_operand("a", a, a_scale, "[rows, K]")
    _check_operand("b", b, b_scale, "[E, N, K]" if grouped else "[rows, K]")
    (m, k), n = a.shape, b.shape[-2]
    n_experts = b.shape[0] if grouped else 0
    if grouped and (not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32
                    or tuple(offsets.shape) != (n_experts + 1,)):
        raise ValueError(f"offsets must be an int32 tensor of shape ({n_experts + 1},) (one more than "
                         f"b's experts), got {getattr(offsets, 'dtype', None)} "
                         f"{tuple(getattr(offsets, 'shape', ()))}")
    if k != b.shape[-1]:
        raise ValueError(f"a and b must share K, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    one_of(out_dtype, "out_dtype", OUT_DTYPES)
    mma = check_mma("a", a.device, mma, a_scale=a_scale, b=b, b_scale=b_scale, offsets=offsets)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    cfg = launch_config(m, n, k, INTERPRETED, mma)
    block_m = cfg.blocks["BLOCK_M"]
    grid = grouped_grid(m, n_experts, n, block_m, cfg.blocks["BLOCK_N"])
    operands = [t.contiguous().view(torch.uint8) for t in (a, a_scale, b, b_scale)]
    tiles = {**cfg.blocks, "MX_MMA": mma, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if grouped:
        _grouped_mx_gemm_kernel[grid](*operands, c, offsets.contiguous(), m, n, k, n_experts,
                                      GROUP_M=tile_group(m, n_experts, block_m), BLOCK_E=block_e(n_experts),
                                      **tiles)
    else:
        _mx_gemm_kernel[grid](*operands, c, m, n, k, GROUP_M=dense_group(m, k, block_m, 1), **tiles)
    return c


def mx_gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor,
            out_dtype: torch.dtype = torch.float32, mma: str | None = None) -> Tensor:
    """``dequant(a) · dequant(b)ᵀ`` from MXFP8 operands blocked along K.

    Args:
        a: ``[M, K]`` ``torch.float8_e4m3fn``; ``a_scale``: ``[M, K/32]`` E8M0
            (``torch.float8_e8m0fnu`` or its bytes as ``torch.uint8``).
        b: ``[N, K]`` E4M3; ``b_scale``: ``[N, K/32]`` E8M0.
        out_dtype: ``torch.float32`` or ``torch.bfloat16`` (accumulation is fp32 either way;
            bf16 is rounded to nearest even by hand, the same compiled and interpreted).

        mma: the ``MX_MMA`` of `mx_dot` (one of ``MX_MMAS``); ``None``: `mx_mma_mode`'s.

    Returns ``[M, N]`` ``out_dtype``. Compiled through ``tl.dot_scaled`` on sm_100, FP8
    ``wgmma`` per K block on sm_90; under ``TRITON_INTERPRET=1`` the emulated path.
    """
    return _mx_gemm(a, a_scale, b, b_scale, None, out_dtype, mma)


def grouped_mx_gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offsets: Tensor,
                    out_dtype: torch.dtype = torch.float32, mma: str | None = None) -> Tensor:
    """Per expert ``e``: ``dequant(a[offsets[e]:offsets[e+1]]) · dequant(b[e])ᵀ``, one launch
    with no host sync — the MoE layer's expert GEMM with both operands in MXFP8.

    Args:
        a: ``[M, K]`` E4M3 rows sorted by expert; ``a_scale``: ``[M, K/32]`` E8M0 (or uint8).
        b: ``[E, N, K]`` E4M3, each expert's weight as ``[out, in]`` blocked along ``in``;
            ``b_scale``: ``[E, N, K/32]``.
        offsets: ``[E + 1]`` int32 on the device, non-decreasing: expert ``e`` owns rows
            ``offsets[e]:offsets[e+1]``; rows from ``offsets[E]`` on come out as zeros.
        out_dtype: ``torch.float32`` or ``torch.bfloat16``; ``mma``: as `mx_gemm`'s.

    Returns ``[M, N]`` ``out_dtype``: compiled through ``tl.dot_scaled`` (block-scaled
    ``tcgen05.mma`` on Blackwell) or FP8 ``wgmma`` per K block (Hopper), interpreted
    through the emulated path.
    """
    return _mx_gemm(a, a_scale, b, b_scale, offsets, out_dtype, mma)


# --------------------------------------------------------------------------------------
# References (plain PyTorch; what the kernels are tested against)
# --------------------------------------------------------------------------------------


def grouped_mx_gemm_reference(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor,
                              offsets: Tensor) -> Tensor:
    """The definition, in float64, one expert at a time (reads ``offsets`` on the host, clamped
    into ``[0, M]`` as the kernel clamps them; a decreasing pair is an empty segment)."""
    bounds = offsets.clamp(0, a.shape[0]).tolist()
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    for e, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        out[lo:hi] = mx_gemm_reference(a[lo:hi], a_scale[lo:hi], b[e], b_scale[e])
    return out


def mx_gemm_reference(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor) -> Tensor:
    """The definition, in float64: each operand dequantized exactly as
    `moe_lab.quant.mx.MXTensor.dequantize` does (fp32), then multiplied in float64."""
    def dequant(codes: Tensor, scales: Tensor) -> Tensor:
        mx = MXTensor(codes, scales.view(E8M0), E4M3, BLOCK_SIZE, 1, codes.shape)
        return mx.dequantize(torch.float32).double()

    return dequant(a, a_scale) @ dequant(b, b_scale).T

