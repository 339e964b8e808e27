"""Triton kernels, one concept per module, each tested against its plain PyTorch reference:

- ``grouped_gemm`` — the grouped GEMM over device offsets (and SwiGLU fused into the first
  GEMM's epilogue), the expert backend ``triton`` (reference: the ``loop`` backend);
- ``permute`` — the dropless layout's token permutation (``permute_args``: the argument
  checks it shares with other permutations; reference: ``moe_lab.moe.dispatch``);
- ``fused_router`` — the whole routing chain in one kernel (reference: ``moe_lab.moe.router``);
- ``mx`` — the MXFP8 quantizer (reference: ``moe_lab.quant.mx``);
- ``mx_attention`` — flash attention on MXFP8 operands (reference: ``moe_lab.attention``).

Each module holds its ``@triton.jit`` functions and a thin wrapper that checks shapes, dtypes
and devices and allocates. On a GPU they run compiled; on a machine without CUDA, under
Triton's interpreter. Nothing here is CPU-specific: moe_lab's C++ CPU kernels are a plug-in,
``moe_lab.workbench.cpu``.
"""
