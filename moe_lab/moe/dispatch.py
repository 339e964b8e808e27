"""Token dispatchers: how routed tokens reach their experts and come back.

A dispatcher takes the tokens ``x: [T, d_model]``, the router's choice
``topk_ids: [T, k]`` and ``topk_weights: [T, k]``, and the experts, and returns
``y: [T, d_model] = Σ_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])`` together
with the number of (token, expert) assignments it dropped.

``naive`` is the loop most code starts from (Hugging Face's Mixtral block is written this
way): for every expert, find its tokens with a boolean mask, gather them, run the expert,
scatter-add the weighted result. Finding "its tokens" is ``torch.where(mask)`` — a
``nonzero`` whose output size depends on the data, so the host must wait for the device
once per expert. It drops nothing and is the correctness reference for every other
dispatcher; it is slow on purpose.

``capacity`` (GShard / Switch Transformer) gives every expert a fixed number of slots,
``C = ceil(tokens · top_k · capacity_factor / n_experts)``, so every buffer has a shape known
before the data: ``[n_experts, C, d_model]``, one batched matmul, no sync. The price is that
an expert chosen more than ``C`` times drops the rest — those tokens skip the layer.

``dropless`` sorts the (token, expert) assignments by expert (a stable argsort: no sync),
computes the per-expert offsets on the device with a prefix sum, runs all experts as one
grouped GEMM over those offsets, and scatters the weighted results back. Every buffer is
``tokens · top_k`` rows — a bound known from shapes alone — so nothing is dropped and the
host never waits. With the ``openmp`` expert backend on a CPU the sort and the two moves run
as moe_lab's C++ kernels (`moe_lab.kernels.cpu_permute`: a counting sort, then one pass per
move), with the ``triton`` backend as the Triton kernels of `moe_lab.kernels.permute`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_lab.moe.experts import SwiGLUExperts
from moe_lab.moe.router import tokens_per_expert_from_ids

Tensor = torch.Tensor
# name -> fn(x, topk_ids, topk_weights, experts, cfg) -> (y, dropped_tokens: Tensor[] int64)
DISPATCHERS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {}


def register_dispatcher(name: str):
    def add(fn):
        DISPATCHERS[name] = fn
        return fn

    return add


@register_dispatcher("naive")
def naive_dispatch(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, experts: SwiGLUExperts, cfg=None
) -> tuple[Tensor, Tensor]:
    """Loop over experts; boolean-mask selection of each expert's tokens (one sync each)."""
    out = torch.zeros_like(x)
    # [E, T, k]: expert_mask[e, t, j] is True where token t's j-th choice is expert e.
    expert_mask = F.one_hot(topk_ids, experts.n_experts).permute(2, 0, 1).bool()
    for e in range(experts.n_experts):
        token_idx, slot = torch.where(expert_mask[e])  # data-dependent size: a host sync
        y_e = experts.forward_expert(e, x[token_idx])
        weight = topk_weights[token_idx, slot].unsqueeze(-1).to(y_e.dtype)
        out.index_add_(0, token_idx, y_e * weight)
    return out, torch.zeros((), dtype=torch.int64, device=x.device)


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float,
                    multiple: int = 1) -> int:
    """Slots per expert: ``ceil(tokens · top_k · capacity_factor / n_experts)``, rounded up to
    a multiple of ``multiple`` (from shapes only: a Python int, no device value)."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
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


@register_dispatcher("capacity")
def capacity_dispatch(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, experts: SwiGLUExperts, cfg
) -> tuple[Tensor, Tensor]:
    """Padded ``[E, C, d]`` buffers and one batched matmul; over-capacity assignments dropped."""
    tokens, k = topk_ids.shape
    n_experts = experts.n_experts
    capacity = expert_capacity(tokens, k, n_experts, cfg.capacity_factor, cfg.capacity_multiple)
    rank = capacity_positions(topk_ids, topk_weights, n_experts, cfg.drop_policy)
    keep = rank < capacity
    # Dropped assignments are written to one extra "trash" slot past the end and ignored.
    trash = n_experts * capacity
    slot = torch.where(keep, topk_ids * capacity + rank, torch.full_like(rank, trash)).reshape(-1)
    token_of = torch.arange(tokens, device=x.device).repeat_interleave(k)
    buffer = x.new_zeros(trash + 1, x.shape[1])
    buffer = buffer.index_add(0, slot, x.index_select(0, token_of))
    y = experts.batched_forward(buffer[:trash].view(n_experts, capacity, -1))
    y = torch.cat([y.reshape(trash, -1), y.new_zeros(1, y.shape[-1])])
    weight = (topk_weights * keep).reshape(-1, 1).to(y.dtype)
    out = torch.zeros_like(x).index_add_(0, token_of, y.index_select(0, slot) * weight)
    return out, (~keep).sum()


def sort_by_expert(topk_ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """The dropless permutation, on the device.

    Returns ``order: [T·k]`` (the flattened assignments sorted by expert, stable, so ties
    keep token order) and ``offsets: [n_experts + 1] int32`` (expert ``e``'s rows are
    ``offsets[e]:offsets[e+1]`` of the sorted buffer).
    """
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    counts = tokens_per_expert_from_ids(topk_ids, n_experts)
    offsets = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    return order, offsets


@register_dispatcher("dropless")
def dropless_dispatch(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, experts: SwiGLUExperts, cfg=None
) -> tuple[Tensor, Tensor]:
    """Permute → grouped GEMM over device offsets → weighted unpermute. Never drops."""
    tokens, k = topk_ids.shape
    if experts.backend == "triton":
        from moe_lab.kernels.permute import make_row_id_map, permute, unpermute

        row_id_map, offsets = make_row_id_map(topk_ids, experts.n_experts)
        x_sorted = permute(x, row_id_map, tokens * k)
        y_sorted = experts.grouped_forward(x_sorted, offsets)
        out = unpermute(y_sorted, row_id_map, topk_weights.to(y_sorted.dtype))
        return out, torch.zeros((), dtype=torch.int64, device=x.device)
    align = getattr(experts, "row_align", 1)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        raise ValueError(f"experts.row_align must be a positive integer, got {align!r}")
    if experts.backend == "openmp" and x.device.type == "cpu":
        # The same layout in one C++ pass each way (a counting sort, a copy per token row,
        # a weighted gather-sum back), instead of the argsort / gather / scatter-add chain.
        from moe_lab.kernels import cpu_permute

        row_id_map, offsets = cpu_permute.make_row_id_map(topk_ids, experts.n_experts, align=align)
        n_rows = cpu_permute.permuted_rows(tokens, k, experts.n_experts, align)
        y_sorted = experts.grouped_forward(cpu_permute.permute(x, row_id_map, n_rows), offsets)
        out = cpu_permute.unpermute(y_sorted, row_id_map, topk_weights)
        return out, torch.zeros((), dtype=torch.int64, device=x.device)
    order, offsets = sort_by_expert(topk_ids, experts.n_experts)
    token_of = order // k  # the token behind each sorted row
    if align == 1:
        y_sorted = experts.grouped_forward(x.index_select(0, token_of), offsets)
    else:
        x_pad, dest, padded = _aligned_layout(x, token_of, order, topk_ids, offsets, align)
        y_sorted = experts.grouped_forward(x_pad, padded).index_select(0, dest)
    weight = topk_weights.reshape(-1).index_select(0, order).unsqueeze(1).to(y_sorted.dtype)
    out = torch.zeros_like(x).index_add_(0, token_of, y_sorted * weight)
    return out, torch.zeros((), dtype=torch.int64, device=x.device)


def _aligned_layout(x: Tensor, token_of: Tensor, order: Tensor, topk_ids: Tensor, offsets: Tensor,
                    align: int) -> tuple[Tensor, Tensor, Tensor]:
    """The sorted rows with every expert's group padded with zero rows to a multiple of
    ``align``: ``(x_pad, dest, padded_offsets)``; sorted row ``i`` sits at ``x_pad[dest[i]]``.

    Why: a CPU's bf16 GEMM (oneDNN) compiles a kernel for every new row count it meets, and
    dropless routing makes new per-expert counts every step — padded, the counts fall on a
    few multiples of ``align`` and the compiled kernels are reused (Megatron-Core pads expert
    groups the same way for FP8 GEMMs, which need aligned rows). The buffer has a static
    size, ``T·k + E·(align − 1)`` rows, so there is no host sync; padding rows are zeros,
    their outputs are never read, and the trailing rows past the last group are not computed.
    """
    n_experts = offsets.shape[0] - 1
    counts = offsets[1:] - offsets[:-1]
    padded_counts = (counts + (align - 1)) // align * align
    padded = F.pad(padded_counts.cumsum(0), (1, 0)).to(offsets.dtype)
    expert_of = topk_ids.reshape(-1).index_select(0, order)
    shift = (padded[:-1] - offsets[:-1]).to(torch.int64)  # [E]: where each group moves
    dest = torch.arange(order.shape[0], device=x.device) + shift.index_select(0, expert_of)
    rows = order.shape[0] + n_experts * (align - 1)
    x_pad = x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x.index_select(0, token_of))
    return x_pad, dest, padded
