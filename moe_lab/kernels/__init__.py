"""Triton kernels, one concept per module, each tested against its plain PyTorch reference:

- ``grouped_gemm`` — the grouped GEMM over device offsets (and SwiGLU fused into the first
  GEMM's epilogue), the expert backend ``triton``; ``grouped_gemm_tma`` — persistent, TMA-fed;
- ``permute`` — the dropless layout's token permutation (the row-id map, permute, unpermute);
- ``fused_moe`` — the permute and the combine fused into the grouped GEMMs; ``fused_mxfp8``
  — the MXFP8-quantize epilogue; ``fusions`` — each fusion beside the chain it replaces;
- ``fused_router`` — the whole routing chain in one kernel (reference: ``moe_lab.moe.router``);
- ``mx_quantize``, ``mx_gemm``, ``mx_attention`` — the MXFP8 quantizer, the block-scaled GEMM
  and flash attention on MXFP8 operands (references: ``moe_lab.quant.mx``, ``moe_lab.attention``).

Each module reads as a Triton tutorial does: the story, the ``@triton.jit`` kernels, the launch
(its ``launch_config`` and a wrapper that checks and allocates), the custom op and its autograd
binding, the reference. What several kernels share — the grouped tile order and schedule, the K
loops, the rounding store, the custom-op binding `kernel_op` — is ``common``; ``launch`` holds
`LaunchConfig`. What makes the kernels run under Triton's interpreter on a machine without CUDA
is ``interpreter``, which this package runs as it is imported, before any kernel is defined: no
kernel module thinks about it.
"""

from moe_lab.registry import TRITON_MISSING

if TRITON_MISSING is None:
    from moe_lab.kernels.interpreter import install

    install()
