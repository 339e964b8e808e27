"""Exercises of notebook 04 (dropless, sync-free) in PyTorch: the permutation, and a sync to
remove (the Triton ones, the combine and the tile schedule, are `nb04_dropless_sync_free_triton`).

- ``expert_permutation(topk_ids, n_experts)``: ``(order, offsets)`` — the flattened
  (token, choice) assignments sorted by expert, ties kept in their original order
  (``order: [T·k]`` int64), and where each expert's rows start in the sorted buffer
  (``offsets: [n_experts + 1]`` int32, ``offsets[0] = 0``, ``offsets[-1] = T·k``). No
  host sync.
- ``expert_of_row(offsets, n_rows)``: ``[n_rows]`` int64, the expert that owns each row of
  the sorted buffer. `expert_of_row_with_sync` below is a correct version that syncs; the
  learner finds the operator that does (``assert_sync_free`` names it) and writes one that
  passes the certificate. It is the question every program of a grouped GEMM asks about
  its tile.

Each ``check_…`` calls the learner's function on fresh random inputs (and awkward ones:
no tokens, experts with no tokens, every token on one expert, ``top_k == n_experts``) and
raises `ExerciseError` when an answer differs from the reference in
`moe_lab.moe.dispatch`, or when it syncs.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from moe_lab.moe.dispatch import sort_by_expert
from moe_lab.training.sync import SyncError, assert_sync_free
from moe_lab.workbench.exercises import (
    ExerciseError,
    call_answer,
    exercise,
    offsets_of,
    random_routing,
    require_sync_free,
    require_tensor,
)


def expert_permutation(topk_ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable argsort of the flattened expert ids, and the prefix sum of the counts."""
    return sort_by_expert(topk_ids, n_experts)


def expert_of_row_with_sync(offsets: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Correct, and not sync-free: which expert owns each row of the sorted buffer."""
    counts = (offsets[1:] - offsets[:-1]).long()  # rows per expert
    experts = torch.arange(counts.numel(), device=offsets.device)
    return torch.repeat_interleave(experts, counts)  # expert e, counts[e] times


def expert_of_row(offsets: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Row ``r`` belongs to the expert whose segment contains it: the number of segment
    ends at or before ``r`` (a binary search over the offsets, sized by ``n_rows``)."""
    rows = torch.arange(n_rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets[1:], rows, right=True)


@exercise(expert_permutation)
def check_expert_permutation(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Raise `ExerciseError` unless ``fn(topk_ids, n_experts)`` returns the stable
    expert-sorted order and the int32 offsets, with no host sync."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    cases = [
        (random_routing(g, 37, 8, 2), 8),
        (random_routing(g, 64, 16, 4), 16),  # some experts likely empty
        (random_routing(g, 11, 4, 4), 4),  # top_k == n_experts
        (torch.full((19, 1), 5, dtype=torch.int64), 8),  # every token on one expert
        (torch.randint(0, 3, (23, 2), generator=g), 12),  # experts 3..11 get nothing
        (torch.zeros(0, 2, dtype=torch.int64), 6),  # no tokens
    ]
    for ids, n_experts in cases:
        want_order, want_offsets = expert_permutation(ids, n_experts)
        got = call_answer(fn, ids.clone(), n_experts)
        where = f"topk_ids of shape {tuple(ids.shape)}, {n_experts} experts"
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseError(f"({where}): return a pair (order, offsets), got "
                                f"{type(got).__name__}")
        order, offsets = got
        require_tensor(order, want_order.shape,
                       f"({where}): order must be a [T·k] = {tuple(want_order.shape)} tensor")
        require_tensor(offsets, want_offsets.shape,
                       f"({where}): offsets must be [n_experts + 1] = {tuple(want_offsets.shape)}")
        flat = ids.reshape(-1)
        if not torch.equal(order.long().sort().values, torch.arange(flat.numel())):
            raise ExerciseError(f"({where}): order is not a permutation of 0..T·k-1")
        if not torch.equal(flat[order.long()], flat[want_order]):
            raise ExerciseError(f"({where}): order does not sort the assignments by expert id")
        if not torch.equal(order.long(), want_order):
            raise ExerciseError(f"({where}): sorted by expert, but not stably — within an "
                                "expert the assignments must keep their original order "
                                "(argsort(..., stable=True))")
        if not torch.equal(offsets.long(), want_offsets.long()):
            hint = ""
            if offsets.numel() and int(offsets[0]) != 0:
                hint = " — offsets[0] must be 0 (an exclusive prefix sum: pad a 0 in front)"
            raise ExerciseError(f"({where}): offsets {offsets.tolist()} should be "
                                f"{want_offsets.tolist()}{hint}")
        if offsets.dtype != torch.int32:
            raise ExerciseError(f"({where}): offsets are right but {offsets.dtype}; grouped GEMM "
                                "kernels take int32 offsets (.to(torch.int32))")
    ids, n_experts = cases[1]
    require_sync_free(fn, (ids, n_experts), "count with scatter_add_ (bincount reads the maximum id "
                      "on the host)")
    print("✓ expert_permutation is correct and sync-free")


@exercise(expert_of_row)
def check_expert_of_row(fn: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
    """Raise `ExerciseError` unless ``fn(offsets, n_rows)`` labels every row with its
    expert on every case *and* passes ``assert_sync_free``."""
    rng = random.Random()
    cases = [
        [3, 0, 5, 1],
        [0, 0, 9, 0],  # every row in one expert
        [7],  # one expert
        [0, 0, 0],  # no rows at all
        [1, 1, 1, 1, 1],
        [rng.randint(0, 6) * rng.randint(0, 1) for _ in range(rng.randint(2, 40))],
        [rng.randint(0, 50) for _ in range(rng.randint(2, 9))],
    ]
    for counts in cases:
        offsets = offsets_of(counts)
        n_rows = sum(counts)
        want = expert_of_row(offsets, n_rows)
        got = call_answer(fn, offsets.clone(), n_rows)
        where = f"rows per expert {counts}"
        require_tensor(got, (n_rows,), f"({where}): expected a [n_rows] = ({n_rows},) tensor")
        if not torch.equal(got.long(), want.long()):
            hint = ""
            left = torch.searchsorted(offsets[1:], torch.arange(n_rows, dtype=offsets.dtype))
            if torch.equal(got.long(), left.long()):
                hint = (" — row offsets[e + 1] is the first row of expert e + 1: a row equal to a "
                        "segment's end belongs to the next expert (count the ends at or before "
                        "the row: searchsorted(..., right=True))")
            raise ExerciseError(f"({where}): got {got.tolist()}, expected {want.tolist()}{hint}")
    try:
        assert_sync_free(fn, offsets_of([4, 0, 2]), 6)
    except SyncError as err:
        raise ExerciseError(f"correct, but not sync-free: {err}\nThe output length is known "
                            "without the data (n_rows): give it to the operator, or search "
                            "the offsets for each row") from None
    print("✓ expert_of_row is correct and passes assert_sync_free")
