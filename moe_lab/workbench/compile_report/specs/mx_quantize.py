"""The MX quantizer's launches (`moe_lab.kernels.mx_quantize`) as a CUDA launch compiles them."""

from __future__ import annotations

import torch

from moe_lab.config import preset
from moe_lab.kernels import mx_quantize as mq
from moe_lab.quant.mx import E4M3, E5M2, padded_size
from moe_lab.workbench.compile_report.specs import CompileSpec, kernel_spec


def compile_specs() -> list[CompileSpec]:
    """`_mx_quantize_kernel` as a CUDA launch of `mx_quantize` compiles it at DeepSeek-V3's and
    GPT-OSS-20B's shapes, contiguous input: every input dtype (bf16, fp32), element format
    (E4M3, E5M2), scale rule (rceil, floor) and copy (row+col, row only as `quantize_qkv`
    does Q and K, column only as it does V) at least once."""
    ds, oss = preset("deepseek_v3"), preset("gpt_oss_20b")
    bf16, fp32 = torch.bfloat16, torch.float32
    t, e = ds.seq_len, ds.moe.n_experts
    cases = [  # label, input dtype, [B, M, K], rowwise, colwise, element dtype, scale rule
        (f"DeepSeek-V3 activations [{t}, {ds.d_model}]", bf16, (1, t, ds.d_model),
         True, True, E4M3, "rceil"),
        (f"DeepSeek-V3 expert weights [{e}, {ds.d_model}, {ds.moe.d_expert}]", fp32,
         (e, ds.d_model, ds.moe.d_expert), True, True, E4M3, "rceil"),
        (f"GPT-OSS-20B output gradient [{oss.seq_len}, {oss.d_model}]", bf16,
         (1, oss.seq_len, oss.d_model), True, True, E5M2, "floor"),
        (f"GPT-OSS-20B attention Q rows [{oss.n_heads * oss.seq_len}, {oss.dim_head}]", bf16,
         (1, oss.n_heads * oss.seq_len, oss.dim_head), True, False, E4M3, "rceil"),
        (f"GPT-OSS-20B attention V [{oss.kv_heads}, {oss.seq_len}, {oss.dim_head}]", bf16,
         (oss.kv_heads, oss.seq_len, oss.dim_head), False, True, E4M3, "rceil"),
    ]
    specs = []
    for label, dtype, (_batch, m, k), rowwise, colwise, elem_dtype, scale_mode in cases:
        m_pad, k_pad = padded_size(m), padded_size(k)
        cfg = mq.launch_config(m_pad if colwise else m, k_pad if rowwise else k, interpreted=False)
        copies = "row+col" if rowwise and colwise else "row-wise" if rowwise else "column-wise"
        fmt = "E4M3" if elem_dtype == E4M3 else "E5M2"
        specs.append(kernel_spec(
            mq, "_mx_quantize_kernel",
            f"MX quantizer, {label} {'bf16' if dtype == bf16 else 'fp32'}, {copies}, {fmt} {scale_mode}",
            {"x_ptr": "*i16" if dtype == bf16 else "*i32", "row_data_ptr": "*u8",
             "row_scale_ptr": "*u8", "col_data_ptr": "*u8", "col_scale_ptr": "*u8"},
            dict(M=m, K=k, M_PAD=m_pad, K_PAD=k_pad, stride_xb=m * k, stride_xm=k, stride_xk=1),
            {**mq.format_constexprs(dtype, rowwise, colwise, elem_dtype, scale_mode), **cfg.blocks},
            cfg))
    return specs
