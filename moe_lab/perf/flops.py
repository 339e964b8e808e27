"""Training FLOPs per token, TFLOPS per GPU and MFU.

To turn "tokens per second" into "how hard is the hardware working" one needs the FLOPs a
token costs. The count here follows the convention of Megatron-LM's FLOPs formula, which
MLPerf submitters and papers quote:

* only matrix multiplications count; one multiply-accumulate (MAC) is 2 FLOPs;
* training = forward + backward, and the backward pass does two matmuls for every one in
  the forward (gradient with respect to the input and to the weight), so 3x forward;
* causal attention does half the work of full attention: a query at position ``i`` sees
  ``i`` keys, ``seq_len / 2`` on average; a sliding-window layer of window ``w`` sees at
  most ``w`` (on average ``w - w^2 / (2 seq_len)`` for ``w < seq_len``);
* an MoE layer runs ``top_k`` routed experts and every shared expert per token, each a
  SwiGLU MLP of three ``d_model x d_expert`` matrices; the router is one
  ``d_model x n_experts`` matmul;
* multi-token prediction (MTP) modules each add one MoE transformer layer, a projection
  of the concatenated ``[hidden; embedding]`` (``2 d_model -> d_model``) and their own
  logits.

Norms, activations, softmax and the embedding lookup are left out (they are a fraction of
a percent for large models). So one token of a model whose matmuls touch ``P`` weights
costs about ``6 P`` FLOPs, plus attention's ``seq_len``-dependent core.

All counts are per token of a training sequence of length ``seq_len`` (default
``cfg.seq_len``).
"""

from __future__ import annotations

from moe_lab.checks import non_negative_number, positive_int, positive_number
from moe_lab.config import ModelConfig

FLOPS_PER_MAC = 2
TRAIN_MULTIPLIER = 3  # forward + backward (input grad + weight grad)
_TRAIN = FLOPS_PER_MAC * TRAIN_MULTIPLIER


def _seq(cfg: ModelConfig, seq_len: int | None) -> int:
    return cfg.seq_len if seq_len is None else positive_int(seq_len, "seq_len", or_none=True)


def attended_keys(seq_len: int, window: int = 0) -> float:
    """Average number of keys a query attends to in a causal sequence of ``seq_len``.

    Full causal attention: ``seq_len / 2`` (the Megatron convention). With a sliding
    window ``w < seq_len``: ``w - w^2 / (2 seq_len)`` (the band of width ``w`` below the
    diagonal of the ``seq_len x seq_len`` score matrix, per row). ``window=0``: no window.
    """
    if window == 0 or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def is_sliding_layer(cfg: ModelConfig, layer: int) -> bool:
    """True when decoder layer ``layer`` (0-based) uses the sliding window: with
    ``sliding_every = e`` layers ``0, e, 2e, ...`` are windowed (GPT-OSS: every other
    layer, starting with the first)."""
    return cfg.sliding_window > 0 and cfg.sliding_every > 0 and layer % cfg.sliding_every == 0


def attention_proj_macs(cfg: ModelConfig) -> int:
    """Forward MACs per token of one layer's attention projections (Q, K, V, O or MLA)."""
    d, h = cfg.d_model, cfg.n_heads
    if cfg.attention == "mla":
        qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            q = d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk_dim  # down, then up
        else:
            q = d * h * qk_dim
        kv_down = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # latent + shared rope key
        kv_up = cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        out = h * cfg.v_head_dim * d
        return q + kv_down + kv_up + out
    hd = cfg.dim_head
    return d * h * hd + 2 * d * cfg.kv_heads * hd + h * hd * d


def attention_core_macs(cfg: ModelConfig, seq_len: int, window: int = 0) -> float:
    """Forward MACs per token of one layer's attention core (``QK^T`` and ``PV``), causal."""
    h = cfg.n_heads
    if cfg.attention == "mla":
        qk_dim, v_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    else:
        qk_dim = v_dim = cfg.dim_head
    return attended_keys(seq_len, window) * h * (qk_dim + v_dim)


def dense_mlp_macs(cfg: ModelConfig) -> int:
    """Forward MACs per token of a dense SwiGLU FFN (gate, up, down: 3 matrices)."""
    return 3 * cfg.d_model * cfg.d_ff


def moe_mlp_macs(cfg: ModelConfig) -> int:
    """Forward MACs per token of an MoE layer's experts: ``top_k`` routed plus every
    shared expert, each a SwiGLU of three ``d_model x d_expert`` matrices."""
    m = cfg.moe
    return (m.top_k + m.n_shared_experts) * 3 * cfg.d_model * m.d_expert


def router_macs(cfg: ModelConfig) -> int:
    """Forward MACs per token of the router gate ``[d_model] @ [d_model, n_experts]``."""
    return cfg.d_model * cfg.moe.n_experts


