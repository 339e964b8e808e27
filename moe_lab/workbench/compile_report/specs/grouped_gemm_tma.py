"""The persistent TMA grouped GEMM's launches (`moe_lab.kernels.grouped_gemm_tma`) as CUDA
compiles them.

For one MoE layer's experts at each preset's shape, in bfloat16 (the training dtype): the
forward of the up/gate and of the down projection, and dX = dY·Wᵀ of both (the same kernel
on the stored weight, ``TRANS_W``). A launch turns warp specialisation on by the GPU
(`moe_lab.kernels.grouped_gemm_tma.warp_specialized`: on Blackwell), which a spec cannot see,
so every shape has two specs, "[sm_90 launch]" without it and "[sm_100 launch]" with it; the
report compiles each for every architecture it is asked for, so its row for the other one
shows what that choice would compile to there. float32, which runs on the CUDA cores, is
left out.
"""

from __future__ import annotations

import torch

from moe_lab.kernels import grouped_gemm_tma as tma
from moe_lab.kernels.grouped_gemm import block_e, dot_bf16, tile_group
from moe_lab.workbench.compile_report.specs import (
    CompileSpec,
    describe,
    kernel_spec,
    layers,
    merge_specs,
)

# What a launch on each architecture passes as WARP_SPECIALIZE.
LAUNCHES = {"sm_90": False, "sm_100": True}
# What the kernel does for every tile before its first TMA load, as its PTX shows (left as
# built until a GPU has timed it): the first run measures this, not a cheaper kernel.
PER_TILE = ("per tile: 3 tensor descriptors (x, w[e], y) rebuilt on the device, each written "
            "in shared memory, copied to global with a release and read after an acquire fence")


def compile_specs() -> list[CompileSpec]:
    """Per preset (DeepSeek-V3, GPT-OSS-20B) at `SPEC_TOKENS` tokens, per launch architecture
    (`LAUNCHES`): the forward and dX of the up/gate and the down projection, bf16,
    contiguous tensors as the expert backend ``triton_tma`` passes them, ``GROUP_M`` as the
    wrapper picks it (`tile_group`)."""
    specs = []
    for moe, m, at, _ in layers(("bf16",)):
        n_experts, d, f = moe.n_experts, moe.d_model, moe.d_expert
        # (what, K, N, TRANS_W): y = x @ w[e], x: [M, K], w: [E, K, N] stored [K, N] or
        # (TRANS_W, dX = dY·Wᵀ) the forward's weight [E, N, K] as stored.
        gemms = [("forward (up/gate projection)", d, 2 * f, False),
                 ("forward (down projection)", f, d, False),
                 ("dX = dY·Wᵀ (TRANS_W; up/gate projection)", 2 * f, d, True),
                 ("dX = dY·Wᵀ (TRANS_W; down projection)", d, f, True)]
        cfg = tma.launch_config(m, 1, 1, n_experts, interpreted=False, dtype=torch.bfloat16)
        for arch, ws in LAUNCHES.items():
            for what, k, n, trans in gemms:
                specs.append(kernel_spec(
                    tma, "_tma_grouped_gemm_kernel",
                    f"[{arch} launch, {describe(cfg)}] persistent TMA grouped GEMM {what}, {at}; {PER_TILE}",
                    {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "offsets_ptr": "*i32"},
                    dict(M_ROWS=m, N=n, K=k, E=n_experts, s_xm=k, s_we=k * n, s_wr=k if trans else n, s_ym=n),
                    {**cfg.blocks, "BLOCK_E": block_e(n_experts),
                     "GROUP_M": tile_group(m, n_experts, cfg.blocks["BLOCK_M"]),
                     "TRANS_W": trans, "DOT_BF16": dot_bf16(torch.bfloat16, interpreted=False),
                     "WARP_SPECIALIZE": ws},
                    cfg, needs="tma"))
    return merge_specs(specs)
