"""Megatron-Core as an oracle: moe_lab's router, balance losses, token permutation and
pipeline-layout parser against the functions NVIDIA's production stack runs.

Megatron-Core 0.16 runs these on a CPU without Transformer Engine or Apex (it warns and
falls back to its plain PyTorch paths, which are the ones called here: ``fused=False``).
Where it is not installed (the test extra installs it on Linux with CPython 3.10-3.13, where
0.16 has wheels) every test here is skipped with that reason.

Where the two differ by design, a test says so:
- Megatron computes the softmax and sigmoid of the router in float32 whatever the logits'
  dtype (``softmax(..., dtype=float32)``, ``sigmoid(logits.float())``, then ``type_as``), so
  with float64 logits its probabilities carry float32 rounding and differ from moe_lab's
  float64 chain at ~1e-8.
- Megatron ranks groups by the sum of each group's top ``topk // group_topk`` scores; moe_lab
  (like DeepSeek-V3 and Hugging Face) by the sum of the top 2. They agree where
  ``topk == 2 · group_topk`` (DeepSeek-V3: 8 experts from 4 groups).
- Megatron's balance losses count the plain top-k of the unbiased scores (no groups, no
  bias), moe_lab the experts actually chosen; they agree when routing has neither.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from moe_lab.config import ModelConfig, MoEConfig
from moe_lab.moe.experts import EXPERT_BACKENDS
from moe_lab.moe.router import ROUTER_IMPLS, route_from_logits, sequence_aux_loss, switch_aux_loss
from moe_lab.sim.layout import check_layout, parse_layout

_SKIP = ("megatron-core is not installed: the test extra installs megatron-core 0.16 on Linux "
         "with CPython 3.10-3.13 only (where it has wheels)")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils", reason=_SKIP)
    layout_mod = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout",
                                     reason=_SKIP)
PipelineParallelLayerLayout = layout_mod.PipelineParallelLayerLayout

# (moe_lab config fields, Megatron topk_routing_with_score_function kwargs): the same routing.
ROUTINGS = {
    # DeepSeek-V3: sigmoid, selection-only bias, 2 of 4 groups, renormalised, scaled.
    "deepseek_v3": (dict(n_experts=16, top_k=4, score_func="sigmoid", renormalize=True,
                         scaling_factor=2.5, n_groups=4, topk_groups=2),
                    dict(topk=4, score_function="sigmoid", num_groups=4, group_topk=2,
                         scaling_factor=2.5)),
    # Mixtral / GPT-OSS: top-k of the logits, softmax over the chosen (= renormalised softmax).
    "softmax_topk": (dict(n_experts=8, top_k=2, score_func="softmax", renormalize=True),
                     dict(topk=2, score_function="softmax", use_pre_softmax=False)),
    # Softmax over all experts, then top-k, weights not renormalised (Qwen3 norm_topk_prob=False).
    "pre_softmax": (dict(n_experts=8, top_k=3, score_func="softmax", renormalize=False),
                    dict(topk=3, score_function="softmax", use_pre_softmax=True)),
}


def moe_cfg(fields, **more):
    return MoEConfig(d_model=16, d_expert=8, **fields, **more)


def dense_probs(out):
    """moe_lab's ``[T, k]`` weights as Megatron's ``[T, E]`` routing probabilities."""
    return torch.zeros_like(out.logits).scatter(1, out.topk_ids, out.topk_weights)


def expert_bias(fields, n_experts, dtype=torch.float32, seed=0):
    """DeepSeek-V3's selection-only correction bias for sigmoid routing; None for softmax."""
    if fields["score_func"] != "sigmoid":
        return None
    return torch.randn(n_experts, dtype=dtype, generator=torch.Generator().manual_seed(seed)) * 0.1


def megatron_route(logits, mcore_kw, bias):
    return moe_utils.topk_routing_with_score_function(logits, expert_bias=bias, **mcore_kw)


