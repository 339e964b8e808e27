"""Expert parallelism: the experts sharded over ranks, tokens moved by two all-to-alls.

With ``W`` ranks in the expert-parallel (EP) group and ``E`` experts, rank ``r`` holds experts
``r·E/W … (r+1)·E/W − 1`` and only those. Attention, the router and the shared expert are
replicated (every rank runs them on its own tokens). A routed token travels to the rank of
each expert it chose, and its result travels back:

1. **permute** (local): sort this rank's ``T·k`` (token, expert) assignments by expert. Sorted
   by expert is also sorted by destination rank: rank ``j``'s rows are one contiguous block.
2. **exchange counts**: a tiny all-to-all of the ``[W, E/W]`` matrix "how many of my rows go
   to each of your experts", so every rank learns what it will receive.
3. **dispatch**: ``all_to_all_single`` of the permuted rows with *uneven* splits.
4. **local experts**: regroup the received rows by local expert, one grouped GEMM on this
   rank's shard, undo the regrouping.
5. **combine**: the reverse all-to-all sends every result row home.
6. **unpermute** (local): weight by the router and sum each token's ``k`` rows.

The gradient of an all-to-all is the reverse all-to-all of the gradient (`AllToAll`), so
autograd differentiates the layer end to end.

Dropless EP needs the split sizes on the host (``all_to_all_single`` takes Python lists):
step 2 is a device→host sync per layer. The **budgeted** mode, in the manner of NVIDIA's
HybridEP, avoids it: every rank sends every other rank a fixed block of
``B = ceil(capacity_factor · T·k / W)`` rows (zero-padded), so every size is known from shapes.
Rows beyond the budget do not fit; an *overflow flag* travels with the counts, and the layer
either re-runs the dispatch with a budget that fits (``on_overflow="rerun"``: exact, the only
host read of the flag) or drops the extra assignments (``"drop"``: no host read at all).

Equivalence: every rank's output equals the single-process dropless layer's for its tokens,
and so do the input gradients and each expert's weight gradient (the all-to-all's backward
delivers every rank's contribution to the expert's owner). Router and shared-expert gradients
are per-rank partial sums: `sync_gradients` all-reduces them, as data parallelism does.

gloo (CPU) has ``all_to_all_single`` with uneven splits, so all of this runs on CPU ranks too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from moe_lab.checks import one_of, positive_number
from moe_lab.config import ModelImpls, MoEConfig
from moe_lab.moe.experts import SwiGLUExperts, torch_permute, torch_unpermute
from moe_lab.moe.layer import MoELayer, MoEStats, shared_expert
from moe_lab.moe.router import Router

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------
# The all-to-all, differentiable
# --------------------------------------------------------------------------------------


def exchange_rows(x: Tensor, output_splits: list[int] | None, input_splits: list[int] | None,
                  group: ProcessGroup | None = None,
                  async_op: bool = False) -> Tensor | tuple[Tensor, Work | None]:
    """``all_to_all_single`` that allocates its output; ``None`` splits mean equal blocks.

    ``x: [rows, ...]`` → ``[sum(output_splits) or rows, ...]``. With ``async_op`` returns
    ``(output, work)``; the output is valid after ``work.wait()`` (``work`` is None on a
    group of one rank). Not differentiable: `AllToAll` is.
    """
    x = x.contiguous()
    rows = x.shape[0] if output_splits is None else int(sum(output_splits))
    out = x.new_empty((rows, *x.shape[1:]))
    if dist.get_world_size(group) == 1:
        out.copy_(x)
        return (out, None) if async_op else out
    work = dist.all_to_all_single(out, x, output_splits, input_splits, group=group, async_op=async_op)
    return (out, work) if async_op else out


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` as an autograd function: ``AllToAll.apply(x, output_splits,
    input_splits, group)`` sends ``input_splits[j]`` rows of ``x`` to rank ``j`` and receives
    ``output_splits[i]`` from rank ``i`` (``None``: equal blocks). Its backward is the reverse
    all-to-all of the gradient (input and output splits swapped)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, output_splits: list[int] | None,
                input_splits: list[int] | None, group: ProcessGroup | None) -> Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return exchange_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return exchange_rows(grad, input_splits, output_splits, ctx.group), None, None, None


# --------------------------------------------------------------------------------------
# Pure helpers (also what the notebook's exercises check)
# --------------------------------------------------------------------------------------


def rank_experts(n_experts: int, world_size: int, rank: int) -> range:
    """The experts rank ``rank`` owns: a contiguous block of ``n_experts / world_size``."""
    if n_experts % world_size:
        raise ValueError(f"n_experts={n_experts} must be divisible by world_size={world_size}")
    per = n_experts // world_size
    return range(rank * per, (rank + 1) * per)


def split_sizes(topk_ids: Tensor, n_experts: int, world_size: int) -> Tensor:
    """``topk_ids: [T, k]`` → ``[world_size]`` int64: how many rows this rank sends each rank
    (assignments to experts that rank owns). Sync-free."""
    per_rank = len(rank_experts(n_experts, world_size, 0))  # checks the division
    dest = topk_ids.reshape(-1) // per_rank
    return torch.zeros(world_size, dtype=torch.int64, device=topk_ids.device).scatter_add_(
        0, dest, torch.ones_like(dest))


def traffic_matrix(topk_ids_per_rank: list[Tensor], n_experts: int) -> Tensor:
    """``[W, W]`` rows each rank sends each rank in one dispatch (row: source, column:
    destination), from every rank's routing ``topk_ids: [T_r, k]``."""
    world = len(topk_ids_per_rank)
    return torch.stack([split_sizes(ids, n_experts, world) for ids in topk_ids_per_rank])


