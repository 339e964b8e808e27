"""Token dispatchers: how routed tokens reach their experts and come back.

A dispatcher takes the tokens ``x: [T, d_model]``, the router's choice
``topk_ids: [T, k]`` and ``topk_weights: [T, k]``, and the experts, and returns
``y: [T, d_model] = Σ_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])`` together
with the number of (token, expert) assignments it dropped.

``naive`` is the loop most code starts from (Hugging Face's Mixtral block): for every
expert, find its tokens with ``torch.where(mask)`` — a ``nonzero`` whose output size depends
on the data, so the host waits for the device once per expert — run the expert, scatter-add
the weighted result. It drops nothing and is the reference for every other dispatcher.

``capacity`` (GShard / Switch Transformer) gives every expert a fixed number of slots,
``C = ceil(tokens · top_k · capacity_factor / n_experts)``, so every buffer has a shape known
before the data: ``[n_experts, C, d_model]``, one batched matmul, no sync. The price is that
an expert chosen more than ``C`` times drops the rest — those tokens skip the layer.

``dropless`` sorts the (token, expert) assignments by expert (a stable argsort: no sync),
computes the per-expert offsets on the device with a prefix sum, runs all experts as one
grouped GEMM over those offsets, and scatters the weighted results back. Every buffer is
``tokens · top_k`` rows — a bound known from shapes alone — so nothing is dropped and the
host never waits. How the tokens are sorted into expert order and brought back belongs to the
expert backend (`moe_lab.moe.experts.ExpertBackend`: the PyTorch chain above for ``loop`` and
``torch``, one Triton kernel per move for the Triton backends, `moe_lab.kernels.permute`).

``fused`` and ``fused_atomic`` are dropless with the two moves folded into the grouped
GEMMs (`moe_lab.kernels.fused_moe`): the first GEMM gathers its rows through the row-id map
and the second weights its rows and scatters them to their tokens — deterministically
(a token-major store, then a sum over the top-k) or with float32 atomics.

Every dispatcher keeps one contract (`Dispatcher`) and declares how it runs the experts
(`EXPERT_PATHS`), which `check_pairing` turns into the rule a layer is built by.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from moe_lab.checks import positive_number
from moe_lab.config import MoEConfig
from moe_lab.moe.experts import SwiGLUExperts, sort_by_expert  # noqa: F401 - sort_by_expert: public here too
from moe_lab.registry import TRITON_MISSING, Registry

Tensor = torch.Tensor

#: How a dispatcher runs the experts, which decides what it pairs with (`check_pairing`):
#: ``"methods"`` — through the experts' own methods, one expert or one padded batch at a time
#: (any expert class; the expert backend is not used); ``"backend"`` — through the experts'
#: backend over expert-sorted rows, sorted and brought back by that backend's permutation;
#: ``"kernels"`` — in kernels of its own that read the experts' weights (plain
#: `SwiGLUExperts` only; the expert backend is not used).
EXPERT_PATHS = ("methods", "backend", "kernels")


#: A dispatcher, ``(x, topk_ids, topk_weights, experts, cfg) -> (y, dropped)``: ``x, y: [T, d_model]``,
#: ``topk_*: [T, k]``, ``dropped: []`` int64 on x's device; `register_dispatcher` gives it
#: ``runs_experts`` (`EXPERT_PATHS`) and ``syncs_host`` (whether it reads device values back to
#: the host: a sync-free step refuses it).
Dispatcher = Callable[..., tuple[Tensor, Tensor]]


DISPATCHERS: Registry[Dispatcher] = Registry(
    "dispatcher", "how routed tokens reach their experts and come back (a Dispatcher)")


def register_dispatcher(name: str, runs_experts: str, *, syncs_host: bool = False,
                        missing: str | None = None) -> Callable[[Callable], Dispatcher]:
    """``@register_dispatcher(name, runs_experts)``: the function, declared to run the
    experts by ``runs_experts`` (`EXPERT_PATHS`) and whether it ``syncs_host``, registered
    in `DISPATCHERS` (or, with ``missing``, marked unavailable: `Registry.register`)."""
    def add(fn: Callable) -> Dispatcher:
        fn.runs_experts = runs_experts
        fn.syncs_host = syncs_host
        return DISPATCHERS.register(name, fn, missing=missing)

    return add


@register_dispatcher("naive", "methods", syncs_host=True)
def naive_dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, experts: SwiGLUExperts,
                   cfg: MoEConfig | None = None) -> tuple[Tensor, Tensor]:
    """Loop over experts; boolean-mask selection of each expert's tokens (one sync each)."""
    out = torch.zeros_like(x)
    # [E, T, k]: expert_mask[e, t, j] is True where token t's j-th choice is expert e.
    expert_mask = F.one_hot(topk_ids, experts.n_experts).permute(2, 0, 1).bool()
    weights = experts.per_expert()  # views taken once: see its docstring for why
    for e in range(experts.n_experts):
        token_idx, slot = torch.where(expert_mask[e])  # data-dependent size: a host sync
        y_e = experts.forward_expert(e, x[token_idx], weights)
        weight = topk_weights[token_idx, slot].unsqueeze(-1).to(y_e.dtype)
        out.index_add_(0, token_idx, y_e * weight)
    return out, torch.zeros((), dtype=torch.int64, device=x.device)


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float,
                    multiple: int = 1) -> int:
    """Slots per expert: ``ceil(tokens · top_k · capacity_factor / n_experts)``, rounded up to
    a multiple of ``multiple`` (from shapes only: a Python int, no device value)."""
    positive_number(capacity_factor, "capacity_factor")
    c = math.ceil(tokens * top_k * capacity_factor / n_experts)
    return -(-c // multiple) * multiple


def capacity_positions(topk_ids: Tensor, topk_weights: Tensor, n_experts: int,
                       policy: str = "position") -> Tensor:
    """``[T, k]`` int64: each assignment's rank among those sent to the same expert.

    ``position``: ranked first by choice (every token's first choice before any second
    choice, as GShard does), then by token order. ``probability``: ranked by router weight,
    highest first (ties by token order). Assignments with rank ``>= C`` are dropped.
    """
    tokens, k = topk_ids.shape
    if policy == "position":
        order = torch.arange(tokens * k, device=topk_ids.device).view(tokens, k).t().reshape(-1)
    elif policy == "probability":
        order = torch.argsort(-topk_weights.reshape(-1).float(), stable=True)
    else:
        raise ValueError(f"drop policy must be 'position' or 'probability', got {policy!r}")
    ids_in_order = topk_ids.reshape(-1)[order]
    one_hot = F.one_hot(ids_in_order, n_experts)  # [T*k, E]
    rank_in_order = (one_hot.cumsum(0) - 1).gather(1, ids_in_order.unsqueeze(1)).squeeze(1)
    rank = torch.empty_like(rank_in_order).scatter_(0, order, rank_in_order)
    return rank.view(tokens, k)


@register_dispatcher("capacity", "methods")
def capacity_dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, experts: SwiGLUExperts,
                      cfg: MoEConfig) -> tuple[Tensor, Tensor]:
    """Padded ``[E, C, d]`` buffers and one batched matmul; over-capacity assignments dropped."""
    tokens, k = topk_ids.shape
    n_experts = experts.n_experts
    capacity = expert_capacity(tokens, k, n_experts, cfg.capacity_factor)
    rank = capacity_positions(topk_ids, topk_weights, n_experts, cfg.drop_policy)
    keep = rank < capacity
    # Dropped assignments are written to one extra "trash" slot past the end and ignored.
    trash = n_experts * capacity
    slot = torch.where(keep, topk_ids * capacity + rank, torch.full_like(rank, trash)).reshape(-1)
    token_of = torch.arange(tokens, device=x.device).repeat_interleave(k)
    buffer = x.new_zeros(trash + 1, x.shape[1])
    buffer = buffer.index_add(0, slot, x.index_select(0, token_of))
    # Sizes spelled out: with no tokens the capacity is 0, and a -1 beside it is ambiguous.
    y = experts.batched_forward(buffer[:trash].view(n_experts, capacity, x.shape[1]))
    y = torch.cat([y.reshape(trash, y.shape[-1]), y.new_zeros(1, y.shape[-1])])
    weight = (topk_weights * keep).reshape(-1, 1).to(y.dtype)
    out = torch.zeros_like(x).index_add_(0, token_of, y.index_select(0, slot) * weight)
    return out, (~keep).sum()