@pytest.mark.parametrize("impl", ["reference", "compiled"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_router_matches_megatron(impl, routing):
    fields, mcore_kw = ROUTINGS[routing]
    cfg = moe_cfg(fields)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 16, generator=gen)
    w = torch.randn(cfg.n_experts, 16, generator=gen) * 0.5
    bias = expert_bias(fields, cfg.n_experts)
    out = ROUTER_IMPLS[impl](x, w, cfg, bias)
    probs, routing_map = megatron_route(x @ w.t(), mcore_kw, bias)
    assert torch.equal(out.routing_map, routing_map)
    # float32 rounding: the two chains order their float32 operations differently.
    torch.testing.assert_close(dense_probs(out), probs, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("routing", ["deepseek_v3", "softmax_topk"])
def test_triton_router_matches_megatron(routing, device):
    fields, mcore_kw = ROUTINGS[routing]
    cfg = moe_cfg(fields)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 16, generator=gen)  # interpreted on a CPU: a tiny problem
    w = torch.randn(cfg.n_experts, 16, generator=gen) * 0.5
    bias = expert_bias(fields, cfg.n_experts)
    out = ROUTER_IMPLS["triton"](x.to(device), w.to(device), cfg,
                                 None if bias is None else bias.to(device))
    probs, routing_map = megatron_route(x @ w.t(), mcore_kw, bias)
    assert torch.equal(out.routing_map.cpu(), routing_map)
    torch.testing.assert_close(dense_probs(out).cpu(), probs, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("routing", ["deepseek_v3", "softmax_topk"])
def test_float64_router_differs_by_megatrons_float32_scores(routing):
    # Megatron's score function runs in float32 even for float64 logits (then type_as), so
    # its float64 probabilities are float32-rounded: ~1e-8 from moe_lab's float64 chain.
    fields, mcore_kw = ROUTINGS[routing]
    cfg = moe_cfg(fields, router_dtype="fp64")
    logits = torch.randn(256, cfg.n_experts, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(5))
    bias = expert_bias(fields, cfg.n_experts, torch.float64)
    out = route_from_logits(logits, cfg, bias)
    probs, routing_map = megatron_route(logits, mcore_kw, bias)
    assert probs.dtype == torch.float64
    assert torch.equal(out.routing_map, routing_map)
    diff = (dense_probs(out) - probs).abs().max().item()
    assert 1e-12 < diff < 1e-6


def test_group_score_rule_differs_when_topk_is_not_twice_the_groups():
    # moe_lab ranks a group by its top-2 scores; Megatron by its top topk // group_topk. With
    # 2 experts from 2 of 4 groups Megatron ranks by each group's best score alone, so a
    # group with one strong expert (4, 5) beats one with two good ones (2, 3).
    cfg = MoEConfig(d_model=4, d_expert=4, n_experts=8, top_k=2, score_func="sigmoid",
                    n_groups=4, topk_groups=2)
    logits = torch.tensor([[3.0, -5.0, 2.8, 2.8, 2.9, -5.0, -5.0, -5.0]])
    out = route_from_logits(logits, cfg)
    _, routing_map = moe_utils.topk_routing_with_score_function(
        logits, topk=2, score_function="sigmoid", num_groups=4, group_topk=2)
    assert out.topk_ids.sort().values.tolist() == [[0, 2]]
    assert routing_map.nonzero()[:, 1].tolist() == [0, 4]


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_switch_aux_loss_matches_megatron(score_func):
    gen = torch.Generator().manual_seed(7)
    tokens, n_experts, top_k = 96, 8, 2
    logits = torch.randn(tokens, n_experts, generator=gen, requires_grad=True)
    # Megatron's aux-loss statistics: normalised scores and their plain top-k.
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, top_k, score_func)
    want = moe_utils.switch_load_balancing_loss_func(
        scores, routing_map.sum(0), tokens, top_k, n_experts, moe_aux_loss_coeff=1.0)
    raw = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    got = switch_aux_loss(raw, routing_map.sum(0), top_k)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    g_got, = torch.autograd.grad(got, logits)
    g_want, = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_sequence_aux_loss_matches_megatron(score_func):
    gen = torch.Generator().manual_seed(8)
    batch, seq, n_experts, top_k = 3, 16, 8, 2
    logits = torch.randn(batch * seq, n_experts, generator=gen)  # moe_lab: batch-major
    cfg = MoEConfig(d_model=4, d_expert=4, n_experts=n_experts, top_k=top_k, score_func=score_func)
    out = route_from_logits(logits, cfg, seq_len=seq)
    got = sequence_aux_loss(out.scores, out.topk_ids, top_k, seq)
    torch.testing.assert_close(got, out.seq_aux_loss)
    # Megatron's tokens are sequence-major [seq, batch]; its sequence loss views each
    # (sequence, expert) pair as one "expert" of a switch loss over seq tokens, / batch
    # (TopKRouter._apply_seq_aux_loss, reproduced here without the router module).
    seq_major = logits.view(batch, seq, n_experts).transpose(0, 1).reshape(-1, n_experts)
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(seq_major, top_k, score_func)
    scores, routing_map = scores.reshape(seq, -1), routing_map.reshape(seq, -1)
    want = moe_utils.switch_load_balancing_loss_func(
        scores, routing_map.sum(0), seq, top_k, n_experts, moe_aux_loss_coeff=1.0) / batch
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("permutation", ["torch", "triton"])
def test_permute_unpermute_match_megatron(permutation, device):
    gen = torch.Generator().manual_seed(9)
    tokens, n_experts, top_k, d = 12, 4, 2, 8
    x = torch.randn(tokens, d, generator=gen)
    topk_ids = torch.rand(tokens, n_experts, generator=gen).argsort(-1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=gen)
    routing_map = torch.zeros(tokens, n_experts, dtype=torch.bool).scatter_(1, topk_ids, True)
    probs = torch.zeros(tokens, n_experts).scatter_(1, topk_ids, weights)
    want_x, _, sorted_indices = moe_utils.permute(x, routing_map)
    dev = device if permutation == "triton" else torch.device("cpu")
    moves = EXPERT_BACKENDS[permutation]  # the backend's permute and unpermute
    got_x, offsets, layout = moves.permute(x.to(dev), topk_ids.to(dev), n_experts)
    # Both group the rows by expert, each expert's tokens in token order.
    torch.testing.assert_close(got_x.cpu(), want_x, rtol=0, atol=0)
    assert offsets.cpu().tolist() == [0, *routing_map.sum(0).cumsum(0).tolist()]
    y = torch.randn_like(want_x)
    want = moe_utils.unpermute(y, sorted_indices, x.shape, probs=probs, routing_map=routing_map)
    got = moves.unpermute(y.to(dev), layout, weights.to(dev))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


def model_cfg(n_layers, mtp_layers=0):
    moe = MoEConfig(d_model=8, n_experts=2, top_k=1, d_expert=8)
    return ModelConfig(vocab_size=8, d_model=8, n_layers=n_layers, n_heads=1, d_ff=8, moe=moe,
                       mtp_layers=mtp_layers)


# (layout, pipeline ranks, decoder layers, MTP layers): valid for both.
VALID = [
    ("Et*3|(tt|)*29,m|L", 16, 61, 1),  # DeepSeek-V3's, from Megatron's documentation
    ("Ettt|tttt|tttt|ttttL", 4, 15, 0),
    ("E|t*4|t*4|L", 2, 8, 0),  # two chunks per rank
    ("Et|(t|)*6,tL", 4, 8, 0),
    ("EttttmL", 1, 4, 1),
]


@pytest.mark.parametrize("text, ranks, layers, mtp", VALID)
def test_layout_parser_matches_megatron_on_valid_strings(text, ranks, layers, mtp):
    ours = parse_layout(text, ranks)
    theirs = PipelineParallelLayerLayout(text, ranks)
    assert theirs.validate_layer_layout(layers, mtp if mtp else None) is not None
    check_layout(ours, model_cfg(layers, mtp))
    assert ours.n_chunks == theirs.virtual_pipeline_model_parallel_size
    chars = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    # Megatron's layout[rank][chunk] is moe_lab's virtual stage chunk * ranks + rank.
    for rank in range(ranks):
        for chunk in range(ours.n_chunks):
            stage = "".join(chars[t.name] for t in theirs.layout[rank][chunk])
            assert ours.stages[chunk * ranks + rank] == stage


# Strings both refuse: a syntax error, a stage count the ranks do not divide, or the wrong
# layers for the model (layers, MTP layers).
INVALID = [
    ("Etx|L", 2, 1, 0),  # unknown character
    ("E*|tL", 2, 1, 0),  # '*' without a count
    ("(Et|tL", 2, 2, 0),  # '(' never closed
    ("Et|t|tL", 2, 3, 0),  # 3 stages on 2 ranks
    ("Ett|ttL", 2, 3, 0),  # 4 decoder layers for a 3-layer model
    ("tE|ttL", 2, 3, 0),  # embedding not first
    ("Et|ttLm", 2, 3, 1),  # loss not last
    ("Etm|ttL", 2, 3, 1),  # MTP before a decoder layer
]


@pytest.mark.parametrize("text, ranks, layers, mtp", INVALID)
def test_layout_parser_refuses_what_megatron_refuses(text, ranks, layers, mtp):
    with pytest.raises(ValueError):
        check_layout(parse_layout(text, ranks), model_cfg(layers, mtp))
    with pytest.raises(AssertionError):
        PipelineParallelLayerLayout(text, ranks).validate_layer_layout(layers, mtp if mtp else None)


def test_layout_grammar_differences_from_megatron():
    # moe_lab's grammar is a superset: nested groups and whitespace parse...
    assert parse_layout("E|((t|)*2)*2,L", 6).stages == ("E", "t", "t", "t", "t", "L")
    assert parse_layout("Et | tL").stages == ("Et", "tL")
    for text in ("E|((t|)*2)*2,L", "Et | tL"):
        with pytest.raises(AssertionError):
            PipelineParallelLayerLayout(text, 1)
    # ...and a zero repeat count, which Megatron expands to nothing, is refused.
    assert PipelineParallelLayerLayout("Et*0t|L", 2).flatten_layout[1].name == "decoder"
    with pytest.raises(ValueError, match="repeat count must be >= 1"):
        parse_layout("Et*0t|L", 2)
