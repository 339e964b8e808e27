"""The MXFP8-quantize epilogue's launches (`moe_lab.kernels.fused_mxfp8`) as a CUDA launch compiles them.

For one MoE layer at each preset's shape, in bfloat16 (the recipe's activation dtype), with the
tile the kernel module's `launch_config` gives: the gather-prologue SwiGLU GEMM with the
MXFP8-quantize epilogue, and the down projection reading its codes and scales (decoded in
registers) into the weighted scatter.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_lab.kernels import fused_mxfp8 as fmx
from moe_lab.kernels.grouped_gemm import block_e
from moe_lab.workbench.compile_report.specs import CompileSpec, grouped_spec, layers


def compile_specs() -> list[CompileSpec]:
    """Both kernels of `moe_lab.kernels.fused_mxfp8` at each preset's layer, bf16."""
    specs = []
    for moe, m, at, _ in layers(("bf16",)):
        n_experts, d, f, top_k = moe.n_experts, moe.d_model, moe.d_expert, moe.top_k
        cfg = fmx.launch_config("swiglu", m, f, d, n_experts, interpreted=False, dtype=torch.bfloat16)
        specs.append(grouped_spec(
            fmx, "_gather_swiglu_mx_kernel",
            f"gather prologue + SwiGLU GEMM + MXFP8-quantize epilogue, {at}",
            {"x_ptr": "*bf16", "src_ptr": "*i32", "w_ptr": "*bf16", "out_ptr": "*u8", "scale_ptr": "*u8"},
            cfg,
            dict(M_ROWS=m, F=f, K=d, E=n_experts, TOP_K=top_k, s_xm=d, s_xk=1, s_we=2 * f * d, s_wk=2 * f,
                 s_wn=1, s_om=f, s_on=1),
            "bf16", BLOCK_E=block_e(n_experts), IS_BF16=True))
        cfg = fmx.launch_config("gemm", m, d, f, n_experts, interpreted=False, dtype=torch.bfloat16)
        specs.append(dataclasses.replace(grouped_spec(
            fmx, "_gemm_scatter_mx_kernel", "grouped GEMM down projection + weighted scatter (the combine), "
            f"A as MXFP8 codes + scales decoded in registers, token-major store, {at}",
            {"a_ptr": "*u8", "a_scale_ptr": "*u8", "w_ptr": "*bf16", "out_ptr": "*bf16", "src_ptr": "*i32",
             "weight_ptr": "*fp32"}, cfg,
            dict(M_ROWS=m, N=d, K=f, E=n_experts, TOP_K=top_k, s_am=f, s_ak=1, s_we=f * d, s_wk=d, s_wn=1,
                 s_om=d, s_on=1),
            "bf16", BLOCK_E=block_e(n_experts)), note=DECODED_A_NOTE))
    return specs


DECODED_A_NOTE = (
    "on sm_80 to sm_89 (mma.sync) the A tile decoded from its MXFP8 codes in registers, beside "
    "the accumulator, puts the kernel at the 255-register limit: a few dozen bytes spill there "
    "(the spill column); on sm_90 and sm_100 nothing does.")
