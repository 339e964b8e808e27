"""Paged stashing: the page arithmetic against a plain-Python reference, the worst case of a
pool, exact round trips, the overflow flag and the re-run, sync-freedom, and the memory saved
against the worst-case static buffer."""

from __future__ import annotations

import functools
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_lab import preset
from moe_lab.moe.stash import (
    PagedStash,
    max_pages,
    page_table,
    pages_per_expert,
    simulate_expert_parallel,
)
from moe_lab.training.build import build_model, random_batch
from moe_lab.training.steps import StepConfig, SyncFreeStep
from moe_lab.training.sync import assert_sync_free, count_syncs
from moe_lab.workbench.exercises.nb08_cuda_graphs import worst_routing

TINY = preset("tiny")


def _offsets(counts) -> torch.Tensor:
    return F.pad(torch.tensor(counts, dtype=torch.int64).cumsum(0), (1, 0)).to(torch.int32)


def _reference_pages(counts, page_rows, head=0):
    """Plain Python: walk the experts, open pages, place rows."""
    page, slot, first = [], [], []
    next_page = head
    for c in counts:
        first.append(next_page)
        for j in range(c):
            page.append(next_page + j // page_rows)
            slot.append(j % page_rows)
        next_page += -(-c // page_rows)
    return page, slot, first


# ------------------------------------------------------------------------------ arithmetic


@pytest.mark.parametrize("counts,page_rows,head", [
    ([3, 0, 5, 17], 4, 0), ([0, 0, 0], 8, 2), ([32], 32, 0), ([1, 1, 1, 1, 1], 3, 7),
    ([0, 40, 0, 9], 16, 1),
])
def test_page_table_matches_the_plain_reference(counts, page_rows, head):
    page, slot, first = page_table(_offsets(counts), page_rows, sum(counts), torch.tensor(head))
    want_page, want_slot, want_first = _reference_pages(counts, page_rows, head)
    assert page.tolist() == want_page and slot.tolist() == want_slot
    assert first.tolist() == want_first
    assert pages_per_expert(_offsets(counts), page_rows).tolist() == [-(-c // page_rows)
                                                                      for c in counts]


def test_page_table_on_random_routings_gives_every_row_its_own_place():
    rng = random.Random(0)
    for _ in range(20):
        counts = [rng.choice([0, rng.randint(1, 50)]) for _ in range(rng.randint(1, 12))]
        page_rows = rng.choice([1, 4, 16])
        page, slot, first = page_table(_offsets(counts), page_rows, sum(counts))
        dest = (page * page_rows + slot).tolist()
        assert len(set(dest)) == len(dest)  # no two rows share a slot
        owners = {}
        expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        for p, e in zip(page.tolist(), expert.tolist(), strict=True):
            assert owners.setdefault(p, e) == e  # a page holds one expert's rows
        assert (max(page.tolist(), default=-1) + 1) == sum(-(-c // page_rows) for c in counts)


def test_page_table_is_sync_free():
    assert_sync_free(page_table, _offsets([3, 0, 9]), 4, 12, torch.tensor(2))


def test_max_pages_is_the_worst_routing():
    @functools.cache
    def brute(tokens, top_k, n_experts, page_rows, e=0, rows=None):
        rows = tokens * top_k if rows is None else rows
        if e == n_experts:
            return 0 if rows == 0 else -(10**9)
        return max(-(-n // page_rows) + brute(tokens, top_k, n_experts, page_rows, e + 1, rows - n)
                   for n in range(min(tokens, rows) + 1))

    for n_experts in range(1, 5):
        for top_k in range(1, n_experts + 1):
            for tokens in range(0, 7):
                for page_rows in (1, 2, 3, 5):
                    want = brute(tokens, top_k, n_experts, page_rows)
                    assert max_pages(tokens, top_k, n_experts, page_rows) == want
                    counts = worst_routing(tokens, top_k, n_experts, page_rows)
                    assert sum(counts) == tokens * top_k and max(counts) <= tokens
                    assert sum(math.ceil(c / page_rows) for c in counts) == want


# ------------------------------------------------------------------------------ the pool


def _save(store, offsets: torch.Tensor, *tensors: torch.Tensor):
    """Run a compute that saves ``tensors`` for backward (``t * w`` saves ``t``) through the
    activation store ``store(compute, x, offsets)``; returns the loss and the weights ``w``,
    whose gradients after ``loss.backward()`` are the tensors as backward got them back."""
    weights = [torch.zeros(t.shape, dtype=t.dtype, requires_grad=True) for t in tensors]
    return store(lambda: sum((t * w).sum() for t, w in zip(tensors, weights, strict=True)),
                 tensors[0], offsets), weights


class _Experts(nn.Module):
    """The least a stash attaches to: a dropless "MoE layer" whose experts save ``n_calls``
    activations of ``rows × width`` over ``n_experts`` through their activation store."""

    def __init__(self, rows, width, n_experts, dtype, n_calls):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.moe_layers = [SimpleNamespace(dispatcher="dropless", cfg=SimpleNamespace(top_k=2), experts=self)]
        self.tensors = [torch.zeros(rows, width, dtype=dtype) for _ in range(n_calls)]
        self.offsets = torch.zeros(n_experts + 1, dtype=torch.int32)

    def use_activation_store(self, store):
        self.store = store

    def forward(self, x):
        return _save(self.store, self.offsets, *self.tensors)[0]


def _stash_for(rows: int, width: int, n_experts: int, dtype=torch.float32, page_rows=8,
               capacity_factor=1.0, n_calls=1) -> PagedStash:
    """A stash planned for ``n_calls`` activations of ``rows × width`` (no MoE model needed)."""
    model = _Experts(rows, width, n_experts, dtype, n_calls)
    return PagedStash(page_rows, capacity_factor).attach(model, SimpleNamespace(x=None))


def _store(stash):
    return functools.partial(stash.run_paged, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_identical(dtype):
    counts = [5, 0, 17, 1, 9]
    rows = sum(counts)
    stash = _stash_for(rows, 6, len(counts), dtype, n_calls=2)
    assert len(stash.plan) == 2 and stash.pool_keys == [(6, dtype)]
    a = torch.randn(rows, 6).to(dtype)
    b = torch.randn(rows, 12).to(dtype)[:, ::2]  # a non-contiguous view, like chunk() gives
    loss, (wa, wb) = _save(_store(stash), _offsets(counts), a, b)
    assert not bool(stash.overflow)
    assert stash.pages_used() == [2 * sum(-(-c // 8) for c in counts)]
    loss.backward()
    assert torch.equal(wa.grad, a) and torch.equal(wb.grad, b)


def test_overflow_raises_the_flag_and_spares_the_rows_that_fit():
    counts = [8, 8, 8, 8]
    stash = _stash_for(8, 4, 4)  # 5 pages
    first = torch.randn(32, 4)
    loss, (w1,) = _save(_store(stash), _offsets(counts), first)  # 4 pages: fits
    assert not bool(stash.overflow)
    _save(_store(stash), _offsets(counts), torch.randn(32, 4))  # 4 more: only 1 left
    assert bool(stash.overflow)
    loss.backward()
    assert torch.equal(w1.grad, first)  # the trash page took the excess
    stash.reset()
    assert not bool(stash.overflow) and stash.pages_used() == [0]


def test_a_pool_filled_exactly_does_not_overflow():
    """The last page used is the pool's last page: it fits (an off-by-one ``>=`` in the flag
    test raised the flag here, and the step was rerun for nothing)."""
    stash = _stash_for(8, 4, 4)
    n_pages = stash.pool_pages()[0]
    assert n_pages == 5
    first, second = torch.randn(32, 4), torch.randn(8, 4)
    loss1, (w1,) = _save(_store(stash), _offsets([8, 8, 8, 8]), first)   # 4 pages
    loss2, (w2,) = _save(_store(stash), _offsets([0, 8, 0, 0]), second)  # the 5th, the last: full, not over
    assert not bool(stash.overflow) and stash.pages_used() == [n_pages]
    (loss1 + loss2).backward()
    assert torch.equal(w1.grad, first) and torch.equal(w2.grad, second)
    _save(_store(stash), _offsets([1, 0, 0, 0]), torch.randn(1, 4))  # one row more: over
    assert bool(stash.overflow)


def test_a_width_without_a_pool_is_refused():
    stash = _stash_for(8, 4, 4)
    with pytest.raises(ValueError, match="no pool for width 6"):
        _save(_store(stash), _offsets([8]), torch.randn(8, 6))


def test_stash_and_restore_are_sync_free():
    counts = [3, 0, 9, 4]
    stash = _stash_for(16, 5, 4)

    def round_trip(x, offsets, s):
        return _save(_store(s), offsets, x)[0]

    assert_sync_free(round_trip, torch.randn(16, 5), _offsets(counts), stash)


# ------------------------------------------------------------------------------ in the model


def _step(batch, capacity_factor=None, policy="rerun", page_rows=16):
    model, optimizer = build_model(TINY, seed=0)
    stash = None
    if capacity_factor is not None:
        stash = PagedStash(page_rows, capacity_factor).attach(model, batch)
    step = SyncFreeStep(model, optimizer, batch, StepConfig(read_every=1, overflow_policy=policy),
                        stash=stash)
    return step, stash


def test_paged_step_gives_bit_identical_gradients_and_weights():
    batch = random_batch(TINY, 4)
    plain, _ = _step(batch)
    paged, stash = _step(batch, capacity_factor=1.25)
    assert len(stash.plan) >= 2 * TINY.n_moe_layers
    results = []
    for step in (plain, paged):
        step.launch(batch)
        results.append([p.grad.clone() for p in step.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert not bool(stash.overflow) and stash.pages_used()[0] <= stash.pool_pages()[0]
    for a, b in zip(plain.model.parameters(), paged.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_overflow_reruns_without_stashing_or_skips():
    batch = random_batch(TINY, 4)
    plain, _ = _step(batch)
    stats_plain = plain(batch)
    rerun, stash = _step(batch, capacity_factor=0.3)  # far too small a pool
    stats, counts = count_syncs(rerun, batch)
    assert stats["reruns"] == 1 and stats["skipped"] == 1 and stats["steps"] == 1
    assert stats["loss"] == stats_plain["loss"]
    assert counts["aten._local_scalar_dense.default"] == 1  # the one flag read per step
    for a, b in zip(plain.model.parameters(), rerun.model.parameters(), strict=True):
        assert torch.equal(a, b)
    skip, _ = _step(batch, capacity_factor=0.3, policy="skip")
    before = [p.detach().clone() for p in skip.model.parameters()]
    stats = skip(batch)
    assert stats["skipped"] == 1 and stats["steps"] == 0 and stats["step"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, skip.model.parameters(), strict=True))


def test_paged_step_is_certified_sync_free():
    batch = random_batch(TINY, 2)
    step, stash = _step(batch, capacity_factor=1.25)
    step.certify()
    assert stash.pages_used() == [0] * len(stash.pool_keys)  # the certificate ran on fake pools


def test_attach_refuses_a_dispatcher_without_offsets():
    from moe_lab.model import MoETransformer

    with pytest.raises(ValueError, match="dropless"):
        PagedStash().attach(MoETransformer(TINY, dispatcher="naive"), random_batch(TINY, 2))


# ------------------------------------------------------------------------------ memory


@pytest.mark.parametrize("name,batch_size,page_rows", [("tiny", 4, 16), ("small", 4, 32)])
def test_pool_saves_at_least_40_percent_against_the_worst_case(name, batch_size, page_rows):
    model_cfg = preset(name)
    model, _ = build_model(model_cfg)
    stash = PagedStash(page_rows, 1.25).attach(model, random_batch(model_cfg, batch_size))
    assert stash.exact_bytes < stash.pool_bytes < stash.worst_case_bytes
    # the exact size holds T·k routed rows per activation; the worst case E·T
    moe = model_cfg.moe
    assert stash.worst_case_bytes * moe.top_k == stash.exact_bytes * moe.n_experts
    assert stash.exact_bytes % (batch_size * model_cfg.seq_len * moe.top_k) == 0
    assert 1 - stash.pool_bytes / stash.worst_case_bytes >= 0.40


def test_expert_parallel_simulation_across_skews():
    rows = simulate_expert_parallel(512, 16, 4, 4, skews=[0.0, 0.5, 2.0], page_rows=16,
                                    capacity_factor=1.25)
    balanced, _, skewed = rows
    assert balanced["worst_case"] == 16 * 512 and not balanced["overflow"]
    # the pool, by hand: ceil(1.25 · 512 · 4 / 16) = 160 pages, plus one per local expert
    # (16 experts over 4 devices: 4), of 16 rows each
    assert balanced["pool"] == (160 + 4) * 16
    assert balanced["exact"] <= balanced["paged"] <= balanced["pool"] < balanced["worst_case"]
    assert 1 - balanced["pool"] / balanced["worst_case"] >= 0.40
    assert skewed["overflow"] and skewed["exact"] > balanced["exact"]
