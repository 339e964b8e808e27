"""The reference router's defined behaviour: ties, -inf and NaN logits, the loss statistics,
and the registry (the compiled chain against the eager one).

The fused Triton router is tested against this reference in ``test_router_kernel.py``.
"""

from __future__ import annotations

import pytest
import torch

from moe_lab.config import MoEConfig
from moe_lab.moe.router import (
    ROUTER_IMPLS,
    Router,
    RouterOutput,
    compiled_route_from_logits,
    group_limited_mask,
    route,
    route_from_logits,
    router_z_loss,
    routing_agreement,
    sequence_aux_loss,
    switch_aux_loss,
    tokens_per_expert_from_ids,
    topk_lowest_index,
)

NEG_INF = float("-inf")


def cfg(**kw) -> MoEConfig:
    base = dict(d_model=16, n_experts=8, top_k=2, d_expert=8)
    base.update(kw)
    return MoEConfig(**base)


DEEPSEEK_LIKE = cfg(n_experts=32, top_k=4, score_func="sigmoid", n_groups=8, topk_groups=4,
                    scaling_factor=2.5)


def brute_force_ids(selection: torch.Tensor, k: int) -> torch.Tensor:
    """The tie rule, spelled out: by score descending, then expert index ascending."""
    rows = []
    for row in selection.tolist():
        order = sorted(range(len(row)), key=lambda e: (-row[e], e))
        rows.append(order[:k])
    return torch.tensor(rows, dtype=torch.int64).reshape(selection.shape[0], k)


