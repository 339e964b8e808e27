"""What each kernel module's launches compile (`moe_lab.workbench.compile_report.specs`): the specs
cover every kernel, argument, model and config their wrappers pick, and compiled for a GPU (no GPU
needed: Triton compiles for sm_90 and sm_100 on any machine, in a process with
``TRITON_INTERPRET=0``) the kernels reach the tensor cores in their dtypes and address every tile
in int64.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from support import checked_compile_specs, compile_for_gpu, tile_offsets_are_int64

import moe_lab
from moe_lab.kernels import fused_moe as fm
from moe_lab.kernels import fused_mxfp8 as fmx
from moe_lab.kernels import fused_router as fr
from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels import mx_gemm as mg
from moe_lab.kernels import permute as pm
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.workbench.compile_report import report as compile_report
from moe_lab.workbench.compile_report.specs import (
    CompileSpec,
    describe,
    for_module,
    kernel_spec,
    merge_specs,
)


def test_every_kernel_module_has_its_specs_and_nothing_else_does():
    assert for_module("moe_lab.kernels.grouped_gemm") == for_module(gg)
    with pytest.raises(ValueError, match="moe_lab.kernels.launch has no compile specs"):
        for_module("moe_lab.kernels.launch")


def test_kernel_spec_types_the_ints_and_merge_specs():
    cfg = LaunchConfig({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32})
    spec = kernel_spec(gg, "k", "ints", {"x": "*bf16"}, dict(a=1, b=48, c=7, d=2**31), {"B": 2}, cfg)
    assert spec.signature == {"x": "*bf16", "b": "i32:16", "c": "i32", "d": "i64:16"}
    assert spec.constexprs == {"a": 1, "B": 2} and spec.kernel == "moe_lab.kernels.grouped_gemm:k"
    one = CompileSpec("m:k", "first", {"x": "*bf16"}, {"B": 1}, cfg)
    merged = merge_specs([one, CompileSpec("m:k", "second", {"x": "*bf16"}, {"B": 1}, cfg, "why"),
                          CompileSpec("m:k", "third", {"x": "*fp32"}, {"B": 1}, cfg)])
    assert [s.label for s in merged] == ["first | second", "third"] and merged[0].note == "why"
    assert describe(cfg) == "64x64x32 (M x N x K blocks), 4 warps, 3 stages"


# ------------------------------------------------------------------------------ grouped GEMM


def test_bf16_tiles_reach_the_hopper_tensor_cores_as_bf16(tmp_path):
    # The bf16 specs of every kernel, compiled for sm_90: tl.dot takes bf16 tiles (not
    # widened to fp32 on the way), wgmma multiplies bf16 x bf16, and every tile address
    # is computed in int64.
    compiled = compile_for_gpu("""
        from moe_lab.workbench.compile_report.specs import grouped_gemm
        specs = [s for s in grouped_gemm.compile_specs()
                 if s.label.startswith("[chosen") and "bf16, DeepSeek-V3" in s.label.split(" | ")[0]]
    """, tmp_path)
    assert len(compiled) == 5, list(compiled)  # forward, dX, SwiGLU forward and backward, dW
    for label, asm in compiled.items():
        dots = re.findall(r"tt\.dot .*: tensor<\w+> \* tensor<\w+>", asm["ttir"])
        assert dots and all(d.count("xbf16>") == 2 for d in dots), (label, dots)
        if "backward" not in label:  # the SwiGLU backward widens dh (epilogue data), no more
            assert "arith.extf" not in asm["ttir"], label
        wgmma = re.findall(r"wgmma\.mma_async\S*", asm["ptx"])
        assert wgmma and all(op.endswith(".bf16.bf16") for op in wgmma), (label, set(wgmma))
        assert tile_offsets_are_int64(asm["ttir"]), label


def test_grouped_gemm_specs_cover_every_kernel_argument_and_both_models():
    specs = checked_compile_specs(gg)
    for spec in specs:
        assert spec.constexprs["DOT_BF16"] == ("*bf16" in spec.signature.values()), spec.label
    labels = " | ".join(s.label for s in specs)
    paths = ("forward (down projection)", "dX = dY·Wᵀ", "SwiGLU forward", "SwiGLU backward", "dW")
    for model in ("DeepSeek-V3", "GPT-OSS-20B"):
        for dtype in ("bf16", "fp32"):
            for what in paths:
                assert re.search(f"{re.escape(what)}[^|]*{dtype}, {model}", labels), (what, dtype, model)


def test_grouped_gemm_specs_cover_the_space_with_the_chosen_first():
    specs = for_module(gg)
    kernel_of = {"_grouped_gemm_kernel": "gemm", "_grouped_gemm_swiglu_kernel": "swiglu",
                 "_grouped_gemm_dw_kernel": "dw"}
    seen = {kernel: set() for kernel in gg.TILE_SPACE}
    for spec in specs:
        seen[kernel_of[spec.kernel.split(":")[1]]].add(repr(spec.config))
        assert all(part.startswith(("[chosen ", "[candidate ")) for part in spec.label.split(" | "))
        assert describe(spec.config) in spec.label.split(" | ")[0]
    for kernel in gg.TILE_SPACE:
        assert seen[kernel] == {repr(cfg) for cfg in gg.TILE_SPACE[kernel]}, kernel
    first = [s.label.startswith("[chosen") for s in specs]
    assert first == sorted(first, reverse=True)  # every chosen spec before every candidate
    # each (path, dtype, model) has exactly one chosen config, the one launch_config picks
    chosen = [part for s in specs for part in s.label.split(" | ") if part.startswith("[chosen")]
    whats = [part.split("] ", 1)[1] for part in chosen]
    assert len(whats) == len(set(whats)) == 2 * 2 * 7  # models x dtypes x paths


# ------------------------------------------------------------------------------ permute


def test_permute_specs_cover_every_kernel_argument_and_both_models():
    specs = checked_compile_specs(pm)
    for spec in specs:
        for model in ("DeepSeek-V3", "GPT-OSS-20B"):
            assert any(model in s.label for s in specs if s.kernel == spec.kernel), (spec.kernel, model)
    for name in ("_permute_kernel", "_unpermute_kernel"):
        branches = {s.constexprs["HAS_WEIGHTS"] for s in specs if s.kernel.endswith(name)}
        assert branches == {False, True}, name


def test_permute_compiles_for_hopper_with_one_expert_and_int64_row_addresses(tmp_path):
    # Every spec at DeepSeek-V3's shape plus the row-id map kernels at E = 1, built for
    # sm_90: they compile, and every row tile is addressed in int64 (65,536 rows x 7,168).
    compiled = compile_for_gpu("""
        import dataclasses
        from moe_lab.kernels import permute as pm
        from moe_lab.workbench.compile_report.specs import for_module
        specs = [s for s in for_module(pm) if "DeepSeek-V3" in s.label]
        one = pm.launch_config("map", 8192, 1, interpreted=False)
        specs += [dataclasses.replace(s, label="E=1 " + s.label, config=one,
                                      constexprs={**s.constexprs, **one.blocks})
                  for s in specs if s.kernel.endswith(("_histogram_kernel", "_row_id_map_kernel"))]
    """, tmp_path)
    assert len(compiled) == 9, list(compiled)
    for label, asm in compiled.items():
        if label.startswith(("permute", "unpermute")):
            assert tile_offsets_are_int64(asm["ttir"]), label


# ------------------------------------------------------------------------------ fused GEMMs


def test_fused_specs_cover_every_kernel():
    specs = checked_compile_specs(fm)
    assert {s.kernel.split(":")[1] for s in specs} == {
        "_gather_swiglu_kernel", "_gemm_scatter_kernel", "_gather_gemm_kernel", "_gather_dw_kernel"}
    assert {s.constexprs.get("ATOMIC") for s in specs if "scatter" in s.kernel} == {True, False}
    mx = checked_compile_specs(fmx)
    assert {s.kernel.split(":")[1] for s in mx} == {"_gather_swiglu_mx_kernel", "_gemm_scatter_mx_kernel"}
    assert all(s.config.blocks["BLOCK_N" if "swiglu" in s.kernel else "BLOCK_K"] >= 32 for s in mx)


# ------------------------------------------------------------------------------ MXFP8 GEMM


def test_mx_gemm_specs_cover_the_compiled_path():
    specs = for_module(mg)
    assert specs and all(spec.constexprs_for("sm_100")["MX_MMA"] == "scaled" for spec in specs)
    hopper = {**specs[0].config.blocks, **specs[0].constexprs_for("sm_90")}
    assert hopper["MX_MMA"] == "fp8_promote"  # and the tile the wrapper picks in that mode:
    cfg = mg.launch_config(65536, 4096, 7168, interpreted=False, mma="fp8_promote")
    assert {k: hopper[k] for k in cfg.blocks} == cfg.blocks
    for model in ("DeepSeek-V3", "GPT-OSS-20B"):
        assert any(model in spec.label for spec in specs)
    assert mg.launch_config(65536, 4096, 7168, interpreted=False) == specs[0].config


def test_compiled_mx_gemm_is_block_scaled_tcgen05_on_blackwell_and_wgmma_on_hopper():
    """On sm_100 ``tl.dot_scaled`` is one block-scaled MMA (``tcgen05.mma kind::mxf8f6f4
    .block_scale``); on sm_90, which has no such instruction, ``MX_MMA="fp8_promote"`` runs
    E4M3 × E4M3 ``wgmma`` (fp32 out) per K block, with no FP8 → 16-bit ``cvt`` of the
    operands (``tl.dot_scaled`` there would upcast them). Neither spills."""
    rows = {row["arch"]: row for row in compile_report.compile_jobs(
        compile_report.module_job("moe_lab.kernels.mx_gemm", limit=1), archs=("sm_90", "sm_100"))}
    assert not any(row.get("error") for row in rows.values()), rows
    blackwell, hopper = rows["sm_100"], rows["sm_90"]
    assert blackwell["mma_class"] == "tcgen05.mma" and blackwell["block_scaled"], blackwell["mma_kinds"]
    assert any("kind::mxf8f6f4" in kind for kind in blackwell["mma_kinds"])
    assert hopper["mma_class"] == "wgmma" and not hopper["block_scaled"], hopper["mma_kinds"]
    assert hopper["mma_kinds"] and all("e4m3.e4m3" in kind for kind in hopper["mma_kinds"])
    assert hopper["fp8_upcasts"] == 0 and hopper["constexprs"]["MX_MMA"] == "fp8_promote"
    assert blackwell["spill_bytes"] == 0 and hopper["spill_bytes"] == 0


# ------------------------------------------------------------------------------ fused router


def test_fused_router_specs_describe_the_launches():
    specs = for_module(fr)
    kernels = {f"{fr.__name__}:{name}": getattr(fr, name)
               for name in ("_router_fwd_kernel", "_router_bwd_kernel")}
    assert [s.kernel for s in specs] == list(kernels) * 2
    for spec, (name, model) in zip(specs, [("deepseek_v3", "DeepSeek-V3")] * 2
                                   + [("gpt_oss_20b", "GPT-OSS-20B")] * 2, strict=True):
        moe = moe_lab.preset(name).moe
        assert model in spec.label and "8192 tokens" in spec.label
        # every argument typed or given: what the report compiles is what a launch runs
        assert all(spec.signature[k] == "constexpr" for k in set(spec.signature) & set(spec.constexprs))
        assert set(spec.signature) | set(spec.constexprs) == set(kernels[spec.kernel].arg_names)
        assert spec.config == fr.launch_config(8192, moe.n_experts, moe.n_groups, interpreted=False)
        assert spec.config.blocks.items() <= spec.constexprs.items()
        assert spec.constexprs["TOP_K"] == moe.top_k
        assert spec.constexprs["SOFTMAX"] == (moe.score_func == "softmax")
        assert spec.constexprs["s_le"] == 1  # a unit stride is a constant in a launch
    fwd_dsv3, fwd_gpt = specs[0].constexprs, specs[2].constexprs
    assert fwd_dsv3["GROUPED"] and fwd_dsv3["TOPK_GROUPS"] == 4 and specs[0].signature["G"] == "i32"
    assert fwd_gpt["G"] == 1 and fwd_gpt["GP"] == 1 and not fwd_gpt["GROUPED"]  # one group


_COMPILE_SIZE_ONE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import moe_lab
from moe_lab.config import MoEConfig
from moe_lab.kernels import fused_router as router
from moe_lab.workbench.compile_report.specs import fused_router as router_specs
from moe_lab.workbench.compile_report.worker import triton_signature

import os
assert os.environ["TRITON_INTERPRET"] == "0"  # compiled, not interpreted
cases = {"one group (GP = 1)": moe_lab.preset("gpt_oss_20b").moe,
         "one expert per group, top-1 (EGP = KP = 1)": MoEConfig(
             d_model=16, n_experts=4, top_k=1, d_expert=8, n_groups=4, topk_groups=2,
             score_func="sigmoid"),
         "one expert (E = GP = EGP = KP = 1)": MoEConfig(d_model=16, n_experts=1, top_k=1,
                                                         d_expert=8)}
out = []
for case, cfg in cases.items():
    for spec in router_specs.compile_specs_for(cfg, 64, model=case):
        fn = getattr(router, spec.kernel.partition(":")[2])
        signature, constexprs, attrs, _ = triton_signature(fn, spec.kernel, spec.signature,
                                                           spec.constexprs)
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                          attrs=attrs),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": spec.config.num_warps,
                                         "num_stages": spec.config.num_stages})
        out.append({"case": case, "kernel": fn.__name__, "cubin": len(kernel.asm["cubin"]),
                    "size_one": sorted(k for k in ("GP", "EGP", "KP") if spec.constexprs.get(k) == 1),
                    "target": ".target sm_90" in kernel.asm["ptx"]})
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_router_size_one_aranges_compile_for_hopper():
    """One group, one expert per group, top-1 and one expert make ``tl.arange(0, 1)`` axes:
    a CUDA launch compiles them (sm_90, in a process where Triton is not interpreted; Triton
    folds a size-1 range into the constant 0, and the launcher makes ``G = 1`` a constant)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_COMPILE_SIZE_ONE)],
                          capture_output=True, text=True, timeout=110,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    size_one = {row["case"]: row["size_one"] for row in rows}
    assert len(rows) == 6 and size_one == {
        "one group (GP = 1)": ["GP"], "one expert per group, top-1 (EGP = KP = 1)": ["EGP", "KP"],
        "one expert (E = GP = EGP = KP = 1)": ["EGP", "GP", "KP"]}
    assert all(row["cubin"] > 0 and row["target"] for row in rows), rows
