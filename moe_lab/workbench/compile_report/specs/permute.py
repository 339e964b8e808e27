"""The token permutation's launches (`moe_lab.kernels.permute`) as a CUDA launch compiles them."""

from __future__ import annotations

from moe_lab.config import preset
from moe_lab.kernels import permute as pm
from moe_lab.workbench.compile_report.specs import (
    SPEC_PRESETS,
    SPEC_TOKENS,
    CompileSpec,
    kernel_spec,
    merge_specs,
)


def compile_specs() -> list[CompileSpec]:
    """What a CUDA launch compiles for one MoE layer's dispatch and combine at DeepSeek-V3's
    and GPT-OSS-20B's shapes: the histogram and row-id map over int64 router ids, permute
    (forward: no weights; unpermute's backward: weighted), unpermute (weighted forward;
    permute's backward: unweighted) and unpermute's weight gradient, for bfloat16 token rows
    and float32 router weights, contiguous as the dropless layer passes them."""
    specs = []
    for name, model in SPEC_PRESETS.items():
        moe = preset(name).moe
        tokens, top_k, n_experts, d = SPEC_TOKENS, moe.top_k, moe.n_experts, moe.d_model
        n_rows = tokens * top_k
        at = (f"{model}: E={n_experts}, top-{top_k}, d_model={d}, "
              f"{tokens} tokens x top-{top_k} = {n_rows} rows")
        cfg = pm.launch_config("map", n_rows, n_experts, interpreted=False)
        ints = dict(N_ENTRIES=n_rows, E=n_experts)
        specs += [
            kernel_spec(pm, "_expert_histogram_kernel",
                        f"expert histogram per block of routed ids, int64 ids, {at}",
                        {"ids_ptr": "*i64", "counts_ptr": "*i32"}, ints, cfg.blocks, cfg),
            kernel_spec(pm, "_row_id_map_kernel", f"row-id map (rank within block + base), int64 ids, {at}",
                        {"ids_ptr": "*i64", "base_ptr": "*i32", "map_ptr": "*i32"}, ints, cfg.blocks, cfg),
        ]
        cfg = pm.launch_config("rows", tokens, d, interpreted=False)
        rows = dict(T=tokens, D=d, N_ROWS=n_rows, TOP_K=top_k, s_mt=top_k, s_mk=1, s_wt=top_k, s_wk=1)
        for weighted in (False, True):
            w_type = "*fp32" if weighted else "*i32"  # unweighted: the map stands in, unread
            # (kernel, what, source and destination pointers, their [rows, d] strides)
            copies = (
                ("permute", "weighted (unpermute's backward)" if weighted else "forward",
                 "x_ptr", "y_ptr", ("s_xt", "s_xd", "s_yr", "s_yd")),
                ("unpermute", "weighted forward" if weighted else "unweighted (permute's backward)",
                 "y_ptr", "out_ptr", ("s_yr", "s_yd", "s_ot", "s_od")),
            )
            for kernel, what, src, dst, strides in copies:
                specs.append(kernel_spec(
                    pm, f"_{kernel}_kernel", f"{kernel} {what}, bf16 rows, {at}",
                    {src: "*bf16", "map_ptr": "*i32", "w_ptr": w_type, dst: "*bf16"},
                    {**rows, **dict(zip(strides, (d, 1, d, 1), strict=True))},
                    {**cfg.blocks, "HAS_WEIGHTS": weighted}, cfg))
        specs.append(kernel_spec(
            pm, "_unpermute_weight_grad_kernel",
            f"unpermute weight gradient <dout[t], y[row]>, bf16 rows, fp32 out, {at}",
            {"y_ptr": "*bf16", "map_ptr": "*i32", "dout_ptr": "*bf16", "dw_ptr": "*fp32"},
            dict(T=tokens, D=d, N_ROWS=n_rows, TOP_K=top_k, s_yr=d, s_yd=1, s_mt=top_k, s_mk=1,
                 s_gt=d, s_gd=1),
            cfg.blocks, cfg))
    return merge_specs(specs)
