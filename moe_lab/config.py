"""Model configuration: three dataclasses, a handful of named presets, and `holds`.

`MoEConfig` describes one Mixture-of-Experts layer (router, experts, dispatcher);
`ModelConfig` describes the decoder-only transformer around it; `ModelImpls` names how it is
computed (one name per registry, and the precision), the one place those names and their
defaults are written. Both validate
themselves on construction (`moe_lab.checks`), so a bad value fails where it is written,
with the field's name and the range that was expected, not deep inside a forward pass.

A config that shares fields with another holds it rather than copying them (`holds`).

Presets:
- ``tiny``  — CI smoke size: a training step takes milliseconds on a CPU.
- ``small`` — a real CPU run: minutes to a visibly falling loss.
- ``gpt_oss_20b`` and ``deepseek_v3`` — the published shapes (the models' public configs:
  Hugging Face's ``openai/gpt-oss-20b`` config and DeepSeek-V3's
  ``inference/configs/config_671B.json``). They drive the FLOPs model, kernel shapes and
  the simulators; they are never trained here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from moe_lab.checks import (
    boolean,
    int_in,
    non_negative_ints,
    non_negative_number,
    one_of,
    positive_ints,
    positive_number,
)

C = TypeVar("C")


def holds(**parts: type) -> Callable[[type[C]], type[C]]:
    """Let a dataclass that holds other config dataclasses be built and read field by field.

    ``@holds(schedule=Schedule)`` on a dataclass with a field ``schedule: Schedule``:
    ``C(lr=1e-3)`` is ``C(schedule=replace(C's default schedule, lr=1e-3))`` (with
    ``schedule=`` given too, the fields change that one), and ``c.lr`` reads ``c.schedule.lr``.
    Each field is then declared and validated once, in the part that owns it; a part may hold
    parts of its own, whose fields the holder takes as well (``held_fields``: field → part)."""

    def decorate(cls: type[C]) -> type[C]:
        flat = {name: part for part, part_cls in parts.items()
                for name in [*(f.name for f in dataclasses.fields(part_cls)),
                             *getattr(part_cls, "held_fields", {})]}
        default = {f.name: f.default_factory for f in dataclasses.fields(cls) if f.name in parts}
        own_init = cls.__init__

        @functools.wraps(own_init)
        def __init__(self: C, *args: object, **kwargs: object) -> None:
            for part in parts:
                values = {name: kwargs.pop(name) for name in list(kwargs) if flat.get(name) == part}
                if values:
                    kwargs[part] = dataclasses.replace(kwargs.get(part) or default[part](), **values)
            own_init(self, *args, **kwargs)

        cls.__init__ = __init__
        for name, part in flat.items():
            setattr(cls, name, property(lambda self, p=part, n=name: getattr(getattr(self, p), n)))
        cls.held_fields = flat
        return cls

    return decorate


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: ``n_experts`` SwiGLU experts of width ``d_expert``, ``top_k`` per token.

    Routing: ``score_func`` turns router logits into scores; with ``n_groups > 1`` the
    experts are split into groups and only the ``topk_groups`` best groups (by the sum of
    each group's top-2 scores, DeepSeek-V3 style) may be chosen. ``renormalize`` rescales
    the chosen weights to sum to one; ``scaling_factor`` multiplies them afterwards.
    ``capacity_factor`` and ``drop_policy`` (which assignments an over-full expert keeps: the
    earliest by ``position`` or the most confident by router ``probability``) are used by the
    capacity dispatcher only.
    """

    d_model: int
    n_experts: int
    top_k: int
    d_expert: int
    n_shared_experts: int = 0
    score_func: str = "softmax"
    renormalize: bool = True
    scaling_factor: float = 1.0
    n_groups: int = 1
    topk_groups: int = 1
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    capacity_factor: float = 1.25
    drop_policy: str = "position"
    router_dtype: str = "fp32"

    def __post_init__(self) -> None:
        positive_ints(self, "d_model", "n_experts", "top_k", "d_expert", "n_groups", "topk_groups")
        non_negative_ints(self, "n_shared_experts")
        one_of(self.drop_policy, "MoEConfig.drop_policy", ("position", "probability"))
        one_of(self.score_func, "MoEConfig.score_func", ("softmax", "sigmoid"))
        one_of(self.router_dtype, "MoEConfig.router_dtype", ("fp32", "fp64"))
        positive_number(self.capacity_factor, "MoEConfig.capacity_factor")
        positive_number(self.scaling_factor, "MoEConfig.scaling_factor")
        int_in(self.top_k, "MoEConfig.top_k (at most n_experts)", 1, self.n_experts)
        non_negative_number(self.aux_loss_coef, "MoEConfig.aux_loss_coef")
        non_negative_number(self.z_loss_coef, "MoEConfig.z_loss_coef")
        boolean(self.renormalize, "MoEConfig.renormalize")
        if self.n_experts % self.n_groups:
            raise ValueError(f"MoEConfig.n_groups must divide n_experts={self.n_experts}, "
                             f"got {self.n_groups}")
        int_in(self.topk_groups, "MoEConfig.topk_groups (at most n_groups)", 1, self.n_groups)
        if self.n_groups > 1 and self.top_k > self.topk_groups * (self.n_experts // self.n_groups):
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds the experts in the {self.topk_groups} "
                             f"selected groups ({self.topk_groups * (self.n_experts // self.n_groups)})")

    def replace(self, **changes: object) -> MoEConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: the first ``n_dense_layers`` use a dense SwiGLU FFN of
    width ``d_ff``, the rest an MoE layer described by ``moe``.

    ``attention="mha"`` is grouped-query attention with ``n_kv_heads`` key/value heads;
    ``attention="mla"`` records DeepSeek's multi-head latent attention shapes for the
    FLOPs model (the trainable model here implements ``mha`` only).
    ``sliding_window`` > 0 with ``sliding_every`` = 2 means every other layer attends
    to a window of that many tokens (GPT-OSS); it only affects the FLOPs model.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    moe: MoEConfig
    n_dense_layers: int = 0
    n_kv_heads: int = 0  # 0 means n_heads
    head_dim: int = 0  # 0 means d_model // n_heads
    seq_len: int = 128
    mtp_layers: int = 0
    attention: str = "mha"
    # MLA shapes (FLOPs model only)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    sliding_every: int = 0
    tie_embeddings: bool = False
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        positive_ints(self, "vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len")
        non_negative_ints(self, "n_dense_layers", "n_kv_heads", "head_dim", "mtp_layers", "q_lora_rank",
                          "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                          "sliding_window", "sliding_every")
        boolean(self.tie_embeddings, "ModelConfig.tie_embeddings")
        if not isinstance(self.moe, MoEConfig):
            raise ValueError(f"ModelConfig.moe must be a MoEConfig, got {type(self.moe).__name__}")
        if self.moe.d_model != self.d_model:
            raise ValueError(f"ModelConfig.moe.d_model must equal d_model={self.d_model}, "
                             f"got {self.moe.d_model}")
        if self.head_dim == 0 and self.d_model % self.n_heads:
            raise ValueError(f"ModelConfig.d_model={self.d_model} must be divisible by "
                             f"n_heads={self.n_heads} (or set head_dim explicitly)")
        if self.kv_heads > self.n_heads or self.n_heads % self.kv_heads:
            raise ValueError(f"ModelConfig.n_kv_heads must divide n_heads={self.n_heads}, "
                             f"got {self.n_kv_heads}")
        int_in(self.n_dense_layers, "ModelConfig.n_dense_layers (at most n_layers)", 0, self.n_layers)
        one_of(self.attention, "ModelConfig.attention", ("mha", "mla"))
        if self.attention == "mla":
            positive_ints(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed (validated again). ``moe=`` may be a dict of
        MoE field changes; ``d_model`` changes propagate to the MoE config."""
        moe = changes.pop("moe", self.moe)
        if isinstance(moe, dict):
            moe = self.moe.replace(**moe)
        if "d_model" in changes:
            moe = moe.replace(d_model=changes["d_model"])
        return dataclasses.replace(self, moe=moe, **changes)


@dataclass(frozen=True)
class ModelImpls:
    """How a model is computed: the implementation names it is built with, one per registry —
    ``dispatcher`` (`moe_lab.moe.dispatch.DISPATCHERS`), ``expert_backend``
    (`moe_lab.moe.experts.EXPERT_BACKENDS`), ``router_impl`` (`moe_lab.moe.router.ROUTER_IMPLS`),
    ``attention_impl`` (`moe_lab.attention.ATTENTION_IMPLS`), ``embedding_impl``
    (`moe_lab.model.EMBEDDING_IMPLS`) — and its precision: ``mxfp8`` names the parts computed in
    emulated MXFP8 (``"attention"``, its projections as
    `moe_lab.quant.linear.make_mxfp8_linear` builds them and the ``"mxfp8"`` core;
    ``"experts"``, every expert GEMM on MXFP8 operands), and ``fp32_logits`` keeps the output
    projection in FP32 under autocast. ``MoETransformer(cfg, impls)``; each name is checked
    by its registry where the part is built."""

    dispatcher: str = "naive"
    expert_backend: str = "loop"
    router_impl: str = "reference"
    attention_impl: str = "sdpa"
    embedding_impl: str = "reference"
    mxfp8: tuple[str, ...] = ()
    fp32_logits: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mxfp8", (self.mxfp8,) if isinstance(self.mxfp8, str) else tuple(self.mxfp8))
        for part in self.mxfp8:
            one_of(part, "ModelImpls.mxfp8", ("attention", "experts"))
        boolean(self.fp32_logits, "ModelImpls.fp32_logits")


PRESETS = {
    "tiny": ModelConfig(
        name="tiny", vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256,
        n_dense_layers=0, seq_len=64,
        moe=MoEConfig(d_model=64, n_experts=8, top_k=2, d_expert=64),
    ),
    "small": ModelConfig(
        name="small", vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512,
        n_dense_layers=1, seq_len=128,
        moe=MoEConfig(d_model=128, n_experts=16, top_k=4, d_expert=128, n_shared_experts=1),
    ),
    # Shapes from the published Hugging Face config of openai/gpt-oss-20b.
    "gpt_oss_20b": ModelConfig(
        name="gpt_oss_20b", vocab_size=201_088, d_model=2880, n_layers=24, n_heads=64,
        n_kv_heads=8, head_dim=64, d_ff=2880, n_dense_layers=0, seq_len=4096,
        sliding_window=128, sliding_every=2,
        moe=MoEConfig(d_model=2880, n_experts=32, top_k=4, d_expert=2880,
                      score_func="softmax", renormalize=True),
    ),
    # Shapes from DeepSeek-V3's published inference/configs/config_671B.json.
    "deepseek_v3": ModelConfig(
        name="deepseek_v3", vocab_size=129_280, d_model=7168, n_layers=61, n_heads=128,
        d_ff=18_432, n_dense_layers=3, seq_len=4096, mtp_layers=1, attention="mla",
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, head_dim=192,
        moe=MoEConfig(d_model=7168, n_experts=256, top_k=8, d_expert=2048, n_shared_experts=1,
                      score_func="sigmoid", renormalize=True, scaling_factor=2.5,
                      n_groups=8, topk_groups=4, aux_loss_coef=0.0001),
    ),
}


def preset(name: str, **changes: object) -> ModelConfig:
    """The named preset, optionally with fields changed: ``preset("tiny", n_layers=4)``."""
    cfg = PRESETS[one_of(name, "preset name", PRESETS)]
    return cfg.replace(**changes) if changes else cfg
