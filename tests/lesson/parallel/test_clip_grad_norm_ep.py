"""`clip_grad_norm_ep`: the global norm counts the replicated gradients once and every rank's
expert shard once (through the all-reduce), and every rank joins that all-reduce.

In one process (a group of one rank): a model of a replicated linear layer and an `EPMoELayer`
(its router and shared expert replicated, its experts a shard); the all-reduce is replaced by
one that adds what the other ranks' expert shards would contribute, and counts its calls."""

import math

import pytest
import torch

from moe_lab.config import MoEConfig
from moe_lab.parallel import ep


@pytest.fixture
def model_and_collective(one_rank_group, monkeypatch):
    moe = ep.EPMoELayer(MoEConfig(d_model=4, n_experts=2, top_k=1, d_expert=6, n_shared_experts=1),
                        expert_backend="torch")
    model = torch.nn.ModuleDict({"dense": torch.nn.Linear(4, 3), "moe": moe})
    calls = []
    other_ranks = 7.0  # the other ranks' expert shards' squared norms, summed

    def all_reduce(t, group=None):
        calls.append(group)
        t.add_(other_ranks)

    monkeypatch.setattr(ep.dist, "all_reduce", all_reduce)
    return model, calls, other_ranks


def _fill_grads(model, g):
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_the_norm_counts_every_expert_shard_once(model_and_collective):
    model, calls, other = model_and_collective
    _fill_grads(model, torch.Generator().manual_seed(0))
    expert = {id(p) for p in model["moe"].experts.parameters()}
    shared = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if id(p) not in expert)
    mine = sum(float(p.grad.pow(2).sum()) for p in model["moe"].experts.parameters())
    want = math.sqrt(shared + mine + other)
    before = [p.grad.clone() for p in model.parameters()]
    norm = ep.clip_grad_norm_ep(model, max_norm=0.5 * want, ep_group="ep")
    assert calls == ["ep"]
    assert float(norm) == pytest.approx(want, rel=1e-6)
    for p, g in zip(model.parameters(), before, strict=True):  # scaled to the max norm
        torch.testing.assert_close(p.grad, g * (0.5 * want / (want + 1e-6)))


def test_a_norm_below_the_max_leaves_the_gradients_alone(model_and_collective):
    model, _, _ = model_and_collective
    _fill_grads(model, torch.Generator().manual_seed(1))
    before = [p.grad.clone() for p in model.parameters()]
    ep.clip_grad_norm_ep(model, max_norm=1e6)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before, strict=True))


def test_a_rank_without_gradients_still_joins_the_all_reduce(model_and_collective):
    """It returned before the collective, leaving the other ranks waiting in theirs."""
    model, calls, other = model_and_collective
    norm = ep.clip_grad_norm_ep(model, max_norm=1.0, ep_group="ep")
    assert calls == ["ep"] and float(norm) == pytest.approx(math.sqrt(other))
