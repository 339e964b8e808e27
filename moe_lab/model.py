"""A small decoder-only MoE transformer, the model every notebook trains.

Pre-norm blocks (RMSNorm → attention → residual, RMSNorm → FFN → residual) with rotary
position embeddings and grouped-query attention. The first ``cfg.n_dense_layers``
blocks use a dense SwiGLU FFN, the rest an MoE layer (DeepSeek-V3 keeps its first three
layers dense the same way). Implementations are picked by name — the dispatcher for
the MoE layers, ``attention_impl`` for attention — never by ``if`` scattered through
the model.

``model(idx, targets)`` with ``idx: [batch, seq] int64`` returns ``ModelOutput`` with
``logits: [batch, seq, vocab]``, ``loss`` (cross-entropy + the MoE auxiliary losses, or
``None`` without targets), ``lm_loss`` and the per-layer ``MoEStats``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_lab.attention import causal_attention
from moe_lab.config import ModelConfig
from moe_lab.moe.experts import SwiGLU
from moe_lab.moe.layer import MoELayer, MoEStats, _autocast_enabled

Tensor = torch.Tensor


@torch.library.custom_op("moe_lab::embedding_grad", mutates_args=())
def embedding_grad(grad: Tensor, idx: Tensor, num_weights: int) -> Tensor:
    """The weight gradient of ``F.embedding(idx, weight)`` for an output gradient ``grad``
    (``[*idx.shape, dim]``): ``[num_weights, dim]``, each token's row of ``grad`` added to
    row ``idx`` — ATen's own kernel, as eager autograd runs it.

    An opaque op, so that ``torch.compile`` keeps it: Inductor would otherwise generate the
    scatter itself, on a CPU as one atomic add per element (about 0.48 ms against ATen's
    0.13 ms at the small preset's 2,048 tokens of width 128 into 256 rows, on 2 cores) and,
    with the adds racing, not bit for bit the same from run to run."""
    return torch.ops.aten.embedding_dense_backward(grad, idx, num_weights, -1, False)


@embedding_grad.register_fake
def _(grad: Tensor, idx: Tensor, num_weights: int) -> Tensor:
    return grad.new_empty(num_weights, grad.shape[-1])


class _Embedding(torch.autograd.Function):
    """``F.embedding(idx, weight)`` whose backward is `embedding_grad`."""

    @staticmethod
    def forward(weight: Tensor, idx: Tensor) -> Tensor:
        return F.embedding(idx, weight)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        weight, idx = inputs
        ctx.save_for_backward(idx)
        ctx.num_weights = weight.shape[0]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (idx,) = ctx.saved_tensors
        return embedding_grad(grad.contiguous(), idx, ctx.num_weights), None


def embed(module: nn.Embedding, idx: Tensor) -> Tensor:
    """``module(idx)``; for a plain embedding (no padding index, max norm or sparse
    gradient) with its weight gradient from `embedding_grad`."""
    if (type(module) is nn.Embedding and module.padding_idx is None and module.max_norm is None
            and not module.sparse):
        return _Embedding.apply(module.weight, idx)
    return module(idx)


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
    ``moe_lab.attention.ATTENTION_IMPLS``). With ``cpu_fused`` and a bfloat16 QKV projection
    (BF16 autocast), as many key/value heads as query heads and an even head_dim, the
    rotary embedding runs inside the kernel on the projection's packed output
    (`moe_lab.kernels.cpu_attention.rope_causal_attention`): the same arithmetic without the
    layout passes around it (``fuse_rope = False`` keeps them, to compare)."""

    def __init__(self, cfg: ModelConfig, attention_impl: str = "sdpa") -> None:
        super().__init__()
        if cfg.attention != "mha":
            raise ValueError(
                f"the trainable model implements attention='mha' only, got {cfg.attention!r} "
                f"(preset {cfg.name!r} is for the FLOPs model and simulators)"
            )
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.dim_head
        self.attention_impl = attention_impl
        self.fuse_rope = True
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.dim_head,
                             bias=False)
        self.out = nn.Linear(cfg.n_heads * cfg.dim_head, cfg.d_model, bias=False)
        cos, sin = rope_cache(cfg.seq_len, cfg.dim_head)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        if self.attention_impl == "cpu_fused" and self.fuse_rope:
            from moe_lab.kernels import cpu_attention

            if cpu_attention.rope_fusable(qkv, self.n_heads, self.kv_heads):
                # the rotary embedding inside the kernel, which reads q, k, v where the
                # projection wrote them and writes the heads side by side for self.out
                return self.out(cpu_attention.rope_causal_attention(qkv, self.cos, self.sin,
                                                                    self.n_heads))
        q, k, v = qkv.split(
            [self.n_heads * self.head_dim, self.kv_heads * self.head_dim,
             self.kv_heads * self.head_dim], dim=-1,
        )
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
        y = causal_attention(q, k, v, impl=self.attention_impl)
        return self.out(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool, dispatcher: str, attention_impl: str,
                 expert_backend: str = "loop", router_impl: str = "reference") -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg, attention_impl)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.ffn = (MoELayer(cfg.moe, dispatcher, expert_backend, router_impl) if moe
                    else SwiGLU(cfg.d_model, cfg.d_ff))

    def forward(self, x: Tensor) -> tuple[Tensor, MoEStats | None]:
        x = x + self.attn(self.norm1(x))
        if isinstance(self.ffn, MoELayer):
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
    def __init__(
        self, cfg: ModelConfig, dispatcher: str = "naive", attention_impl: str = "sdpa",
        expert_backend: str = "loop", router_impl: str = "reference",
    ) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg, i >= cfg.n_dense_layers, dispatcher, attention_impl, expert_backend,
                  router_impl)
            for i in range(cfg.n_layers)
        )
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # Under autocast, compute the logits in FP32 (see `_logits`); off, nothing changes.
        self.fp32_logits = False
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoELayer)]

    def set_dispatcher(self, name: str, expert_backend: str | None = None) -> None:
        """Switch every MoE layer to dispatcher ``name`` (weights unchanged)."""
        from moe_lab.moe.dispatch import DISPATCHERS
        from moe_lab.moe.experts import EXPERT_BACKENDS

        if name not in DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {sorted(DISPATCHERS)}, got {name!r}")
        if expert_backend is not None and expert_backend not in EXPERT_BACKENDS:
            raise ValueError(
                f"expert_backend must be one of {EXPERT_BACKENDS}, got {expert_backend!r}")
        for layer in self.moe_layers:
            layer.dispatcher = name
            if expert_backend is not None:
                layer.experts.backend = expert_backend

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> ModelOutput:
        if idx.dim() != 2 or idx.dtype != torch.int64:
            raise ValueError(f"idx must be [batch, seq] int64, got {tuple(idx.shape)} {idx.dtype}")
        if idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds cfg.seq_len={self.cfg.seq_len}")
        x = embed(self.embed, idx)
        stats: list[MoEStats] = []
        for block in self.blocks:
            x, s = block(x)
            if s is not None:
                stats.append(s)
        logits = self._logits(self.norm(x))
        out = ModelOutput(logits=logits, loss=None, lm_loss=None, moe_stats=stats)
        if targets is not None:
            lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
            out.lm_loss = lm
            out.loss = lm + out.aux_loss.float()
        return out

    def _logits(self, h: Tensor) -> Tensor:
        """The output projection. With ``fp32_logits`` and autocast on for ``h``'s device, it
        runs in FP32 (FP32 weight, FP32 logits, FP32 gradients), as mixed-precision recipes
        keep the output layer: rounded to bf16, logits of a few units are off by up to a
        hundredth or two, which near convergence is as large as the signal the loss still has
        to learn from. It is ~3% of the small preset's matmul FLOPs."""
        device_type = h.device.type
        if self.fp32_logits and type(self.lm_head) is nn.Linear and _autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                return F.linear(h.float(), self.lm_head.weight.float())
        return self.lm_head(h)

    def num_parameters(self, active: bool = False) -> int:
        """Parameters in total, or active per token (top_k of n_experts routed experts)."""
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        inactive = 0
        for layer in self.moe_layers:
            per_expert = layer.experts.w_gate_up[0].numel() + layer.experts.w_down[0].numel()
            inactive += per_expert * (layer.cfg.n_experts - layer.cfg.top_k)
        return total - inactive
