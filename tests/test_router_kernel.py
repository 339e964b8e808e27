"""The fused Triton router against the reference chain (`moe_lab.moe.router`).

On a machine without CUDA the kernels run under Triton's interpreter, so the problems here
are small. Every case compares on fresh random logits: ids equal, weights close, counts
equal, aux statistics close; then ties, -inf and NaN logits, the degenerate shapes, the
gradients, and the host-sync certificate.
"""

from __future__ import annotations

import pytest
import torch

from moe_lab.config import MoEConfig
from moe_lab.kernels.fused_router import (
    check_finite_logits,
    fused_route,
    fused_route_from_logits,
    fused_router,
)
from moe_lab.moe.layer import MoELayer
from moe_lab.moe.router import Router, route, route_from_logits
from moe_lab.training.sync import assert_sync_free, count_syncs

NEG_INF = float("-inf")


def cfg(**kw) -> MoEConfig:
    base = dict(d_model=16, n_experts=8, top_k=2, d_expert=8)
    base.update(kw)
    return MoEConfig(**base)


DEEPSEEK = cfg(n_experts=256, top_k=8, score_func="sigmoid", n_groups=8, topk_groups=4,
               scaling_factor=2.5)
CONFIGS = {
    "softmax": cfg(),
    "sigmoid-scaled": cfg(score_func="sigmoid", scaling_factor=2.5, top_k=3),
    "no-renorm": cfg(renormalize=False, top_k=3),
    "top1": cfg(top_k=1),
    "groups-odd-width": cfg(n_experts=12, n_groups=4, topk_groups=2, top_k=3),
    "groups-of-one": cfg(n_experts=4, n_groups=4, topk_groups=2, top_k=2, score_func="sigmoid"),
    "softmax-groups": cfg(n_experts=16, n_groups=4, topk_groups=3, top_k=4),
    "deepseek-v3": DEEPSEEK,
}


def assert_same_routing(got, want, *, stats: bool = True) -> None:
    assert got.topk_ids.dtype == torch.int64
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights.float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    if stats:
        torch.testing.assert_close(got.aux_loss, want.aux_loss.float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.z_loss, want.z_loss.float(), rtol=1e-5, atol=1e-5)
        if want.seq_aux_loss is not None:
            torch.testing.assert_close(got.seq_aux_loss, want.seq_aux_loss.float(), rtol=1e-5,
                                       atol=1e-6)


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_matches_reference_on_random_logits(name):
    c = CONFIGS[name]
    g = torch.Generator().manual_seed(list(CONFIGS).index(name))
    tokens = 96 if c.n_experts > 64 else 61  # not a multiple of any block
    logits = torch.randn(tokens, c.n_experts, generator=g) * 2
    bias = torch.randn(c.n_experts, generator=g) * 0.1
    want = route_from_logits(logits, c, bias)
    got = fused_route_from_logits(logits, c, bias)
    assert got.scores is None and got.logits is logits
    assert_same_routing(got, want)
    assert_same_routing(fused_route_from_logits(logits, c), route_from_logits(logits, c))


