"""What a CUDA launch of each moe_lab kernel compiles, as data: one module per kernel module.

``specs/<name>.py`` describes the launches of ``moe_lab.kernels.<name>``: its
``compile_specs()`` returns one `CompileSpec` per distinct compilation, at the shapes that
matter (each of `SPEC_PRESETS`' MoE layers at `SPEC_TOKENS` tokens per GPU), each built from
the kernel module's own ``launch_config`` — the function its wrapper calls — so the report
compiles what runs. `for_module` finds a kernel module's specs.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from moe_lab.config import MoEConfig, preset
from moe_lab.kernels.grouped_gemm import dot_bf16, tile_group
from moe_lab.kernels.launch import TOKENS_PER_GPU, LaunchConfig
from moe_lab.kernels.mx_gemm import launch_config as mx_launch_config
from moe_lab.perf.hardware import ARCHS, mx_mma_of

# The shapes every `compile_specs` describes: each preset's model (`moe_lab.config.preset`
# name: its label) at a realistic load per GPU (tokens; each routed to top_k experts, so a
# grouped GEMM sees SPEC_TOKENS · top_k rows).
SPEC_PRESETS = {"deepseek_v3": "DeepSeek-V3", "gpt_oss_20b": "GPT-OSS-20B"}
SPEC_TOKENS = TOKENS_PER_GPU
SPEC_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # Triton's name: torch's dtype

# Why the float32 rows of the GEMMs show no tensor cores: by design, not by accident.
FP32_NOTE = ("float32 is the exact path: its products are IEEE float32 on the CUDA cores "
             "(`input_precision=\"ieee\"`; a TF32 tensor-core dot would round the inputs to 11 "
             "significant bits); training on a GPU runs the experts in bfloat16.")


@dataclass(frozen=True)
class CompileSpec:
    """One ``@jit`` kernel at one shape, as a CUDA launch would compile it.

    ``kernel``: ``"module:function"`` (e.g. ``"moe_lab.kernels.grouped_gemm:_grouped_gemm_kernel"``);
    ``label``: what and at which shape, for the report (``"grouped GEMM fwd, DeepSeek-V3
    experts, bf16"``); ``signature``: every non-constexpr argument's Triton type (``"*bf16"``,
    ``"*fp32"``, ``"i32"``, ``"i64"``, ``"fp32"``), as ``triton.compiler.ASTSource`` takes it;
    ``constexprs``: every constexpr argument's value (the ``launch_config`` blocks among
    them); ``config``: the `LaunchConfig` the wrapper would pick at this shape; ``note``:
    why this compilation may miss the report's targets (spilled bytes, no tensor cores),
    when it does by design — the report prints it beside each row off target;
    ``per_arch``: constexprs that differ by target (``{"sm_90": {"MX_MMA": "fp8_promote"}}``),
    over ``constexprs`` for that arch (`constexprs_for`); ``per_arch_config``: a target's own
    `LaunchConfig` where its launch picks another (fewer stages for less shared memory:
    `config_for`); ``needs``: the feature of `moe_lab.perf.hardware.ARCHS` the launch
    requires (a target without it is refused, as the wrapper refuses it, not compiled).
    """

    kernel: str
    label: str
    signature: dict[str, str]
    constexprs: dict[str, object]
    config: LaunchConfig
    note: str = ""
    per_arch: dict[str, dict[str, object]] = field(default_factory=dict)
    per_arch_config: dict[str, LaunchConfig] = field(default_factory=dict)
    needs: str = "bf16_mma"

    def config_for(self, arch: str) -> LaunchConfig:
        return self.per_arch_config.get(arch, self.config)

    def constexprs_for(self, arch: str) -> dict[str, object]:
        return {**self.constexprs, **self.per_arch.get(arch, {})}


# The MXFP8 kernels' inner product per target, as a launch there picks it
# (`moe_lab.perf.hardware.mx_mma_of`): block-scaled tcgen05 on sm_100, an FP8 MMA per
# 32-wide K block on sm_89 and sm_90, bf16 on sm_80 and sm_86. (The GEMMs' tiles follow:
# `moe_lab.kernels.mx_gemm.launch_config`.)
MX_MMA = {"MX_MMA": "scaled"}
MX_MMA_PER_ARCH = {a.arch: {"MX_MMA": mx_mma_of(a)} for a in ARCHS.values()
                   if mx_mma_of(a) not in ("scaled", "none")}
MX_GEMM_PER_ARCH = {arch: {**mode, **mx_launch_config(1, 1, 64, False, mode["MX_MMA"]).blocks}
                    for arch, mode in MX_MMA_PER_ARCH.items()}


def kernel_spec(module: types.ModuleType, kernel: str, label: str, pointers: dict[str, str],
                ints: dict[str, int], constexprs: dict[str, object], config: LaunchConfig,
                **fields: object) -> CompileSpec:
    """The `CompileSpec` of ``module``'s ``kernel``: ``pointers`` (and any other typed argument)
    and ``ints`` its signature, the ints equal to 1 then ``constexprs`` its constexprs;
    ``fields``: `CompileSpec`'s others (``note``, ...).

    The ints are typed as a CUDA launch specializes them: Triton's launcher makes an integer
    equal to 1 (a unit stride) the constant 1, passes the others as ``i32`` (``i64`` from 2³¹
    on) and tells the compiler which are divisible by 16 (``"i32:16"``), which is what lets it
    vectorize loads and copy them asynchronously."""
    signature, constants = {}, {}
    for name, value in ints.items():
        if value == 1:
            constants[name] = 1
        else:
            kind = "i32" if -(2**31) <= value < 2**31 else "i64"
            signature[name] = f"{kind}:16" if value % 16 == 0 else kind
    return CompileSpec(f"{module.__name__}:{kernel}", label, {**pointers, **signature},
                       {**constants, **constexprs}, config, **fields)


def merge_specs(specs: list[CompileSpec]) -> list[CompileSpec]:
    """One spec per distinct compilation: specs equal in kernel, signature, constexprs and
    config (one binary at run time) become one, their labels joined with " | "."""
    merged: dict[str, CompileSpec] = {}
    for spec in specs:
        key = repr(dataclasses.replace(spec, label="", note=""))
        first = merged.setdefault(key, spec)
        if first is not spec:
            merged[key] = dataclasses.replace(first, label=f"{first.label} | {spec.label}",
                                              note=first.note or spec.note)
    return list(merged.values())


def layers(dtypes: Iterable[str]) -> Iterator[tuple[MoEConfig, int, str, str]]:
    """``(the preset's MoEConfig, routed rows, the labels' shape, dtype)`` of each of `SPEC_PRESETS`'
    layers (its model in the labels) at `SPEC_TOKENS` tokens, in each of ``dtypes``."""
    for name, model in SPEC_PRESETS.items():
        moe = preset(name).moe
        m = SPEC_TOKENS * moe.top_k
        for dtype in dtypes:
            at = (f"{dtype}, {model}: E={moe.n_experts}, d_model={moe.d_model}, d_expert={moe.d_expert}, "
                  f"{SPEC_TOKENS} tokens x top-{moe.top_k} = {m} rows")
            yield moe, m, at, dtype


def grouped_spec(module: types.ModuleType, kernel: str, label: str, pointers: dict[str, str],
                 cfg: LaunchConfig, ints: dict[str, int], dtype: str, tag: str = "",
                 **constexprs: object) -> CompileSpec:
    """A `CompileSpec` of a grouped-GEMM ``kernel`` of ``module``, labelled ``"[<tag><the config,
    `describe`>] <label>"``: ``pointers`` (and ``offsets_ptr`` to int32), ``ints`` typed as a
    launch types them, ``cfg``'s blocks, ``DOT_BF16`` and, for the kernels with a tile order
    over experts' row tiles (those that take ``E``), ``GROUP_M`` as the wrapper picks them
    (`tile_group`), besides ``constexprs``."""
    group = {"GROUP_M": tile_group(ints["M_ROWS"], ints["E"], cfg.blocks["BLOCK_M"])} if "E" in ints else {}
    return kernel_spec(
        module, kernel, f"[{tag}{describe(cfg)}] {label}", {**pointers, "offsets_ptr": "*i32"}, ints,
        {**cfg.blocks, "DOT_BF16": dot_bf16(SPEC_DTYPES[dtype], interpreted=False), **group, **constexprs},
        cfg, note=FP32_NOTE if dtype == "fp32" else "")


def describe(cfg: LaunchConfig) -> str:
    """A GEMM's config as the report's labels show it: ``"64x128x64 (M x N x K blocks),
    4 warps, 3 stages"``."""
    b = cfg.blocks
    return (f"{b['BLOCK_M']}x{b['BLOCK_N']}x{b['BLOCK_K']} (M x N x K blocks), "
            f"{cfg.num_warps} warps, {cfg.num_stages} stages")


def for_module(kernel_module: str | types.ModuleType) -> list[CompileSpec]:
    """The `CompileSpec` list of a kernel module (its name or the module); ``ValueError``
    when it has none."""
    name = kernel_module if isinstance(kernel_module, str) else kernel_module.__name__
    spec_module = f"{__name__}.{name.rpartition('.')[2]}"  # specs/<name>.py describes moe_lab.kernels.<name>
    try:
        specs = importlib.import_module(spec_module)
    except ModuleNotFoundError as exc:
        if exc.name != spec_module:
            raise
        raise ValueError(f"{name} has no compile specs ({spec_module} does not exist)") from None
    return list(specs.compile_specs())
