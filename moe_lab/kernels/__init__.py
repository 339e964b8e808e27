"""Triton kernels, one concept per module, each tested against its plain PyTorch reference:

- ``grouped_gemm`` — the grouped GEMM over device offsets (and SwiGLU fused into the first
  GEMM's epilogue), the expert backend ``triton``; ``grouped_gemm_tma`` — persistent, TMA-fed;
- ``permute`` — the dropless layout's token permutation (``permute_args``: the argument
  checks it shares with the CPU plug-in's permutation);
- ``fused_moe`` — the permute and the combine fused into the grouped GEMMs; ``fused_mxfp8``
  — the MXFP8-quantize epilogue; ``fusions`` — each fusion beside the chain it replaces;
- ``fused_router`` — the whole routing chain in one kernel (reference: ``moe_lab.moe.router``);
- ``mx_quantize``, ``mx_gemm``, ``mx_attention`` — the MXFP8 quantizer, the block-scaled GEMM
  and flash attention on MXFP8 operands (references: ``moe_lab.quant.mx``, ``moe_lab.attention``).

Each module reads as a Triton tutorial does: the story, the kernels, the launch (its
``launch_config`` and a wrapper that checks and allocates), the autograd binding, the
reference. What they share — the `jit` that decides compiled or interpreted, the tile
schedule, the K loops, the rounding store — is ``common``; ``launch`` holds `LaunchConfig`;
``tuning`` the GPU's tuned table that overrides the grouped GEMM's rule.
"""

import importlib.util

#: Why Triton kernels cannot run in this Python (Triton ships Linux wheels only), or ``None``; the
#: registries mark their Triton names unavailable with it (`moe_lab.registry.Registry.register`).
TRITON_MISSING: str | None = None if importlib.util.find_spec("triton") else (
    "it needs Triton, which installs on Linux only: run it on Linux, in the container or on a "
    "hosted GPU notebook (README, Where to run it)")
