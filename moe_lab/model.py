"""A small decoder-only MoE transformer, the model every notebook trains.

Pre-norm blocks (RMSNorm → attention → residual, RMSNorm → FFN → residual) with rotary
position embeddings and grouped-query attention. The first ``cfg.n_dense_layers``
blocks use a dense SwiGLU FFN, the rest an MoE layer (DeepSeek-V3 keeps its first three
layers dense the same way). Implementations are picked by name, all of them in one
`moe_lab.config.ModelImpls` passed whole (``MoETransformer(cfg, impls)``), never by ``if``
scattered through the model.

``model(idx, targets)`` with ``idx: [batch, seq] int64`` returns ``ModelOutput`` with
``logits: [batch, seq, vocab]``, ``loss`` (cross-entropy + the MoE auxiliary losses, or
``None`` without targets), ``lm_loss`` and the per-layer ``MoEStats``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_lab.attention import ATTENTION_IMPLS, PACKED_ATTENTION_IMPLS, causal_attention
from moe_lab.config import ModelConfig, ModelImpls
from moe_lab.moe.experts import SwiGLU
from moe_lab.moe.layer import MoELayer, MoEStats, autocast_enabled
from moe_lab.quant.linear import make_mxfp8_linear
from moe_lab.registry import Registry

Tensor = torch.Tensor


# A plug-in may add variants (an embedding whose weight gradient is one opaque op, for
# example), each the same function.
EMBEDDING_IMPLS: Registry[Callable[[nn.Embedding, Tensor], Tensor]] = Registry(
    "embedding", "token embeddings: fn(module: nn.Embedding, idx) -> [*idx.shape, dim]",
    plugin=True)
EMBEDDING_IMPLS.register("reference", lambda module, idx: module(idx))


def rope_cache(seq_len: int, head_dim: int, theta: float = 10_000.0) -> tuple[Tensor, Tensor]:
    """cos, sin: ``[seq_len, head_dim // 2]`` for rotary embeddings."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs of ``x: [batch, heads, seq, head_dim]`` by position."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention; ``attention_impl`` names the core (see
    ``moe_lab.attention.ATTENTION_IMPLS``). Where that name also has a packed variant
    (``moe_lab.attention.PACKED_ATTENTION_IMPLS``) that accepts the projection's output, the
    rotary embedding and the split into heads run inside it: the same function without the
    layout passes around the core."""

    def __init__(self, cfg: ModelConfig, attention_impl: str = ModelImpls.attention_impl) -> None:
        super().__init__()
        if cfg.attention != "mha":
            raise ValueError(f"the trainable model implements attention='mha' only, got {cfg.attention!r} "
                             f"(preset {cfg.name!r} is for the FLOPs model and simulators)")
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.dim_head
        self.attention_impl = ATTENTION_IMPLS.check(attention_impl, "attention_impl")
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.dim_head, bias=False)
        self.out = nn.Linear(cfg.n_heads * cfg.dim_head, cfg.d_model, bias=False)
        cos, sin = rope_cache(cfg.seq_len, cfg.dim_head)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        packed = PACKED_ATTENTION_IMPLS.get(self.attention_impl)
        if packed is not None and packed.accepts(qkv, self.n_heads, self.kv_heads):
            # q, k, v read where the projection wrote them, the heads written side by side
            return self.out(packed(qkv, self.cos, self.sin, self.n_heads))
        heads = (self.n_heads, self.kv_heads, self.kv_heads)
        # each [b, t, heads·head_dim] -> [b, heads, t, head_dim]
        q, k, v = [part.view(b, t, h, self.head_dim).transpose(1, 2)
                   for part, h in zip(qkv.split([h * self.head_dim for h in heads], dim=-1), heads)]
        q, k = apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
        y = causal_attention(q, k, v, impl=self.attention_impl)
        return self.out(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class Block(nn.Module):
    """Attention, then the FFN: an MoE layer where ``moe`` (its ``ffn`` may be swapped for a
    layer of the same contract, `moe_lab.parallel.ep.EPMoELayer`), a dense SwiGLU elsewhere."""

    def __init__(self, cfg: ModelConfig, moe: bool, impls: ModelImpls) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        # MXFP8 projections feed the emulated MXFP8 core; MXFP8 experts quantize every GEMM's operands.
        self.attn = Attention(cfg, "mxfp8" if "attention" in impls.mxfp8 else impls.attention_impl)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.moe = moe
        quant = "mxfp8" if "experts" in impls.mxfp8 else None
        self.ffn = (MoELayer(cfg.moe, impls.dispatcher, impls.expert_backend, impls.router_impl,
                             quant=quant) if moe else SwiGLU(cfg.d_model, cfg.d_ff))

    def forward(self, x: Tensor) -> tuple[Tensor, MoEStats | None]:
        x = x + self.attn(self.norm1(x))
        if self.moe:
            y, stats = self.ffn(self.norm2(x))
            return x + y, stats
        return x + self.ffn(self.norm2(x)), None


@dataclass
class ModelOutput:
    logits: Tensor
    loss: Tensor | None
    lm_loss: Tensor | None
    moe_stats: list[MoEStats] = field(default_factory=list)

    @property
    def aux_loss(self) -> Tensor:
        return sum((s.aux_loss + s.z_loss for s in self.moe_stats), self.logits.new_zeros(()))


class MoETransformer(nn.Module):
    """The model of ``cfg``, computed as ``impls`` names (`moe_lab.config.ModelImpls`); its
    fields may be given as keywords instead: ``MoETransformer(cfg, dispatcher="dropless")`` is
    ``MoETransformer(cfg, ModelImpls(dispatcher="dropless"))``."""

    def __init__(self, cfg: ModelConfig, impls: ModelImpls | None = None, **names: object) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg, self.impls = cfg, replace(impls or ModelImpls(), **names)
        self.embedding_impl = EMBEDDING_IMPLS.check(self.impls.embedding_impl, "embedding_impl")
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i >= cfg.n_dense_layers, self.impls)
                                    for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        for module in self.modules():  # GPT-2's init: N(0, 0.02²) for every projection and embedding
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        if "attention" in self.impls.mxfp8:  # after the init: a Transformer Engine linear copies it
            for attn in (block.attn for block in self.blocks):
                attn.qkv, attn.out = make_mxfp8_linear(attn.qkv), make_mxfp8_linear(attn.out)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if b.moe]

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> ModelOutput:
        if idx.dim() != 2 or idx.dtype != torch.int64:
            raise ValueError(f"idx must be [batch, seq] int64, got {tuple(idx.shape)} {idx.dtype}")
        if idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds cfg.seq_len={self.cfg.seq_len}")
        try:
            x = EMBEDDING_IMPLS[self.embedding_impl](self.embed, idx)
        except IndexError as exc:
            # Raised where the lookup runs eagerly; a range check here would read idx back to
            # the host every step (on a GPU the embedding kernel's own assert fires instead).
            raise ValueError(f"idx holds token ids outside [0, vocab_size={self.cfg.vocab_size})") from exc
        stats: list[MoEStats] = []
        for block in self.blocks:
            x, s = block(x)
            if s is not None:
                stats.append(s)
        logits = self._logits(self.norm(x))
        out = ModelOutput(logits=logits, loss=None, lm_loss=None, moe_stats=stats)
        if targets is not None:
            out.lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
            out.loss = out.lm_loss + out.aux_loss.float()
        return out

    def _logits(self, h: Tensor) -> Tensor:
        """The output projection. With ``impls.fp32_logits`` and autocast on for ``h``'s device,
        it runs in FP32 (FP32 weight, FP32 logits, FP32 gradients), as mixed-precision recipes
        keep the output layer: rounded to bf16, logits of a few units are off by up to a
        hundredth or two, which near convergence is as large as the signal the loss still has
        to learn from. It is ~3% of the small preset's matmul FLOPs. Off, nothing changes."""
        device_type = h.device.type
        if self.impls.fp32_logits and type(self.lm_head) is nn.Linear and autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                return F.linear(h.float(), self.lm_head.weight.float())
        return self.lm_head(h)
