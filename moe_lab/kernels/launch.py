"""How a Triton kernel is launched, as data: the one place a launch's choices are written down.

Every kernel module chooses its block sizes, warps and pipeline stages in one function of its
own (``launch_config``) that its wrapper calls at launch time and its ``compile_specs`` calls
to describe what a CUDA launch would run at the shapes that matter (DeepSeek-V3's and
GPT-OSS-20B's). `moe_lab.workbench.compile_report.report` compiles those specs for Hopper (sm_90) and
Blackwell (sm_100) without a GPU and reads registers, spills, shared memory, the tensor-core
instructions and the async copies off the result — so the report cannot drift from what runs.

Plain dataclasses: importing this module imports neither Triton nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LaunchConfig:
    """What one launch picks besides the grid: the block-size constexprs (``blocks``, e.g.
    ``{"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}``), ``num_warps`` and ``num_stages``
    (software-pipeline depth of the kernel's loops; Triton's CUDA default is 3)."""

    blocks: dict[str, int] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name, value in self.blocks.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LaunchConfig.blocks[{name!r}] must be a positive int, got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"LaunchConfig.num_warps must be a power of two <= 32, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"LaunchConfig.num_stages must be a positive int, got {self.num_stages!r}")


@dataclass(frozen=True)
class CompileSpec:
    """One ``@triton.jit`` kernel at one shape, as a CUDA launch would compile it.

    ``kernel``: ``"module:function"`` (e.g. ``"moe_lab.kernels.grouped_gemm:_grouped_gemm_kernel"``);
    ``label``: what and at which shape, for the report (``"grouped GEMM fwd, DeepSeek-V3
    experts, bf16"``); ``signature``: every non-constexpr argument's Triton type (``"*bf16"``,
    ``"*fp32"``, ``"i32"``, ``"i64"``, ``"fp32"``), as ``triton.compiler.ASTSource`` takes it;
    ``constexprs``: every constexpr argument's value (the ``launch_config`` blocks among
    them); ``config``: the `LaunchConfig` the wrapper would pick at this shape; ``note``:
    why this compilation may miss the report's targets (spilled bytes, no tensor cores),
    when it does by design — the report prints it beside each row off target.
    """

    kernel: str
    label: str
    signature: dict[str, str]
    constexprs: dict[str, object]
    config: LaunchConfig
    note: str = ""

    def __post_init__(self) -> None:
        if ":" not in self.kernel:
            raise ValueError(f"CompileSpec.kernel must be 'module:function', got {self.kernel!r}")


# The shapes every `compile_specs` describes: each preset's model (`moe_lab.config.preset`
# name: its label) at a realistic load per GPU (tokens; each routed to top_k experts, so a
# grouped GEMM sees SPEC_TOKENS · top_k rows).
SPEC_PRESETS = {"deepseek_v3": "DeepSeek-V3", "gpt_oss_20b": "GPT-OSS-20B"}
SPEC_TOKENS = 8192


def int_args(**values: int) -> tuple[dict[str, str], dict[str, int]]:
    """Integer kernel arguments as a CUDA launch specializes them, for a `CompileSpec`:
    Triton's launcher makes an integer equal to 1 (a unit stride) the constant 1, passes
    the others as ``i32`` (``i64`` from 2³¹ on) and tells the compiler which are divisible
    by 16 (``"i32:16"``), which is what lets it vectorize loads and copy them
    asynchronously. Returns ``(signature, constexprs)`` entries."""
    signature, constants = {}, {}
    for name, value in values.items():
        if value == 1:
            constants[name] = 1
        else:
            kind = "i32" if -(2**31) <= value < 2**31 else "i64"
            signature[name] = f"{kind}:16" if value % 16 == 0 else kind
    return signature, constants


def merge_specs(specs: list[CompileSpec]) -> list[CompileSpec]:
    """One spec per distinct compilation: specs equal in kernel, signature, constexprs and
    config (one binary at run time) become one, their labels joined with " | "."""
    merged: dict[tuple, CompileSpec] = {}
    for spec in specs:
        key = (spec.kernel, tuple(sorted(spec.signature.items())),
               tuple(sorted((k, repr(v)) for k, v in spec.constexprs.items())), repr(spec.config))
        if key in merged:
            first = merged[key]
            merged[key] = CompileSpec(first.kernel, f"{first.label} | {spec.label}", first.signature,
                                      first.constexprs, first.config, first.note or spec.note)
        else:
            merged[key] = spec
    return list(merged.values())


__all__ = ["SPEC_PRESETS", "SPEC_TOKENS", "CompileSpec", "LaunchConfig", "int_args", "merge_specs"]
