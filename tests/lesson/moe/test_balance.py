"""Aux-loss-free load balancing (`moe_lab.moe.balance`)."""

from __future__ import annotations

import pytest
import torch

from moe_lab import preset
from moe_lab.config import MoEConfig
from moe_lab.model import MoETransformer
from moe_lab.moe.balance import ExpertBiasBalancer, load_imbalance, update_expert_bias
from moe_lab.moe.layer import MoELayer
from moe_lab.moe.router import Router
from moe_lab.training.sync import count_syncs


def cfg(**kw) -> MoEConfig:
    base = dict(d_model=16, n_experts=4, top_k=1, d_expert=8)
    base.update(kw)
    return MoEConfig(**base)


def test_update_is_rate_times_sign_of_mean_minus_load():
    router = Router(cfg())
    update_expert_bias([router], [torch.tensor([10, 0, 5, 5])], rate=0.1)  # mean 5
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    update_expert_bias([router], [[10, 0, 5, 5]], rate=0.1)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.2, 0.2, 0.0, 0.0]))


def test_update_reaches_every_router_of_a_model_in_order():
    model = MoETransformer(preset("tiny"))
    layers = model.moe_layers
    loads = torch.stack([torch.arange(8), torch.arange(8).flip(0)])  # [layers, E]
    update_expert_bias(model, loads, rate=1.0)
    assert layers[0].router.expert_bias.tolist() == [1.0] * 4 + [-1.0] * 4
    assert layers[1].router.expert_bias.tolist() == [-1.0] * 4 + [1.0] * 4
    update_expert_bias(layers[:1], loads[:1], rate=1.0)  # one layer, one [E] load
    assert layers[0].router.expert_bias.tolist() == [2.0] * 4 + [-2.0] * 4


def test_update_refuses_bad_arguments():
    router = Router(cfg())
    with pytest.raises(ValueError, match="rate"):
        update_expert_bias([router], torch.ones(1, 4), rate=0)
    with pytest.raises(ValueError, match="one load per router"):
        update_expert_bias([router], torch.ones(2, 4), rate=0.1)
    with pytest.raises(ValueError, match=r"n_experts=4"):
        update_expert_bias([router], torch.ones(1, 5), rate=0.1)


def test_update_is_sync_free_with_device_loads():
    router = Router(cfg())
    loads = router(torch.randn(20, 16)).tokens_per_expert
    _, syncs = count_syncs(update_expert_bias, [router], [loads], 0.01)
    assert sum(syncs.values()) == 0, dict(syncs)


def test_bias_balances_a_skewed_router():
    torch.manual_seed(0)
    router = Router(cfg(n_experts=8, top_k=2, score_func="sigmoid"))
    with torch.no_grad():
        router.weight[0] += 1.0  # expert 0 scores high for most tokens
    x = torch.randn(512, 16) + 0.5
    before = float(load_imbalance(router(x).tokens_per_expert))
    for _ in range(60):
        update_expert_bias([router], [router(torch.randn(512, 16) + 0.5).tokens_per_expert], 0.02)
    after = float(load_imbalance(router(x).tokens_per_expert))
    assert before > 2.0 and after < 1.5, (before, after)
    assert load_imbalance(torch.tensor([[2, 2], [4, 0]])).tolist() == [1.0, 2.0]


def test_balancer_counts_training_forwards_only_and_updates_after_each_step():
    layer = MoELayer(cfg(n_experts=4, top_k=1))
    with ExpertBiasBalancer(rate=0.5) as balancer:
        layer.eval()
        layer(torch.randn(8, 16))
        balancer(0)
        assert balancer.updates == 0 and layer.router.expert_bias.abs().sum() == 0
        layer.train()
        _, s1 = layer(torch.randn(8, 16))
        _, s2 = layer(torch.randn(8, 16))  # two forwards, one step: loads summed
        load = (s1.tokens_per_expert + s2.tokens_per_expert).float()
        balancer(1, {})
        assert balancer.updates == 1
        torch.testing.assert_close(layer.router.expert_bias, 0.5 * torch.sign(load.mean() - load))
    bias = layer.router.expert_bias.clone()
    layer(torch.randn(8, 16))  # hook removed on exit
    balancer(2)
    assert torch.equal(layer.router.expert_bias, bias)
    with pytest.raises(ValueError, match="rate"):
        ExpertBiasBalancer(rate=-1.0)


def test_balancer_as_a_train_callback_moves_the_biases():
    from moe_lab.workbench.training.loop import TrainConfig, train

    with ExpertBiasBalancer(rate=0.01) as balancer:
        result = train(preset("tiny"), TrainConfig(steps=3, batch_size=2, eval_every=0,
                                                   warmup_steps=1, progress=False),
                       callback=balancer)
    assert balancer.updates == 3
    biases = [layer.router.expert_bias for layer in result.model.moe_layers]
    assert all(0 < b.abs().max() <= 3 * 0.01 + 1e-6 for b in biases)  # three steps of 0.01


def test_compare_balancing_returns_three_runs_of_records():
    from moe_lab.workbench.demos.balancing import compare_balancing

    runs = compare_balancing(preset("tiny", n_layers=1), steps=3, batch_size=2)
    assert list(runs) == ["none", "aux loss", "bias"]
    for records in runs.values():
        assert [r["step"] for r in records] == [0, 1, 2]
        assert all(r["imbalance"] >= 1.0 and 0 < r["max_share"] <= 1 for r in records)
    # the same data and initialisation: the first step's loss is the same in every run
    first = {name: records[0]["loss"] for name, records in runs.items()}
    assert len({round(v, 5) for v in first.values()}) == 1, first
