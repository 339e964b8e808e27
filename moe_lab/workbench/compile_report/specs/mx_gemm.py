"""The MXFP8 GEMMs' launches (`moe_lab.kernels.mx_gemm`) as a CUDA launch compiles them."""

from __future__ import annotations

from moe_lab.config import preset
from moe_lab.kernels import mx_gemm as mg
from moe_lab.kernels.common import dense_group
from moe_lab.kernels.grouped_gemm import block_e, tile_group
from moe_lab.workbench.compile_report.specs import (
    MX_GEMM_PER_ARCH,
    MX_MMA,
    SPEC_PRESETS,
    SPEC_TOKENS,
    CompileSpec,
    kernel_spec,
    merge_specs,
)


def compile_specs() -> list[CompileSpec]:
    """`_mx_gemm_kernel` and `_grouped_mx_gemm_kernel` as CUDA launches of `mx_gemm` and
    `grouped_mx_gemm` compile them (``MX_MMA`` "scaled" on sm_100, "fp8_promote" on sm_90)
    for an MoE layer's expert GEMMs at
    DeepSeek-V3's and GPT-OSS-20B's shapes: the up/gate projection ``[tokens·top_k, d_model]
    · [2·d_expert, d_model]ᵀ`` and the down projection ``[tokens·top_k, d_expert] ·
    [d_model, d_expert]ᵀ`` (as one GEMM, and split over the experts), bf16 output."""
    specs = []
    for name, model in SPEC_PRESETS.items():
        moe = preset(name).moe
        d, f, m = moe.d_model, moe.d_expert, SPEC_TOKENS * moe.top_k
        for what, n, k in (("up/gate projection", 2 * f, d), ("down projection", d, f)):
            cfg = mg.launch_config(m, n, k, interpreted=False)
            pointers = {"a_ptr": "*u8", "a_scale_ptr": "*u8", "b_ptr": "*u8", "b_scale_ptr": "*u8",
                        "c_ptr": "*bf16"}
            specs.append(kernel_spec(
                mg, "_mx_gemm_kernel",
                f"MXFP8 GEMM, {model} experts {what}: [{m}, {k}] x [{n}, {k}]^T, bf16 out",
                pointers, dict(M=m, N=n, K=k),
                {**cfg.blocks, **MX_MMA, "GROUP_M": dense_group(m, k, cfg.blocks["BLOCK_M"], 1)},
                cfg, per_arch=MX_GEMM_PER_ARCH))
            specs.append(kernel_spec(
                mg, "_grouped_mx_gemm_kernel",
                f"grouped MXFP8 GEMM, {model} experts {what}: "
                f"[{m}, {k}] x {moe.n_experts} x [{n}, {k}]^T, bf16 out",
                {**pointers, "offsets_ptr": "*i32"}, dict(M_ROWS=m, N=n, K=k, E=moe.n_experts),
                {**cfg.blocks, "BLOCK_E": block_e(moe.n_experts), **MX_MMA,
                 "GROUP_M": tile_group(m, moe.n_experts, cfg.blocks["BLOCK_M"])},
                cfg, per_arch=MX_GEMM_PER_ARCH))
    return merge_specs(specs)
