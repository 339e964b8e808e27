"""Which GPU runs what: the README's table, generated from the architecture table
(`moe_lab.perf.hardware.ARCHS`) and the kernels' own choices, never typed.

``python -m moe_lab.workbench.figures.gpu_paths`` prints it; tests/project/test_readme_gpus.py
checks that the README holds exactly this table.
"""

from __future__ import annotations

from moe_lab.perf.hardware import ARCHS, mx_mma_of

MX_WORDS = {"scaled": "block-scaled MMA (`tl.dot_scaled`)",
            "fp8_promote": "FP8 MMA per 32-wide block, scales in fp32",
            "bf16": "decoded to bf16, one bf16 MMA (emulated)",
            "none": "the PyTorch reference"}


def gpu_paths_markdown() -> str:
    """One row per architecture: the GPU, whether moe_lab's Triton kernels run there and on
    which tensor-core instruction, the MXFP8 path (`moe_lab.perf.hardware.mx_mma_of`), the
    persistent TMA grouped GEMM, shared memory per block and L2."""
    lines = ["| arch | e.g. | Triton kernels | MXFP8 | TMA grouped GEMM | shared per block | L2 |",
             "|---|---|---|---|---|---:|---:|"]
    for a in ARCHS.values():
        triton = f"compiled, `{a.mma}`" if a.bf16_mma else "refused (Triton needs sm_80): PyTorch paths"
        tma = ("warp-specialised" if a.warp_specialize else "yes") if a.tma else "refused (needs sm_90)"
        lines.append(f"| {a.arch} | {a.gpu} | {triton} | {MX_WORDS[mx_mma_of(a)]} | {tma} | "
                     f"{a.max_shared_per_block // 1024} KB | {a.l2_mb:g} MB |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(gpu_paths_markdown(), end="")