def brute_force_group_mask(scores: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """DeepSeek-V3's group limit, spelled out without the function under test: a group scores
    the sum of its two best experts; the ``topk_groups`` best groups are kept, ties to the lower
    group index."""
    per = scores.shape[1] // n_groups
    rows = []
    for row in scores.tolist():
        group_score = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_groups)]
        kept = sorted(range(n_groups), key=lambda g: (-group_score[g], g))[:topk_groups]
        rows.append([e // per in kept for e in range(len(row))])
    return torch.tensor(rows, dtype=torch.bool)


# ------------------------------------------------------------------------------ ties


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_topk_does_not_promise_the_tie_rule_but_topk_lowest_index_does(dtype):
    x = torch.randint(-2, 3, (400, 16)).to(dtype) * 0.75  # many equal values per row
    x[::7, 3] = NEG_INF
    x[::5, :4] = NEG_INF
    x[::3, 5] = -0.0  # equal to +0.0
    for k in (1, 4, 16):
        assert torch.equal(topk_lowest_index(x, k), brute_force_ids(x, k))
    assert torch.equal(topk_lowest_index(x[:, :1], 1), torch.zeros(400, 1, dtype=torch.int64))
    wide = torch.randint(0, 2, (50, 300)).to(dtype)  # index bits above 8
    assert torch.equal(topk_lowest_index(wide, 8), brute_force_ids(wide, 8))
    # Why the reference does not use torch.topk: on this CPU it orders equal values
    # differently. (If a torch release makes it stable, this line documents the change.)
    assert not torch.equal(x.topk(4, dim=-1).indices, brute_force_ids(x, 4))


@pytest.mark.parametrize("c", [cfg(), cfg(top_k=5, score_func="sigmoid"), DEEPSEEK_LIKE,
                               cfg(n_experts=12, n_groups=4, topk_groups=2, top_k=3)])
def test_ties_go_to_the_lower_expert_index(c):
    logits = torch.randint(-1, 2, (64, c.n_experts)).float()  # three values: ties everywhere
    bias = torch.randint(0, 2, (c.n_experts,)).float() * 0.25
    r = route_from_logits(logits, c, bias)
    selection = r.scores + bias
    if c.n_groups > 1:
        selection = selection.masked_fill(~brute_force_group_mask(selection, c.n_groups,
                                                                   c.topk_groups), NEG_INF)
    assert torch.equal(r.topk_ids, brute_force_ids(selection, c.top_k))


def test_groups_rank_by_the_sum_of_their_two_best_experts_hand_worked():
    """Group 0 holds the single best expert (0.9) but its two best sum to 1.0; group 1's sum
    to 1.2: DeepSeek-V3's rule keeps group 1. Ranking by the max, or by the sum of all,
    keeps another group."""
    c = cfg(n_experts=8, n_groups=4, topk_groups=1, top_k=2, score_func="sigmoid")
    scores = torch.tensor([[0.9, 0.1, 0.6, 0.6, 0.3, 0.3, 0.35, 0.35]])
    #                      group 0: max 0.9, top-2 1.0 | group 1: 1.2 | group 2: 0.6 (sum of all 0.6)
    assert group_limited_mask(scores, 4, 1).tolist() == [[False, False, True, True] + [False] * 4]
    assert torch.equal(group_limited_mask(scores, 4, 1), brute_force_group_mask(scores, 4, 1))
    logits = torch.logit(scores)  # sigmoid(logits) == scores
    r = route_from_logits(logits, c, torch.zeros(8))
    assert sorted(r.topk_ids[0].tolist()) == [2, 3]


@pytest.mark.parametrize("n_experts, n_groups, topk_groups", [(32, 8, 4), (12, 4, 2), (16, 8, 3), (8, 8, 2)])
def test_group_mask_matches_the_spelled_out_rule_on_random_scores(n_experts, n_groups, topk_groups):
    g = torch.Generator().manual_seed(n_experts + n_groups)
    scores = torch.rand(200, n_experts, generator=g)
    scores[::9] = torch.randint(0, 3, (scores[::9].shape[0], n_experts), generator=g).float() / 4  # ties
    assert torch.equal(group_limited_mask(scores, n_groups, topk_groups),
                       brute_force_group_mask(scores, n_groups, topk_groups))


def test_group_ties_go_to_the_lower_group_index():
    c = cfg(n_experts=8, n_groups=4, topk_groups=1, top_k=1)
    scores = torch.tensor([[0.125, 0.25, 0.5, 0.5, 0.25, 0.125, 0.5, 0.5]])  # groups 1 and 3 tie
    mask = group_limited_mask(scores, c.n_groups, c.topk_groups)
    assert mask.tolist() == [[False, False, True, True, False, False, False, False]]


# ------------------------------------------------------------------------------ -inf and NaN


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_minus_inf_logits_are_never_chosen_while_others_are_available(score_func):
    c = cfg(score_func=score_func, top_k=3)
    logits = torch.randn(50, 8)
    logits[:, :4] = NEG_INF  # experts 0..3 unavailable to every token
    bias = torch.zeros(8)
    bias[:4] = 100.0  # however attractive their bias
    r = route_from_logits(logits, c, bias)
    assert bool((r.topk_ids >= 4).all())
    assert torch.isfinite(r.topk_weights).all()


def test_minus_inf_experts_are_chosen_lowest_first_when_needed_with_weight_zero():
    c = cfg(score_func="sigmoid", top_k=3, renormalize=False)
    logits = torch.full((2, 8), NEG_INF)
    logits[0, 6] = 0.5  # one available expert, three slots
    logits[1, 2] = -1.0
    r = route_from_logits(logits, c)
    assert r.topk_ids.tolist() == [[6, 0, 1], [2, 0, 1]]
    assert r.topk_weights[:, 1:].abs().max() == 0


def test_gradients_at_minus_inf_logits_are_zero():
    c = cfg(score_func="softmax", top_k=2, z_loss_coef=1.0)
    logits = torch.randn(10, 8)
    logits[:, 3] = NEG_INF
    logits.requires_grad_()
    r = route_from_logits(logits, c)
    (r.topk_weights.square().sum() + r.aux_loss + r.z_loss).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[:, 3].abs().max() == 0


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_nan_logits_propagate_to_the_loss_and_ids_stay_valid(score_func):
    c = cfg(score_func=score_func, top_k=2)
    logits = torch.randn(6, 8)
    logits[2, 5] = float("nan")
    r = route_from_logits(logits, c)
    assert bool(((r.topk_ids >= 0) & (r.topk_ids < 8)).all())
    assert torch.isnan(r.aux_loss) and torch.isnan(r.z_loss)
    clean = route_from_logits(logits[[0, 1, 3, 4, 5]], c)
    assert torch.equal(r.topk_ids[[0, 1, 3, 4, 5]], clean.topk_ids)


# ------------------------------------------------------------------------------ statistics


def test_chain_pieces_agree_with_the_output():
    c = cfg(top_k=3, renormalize=True, scaling_factor=1.5)
    logits = torch.randn(40, 8, dtype=torch.float64)
    r = route_from_logits(logits, c)
    assert r.topk_weights.dtype == torch.float64
    torch.testing.assert_close(r.topk_weights.sum(-1), torch.full((40,), 1.5, dtype=torch.float64))
    assert torch.equal(r.tokens_per_expert, torch.bincount(r.topk_ids.flatten(), minlength=8))
    assert torch.equal(r.tokens_per_expert, tokens_per_expert_from_ids(r.topk_ids, 8))
    torch.testing.assert_close(r.aux_loss, switch_aux_loss(r.scores, r.tokens_per_expert, 3))
    torch.testing.assert_close(r.z_loss, (logits.logsumexp(-1) ** 2).mean())
    assert r.seq_aux_loss is None
    assert r.routing_map.shape == (40, 8) and int(r.routing_map.sum()) == 120
    assert torch.equal(r.routing_map.nonzero()[:, 1].view(40, 3).sort(-1).values,
                       r.topk_ids.sort(-1).values)


def test_sequence_aux_loss_is_the_mean_of_per_sequence_switch_losses():
    c = cfg(top_k=2, score_func="sigmoid")
    logits = torch.randn(4 * 10, 8)
    r = route_from_logits(logits, c, seq_len=10)
    per_seq = []
    for s in range(4):
        rs = route_from_logits(logits[s * 10:(s + 1) * 10], c)
        per_seq.append(rs.aux_loss)
    torch.testing.assert_close(r.seq_aux_loss, torch.stack(per_seq).mean())
    # one sequence: the same as the global loss
    whole = route_from_logits(logits, c, seq_len=40)
    torch.testing.assert_close(whole.seq_aux_loss, whole.aux_loss)
    torch.testing.assert_close(sequence_aux_loss(r.scores, r.topk_ids, 2, 10), r.seq_aux_loss)
    with pytest.raises(ValueError, match="multiple of seq_len"):
        route_from_logits(logits, c, seq_len=7)


def test_zero_tokens_one_expert_and_all_experts():
    r = route_from_logits(torch.randn(0, 8), cfg(), seq_len=4)
    assert r.topk_ids.shape == (0, 2) and int(r.tokens_per_expert.sum()) == 0
    assert float(r.aux_loss) == 0 and float(r.z_loss) == 0 and float(r.seq_aux_loss) == 0
    assert float(router_z_loss(torch.randn(0, 8))) == 0
    one = route_from_logits(torch.randn(5, 1), cfg(n_experts=1, top_k=1))
    assert one.topk_ids.tolist() == [[0]] * 5
    torch.testing.assert_close(one.topk_weights, torch.ones(5, 1))  # softmax of one logit
    every = route_from_logits(torch.randn(5, 8), cfg(top_k=8))
    assert torch.equal(every.topk_ids.sort(-1).values, torch.arange(8).expand(5, 8))
    assert every.tokens_per_expert.tolist() == [5] * 8


def test_route_is_the_matmul_then_the_chain():
    c = cfg(router_dtype="fp64")
    x, w = torch.randn(12, 16), torch.randn(8, 16)
    r = route(x, w, c)
    assert r.logits.dtype == torch.float64
    torch.testing.assert_close(r.logits, x.double() @ w.double().t())
    ref = route_from_logits(r.logits, c)
    assert torch.equal(r.topk_ids, ref.topk_ids)
    with pytest.raises(ValueError, match="d_model=16"):
        route(torch.randn(3, 15), w, c)
    with pytest.raises(ValueError, match="n_experts=8"):
        route_from_logits(torch.randn(3, 7), c)
    with pytest.raises(ValueError, match="float32 or float64"):
        route_from_logits(torch.randn(3, 8, dtype=torch.bfloat16), c)


def test_frameworks_topk_gives_the_same_answer_without_ties():
    c = DEEPSEEK_LIKE
    logits = torch.randn(100, c.n_experts, dtype=torch.float64)
    a = route_from_logits(logits, c)
    b = route_from_logits(logits, c, lowest_index_ties=False)
    assert torch.equal(a.topk_ids, b.topk_ids)


# ------------------------------------------------------------------------------ registry


def test_registry_and_router_module():
    assert {"reference", "compiled", "triton"} <= set(ROUTER_IMPLS)
    with pytest.raises(ValueError, match="^router_impl must be one of"):
        Router(cfg(), impl="magic")
    with pytest.raises(ValueError, match="router_dtype"):
        Router(cfg(router_dtype="fp64"), impl="triton")
    router = Router(cfg())
    assert router.weight.shape == (8, 16) and router.expert_bias.shape == (8,)
    out = router(torch.randn(7, 16))
    assert isinstance(out, RouterOutput) and out.topk_ids.shape == (7, 2)
    assert out.seq_aux_loss is None
    x = torch.randn(12, 16)
    for impl in ("reference", "triton"):
        with_seq = Router(cfg(), impl=impl)
        with_seq.load_state_dict(router.state_dict())
        torch.testing.assert_close(with_seq(x, seq_len=4).seq_aux_loss,
                                   route(x, router.weight, cfg(), seq_len=4).seq_aux_loss)


@pytest.mark.slow  # one torch.compile: seconds with a warm cache, a minute cold
def test_compiled_chain_matches_the_reference():
    c = DEEPSEEK_LIKE
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(96, c.n_experts, generator=g)
    bias = torch.randn(c.n_experts, generator=g) * 0.05
    ref = route_from_logits(logits, c, bias, seq_len=32)
    got = compiled_route_from_logits(logits, c, bias, seq_len=32)
    assert torch.equal(got.topk_ids, ref.topk_ids)
    torch.testing.assert_close(got.topk_weights, ref.topk_weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.tokens_per_expert, ref.tokens_per_expert)
    for name in ("aux_loss", "z_loss", "seq_aux_loss"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
    ties = torch.randint(-1, 2, (96, c.n_experts), generator=g).float()
    assert torch.equal(compiled_route_from_logits(ties, c, bias, seq_len=32).topk_ids,
                       route_from_logits(ties, c, bias, seq_len=32).topk_ids)
    router = Router(c, impl="compiled")  # the registry entry: the matmul, then the same chain
    x = torch.randn(96, c.d_model, generator=g)
    want = route(x, router.weight, c, router.expert_bias, seq_len=32)
    assert torch.equal(router(x, seq_len=32).topk_ids, want.topk_ids)


def test_routing_agreement_ignores_order_within_a_token():
    ids = torch.tensor([[0, 1], [2, 3]])
    assert routing_agreement(ids, torch.tensor([[1, 0], [2, 5]])) == 0.75
    assert routing_agreement(ids[:0], ids[:0]) == 1.0
    with pytest.raises(ValueError, match="same shape"):
        routing_agreement(ids, ids[:, :1])


@pytest.mark.slow  # compiles the chain once per shape
def test_router_benchmark_module_contract_and_ledger():
    import argparse

    from moe_lab.workbench.benchmarks import router as bench
    from moe_lab.workbench.measure import ledger

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--shape", "deepseek_v3", "--tokens", "64", "--min-time", "0.01",
                              "--notebook", "test:router"])
    assert bench.DESCRIPTION
    result = bench.run(args)
    rows = {row["provider"]: row for row in result["rows"]}
    assert list(rows)[:3] == ["unfused fp64", "unfused fp32", "compiled fp32"]
    assert rows["unfused fp64"]["vs_unfused_fp64"] == 1.0
    assert rows["compiled fp32"]["kernels"] < rows["unfused fp32"]["kernels"]
    assert rows["unfused fp32"]["bytes"] < rows["unfused fp64"]["bytes"]
    assert all(row["bytes_vs_floor"] > 1 and row["ids_vs_fp64"] > 0.99 for row in rows.values())
    recorded = [r for r in ledger.read() if r["notebook"] == "test:router"]
    assert {r["metric"] for r in recorded} >= {"median_ms", "vs_unfused_fp64", "kernels_per_call",
                                               "bytes_per_call", "bytes_vs_floor"}
    deepseek = MoEConfig(d_model=64, d_expert=64, **bench.SHAPES["deepseek_v3"])
    assert bench.floor_bytes(64, deepseek) == 64 * 256 * 4 + 64 * 8 * 12
