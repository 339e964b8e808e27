"""The grouped GEMM's launches (`moe_lab.kernels.grouped_gemm`) as a CUDA launch compiles them.

For one MoE layer's experts (SwiGLU up/gate, down projection) at each preset's shape, forward
and backward, in bfloat16 (the training dtype) and float32: first the config the kernel
module's `launch_config` chooses ("[chosen …]" in the label), then, in bfloat16, every other
config of its `TILE_SPACE` ("[candidate …]"), so the report compiles the whole space.
"""

from __future__ import annotations

import dataclasses

from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels.grouped_gemm import DW_GROUP_K, block_e
from moe_lab.perf.hardware import ARCHS
from moe_lab.workbench.compile_report.specs import (
    SPEC_DTYPES,
    CompileSpec,
    grouped_spec,
    layers,
    merge_specs,
)


def _space_specs(kernel: str, fn: str, what: str, dtype: str, pointers: tuple[str, ...],
                 shape: tuple[int, int, int, int], ints: dict[str, int],
                 **constexprs: object) -> list[CompileSpec]:
    """The spec of the config `launch_config` chooses at ``shape = (m, n, k, n_experts)``,
    labelled "[chosen …]", then one per other config of ``kernel``'s `TILE_SPACE`,
    labelled "[candidate …]"."""
    chosen = gg.launch_config(kernel, *shape, interpreted=False, dtype=SPEC_DTYPES[dtype])
    # The space is the tensor-core path's (bfloat16); float32 runs on the CUDA cores with the
    # one config the rule gives it, so only that one is compiled (bf16-sized tiles would
    # only show float32 spilling where no launch puts it).
    space = gg.TILE_SPACE[kernel] if dtype == "bf16" else (chosen,)
    first = space.index(chosen)
    return [dataclasses.replace(  # each target with the stages its shared memory holds
                 grouped_spec(gg, fn, what, {p: f"*{dtype}" for p in pointers}, cfg, ints, dtype,
                              tag="chosen " if cfg == chosen else "candidate ", **constexprs),
                 per_arch_config={a.arch: fitted for a in ARCHS.values() if a.bf16_mma
                                  and (fitted := gg.fit_shared(kernel, cfg, SPEC_DTYPES[dtype], a)) != cfg})
             for cfg in (chosen, *space[:first], *space[first + 1:])]


def compile_specs() -> list[CompileSpec]:
    """What a CUDA launch compiles for one MoE layer's experts (SwiGLU up/gate, down
    projection) at DeepSeek-V3's and GPT-OSS-20B's shapes, forward and backward, in
    bfloat16 (the training dtype) and float32, with contiguous tensors as the layer passes
    them: first the config `launch_config` chooses at each shape ("[chosen …]" in the
    label), then, in bfloat16, every other config of the kernel's `TILE_SPACE`
    ("[candidate …]"), so the report compiles the whole space. dX = dY·Wᵀ runs the forward
    kernel on a transposed view of ``W``: its unit stride sits on the other axis, so Triton
    compiles it separately, and so does this list."""
    spaces = []
    for moe, m, at, dtype in layers(SPEC_DTYPES):
        n_experts, d, f = moe.n_experts, moe.d_model, moe.d_expert
        blocks_e = block_e(n_experts)
        # y = x @ w[e] with x: [M, K], w: [E, K, N], y: [M, N] and their strides.
        gemms = [
            ("grouped GEMM forward (down projection)", d, f, (f, 1), (f * d, d, 1), (d, 1)),
            ("grouped GEMM dX = dY·Wᵀ (the forward kernel on a transposed W; down projection)",
             f, d, (d, 1), (f * d, 1, d), (f, 1)),
            ("grouped GEMM dX = dY·Wᵀ (the forward kernel on a transposed W; up/gate projection)",
             d, 2 * f, (2 * f, 1), (2 * f * d, 1, 2 * f), (d, 1)),
        ]
        for what, n, k, x, w, y in gemms:
            spaces.append(_space_specs(
                "gemm", "_grouped_gemm_kernel", f"{what}, {at}", dtype, ("x_ptr", "w_ptr", "y_ptr"),
                (m, n, k, n_experts),
                dict(M_ROWS=m, N=n, K=k, E=n_experts, s_xm=x[0], s_xk=x[1],
                     s_we=w[0], s_wk=w[1], s_wn=w[2], s_ym=y[0], s_yn=y[1]),
                BLOCK_E=blocks_e))
        for backward in (False, True):
            out_cols = 2 * f if backward else f
            what = ("backward: recomputed pre-activation, dgate/dup epilogue" if backward
                    else "forward")
            spaces.append(_space_specs(
                "swiglu", "_grouped_gemm_swiglu_kernel",
                f"grouped GEMM + SwiGLU {what} (up/gate projection), {at}",
                dtype, ("x_ptr", "w_ptr", "out_ptr", "dh_ptr"), (m, f, d, n_experts),
                dict(M_ROWS=m, F=f, K=d, E=n_experts, s_xm=d, s_xk=1, s_we=2 * f * d, s_wk=2 * f,
                     s_wn=1, s_om=out_cols, s_on=1, s_dm=f, s_dn=1),
                BLOCK_E=blocks_e, BACKWARD=backward))
        # dW[e] = X_eᵀ·dY_e: down projection (x = h: [M, F], dy: [M, d]), up/gate (x, dpre)
        for what, k, n in (("down projection", f, d), ("up/gate projection", d, 2 * f)):
            spaces.append(_space_specs(
                "dw", "_grouped_gemm_dw_kernel",
                f"grouped GEMM dW = Xᵀ·dY per expert ({what}), {at}",
                dtype, ("x_ptr", "dy_ptr", "dw_ptr"), (m, n, k, n_experts),
                dict(M_ROWS=m, N=n, K=k, s_xm=k, s_xk=1, s_ym=n, s_yn=1, s_we=k * n, s_wk=n, s_wn=1),
                GROUP_K=DW_GROUP_K))
    return merge_specs([space[0] for space in spaces] + [spec for space in spaces for spec in space[1:]])
