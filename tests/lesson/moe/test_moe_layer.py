"""The MoE layer and the naive dispatcher against a dense reference.

The dense reference runs every expert on every token and combines the outputs with a
``[tokens, n_experts]`` gate matrix built from the router's choices: the definition of an
MoE layer with no dispatching at all.
"""

import pytest
import torch

from moe_lab import MoELayer, preset
from moe_lab.config import MoEConfig
from moe_lab.moe.dispatch import DISPATCHERS
from moe_lab.moe.experts import SwiGLUExperts
from moe_lab.moe.router import route, tokens_per_expert_from_ids


def dense_moe(x, topk_ids, topk_weights, experts: SwiGLUExperts):
    gate = torch.zeros(x.shape[0], experts.n_experts, dtype=x.dtype)
    gate.scatter_add_(1, topk_ids, topk_weights.to(x.dtype))
    all_out = torch.stack([experts.forward_expert(e, x) for e in range(experts.n_experts)], 1)
    return (gate.unsqueeze(-1) * all_out).sum(1)


def cfg(**kw):
    base = dict(d_model=32, n_experts=8, top_k=2, d_expert=16)
    base.update(kw)
    return MoEConfig(**base)


@pytest.mark.parametrize("c", [cfg(), cfg(top_k=8), cfg(n_experts=1, top_k=1),
                               cfg(score_func="sigmoid", scaling_factor=2.5),
                               cfg(n_groups=4, topk_groups=2, top_k=3, score_func="sigmoid"),
                               cfg(router_dtype="fp64"), cfg(renormalize=False)])
def test_naive_matches_dense_reference(c):
    layer = MoELayer(c, dispatcher="naive")
    x = torch.randn(37, c.d_model)
    y, stats = layer(x)
    r = route(x, layer.router.weight, c, layer.router.expert_bias)
    ref = dense_moe(x, r.topk_ids, r.topk_weights, layer.experts)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert int(stats.tokens_per_expert.sum()) == 37 * c.top_k
    assert int(stats.dropped_tokens) == 0


def test_3d_input_and_noncontiguous():
    c = cfg()
    layer = MoELayer(c)
    x = torch.randn(3, 5, c.d_model)
    y, _ = layer(x)
    assert y.shape == x.shape
    y2, _ = layer(x.reshape(15, c.d_model))
    torch.testing.assert_close(y.reshape(15, -1), y2)
    xt = torch.randn(c.d_model, 11).t()  # non-contiguous [11, d]
    assert not xt.is_contiguous()
    torch.testing.assert_close(layer(xt)[0], layer(xt.contiguous())[0])


@pytest.mark.parametrize("dispatcher", sorted(DISPATCHERS))
def test_zero_tokens(dispatcher):
    """Every dispatcher takes an empty batch forward and backward (the capacity dispatcher's
    zero capacity once made a ``view(E, 0, -1)`` ambiguous)."""
    layer = MoELayer(cfg(), dispatcher=dispatcher)
    x = torch.randn(0, 32, requires_grad=True)
    y, stats = layer(x)
    assert y.shape == (0, 32)
    assert int(stats.tokens_per_expert.sum()) == 0
    assert torch.isfinite(stats.aux_loss)
    (y.sum() + stats.aux_loss).backward()
    assert x.grad.shape == (0, 32)


def test_all_tokens_to_one_expert_and_idle_experts():
    c = cfg(top_k=1)
    layer = MoELayer(c)
    with torch.no_grad():
        layer.router.expert_bias[5] = 100.0  # selection only: every token picks expert 5
    x = torch.randn(20, c.d_model)
    y, stats = layer(x)
    assert stats.tokens_per_expert.tolist() == [0, 0, 0, 0, 0, 20, 0, 0]
    assert float(stats.imbalance) == pytest.approx(8.0)
    r = route(x, layer.router.weight, c, layer.router.expert_bias)
    torch.testing.assert_close(y, dense_moe(x, r.topk_ids, r.topk_weights, layer.experts))


