"""The MX kernels as a CUDA launch compiles them, read off Triton's IR: every address offset
is 64-bit (a tensor past 2^31 elements, such as DeepSeek-V3's [256, 7168, 2048] expert
weights, would wrap int32 offsets), and probabilities left unquantized reach ``P·V`` as
float32 in an IEEE float32 dot.

No GPU is needed: Triton compiles for sm_90 on any machine. This session's kernels belong
to the interpreter, so one subprocess with ``TRITON_INTERPRET=0`` compiles one spec of each
module (`moe_lab.workbench.compile_report.specs`) and prints the Triton IR (the arguments
specialised as the compile report's `moe_lab.workbench.compile_report.worker` does, as a
launch would).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from moe_lab.kernels import mx_attention
from moe_lab.kernels import mx_quantize as mx
from moe_lab.workbench.compile_report.specs import for_module

COMPILE_TO_TTIR = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_lab.workbench.compile_report.specs import for_module
from moe_lab.workbench.compile_report.worker import triton_signature

ttir = {}
for module, index in json.loads(sys.argv[1]):
    spec = for_module(module)[index]
    kernel = getattr(importlib.import_module(module), spec.kernel.split(":")[1])
    sig, constexprs, attrs, _ = triton_signature(kernel, spec.kernel, spec.signature,
                                                 spec.constexprs)
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": spec.config.num_warps, "num_stages": spec.config.num_stages})
    ttir[module] = compiled.asm["ttir"]
print(json.dumps(ttir))
"""


def _unquantized_p_spec() -> int:
    return next(i for i, spec in enumerate(for_module(mx_attention))
                if not spec.constexprs["QUANT_P"])


@pytest.fixture(scope="module")
def ttir() -> dict[str, str]:
    """Triton IR of the quantizer (row+col, bf16) and of the attention forward with P left
    in float32 (its address arithmetic is the recipe's), compiled for sm_90."""
    which = [(mx.__name__, 0), (mx_attention.__name__, _unquantized_p_spec())]
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_TO_TTIR, json.dumps(which)],
        env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True,
        timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", [mx.__name__, mx_attention.__name__])
def test_every_address_offset_is_64_bit(ttir, module):
    # tt.addptr %ptr, %offset : <pointer type>, <offset type>
    offsets = re.findall(r"tt\.addptr [^:]*: .*?ptr<\w+>>?, (\S*?i\d+)>? loc", ttir[module])
    assert offsets and len(offsets) == ttir[module].count("tt.addptr "), ttir[module][:2000]
    narrow = sorted({t for t in offsets if not t.endswith("i64")})
    assert not narrow, f"{module}: pointer offsets computed in {narrow}, not int64"


def test_unquantized_p_enters_an_ieee_float32_dot(ttir):
    # QKᵀ is one block-scaled dot of E4M3 codes; P·V takes float32 operands (P as computed,
    # V dequantized) without a TF32 (or float16) rounding on the way in.
    module = ttir[mx_attention.__name__]
    assert len(re.findall(r"tt\.dot_scaled .* lhs = e4m3 rhs = e4m3", module)) == 1, module[:2000]
    dots = re.findall(r"tt\.dot [^:]*: (tensor<\S+>) \* (tensor<\S+>)", module)
    lines = [line for line in module.splitlines() if "tt.dot " in line]
    assert len(dots) == len(lines) == 1, lines
    (a, b), line = dots[0], lines[0]
    assert a.endswith("xf32>") and b.endswith("xf32>"), line
    precision = re.search(r"inputPrecision = (\w+)", line)
    assert precision is None or precision.group(1) == "ieee", line


def test_attention_specs_compile_each_arch_at_its_launch_tile():
    # sm_100 compiles the block-scaled tile (128 queries), sm_90 the FP8-promote one (64): the
    # report must show the tile a launch on that GPU would run, not one tile for both.
    specs = for_module(mx_attention)
    assert specs
    for spec in specs:
        d = int(re.search(r"d=(\d+)", spec.label).group(1))
        for arch, mma in (("sm_100", "scaled"), ("sm_90", "fp8_promote")):
            constexprs = spec.constexprs_for(arch)
            cfg = mx_attention.launch_config(4096, 4096, d, interpreted=False, mma=mma)
            assert constexprs["MX_MMA"] == mma, (spec.label, arch)
            assert {k: constexprs[k] for k in cfg.blocks} == cfg.blocks, (spec.label, arch)
            assert (spec.config.num_warps, spec.config.num_stages) == (cfg.num_warps, cfg.num_stages)
    assert mx_attention.launch_config(4096, 4096, 128, False, "fp8_promote").blocks["BLOCK_M"] == 64
    assert mx_attention.launch_config(4096, 4096, 128, False, "scaled").blocks["BLOCK_M"] == 128
