"""The fused router's launches (`moe_lab.kernels.fused_router`) as a CUDA launch compiles them."""

from __future__ import annotations

from moe_lab.config import MoEConfig, preset
from moe_lab.kernels import fused_router as fr
from moe_lab.workbench.compile_report.specs import SPEC_PRESETS, SPEC_TOKENS, CompileSpec, kernel_spec


def compile_specs_for(cfg: MoEConfig, tokens: int, *, seq_len: int | None = None,
                      model: str = "") -> list[CompileSpec]:
    """The forward and backward kernels as a CUDA launch compiles them for ``tokens`` rows of
    contiguous float32 logits routed by ``cfg``, with an expert bias (the `Router` module
    always passes its buffer) and per-sequence statistics over ``seq_len`` tokens; the
    integer arguments typed as Triton's launcher types them (an argument equal to 1, such
    as the unit stride or ``G`` with one group, becomes a constant). ``model`` names the
    shape in the labels."""
    n_experts, n_groups, top_k = cfg.n_experts, cfg.n_groups, cfg.top_k
    softmax = cfg.score_func == "softmax"
    config = fr.launch_config(tokens, n_experts, n_groups, interpreted=False)
    groups = f"{n_groups} groups (top-{cfg.topk_groups})" if n_groups > 1 else "one group"
    shape = (f"{model + ': ' if model else ''}{tokens} tokens, E={n_experts}, {groups}, "
             f"top-{top_k}, {cfg.score_func}")
    ints = dict(T=tokens, E=n_experts, EG=n_experts // n_groups, G=n_groups,
                SEQ_LEN=seq_len or tokens, s_lt=n_experts, s_le=1)
    return [
        kernel_spec(
            fr, "_router_fwd_kernel",
            f"fused router forward (scores, top-k, statistics), fp32 logits, {shape}",
            {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32",
             "counts_ptr": "*i32", "psum_ptr": "*fp32", "zsum_ptr": "*fp32", "scaling": "fp32"}, ints,
            {**config.blocks, **fr.fwd_constexprs(top_k, softmax, n_experts, n_groups, cfg.topk_groups,
                                                  cfg.renormalize, True)},
            config),
        kernel_spec(
            fr, "_router_bwd_kernel", f"fused router backward (recomputed scores), fp32 logits, {shape}",
            {"logits_ptr": "*fp32", "ids_ptr": "*i64", "dw_ptr": "*fp32", "dpsum_ptr": "*fp32",
             "dz_ptr": "*fp32", "dl_ptr": "*fp32", "scaling": "fp32"}, {**ints, "s_dt": n_experts, "s_de": 1},
            {**config.blocks, **fr.bwd_constexprs(top_k, softmax, cfg.renormalize)},
            config),
    ]


def compile_specs() -> list[CompileSpec]:
    """`compile_specs_for` DeepSeek-V3's router (256 experts in 8 groups, top-4 groups,
    top-8, sigmoid) and GPT-OSS-20B's (32 experts, one group, top-4, softmax), at 8192
    tokens per GPU in sequences of the preset's length."""
    specs = []
    for name, model in SPEC_PRESETS.items():
        cfg = preset(name)
        specs += compile_specs_for(cfg.moe, SPEC_TOKENS, seq_len=cfg.seq_len, model=model)
    return specs
