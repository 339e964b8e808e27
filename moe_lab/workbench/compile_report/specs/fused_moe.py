"""The fused grouped GEMMs' launches (`moe_lab.kernels.fused_moe`) as a CUDA launch compiles them.

For one MoE layer at each preset's shape, in bfloat16 and float32, with the tile the kernel
module's `launch_config` gives (the grouped GEMM's, for the unfused kernel each replaces):
the gather-prologue SwiGLU GEMM forward and backward, the scatter-epilogue GEMM (the forward
combine, weighted, both schemes; the first GEMM's dX, unweighted), the combine's backward
gather GEMM, and the two gathered weight-gradient GEMMs.
"""

from __future__ import annotations

import triton

from moe_lab.kernels import fused_moe as fm
from moe_lab.kernels.grouped_gemm import DW_GROUP_K, block_e
from moe_lab.workbench.compile_report.specs import (
    SPEC_DTYPES,
    CompileSpec,
    grouped_spec,
    layers,
    merge_specs,
)


def compile_specs() -> list[CompileSpec]:
    """Every kernel of `moe_lab.kernels.fused_moe` at each preset's layer, bf16 and fp32."""
    specs = []
    for moe, m, at, dtype in layers(SPEC_DTYPES):
        n_experts, d, f, top_k = moe.n_experts, moe.d_model, moe.d_expert, moe.top_k
        blocks_e, p, torch_dtype = block_e(n_experts), f"*{dtype}", SPEC_DTYPES[dtype]
        cfg = fm.launch_config("swiglu", m, f, d, n_experts, interpreted=False, dtype=torch_dtype)
        ints = dict(M_ROWS=m, F=f, K=d, E=n_experts, TOP_K=top_k, s_xm=d, s_xk=1, s_we=2 * f * d,
                    s_wk=2 * f, s_wn=1, s_om=f, s_on=1, s_dm=f, s_dn=1)
        pointers = {"x_ptr": p, "src_ptr": "*i32", "w_ptr": p, "out_ptr": p, "dh_ptr": p}
        for backward in (False, True):
            what = "backward (recomputed, dgate/dup epilogue)" if backward else "forward"
            specs.append(grouped_spec(
                fm, "_gather_swiglu_kernel", f"gather prologue + SwiGLU GEMM {what}, {at}", pointers, cfg,
                {**ints, "s_om": 2 * f if backward else f}, dtype, BLOCK_E=blocks_e, BACKWARD=backward))
        # The scatter epilogue: the down projection's combine (weighted), and the first
        # GEMM's dX back to the tokens (unweighted, W1ᵀ as a view).
        for what, n, k, w_strides, weighted in (
                ("down projection + weighted scatter (the combine)", d, f, (f * d, d, 1), True),
                ("dX of the up/gate projection + scatter to tokens", d, 2 * f, (2 * f * d, 1, 2 * f),
                 False)):
            cfg = fm.launch_config("gemm", m, n, k, n_experts, interpreted=False, dtype=torch_dtype)
            for atomic in (False, True):
                scheme = "fp32 atomics" if atomic else "token-major store"
                specs.append(grouped_spec(
                    fm, "_gemm_scatter_kernel", f"grouped GEMM {what}, {scheme}, {at}",
                    {"a_ptr": p, "w_ptr": p, "out_ptr": "*fp32" if atomic else p, "src_ptr": "*i32",
                     "weight_ptr": "*fp32" if weighted else "*i32"}, cfg,
                    dict(M_ROWS=m, N=n, K=k, E=n_experts, TOP_K=top_k, s_am=k, s_ak=1,
                         s_we=w_strides[0], s_wk=w_strides[1], s_wn=w_strides[2], s_om=n, s_on=1),
                    dtype, BLOCK_E=blocks_e, HAS_WEIGHTS=weighted, ATOMIC=atomic))
        cfg = fm.launch_config("gemm", m, f, d, n_experts, interpreted=False, dtype=torch_dtype)
        n_tiles = triton.cdiv(f, cfg.blocks["BLOCK_N"])
        specs.append(grouped_spec(
            fm, "_gather_gemm_kernel", f"combine backward: gathered dout·W2ᵀ, dh and weight-gradient "
            f"epilogue, {at}",
            {"g_ptr": p, "src_ptr": "*i32", "w_ptr": p, "h_ptr": p, "weight_ptr": "*fp32", "out_ptr": p,
             "part_ptr": "*fp32"}, cfg,
            dict(M_ROWS=m, N=f, K=d, E=n_experts, TOP_K=top_k, N_TILES=n_tiles, s_gm=d, s_gk=1,
                 s_we=f * d, s_wk=1, s_wn=d, s_hm=f, s_hn=1, s_om=f, s_on=1),
            dtype, BLOCK_E=blocks_e))
        for what, k, n, gather_x in (("up/gate projection, gathered x", d, 2 * f, True),
                                     ("down projection, gathered weighted dout", f, d, False)):
            cfg = fm.launch_config("dw", m, n, k, n_experts, interpreted=False, dtype=torch_dtype)
            specs.append(grouped_spec(
                fm, "_gather_dw_kernel", f"grouped GEMM dW per expert ({what}), {at}",
                {"x_ptr": p, "dy_ptr": p, "dw_ptr": p, "src_ptr": "*i32",
                 "weight_ptr": "*i32" if gather_x else "*fp32"}, cfg,
                dict(M_ROWS=m, N=n, K=k, TOP_K=top_k, s_xm=k, s_xk=1, s_ym=n if gather_x else d,
                     s_yn=1, s_we=k * n, s_wk=n, s_wn=1),
                dtype, GATHER_X=gather_x, GROUP_K=DW_GROUP_K))
    return merge_specs(specs)