def logits_macs(cfg: ModelConfig) -> int:
    """Forward MACs per token of the output projection ``[d_model] @ [d_model, vocab]``."""
    return cfg.d_model * cfg.vocab_size


def mtp_proj_macs(cfg: ModelConfig) -> int:
    """Forward MACs per token of one MTP module's ``eh`` projection ``2 d_model -> d_model``."""
    return 2 * cfg.d_model * cfg.d_model


def flops_breakdown(
    cfg: ModelConfig, seq_len: int | None = None, *, include_mtp: bool = True
) -> dict[str, float]:
    """Training FLOPs per token by kind of work; the values sum to
    `training_flops_per_token`.

    Keys: ``mlp`` (dense FFNs, routed and shared experts, MTP modules' experts included),
    ``attention_proj``, ``attention_core``, ``router``, ``logits`` (main head plus each MTP
    module's), ``mtp`` (only the MTP modules' ``eh`` projections: their attention, MLP and
    logits are counted under the keys above).
    """
    s = _seq(cfg, seq_len)
    n_mtp = cfg.mtp_layers if include_mtp else 0
    n_layers_attn = cfg.n_layers + n_mtp
    n_moe = cfg.n_moe_layers + n_mtp
    core = sum(
        attention_core_macs(cfg, s, cfg.sliding_window if is_sliding_layer(cfg, i) else 0)
        for i in range(cfg.n_layers)
    ) + n_mtp * attention_core_macs(cfg, s)
    macs = {
        "mlp": cfg.n_dense_layers * dense_mlp_macs(cfg) + n_moe * moe_mlp_macs(cfg),
        "attention_proj": n_layers_attn * attention_proj_macs(cfg),
        "attention_core": core,
        "router": n_moe * router_macs(cfg),
        "logits": (1 + n_mtp) * logits_macs(cfg),
        "mtp": n_mtp * mtp_proj_macs(cfg),
    }
    return {k: float(_TRAIN * v) for k, v in macs.items()}


def training_flops_per_token(
    cfg: ModelConfig, seq_len: int | None = None, *, include_mtp: bool = True
) -> float:
    """Training (forward + backward) FLOPs per token at sequence length ``seq_len``.

    DeepSeek-V3 at 4096 with its one MTP module: about 260 GFLOP/token.
    """
    return sum(flops_breakdown(cfg, seq_len, include_mtp=include_mtp).values())


def _layer_macs(cfg: ModelConfig, seq_len: int, window: int, dense: bool) -> float:
    """Forward MACs per token of one transformer layer: attention, then the dense FFN or the
    router and the experts."""
    mlp = dense_mlp_macs(cfg) if dense else moe_mlp_macs(cfg) + router_macs(cfg)
    return attention_proj_macs(cfg) + attention_core_macs(cfg, seq_len, window) + mlp


def layer_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, float]:
    """Training FLOPs per token of one layer of each type, for a pipeline model.

    ``embedding`` (a lookup: 0), ``dense`` (attention + dense FFN), ``moe`` (attention +
    router + experts; the mean over MoE layers when sliding-window layers make them
    differ), ``mtp`` (one MTP module: an MoE layer with full causal attention, its ``eh``
    projection and its own logits), ``logits`` (the output head). A type the model lacks
    has 0. ``dense * n_dense_layers + moe * n_moe_layers + mtp * mtp_layers + logits``
    equals `training_flops_per_token`.
    """
    s = _seq(cfg, seq_len)
    # Each decoder layer's FLOPs, in order: a sliding-window layer attends to fewer keys.
    layers = [float(_TRAIN * _layer_macs(cfg, s, cfg.sliding_window if is_sliding_layer(cfg, i) else 0,
                                         i < cfg.n_dense_layers)) for i in range(cfg.n_layers)]
    dense = layers[: cfg.n_dense_layers]
    moe = layers[cfg.n_dense_layers :]
    return {
        "embedding": 0.0,
        "dense": sum(dense) / len(dense) if dense else 0.0,
        "moe": sum(moe) / len(moe) if moe else 0.0,
        "mtp": float(_TRAIN * (_layer_macs(cfg, s, 0, False) + mtp_proj_macs(cfg) + logits_macs(cfg)))
        if cfg.mtp_layers
        else 0.0,
        "logits": float(_TRAIN * logits_macs(cfg)),
    }


def tflops_per_gpu(
    cfg: ModelConfig, seq_len: int | None, tokens_per_s: float, *, include_mtp: bool = True
) -> float:
    """Model TFLOPS per GPU sustained at ``tokens_per_s`` tokens per second per GPU."""
    non_negative_number(tokens_per_s, "tokens_per_s")
    return training_flops_per_token(cfg, seq_len, include_mtp=include_mtp) * tokens_per_s / 1e12


def mfu(achieved_flops: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over peak FLOP/s (same units), in [0, ...)."""
    non_negative_number(achieved_flops, "achieved_flops")
    positive_number(peak_flops, "peak_flops")
    return achieved_flops / peak_flops