def test_gradients_match_dense_reference():
    c = cfg(n_shared_experts=1)
    layer = MoELayer(c)
    x = torch.randn(16, c.d_model, requires_grad=True)
    y, stats = layer(x)
    (y.square().sum() + stats.aux_loss).backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    x.grad = None
    r = route(x, layer.router.weight, c, layer.router.expert_bias)
    ref = dense_moe(x, r.topk_ids, r.topk_weights, layer.experts) + layer.shared(x)
    (ref.square().sum() + r.aux_loss * c.aux_loss_coef).backward()
    want = [x.grad] + [p.grad for p in layer.parameters()]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_bad_inputs_are_refused():
    layer = MoELayer(cfg())
    with pytest.raises(ValueError, match="d_model=32"):
        layer(torch.randn(4, 31))
    with pytest.raises(ValueError, match="float64"):
        layer(torch.randn(4, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="floating-point"):
        layer(torch.ones(4, 32, dtype=torch.int64))
    with pytest.raises(ValueError, match="dispatcher"):
        MoELayer(cfg(), dispatcher="magic")


def test_router_group_limited_selection_stays_in_groups():
    c = cfg(n_experts=16, n_groups=4, topk_groups=2, top_k=4, score_func="sigmoid")
    x = torch.randn(50, c.d_model)
    w = torch.randn(16, c.d_model)
    r = route(x, w, c)
    groups = r.topk_ids // 4
    assert all(len(set(g.tolist())) <= 2 for g in groups)
    # the chosen groups are the best two by the sum of their top-2 scores
    gs = r.scores.view(50, 4, 4).topk(2, -1).values.sum(-1)
    best = gs.topk(2, -1).indices.sort(-1).values
    for t in range(50):
        assert set(groups[t].tolist()) <= set(best[t].tolist())


def test_router_weights_and_counts():
    c = cfg(top_k=3)
    x = torch.randn(40, c.d_model)
    w = torch.randn(8, c.d_model)
    r = route(x, w, c)
    torch.testing.assert_close(r.topk_weights.sum(-1), torch.ones(40))
    manual = torch.bincount(r.topk_ids.flatten(), minlength=8)
    assert torch.equal(tokens_per_expert_from_ids(r.topk_ids, 8), manual)
    # the chosen experts are the top-3 scores, in descending order
    assert torch.equal(r.topk_ids, r.scores.topk(3, -1).indices)
    # aux loss is 1 for perfectly uniform routing statistics
    uniform = torch.full((8, 8), 1 / 8)
    from moe_lab.moe.router import switch_aux_loss
    assert float(switch_aux_loss(uniform, torch.full((8,), 2), 2)) == pytest.approx(1.0)


def test_naive_is_registered():
    assert "naive" in DISPATCHERS


def test_model_forward_backward_tiny():
    from moe_lab.model import MoETransformer

    m = MoETransformer(preset("small"))
    idx = torch.randint(0, 256, (2, 16))
    out = m(idx, idx)
    assert out.logits.shape == (2, 16, 256)
    assert len(out.moe_stats) == 3  # small: 4 layers, 1 dense
    out.loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    with pytest.raises(ValueError, match="seq_len"):
        m(torch.zeros(1, 129, dtype=torch.int64))
    with pytest.raises(ValueError, match="attention='mha'"):
        MoETransformer(preset("deepseek_v3"))


def test_naive_layer_syncs_once_per_expert_and_fails_the_certificate():
    from moe_lab.training.sync import SyncError, assert_sync_free, count_syncs

    c = cfg(n_experts=6)
    layer = MoELayer(c)
    x = torch.randn(30, c.d_model)
    _, syncs = count_syncs(layer, x)
    assert sum(syncs.values()) >= c.n_experts
    with pytest.raises(SyncError, match="nonzero") as err:
        assert_sync_free(layer, x)
    assert "dispatch.py" in str(err.value)  # it names where the sync happens


@pytest.mark.parametrize("shape, dtype", [((37, 64), torch.float32), ((3, 5, 16), torch.float64),
                                          ((0, 8), torch.float32), ((33, 32), torch.bfloat16)])
def test_swiglu_function_matches_autograd_bit_for_bit(shape, dtype):
    """`swiglu` and its backward against autograd's graph of the plain expression: same bits,
    special values included."""
    import torch.nn.functional as F

    from moe_lab.moe.experts import swiglu

    h = torch.randn(shape, dtype=dtype)
    if h.numel():
        h.view(-1, shape[-1])[0, 0] = float("inf")
        h.view(-1, shape[-1])[-1, -1] = float("nan")
    ours, plain = h.clone().requires_grad_(), h.clone().requires_grad_()
    y = swiglu(ours)
    gate, up = plain.chunk(2, dim=-1)
    y_plain = F.silu(gate) * up
    dy = torch.randn_like(y)
    y.backward(dy)
    y_plain.backward(dy)
    torch.testing.assert_close(y, y_plain, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ours.grad, plain.grad, rtol=0, atol=0, equal_nan=True)
    # the same function without autograd, and on a non-contiguous input
    with torch.no_grad():
        torch.testing.assert_close(swiglu(h), y_plain, rtol=0, atol=0, equal_nan=True)
    wide = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2].requires_grad_()
    swiglu(wide).sum().backward()
    assert wide.grad.shape == wide.shape