def test_statistics_per_sequence():
    c = CONFIGS["sigmoid-scaled"]
    logits = torch.randn(60, 8)
    for seq_len in (3, 20, 60):  # a program's tokens span many, two, one sequence
        want = route_from_logits(logits, c, seq_len=seq_len)
        got = fused_route_from_logits(logits, c, seq_len=seq_len)
        assert_same_routing(got, want)
    ids, weights, counts, prob_sums, z_sum = fused_router(logits, c, seq_len=20)
    assert counts.shape == prob_sums.shape == (3, 8) and counts.dtype == torch.int32
    assert counts.sum(1).tolist() == [20 * 3] * 3
    scores = logits.sigmoid()
    p = scores / scores.sum(-1, keepdim=True)
    torch.testing.assert_close(prob_sums, p.view(3, 20, 8).sum(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z_sum, (logits.logsumexp(-1) ** 2).sum().view(1), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="multiple of seq_len"):
        fused_router(logits, c, seq_len=7)


def test_ties_follow_the_reference_rule():
    for name in ("softmax", "groups-odd-width", "deepseek-v3"):
        c = CONFIGS[name]
        g = torch.Generator().manual_seed(7)
        logits = torch.randint(-1, 2, (48, c.n_experts), generator=g).float()  # ties everywhere
        bias = torch.randint(0, 2, (c.n_experts,), generator=g).float() * 0.25
        assert_same_routing(fused_route_from_logits(logits, c, bias),
                            route_from_logits(logits, c, bias))


def test_minus_inf_logits():
    c = cfg(score_func="sigmoid", top_k=3)
    logits = torch.randn(20, 8)
    logits[:, :4] = NEG_INF
    logits[5] = NEG_INF
    logits[5, 6] = 0.3  # one available expert: two slots go to the lowest unavailable ones
    bias = torch.zeros(8)
    bias[:4] = 100.0
    got = fused_route_from_logits(logits, c, bias)
    assert_same_routing(got, route_from_logits(logits, c, bias))
    assert bool((got.topk_ids[torch.arange(20) != 5] >= 4).all())
    assert got.topk_ids[5].tolist() == [6, 0, 1]
    softmax = cfg(top_k=2)
    assert_same_routing(fused_route_from_logits(logits, softmax), route_from_logits(logits, softmax))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_nan_logits_reach_the_loss_and_ids_stay_valid(score_func):
    c = cfg(score_func=score_func, top_k=3)
    logits = torch.randn(10, 8)
    logits[4, 2] = float("nan")
    got = fused_route_from_logits(logits, c)
    ids = got.topk_ids
    assert bool(((ids >= 0) & (ids < 8)).all())
    assert all(len(set(row)) == 3 for row in ids.tolist())  # distinct experts
    assert torch.isnan(got.aux_loss) and torch.isnan(got.z_loss)
    clean = [0, 1, 2, 3, 5, 6, 7, 8, 9]
    want = route_from_logits(logits[clean], c)
    assert torch.equal(ids[clean], want.topk_ids)
    torch.testing.assert_close(got.topk_weights[clean], want.topk_weights)
    with pytest.raises(ValueError, match=r"tokens \[4\]"):
        check_finite_logits(logits)
    dead = torch.randn(3, 8)
    dead[1] = NEG_INF
    with pytest.raises(ValueError, match=r"tokens \[1\]"):
        check_finite_logits(dead)
    check_finite_logits(torch.randn(3, 8))


def test_degenerate_shapes():
    for c in (cfg(n_experts=1, top_k=1), cfg(top_k=8), cfg(top_k=8, n_groups=4, topk_groups=4),
              cfg(n_experts=3, top_k=3, score_func="sigmoid")):
        logits = torch.randn(9, c.n_experts)
        assert_same_routing(fused_route_from_logits(logits, c), route_from_logits(logits, c))
    c = cfg()
    empty = torch.randn(0, 8, requires_grad=True)
    got = fused_route_from_logits(empty, c, seq_len=4)
    assert got.topk_ids.shape == (0, 2) and got.topk_weights.shape == (0, 2)
    assert got.tokens_per_expert.tolist() == [0] * 8
    assert [float(v.detach()) for v in (got.aux_loss, got.z_loss, got.seq_aux_loss)] == [0, 0, 0]
    (got.topk_weights.sum() + got.aux_loss + got.z_loss).backward()
    assert empty.grad.shape == (0, 8)


def test_strided_logits_and_bias_dtype():
    c = CONFIGS["softmax-groups"]
    logits = torch.randn(16, 40).t()  # [40, 16], not contiguous
    bias = torch.randn(16, dtype=torch.float64) * 0.1
    assert_same_routing(fused_route_from_logits(logits, c, bias),
                        route_from_logits(logits, c, bias.float()))


def test_wrapper_refuses_bad_inputs():
    c = cfg()
    with pytest.raises(ValueError, match="float32"):
        fused_router(torch.randn(4, 8, dtype=torch.float64), c)
    with pytest.raises(ValueError, match="n_experts=8"):
        fused_router(torch.randn(4, 9), c)
    with pytest.raises(ValueError, match="expert_bias"):
        fused_router(torch.randn(4, 8), c, torch.zeros(9))
    with pytest.raises(ValueError, match="router_dtype"):
        fused_route(torch.randn(4, 16), torch.randn(8, 16), cfg(router_dtype="fp64"))
    with pytest.raises(ValueError, match="d_model=16"):
        fused_route(torch.randn(4, 15), torch.randn(8, 16), c)


# ------------------------------------------------------------------------------ backward


def _loss(r, grad_w, seq: bool):
    loss = (r.topk_weights * grad_w).sum() + 3.0 * r.aux_loss + 0.5 * r.z_loss
    return loss + 2.0 * r.seq_aux_loss if seq else loss


@pytest.mark.parametrize("name", ["softmax", "sigmoid-scaled", "no-renorm", "top1",
                                  "groups-odd-width", "deepseek-v3"])
def test_gradients_match_reference_autograd(name):
    c = CONFIGS[name]
    g = torch.Generator().manual_seed(11)
    tokens = 64 if c.n_experts > 64 else 30
    logits = torch.randn(tokens, c.n_experts, generator=g)
    logits[0, 0] = NEG_INF  # zero gradient there, finite elsewhere
    grad_w = torch.randn(tokens, c.top_k, generator=g)
    bias = torch.randn(c.n_experts, generator=g) * 0.1
    seq_len = tokens // 2
    grads = []
    for fn in (route_from_logits, fused_route_from_logits):
        x = logits.clone().requires_grad_()
        r = fn(x, c, bias, seq_len=seq_len)
        (gx,) = torch.autograd.grad(_loss(r, grad_w, True), x)
        grads.append(gx)
    want, got = grads
    assert torch.isfinite(got).all() and got[0, 0] == 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_gradients_of_single_outputs():
    c = CONFIGS["sigmoid-scaled"]
    logits = torch.randn(20, 8)
    for pick in ("topk_weights", "aux_loss", "z_loss"):
        grads = []
        for fn in (route_from_logits, fused_route_from_logits):
            x = logits.clone().requires_grad_()
            out = getattr(fn(x, c), pick)
            (gx,) = torch.autograd.grad(out.sum(), x)
            grads.append(gx)
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def test_fused_router_in_a_layer_matches_the_reference_layer():
    c = cfg(n_experts=16, top_k=4, score_func="sigmoid", n_groups=4, topk_groups=2,
            aux_loss_coef=0.1, z_loss_coef=0.01)
    ref = MoELayer(c, dispatcher="dropless", expert_backend="torch")
    fused = MoELayer(c, dispatcher="dropless", expert_backend="torch", router_impl="triton")
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(50, 16)
    outs = []
    for layer in (ref, fused):
        xi = x.clone().requires_grad_()
        y, stats = layer(xi)
        (y.square().sum() + stats.aux_loss + stats.z_loss).backward()
        outs.append((y, stats, xi.grad, layer.router.weight.grad))
    (y0, s0, gx0, gw0), (y1, s1, gx1, gw1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    assert torch.equal(s1.tokens_per_expert, s0.tokens_per_expert)
    torch.testing.assert_close(gx1, gx0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw1, gw0, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ syncs, tracing


def test_fused_router_is_sync_free_forward_and_backward():
    c = CONFIGS["deepseek-v3"]
    router = Router(c, impl="triton")
    x = torch.randn(32, c.d_model)

    def step(x):
        r = router(x)
        return r.topk_weights.sum() + r.aux_loss + r.z_loss

    assert_sync_free(step, x)  # fake tensors: the custom ops' fake implementations
    _, syncs = count_syncs(lambda: step(x.requires_grad_()).backward())  # and for real
    assert sum(syncs.values()) == 0, dict(syncs)


def test_torch_compile_traces_the_custom_ops():
    c = CONFIGS["groups-odd-width"]
    x, w = torch.randn(24, 16), torch.randn(12, 16)

    def fn(x, w):
        r = fused_route(x, w, c)
        return r.topk_ids, r.topk_weights, r.aux_loss

    compiled = torch.compile(fn, backend="eager", fullgraph=True)  # no graph break
    for got, want in zip(compiled(x, w), fn(x, w), strict=True):
        torch.testing.assert_close(got, want)


def test_reference_route_and_fused_route_agree_end_to_end():
    c = DEEPSEEK
    x, w = torch.randn(40, 16), torch.randn(256, 16)
    assert_same_routing(fused_route(x, w, c), route(x, w, c))