@register_dispatcher("dropless", "backend")
def dropless_dispatch(x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor,
                      experts: SwiGLUExperts, cfg: MoEConfig | None = None) -> tuple[Tensor, Tensor]:
    """Permute → grouped GEMM over device offsets → weighted unpermute, each step the experts'
    backend's (`moe_lab.moe.experts.ExpertBackend`). Never drops. (``T`` tokens, ``K`` choices
    each, ``d`` features; ``M = T·K`` sorted rows.)"""
    backend = experts.impl
    x_MD, offsets, layout = backend.permute(x_TD, topk_ids_TK, experts.n_experts)
    y_MD = experts.grouped_forward(x_MD, offsets)
    out_TD = backend.unpermute(y_MD, layout, topk_weights_TK)
    return out_TD, torch.zeros((), dtype=torch.int64, device=x_TD.device)


def fused_dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, experts: SwiGLUExperts,
                   cfg: MoEConfig | None = None, *, scatter: str) -> tuple[Tensor, Tensor]:
    """Dropless with the permute and the combine fused into the grouped GEMMs
    (`moe_lab.kernels.fused_moe`): a gather prologue and a weighted-scatter epilogue, so neither
    the permuted tokens nor the expert-ordered output is written. Never drops. ``scatter``, as
    registered: ``"deterministic"`` (``fused``: a token-major store, then a sum over the top-k)
    or ``"atomic"`` (``fused_atomic``: float32 atomics)."""
    # Imported on first use: importing the layer does not import Triton.
    from moe_lab.kernels.fused_moe import fused_moe_mlp
    from moe_lab.kernels.permute import build_row_id_map

    row_id_map, offsets = build_row_id_map(topk_ids, experts.n_experts)
    out = fused_moe_mlp(x, experts.w_gate_up.to(x.dtype), experts.w_down.to(x.dtype), row_id_map,
                        offsets, topk_weights, scatter=scatter)
    return out, torch.zeros((), dtype=torch.int64, device=x.device)


for _name, _scatter in (("fused", "deterministic"), ("fused_atomic", "atomic")):
    register_dispatcher(_name, "kernels", missing=TRITON_MISSING)(partial(fused_dispatch, scatter=_scatter))


def check_pairing(dispatcher: str, experts: SwiGLUExperts) -> Dispatcher:
    """The dispatcher named ``dispatcher``, once it is known to run ``experts``: one that runs
    them in its own kernels needs plain `SwiGLUExperts` without quantization (the kernels
    compute SwiGLU from the weights, unquantized). Which backends an expert class runs on it
    checks itself (``SwiGLUExperts.BACKENDS``, as it takes its backend)."""
    fn = DISPATCHERS.lookup(dispatcher, "dispatcher")
    if fn.runs_experts == "kernels" and (type(experts) is not SwiGLUExperts or experts.quant is not None):
        raise ValueError(f"dispatcher {dispatcher!r} computes plain SwiGLU experts, without quantization, "
                         f"in its own kernels, so it cannot run {type(experts).__name__} with "
                         f"quant={experts.quant!r}; use 'dropless', 'naive' or 'capacity'")
    return fn