def received_order(recv_counts: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Received rows grouped by (source rank, local expert), ``recv_counts: [W, E_local]``
    of them (``rows`` in all), regrouped by local expert for one grouped GEMM: ``(order,
    inverse, ends)``, the stable sort, its inverse permutation, and ``ends: [E_local]`` int32,
    each local expert's cumulative row end in sorted order."""
    world, n_local = recv_counts.shape
    segment_expert = torch.arange(n_local, device=recv_counts.device).repeat(world)
    row_expert = torch.repeat_interleave(segment_expert, recv_counts.reshape(-1), output_size=rows)
    order = torch.argsort(row_expert, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(rows, device=order.device))
    return order, inverse, recv_counts.sum(0).cumsum(0).to(torch.int32)


# --------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------


@dataclass
class EPStats(MoEStats):
    """`MoEStats` plus what the exchange cost. ``tokens_per_expert`` counts this rank's own
    routing (all ``E`` experts); ``dropped_tokens`` is non-zero only with ``on_overflow="drop"``."""

    overflow: Tensor | None = None  # [] bool: some rank had more rows for a rank than the budget
    reruns: int = 0  # dispatches re-run because of an overflow
    budget: int = 0  # rows per (source, destination) block; 0 in dropless mode
    a2a_bytes: int = 0  # bytes this rank sent to other ranks in the forward (dispatch + combine)


class EPMoELayer(nn.Module):
    """The MoE layer with its experts sharded over the process group ``group``, composed of the
    pieces it needs: the router and the shared expert every rank runs on its own tokens, this
    rank's ``E / W`` experts, and the exchange (``mode``).

    ``forward(x)`` takes this rank's tokens ``x: [tokens, d_model]`` (or ``[b, s, d]``) and
    returns ``(y, EPStats)`` as `MoELayer` does, so a model's block takes it in place of one;
    every rank of the group must call it together. ``mode="dropless"`` exchanges counts and
    sends exactly the routed rows; ``mode="budget"`` sends fixed ``[W, B, d]`` blocks (see the
    module docstring) with ``B = ceil(capacity_factor · tokens · top_k / W)`` rows, at least 1.

    Build it from a single-process layer with `from_layer` (same router, shared expert and
    this rank's slice of the experts), or fresh from a config (then seed every rank alike).
    """

    def __init__(self, cfg: MoEConfig, group: ProcessGroup | None = None, mode: str = "dropless",
                 capacity_factor: float = 1.25, on_overflow: str = "rerun",
                 expert_backend: str = ModelImpls.expert_backend,
                 router_impl: str = ModelImpls.router_impl, *, quant: str | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: start the ranks with "
                               "moe_lab.workbench.ranks.launch.run_ranks or torchrun first")
        one_of(mode, "mode", ("dropless", "budget"))
        one_of(on_overflow, "on_overflow", ("rerun", "drop"))
        positive_number(capacity_factor, "capacity_factor")
        super().__init__()
        world = dist.get_world_size(group)
        self.cfg, self.group, self.ep_size, self.ep_rank = cfg, group, world, dist.get_rank(group)
        self.local_experts = rank_experts(cfg.n_experts, world, self.ep_rank)  # checks n_experts
        self.n_local = cfg.n_experts // world
        self.mode, self.capacity_factor, self.on_overflow = mode, capacity_factor, on_overflow
        self.router = Router(cfg, impl=router_impl)
        self.experts = SwiGLUExperts(self.n_local, cfg.d_model, cfg.d_expert, expert_backend, quant)
        self.shared = shared_expert(cfg)

    # ---------------------------------------------------------------- forward
    def forward(self, x: Tensor) -> tuple[Tensor, EPStats]:
        if x.dim() not in (2, 3) or x.shape[-1] != self.cfg.d_model:
            raise ValueError(f"x must be [tokens, d_model={self.cfg.d_model}] or [batch, seq, "
                             f"d_model], got {tuple(x.shape)}")
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.router(tokens)
        # 1. permute: this rank's T·k rows sorted by expert, hence grouped by destination rank
        x_sorted, _, layout = torch_permute(tokens, routing.topk_ids, self.cfg.n_experts)  # [T·k, d]
        counts = routing.tokens_per_expert.view(self.ep_size, self.n_local)  # [W, E_local]
        # 2.–5. the exchange and this rank's experts: each permuted row's expert output
        # ``info``: the `EPStats` fields of the exchange
        if self.mode == "dropless":
            y_rows, info = self._dropless(x_sorted, counts)
        else:
            row_dest = routing.topk_ids.reshape(-1).index_select(0, layout[0]) // self.n_local  # [T·k]
            # the capacity factor times a block's average share of this rank's T·k rows
            budget = max(1, math.ceil(self.capacity_factor * tokens.shape[0] * self.cfg.top_k / self.ep_size))
            y_rows, info, needed = self._budgeted(x_sorted, row_dest, counts, budget)
            if self.on_overflow == "rerun" and bool(info["overflow"]):
                # The one host read of the budgeted path, taken only to decide on a re-run
                # (a production stack defers it to the end of the step). Every rank sees the
                # same flag, so all re-run together, with the largest block any rank needs.
                y_rows, again, _ = self._budgeted(x_sorted, row_dest, counts, int(needed))
                info = {**again, "overflow": info["overflow"], "reruns": 1,
                        "a2a_bytes": again["a2a_bytes"] + info["a2a_bytes"]}
        # 6. unpermute: weight by the router and sum each token's k rows
        y = torch_unpermute(y_rows, layout, routing.topk_weights)
        if self.shared is not None:
            y = y + self.shared(tokens)
        stats = EPStats(tokens_per_expert=routing.tokens_per_expert,
                        aux_loss=(routing.aux_loss * self.cfg.aux_loss_coef).to(x.dtype),
                        z_loss=(routing.z_loss * self.cfg.z_loss_coef).to(x.dtype), routing=routing, **info)
        return y.reshape(shape), stats

    def _dropless(self, x_sorted: Tensor, send_counts: Tensor) -> tuple[Tensor, dict]:
        recv_counts = exchange_rows(send_counts, None, None, self.group)  # [W, E_local], equal blocks
        # all_to_all_single takes its split sizes as Python ints: the host must see them.
        send_splits, recv_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        x_recv = AllToAll.apply(x_sorted, recv_splits, send_splits, self.group)
        # rows grouped by (source rank, local expert) → local experts → the same row order
        order, inverse, ends = received_order(recv_counts, x_recv.shape[0])
        y_recv = self.experts.grouped_forward(x_recv.index_select(0, order), F.pad(ends, (1, 0)))
        y_back = AllToAll.apply(y_recv.index_select(0, inverse), send_splits, recv_splits, self.group)
        sent = sum(send_splits) - send_splits[self.ep_rank]
        returned = sum(recv_splits) - recv_splits[self.ep_rank]
        info = {"dropped_tokens": torch.zeros((), dtype=torch.int64, device=x_sorted.device),
                "a2a_bytes": (sent + returned) * x_sorted.shape[1] * x_sorted.element_size()}
        return y_back, info

    def _budgeted(self, x_sorted: Tensor, row_dest: Tensor, counts: Tensor,
                  budget: int) -> tuple[Tensor, dict, Tensor]:
        """The exchange in fixed blocks of ``budget`` rows: each permuted row's expert output
        (zeros where dropped), the `EPStats` fields, and the largest block any rank needs."""
        world, n_local = self.ep_size, self.n_local
        rows, d = x_sorted.shape
        per_dest = counts.sum(1)  # [W]
        dest_start = F.pad(per_dest.cumsum(0), (1, 0))[:-1]
        position = torch.arange(rows, device=x_sorted.device) - dest_start.index_select(0, row_dest)
        keep = position < budget
        trash = world * budget  # dropped rows land on one extra row that is never sent
        slot = torch.where(keep, row_dest * budget + position, torch.full_like(position, trash))
        send = x_sorted.new_zeros(trash + 1, d).index_add(0, slot, x_sorted)
        # Rows kept per (destination, local expert): each destination's block is sorted by
        # expert, so the kept rows are a prefix of it.
        kept_cum = counts.cumsum(1).clamp(max=budget)
        kept = kept_cum - F.pad(kept_cum, (1, 0))[:, :-1]
        # The flag and the largest block this rank needs travel with the counts.
        overflow_local = (per_dest > budget).any().to(torch.int64)
        meta = torch.cat([kept, overflow_local.expand(world, 1), per_dest.max().expand(world, 1)], 1)
        meta_recv = exchange_rows(meta, None, None, self.group)  # [W, E_local + 2]
        recv_kept = meta_recv[:, :n_local]
        x_recv = AllToAll.apply(send[:trash], None, None, self.group)  # [W·B, d]
        # Block ``i`` from rank ``i`` holds ``recv_kept[i].sum()`` real rows (by local expert),
        # then zero padding: one more segment, which sorts last and is given to the last local
        # expert (zeros in, zeros out: SwiGLU(0) = 0, and no weight gradient).
        padding = budget - recv_kept.sum(1, keepdim=True)  # [W, 1]
        order, inverse, ends = received_order(torch.cat([recv_kept, padding], 1), world * budget)
        offsets = F.pad(ends[:-1], (1, 0))
        offsets[-1] = world * budget
        y_recv = self.experts.grouped_forward(x_recv.index_select(0, order), offsets)
        y_back = AllToAll.apply(y_recv.index_select(0, inverse), None, None, self.group)
        y_rows = torch.cat([y_back, y_back.new_zeros(1, d)]).index_select(0, slot)
        # Every rank's flag reaches every rank, so all agree on a re-run.
        info = {"dropped_tokens": (~keep).sum(), "overflow": meta_recv[:, n_local].amax() > 0,
                "budget": budget, "a2a_bytes": 2 * (world - 1) * budget * d * x_sorted.element_size()}
        return y_rows, info, meta_recv[:, n_local + 1].amax()


def from_layer(layer: MoELayer, group: ProcessGroup | None = None, **kwargs: Any) -> EPMoELayer:
    """This rank's `EPMoELayer` part of the single-process ``layer``: its router and shared
    expert, and the slice of its experts this rank owns. ``kwargs`` go to the constructor
    (``mode``, ...); the expert backend, router and precision are ``layer``'s."""
    if not isinstance(layer, MoELayer):
        raise ValueError(f"layer must be a MoELayer, got {type(layer).__name__}")
    kwargs.setdefault("expert_backend", layer.experts.backend)
    kwargs.setdefault("router_impl", layer.router.impl)
    w = layer.experts.w_gate_up
    with torch.device(w.device):  # built where ``layer`` lives, not on the default device
        ep = EPMoELayer(layer.cfg, group, quant=layer.experts.quant, **kwargs)
    ep.to(dtype=w.dtype)
    # The same names as the layer's (router, experts, shared); the experts' weights sliced.
    lo, hi = ep.local_experts.start, ep.local_experts.stop
    state = layer.state_dict()
    ep.load_state_dict({k: v[lo:hi] if k.startswith("experts.") else v for k, v in state.items()})
    ep.train(layer.training)
    return ep


def _grads(model: torch.nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """The gradients of ``model``'s parameters: the replicated ones and the EP expert shards'."""
    expert = {id(p) for m in model.modules() if isinstance(m, EPMoELayer) for p in m.experts.parameters()}
    params = [p for p in model.parameters() if p.grad is not None]
    return [p.grad for p in params if id(p) not in expert], [p.grad for p in params if id(p) in expert]


def sync_gradients(model: torch.nn.Module, world_group: ProcessGroup | None = None,
                   expert_dp_group: ProcessGroup | None = None) -> None:
    """Make gradients those of the mean loss over all ranks, after ``loss.backward()`` on
    each rank's own batch.

    Replicated parameters (everything but EP experts): all-reduce and divide by the world
    size, as data parallelism does. Expert shards: the all-to-all's backward already summed
    every rank's contribution into the owner; divide by the world size too, and, where
    several EP groups hold copies of a shard, all-reduce over ``expert_dp_group`` first.
    """
    world = dist.get_world_size(world_group)
    replicated, experts = _grads(model)
    if replicated:
        flat = torch.cat([g.reshape(-1) for g in replicated])
        dist.all_reduce(flat, group=world_group)
        flat /= world
        for g, new in zip(replicated, flat.split([g.numel() for g in replicated]), strict=True):
            g.copy_(new.view_as(g))
    for g in experts:
        if expert_dp_group is not None and dist.get_world_size(expert_dp_group) > 1:
            dist.all_reduce(g, group=expert_dp_group)
        g /= world


def clip_grad_norm_ep(model: torch.nn.Module, max_norm: float,
                      ep_group: ProcessGroup | None = None) -> Tensor:
    """``clip_grad_norm_`` for a model with EP expert shards: the global norm counts every
    replicated gradient once and every expert shard of the EP group once (the shards' squared
    norms are all-reduced over ``ep_group``). Call after `sync_gradients`; returns the norm."""
    replicated, experts = _grads(model)
    device = next(model.parameters()).device
    replicated_sq = sum((g.float().pow(2).sum() for g in replicated), torch.zeros((), device=device))
    experts_sq = sum((g.float().pow(2).sum() for g in experts), torch.zeros((), device=device))
    # Every rank joins the all-reduce, one without gradients too (it would hang the others).
    dist.all_reduce(experts_sq, group=ep_group)
    norm = (replicated_sq + experts_sq).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in replicated + experts:
        g.mul_(scale.to(g.dtype))
    return norm
