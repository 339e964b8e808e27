"""The MXFP8 attention kernel's launches (`moe_lab.kernels.mx_attention`) as a CUDA launch compiles them."""

from __future__ import annotations

from moe_lab.config import preset
from moe_lab.kernels import mx_attention as ma
from moe_lab.quant.mx import BLOCK_SIZE, padded_size
from moe_lab.workbench.compile_report.specs import MX_MMA, MX_MMA_PER_ARCH, CompileSpec, kernel_spec


def compile_specs() -> list[CompileSpec]:
    """`_mx_attention_fwd_kernel` as a CUDA launch of `mx_attention_forward` on
    `quantize_qkv`'s layouts compiles it, at a sequence of each preset's ``seq_len``.

    moe_lab's attention is grouped-query attention with one head_dim for Q, K and V, so
    GPT-OSS-20B runs at its own (64 heads, 8 KV heads, d = 64) and DeepSeek-V3's preset as
    moe_lab's model would run it (128 heads, d = 192: its MLA uses 192 for Q/K but 128 for
    V, which this kernel does not take); d = 128 at 128 heads is the MLA value head_dim.
    The probabilities' variants (floor rule, unquantized) at GPT-OSS-20B's shape.
    """
    ds, oss = preset("deepseek_v3"), preset("gpt_oss_20b")
    cases = [  # label, heads, kv heads, seq, head_dim, quantize_p, scale rule
        ("GPT-OSS-20B", oss.n_heads, oss.kv_heads, oss.seq_len, oss.dim_head, True, "rceil"),
        ("DeepSeek-V3 as MHA", ds.n_heads, ds.kv_heads, ds.seq_len, ds.dim_head, True, "rceil"),
        ("DeepSeek-V3 MLA value head_dim", ds.n_heads, ds.kv_heads, ds.seq_len, ds.v_head_dim,
         True, "rceil"),
        ("GPT-OSS-20B", oss.n_heads, oss.kv_heads, oss.seq_len, oss.dim_head, True, "floor"),
        ("GPT-OSS-20B", oss.n_heads, oss.kv_heads, oss.seq_len, oss.dim_head, False, "rceil"),
    ]
    specs = []
    for name, h, h_kv, t, d, quantize_p, scale_mode in cases:
        d_pad, t_pad = padded_size(d), padded_size(t)
        n_ds = d_pad // BLOCK_SIZE
        # Strides of quantize_qkv's outputs for one sequence: Q, K codes and scales and the
        # output contiguous; V's codes and scales stored transposed ([.., d, T], key-major).
        ints = dict(
            H=h, KV_GROUP=h // h_kv, T_Q=t, T_K=t, T_K_PAD=t_pad, D=d, D_PAD=d_pad,
            s_qb=h * t * d_pad, s_qh=t * d_pad, s_qt=d_pad, s_qd=1,
            s_qsb=h * t * n_ds, s_qsh=t * n_ds, s_qst=n_ds, s_qsd=1,
            s_kb=h_kv * t * d_pad, s_kh=t * d_pad, s_kt=d_pad, s_kd=1,
            s_ksb=h_kv * t * n_ds, s_ksh=t * n_ds, s_kst=n_ds, s_ksd=1,
            s_vb=h_kv * t_pad * d, s_vh=t_pad * d, s_vt=1, s_vd=t_pad,
            s_vsb=h_kv * t_pad // BLOCK_SIZE * d, s_vsh=t_pad // BLOCK_SIZE * d, s_vst=1,
            s_vsd=t_pad // BLOCK_SIZE,
            s_ob=h * t * d, s_oh=t * d, s_ot=d, s_od=1,
        )
        cfg = ma.launch_config(t, t, d, interpreted=False, mma=MX_MMA["MX_MMA"])
        # Each target's tile (`launch_config` for its mode): its blocks, warps and stages.
        tiles = {arch: ma.launch_config(t, t, d, interpreted=False, mma=v["MX_MMA"])
                 for arch, v in MX_MMA_PER_ARCH.items()}
        per_arch = {arch: {**v, **tiles[arch].blocks} for arch, v in MX_MMA_PER_ARCH.items()}
        p = f"P {scale_mode}" if quantize_p else "P float32"
        note = (UNQUANTIZED_P_NOTE if not quantize_p else WIDE_HEAD_NOTE if d > 128
                else ADA_NOTE if d == 128 else "")
        specs.append(kernel_spec(
            ma, "_mx_attention_fwd_kernel",
            f"MXFP8 attention fwd, {name}: {h} heads ({h_kv} KV), seq {t}, d={d}, {p}",
            {**{n: "*u8" for n in ("q_ptr", "qs_ptr", "k_ptr", "ks_ptr", "v_ptr", "vs_ptr")},
             "o_ptr": "*fp32", "sm_scale_log2": "fp32"}, ints,
            {**ma.mode_constexprs(quantize_p, scale_mode, MX_MMA["MX_MMA"]), **cfg.blocks},
            cfg, per_arch=per_arch, per_arch_config=tiles, note=note))
    return specs


# Why some of `compile_specs`'s rows miss the report's targets.
UNQUANTIZED_P_NOTE = (
    "P float32 is a study path, not the recipe: P·V is meant as an IEEE float32 dot "
    "(exact under the interpreter and on sm_90's CUDA cores), and Triton 3.7 lowers it on "
    "sm_100 to tcgen05 kind::tf32 instead (see the tensor-core column): on Blackwell that "
    "dot rounds P and the dequantized V to TF32.")
ADA_NOTE = (
    "on sm_89 (Ada) fp8_promote runs on FP8 mma.sync, whose fragments hold more registers than "
    "sm_90's wgmma: at head_dim 128 its fp32 partial beside P·V's accumulator spills about a "
    "hundred bytes (the spill column); on sm_90 nothing does.")
WIDE_HEAD_NOTE = (
    "head_dim 192 is padded to 256-wide Q, K and output tiles (tl.arange needs a power of two): "
    "on sm_90, which has no block-scaled MMA, fp8_promote keeps an fp32 partial beside each "
    "accumulator (P·V's as wide as the padded output) and splits the FP8 Q and K tiles into "
    "32-wide head-dim blocks in registers; at 64 queries per program that sits at the "
    "255-register limit. Splitting the output into a 128- and a 64-wide accumulator would "
    "drop the padding.")
