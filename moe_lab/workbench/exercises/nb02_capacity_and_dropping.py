"""Exercises of notebook 02 (capacity and dropping): sizing the buffers, choosing the drops.

- ``keep_mask(topk_ids, n_experts, capacity)``: which (token, choice) assignments the
  ``position`` drop policy keeps. Assignments are ranked per expert, every token's first
  choice before any token's second choice, and by token order within a choice; an
  assignment is kept when its rank is below ``capacity``. It must not sync with the host.

Each ``check_…`` calls the learner's function on fresh random inputs (and awkward ones:
no tokens, every token on one expert, ``top_k == n_experts``, room for everything) and
raises `ExerciseError` when an answer differs from the reference in
`moe_lab.moe.dispatch`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from moe_lab.moe import dispatch
from moe_lab.workbench.exercises import (
    ExerciseError,
    call_answer,
    exercise,
    random_routing,
    require_sync_free,
    require_tensor,
)


def keep_mask(topk_ids: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """``[T, k]`` bool: True where the assignment fits in its expert's ``capacity`` slots
    under the position policy (first choices first, then token order)."""
    rank = dispatch.capacity_positions(topk_ids, torch.zeros(topk_ids.shape), n_experts,
                                       "position")
    return rank < capacity


def _token_major_keep(topk_ids: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """The common mistake: ranking token by token (all of token 0's choices first)."""
    flat = topk_ids.reshape(-1)
    one_hot = torch.nn.functional.one_hot(flat, n_experts)
    rank = (one_hot.cumsum(0) - 1).gather(1, flat.unsqueeze(1)).squeeze(1)
    return (rank < capacity).view(topk_ids.shape)


@exercise(keep_mask)
def check_keep_mask(fn: Callable[..., torch.Tensor]) -> None:
    """Raise `ExerciseError` unless ``fn(topk_ids, n_experts, capacity)`` equals the
    position policy's mask on every case, and runs without a host sync."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    cases = [
        (random_routing(g, 40, 8, 2), 8, 10),
        (random_routing(g, 97, 16, 4), 16, 20),
        (random_routing(g, 33, 4, 4), 4, 20),  # top_k == n_experts
        (torch.full((25, 1), 3, dtype=torch.int64), 8, 7),  # every token on one expert
        (random_routing(g, 12, 6, 2), 6, 100),  # room for everything
        (random_routing(g, 30, 5, 2), 5, 1),  # one slot each
        (torch.zeros(0, 2, dtype=torch.int64), 8, 3),  # no tokens
    ]
    for ids, n_experts, capacity in cases:
        want = keep_mask(ids, n_experts, capacity)
        got = call_answer(fn, ids.clone(), n_experts, capacity)
        where = f"topk_ids of shape {tuple(ids.shape)}, {n_experts} experts, capacity {capacity}"
        require_tensor(got, want.shape, f"({where}): expected a [T, k] = {tuple(want.shape)} tensor")
        got = got.bool()
        if torch.equal(got, want):
            continue
        hint = ""
        if torch.equal(got, _token_major_keep(ids, n_experts, capacity)):
            hint = (" — you ranked token by token; the position policy ranks every token's "
                    "first choice before any second choice (slot-major), so a first choice "
                    "is never dropped to make room for an earlier token's second choice")
        elif int(got.sum()) != int(want.sum()):
            hint = (f" — you keep {int(got.sum())} assignments, the policy keeps "
                    f"{int(want.sum())}: each expert keeps min(its load, capacity)")
        bad = (got != want).nonzero()[0].tolist()
        raise ExerciseError(f"({where}): assignment (token {bad[0]}, choice {bad[1]}) should be "
                            f"{'kept' if want[bad[0], bad[1]] else 'dropped'}{hint}")
    ids, n_experts, capacity = cases[1]
    require_sync_free(fn, (ids, n_experts, capacity), "the capacity dispatcher must stay sync-free "
                      "— try a cumulative sum over a one-hot of the expert ids")
    print("✓ keep_mask is correct and sync-free")


def capacity_buffer(x: torch.Tensor, topk_ids: torch.Tensor, n_experts: int,
                    capacity_factor: float, multiple: int = 1) -> torch.Tensor:
    """``[E, C, d]``: token rows in their expert's slots (position policy), zeros elsewhere."""
    tokens, k = topk_ids.shape
    capacity = dispatch.expert_capacity(tokens, k, n_experts, capacity_factor, multiple)
    rank = dispatch.capacity_positions(topk_ids, torch.zeros(topk_ids.shape), n_experts, "position")
    keep = rank < capacity
    trash = n_experts * capacity  # dropped assignments go to one extra slot, then cut off
    slot = torch.where(keep, topk_ids * capacity + rank, torch.full_like(rank, trash)).reshape(-1)
    token_of = torch.arange(tokens, device=x.device).repeat_interleave(k)
    buffer = x.new_zeros(trash + 1, x.shape[1]).index_add_(0, slot, x.index_select(0, token_of))
    return buffer[:trash].view(n_experts, capacity, x.shape[1])


@exercise(capacity_buffer)
def check_capacity_buffer(fn: Callable[..., torch.Tensor]) -> None:
    """Raise `ExerciseError` unless ``fn(x, topk_ids, n_experts, capacity_factor, multiple)``
    builds `capacity_buffer`'s ``[E, C, d]`` buffer on every case (fractional shares, a
    multiple, every token on one expert, room for everything, no tokens) without a host sync."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    cases = [  # topk_ids, experts, factor, multiple
        (random_routing(g, 40, 8, 2), 8, 1.0, 1), (random_routing(g, 97, 16, 4), 16, 1.25, 1),
        (random_routing(g, 50, 8, 2), 8, 1.0, 16), (random_routing(g, 33, 4, 4), 4, 0.75, 1),
        (random_routing(g, 12, 6, 2), 6, 2.0, 4), (random_routing(g, 0, 8, 2), 8, 1.0, 1),
        (torch.full((25, 1), 3, dtype=torch.int64), 8, 1.5, 1),  # every token on expert 3
    ]
    for ids, n_experts, factor, multiple in cases:
        x = torch.randn(ids.shape[0], 16, generator=g)
        want = capacity_buffer(x, ids, n_experts, factor, multiple)
        got = call_answer(fn, x.clone(), ids.clone(), n_experts, factor, multiple)
        where = (f"{ids.shape[0]} tokens, top-{ids.shape[1]} of {n_experts} experts, capacity factor "
                 f"{factor}, multiple {multiple}")
        if not isinstance(got, torch.Tensor) or got.dim() != 3:
            raise ExerciseError(f"({where}): return the [E, C, d] buffer, got "
                                f"{getattr(got, 'shape', type(got).__name__)}")
        if tuple(got.shape) != tuple(want.shape):
            c = want.shape[1]
            hint = ""
            if got.shape[1] == c // multiple or (multiple > 1 and got.shape[1] < c):
                hint = f" (round C up to a multiple of {multiple})"
            elif got.shape[1] == c - 1:
                hint = " (a fractional slot is still a slot: round the even share up)"
            raise ExerciseError(f"({where}): buffer of shape {tuple(got.shape)}, expected "
                                f"{tuple(want.shape)}: C = ceil(tokens · top_k · capacity_factor / "
                                f"n_experts), a Python int from shapes{hint}")
        if not torch.equal(got, want):
            e, c = (got != want).any(-1).nonzero()[0].tolist()
            hint = ""
            kept = keep_mask(ids, n_experts, want.shape[1])
            if int(got.ne(0).any(-1).sum()) != int(kept.sum()):
                hint = (" — the slots hold the wrong number of rows: a dropped assignment "
                        "(rank >= C) goes nowhere, a kept one to slot rank of its expert")
            raise ExerciseError(f"({where}): expert {e}, slot {c} holds the wrong row{hint}; "
                                "rank the assignments as keep_mask does (first choices first)")
    ids = random_routing(g, 64, 8, 2)
    require_sync_free(fn, (torch.randn(64, 16, generator=g), ids, 8, 1.0, 1), "C comes from shapes "
                      "(Python numbers), the slots from a cumulative sum, the copy from index_add_ or "
                      "scatter")
    print("✓ capacity_buffer is correct and sync-free")
