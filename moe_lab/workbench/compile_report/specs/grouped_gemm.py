"""The grouped GEMM's launches (`moe_lab.kernels.grouped_gemm`) as a CUDA launch compiles them.

For one MoE layer's experts (SwiGLU up/gate, down projection) at each preset's shape, forward
and backward, in bfloat16 (the training dtype) and float32: first the config the kernel
module's `launch_config` chooses ("[chosen …]" in the label), then, in bfloat16, every other
config of its `TILE_SPACE` ("[candidate …]"), so the report compiles the whole space.
"""

from __future__ import annotations

import dataclasses

from moe_lab.config import preset
from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels.grouped_gemm import DW_GROUP_K, block_e, dot_bf16, tile_group
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.perf.hardware import ARCHS
from moe_lab.workbench.compile_report.specs import (
    FP32_NOTE,
    SPEC_DTYPES,
    SPEC_PRESETS,
    SPEC_TOKENS,
    CompileSpec,
    describe,
    int_args,
    merge_specs,
)


def _group(ints: dict[str, int], cfg: LaunchConfig) -> dict[str, int]:
    """``GROUP_M`` as the wrapper picks it (`tile_group`), for the kernels with a tile order
    (those over experts' row tiles: they take ``E``)."""
    return {"GROUP_M": tile_group(ints["M_ROWS"], ints["E"], cfg.blocks["BLOCK_M"])} if "E" in ints else {}



def _spec(kernel: str, label: str, dtype: str, pointers: tuple[str, ...], cfg: LaunchConfig,
          ints: dict[str, int], **constexprs: object) -> CompileSpec:
    """A `CompileSpec` of ``kernel`` in this module: ``pointers`` to ``dtype`` tensors (and
    ``offsets_ptr`` to int32), ``ints`` typed as a launch types them, ``cfg``'s blocks and
    ``DOT_BF16`` as the wrapper picks it, besides ``constexprs``."""
    signature, constants = int_args(**ints)
    return CompileSpec(
        f"{gg.__name__}:{kernel}", label,
        {**{p: f"*{dtype}" for p in pointers}, "offsets_ptr": "*i32", **signature},
        {**constants, **cfg.blocks, "DOT_BF16": dot_bf16(SPEC_DTYPES[dtype], interpreted=False),
         **_group(ints, cfg), **constexprs},
        cfg,
        FP32_NOTE if dtype == "fp32" else "",
    )


def _space_specs(kernel: str, fn: str, what: str, dtype: str, pointers: tuple[str, ...],
                 shape: tuple[int, int, int, int], ints: dict[str, int],
                 **constexprs: object) -> tuple[CompileSpec, list[CompileSpec]]:
    """The spec of the config `launch_config` chooses at ``shape = (m, n, k, n_experts)``,
    labelled "[chosen …]", and one per other config of ``kernel``'s `TILE_SPACE`,
    labelled "[candidate …]"."""
    chosen = gg.launch_config(kernel, *shape, interpreted=False, dtype=SPEC_DTYPES[dtype])
    # The space is the tensor-core path's (bfloat16); float32 runs on the CUDA cores with the
    # one config the rule gives it, so only that one is compiled (bf16-sized tiles would
    # only show float32 spilling where no launch puts it).
    space = gg.TILE_SPACE[kernel] if dtype == "bf16" else (chosen,)
    specs = [dataclasses.replace(  # each target with the stages its shared memory holds
                 _spec(fn, f"[{'chosen' if cfg == chosen else 'candidate'} {describe(cfg)}] {what}",
                       dtype, pointers, cfg, ints, **constexprs),
                 per_arch_config={a.arch: fitted for a in ARCHS.values() if a.bf16_mma
                                  and (fitted := gg.fit_shared(kernel, cfg, SPEC_DTYPES[dtype], a)) != cfg})
             for cfg in space]
    first = space.index(chosen)
    return specs[first], specs[:first] + specs[first + 1:]


