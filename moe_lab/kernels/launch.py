"""How a Triton kernel is launched, as data: block sizes, warps and pipeline stages.

Every kernel module chooses them in one function of its own, ``launch_config``, which its
wrapper calls at launch time; the compile report (`moe_lab.workbench.compile_report`)
calls the same function to compile what a CUDA launch would run, so the report cannot
drift from what runs. Plain dataclasses: importing this module imports neither Triton nor
torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A realistic load per GPU: the tokens one MoE layer routes on each GPU in a training step,
# each to top_k experts. The tile rules are reasoned at it (with DeepSeek-V3's and
# GPT-OSS-20B's layers), and the fusion model and the compile report take it by default.
TOKENS_PER_GPU = 8192


@dataclass(frozen=True)
class LaunchConfig:
    """What one launch picks besides the grid: the block-size constexprs (``blocks``, e.g.
    ``{"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}``), ``num_warps`` and ``num_stages``
    (software-pipeline depth of the kernel's loops; Triton's CUDA default is 3), and for a
    kernel with a grouped tile order its ``GROUP_M`` (``group_m``: row tiles per group of
    `moe_lab.kernels.common.tile_order`; ``None``, as in every rule's config, leaves it to the
    launch's rule, `moe_lab.kernels.grouped_gemm.tile_group`; a config applied explicitly may
    set it). Written by the kernel modules' own rules, it trusts them: nothing here checks."""

    blocks: dict[str, int] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    group_m: int | None = None

