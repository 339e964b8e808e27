"""Triton kernels, one concept per module: ``mx`` (MXFP8 quantizer), ``attention``
(MXFP8 flash attention), and the MoE kernels beside them. Each module holds its
``@triton.jit`` functions and a thin wrapper that checks shapes, dtypes and devices and
allocates; on a machine without CUDA they run under Triton's interpreter."""