def compile_specs() -> list[CompileSpec]:
    """What a CUDA launch compiles for one MoE layer's experts (SwiGLU up/gate, down
    projection) at DeepSeek-V3's and GPT-OSS-20B's shapes, forward and backward, in
    bfloat16 (the training dtype) and float32, with contiguous tensors as the layer passes
    them: first the config `launch_config` chooses at each shape ("[chosen …]" in the
    label), then, in bfloat16, every other config of the kernel's `TILE_SPACE`
    ("[candidate …]"), so the report compiles the whole space. dX = dY·Wᵀ runs the forward
    kernel on a transposed view of ``W``: its unit stride sits on the other axis, so Triton
    compiles it separately, and so does this list."""
    chosen, candidates = [], []

    def add(pair: tuple[CompileSpec, list[CompileSpec]]) -> None:
        chosen.append(pair[0])
        candidates.extend(pair[1])

    for name, model in SPEC_PRESETS.items():
        moe = preset(name).moe
        n_experts, d, f = moe.n_experts, moe.d_model, moe.d_expert
        m = SPEC_TOKENS * moe.top_k
        shape = (f"{model}: E={n_experts}, d_model={d}, d_expert={f}, "
                 f"{SPEC_TOKENS} tokens x top-{moe.top_k} = {m} rows")
        blocks_e = block_e(n_experts)
        for dtype in SPEC_DTYPES:
            at = f"{dtype}, {shape}"
            # y = x @ w[e] with x: [M, K], w: [E, K, N], y: [M, N] and their strides.
            gemms = [
                ("grouped GEMM forward (down projection)", d, f, (f, 1), (f * d, d, 1), (d, 1)),
                ("grouped GEMM dX = dY·Wᵀ (the forward kernel on a transposed W; down projection)",
                 f, d, (d, 1), (f * d, 1, d), (f, 1)),
                ("grouped GEMM dX = dY·Wᵀ (the forward kernel on a transposed W; up/gate projection)",
                 d, 2 * f, (2 * f, 1), (2 * f * d, 1, 2 * f), (d, 1)),
            ]
            for what, n, k, x, w, y in gemms:
                add(_space_specs(
                    "gemm", "_grouped_gemm_kernel", f"{what}, {at}", dtype, ("x_ptr", "w_ptr", "y_ptr"),
                    (m, n, k, n_experts),
                    dict(M_ROWS=m, N=n, K=k, E=n_experts, s_xm=x[0], s_xk=x[1],
                         s_we=w[0], s_wk=w[1], s_wn=w[2], s_ym=y[0], s_yn=y[1]),
                    BLOCK_E=blocks_e))
            for backward in (False, True):
                out_cols = 2 * f if backward else f
                what = ("backward: recomputed pre-activation, dgate/dup epilogue" if backward
                        else "forward")
                add(_space_specs(
                    "swiglu", "_grouped_gemm_swiglu_kernel",
                    f"grouped GEMM + SwiGLU {what} (up/gate projection), {at}",
                    dtype, ("x_ptr", "w_ptr", "out_ptr", "dh_ptr"), (m, f, d, n_experts),
                    dict(M_ROWS=m, F=f, K=d, E=n_experts, s_xm=d, s_xk=1, s_we=2 * f * d, s_wk=2 * f,
                         s_wn=1, s_om=out_cols, s_on=1, s_dm=f, s_dn=1),
                    BLOCK_E=blocks_e, BACKWARD=backward))
            # dW[e] = X_eᵀ·dY_e: down projection (x = h: [M, F], dy: [M, d]), up/gate (x, dpre)
            for what, k, n in (("down projection", f, d), ("up/gate projection", d, 2 * f)):
                add(_space_specs(
                    "dw", "_grouped_gemm_dw_kernel",
                    f"grouped GEMM dW = Xᵀ·dY per expert ({what}), {at}",
                    dtype, ("x_ptr", "dy_ptr", "dw_ptr"), (m, n, k, n_experts),
                    dict(M_ROWS=m, N=n, K=k, s_xm=k, s_xk=1, s_ym=n, s_yn=1, s_we=k * n, s_wk=n, s_wn=1),
                    GROUP_K=DW_GROUP_K))
    return merge_specs(chosen + candidates)
