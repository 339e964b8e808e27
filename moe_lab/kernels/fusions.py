"""Every fused expert-MLP function beside the unfused chain it replaces: `FUSIONS`.

The fusions themselves are `moe_lab.kernels.fused_moe` (gather prologue, weighted-scatter
epilogue) and `moe_lab.kernels.fused_mxfp8` (the MXFP8-quantize epilogue); each file ends
with the plain PyTorch chains its kernels replace. An entry pairs the two (same arguments,
same result); tests/lesson/kernels/test_fused_moe.py runs each against its chain.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from moe_lab.kernels import fused_moe as fm
from moe_lab.kernels import fused_mxfp8 as fmx
from moe_lab.registry import Registry


@dataclass(frozen=True)
class Fusion:
    """A fused function and the unfused chain it replaces (same arguments, same result)."""

    fused: Callable[..., object]
    unfused: Callable[..., object]
    what: str


FUSIONS: Registry[Fusion] = Registry(
    "fusion", "memory-bound work fused into the grouped GEMMs, each beside the unfused chain it replaces")
for name, fused, unfused, what in (
    ("gather_prologue", fm.gather_swiglu, fm.gather_swiglu_unfused,
     "first GEMM reads token rows through the row-id map (no permuted copy of x)"),
    ("scatter_epilogue", fm.gemm_scatter, fm.gemm_scatter_unfused,
     "second GEMM weights its rows and sends them to their tokens (deterministic)"),
    ("scatter_epilogue_atomic", functools.partial(fm.gemm_scatter, scatter="atomic"), fm.gemm_scatter_unfused,
     "second GEMM adds its weighted rows into the tokens with float32 atomics"),
    ("mxfp8_epilogue", fmx.gather_swiglu_mxfp8, fmx.gather_swiglu_mxfp8_unfused,
     "first GEMM's SwiGLU output leaves as MXFP8 codes and scales"),
    ("mxfp8_mlp_forward", fmx.fused_moe_mlp_mxfp8, fmx.fused_moe_mlp_mxfp8_unfused,
     "MXFP8 epilogue feeding the second GEMM (decoded in registers) and the weighted scatter"),
    ("mxfp8_mlp_forward_native", fmx.fused_moe_mlp_mxfp8_native, fmx.fused_moe_mlp_mxfp8_native_unfused,
     "MXFP8 epilogue feeding a grouped MXFP8 GEMM (tl.dot_scaled, W2 in MXFP8 too)"),
    ("fused_mlp", fm.fused_moe_mlp, fm.fused_moe_mlp_unfused, "gather prologue + SwiGLU + weighted scatter"),
):
    FUSIONS.register(name, Fusion(fused, unfused, what))
