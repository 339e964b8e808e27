"""The fused Triton router against the reference chain (`moe_lab.moe.router`).

The kernels run where the ``device`` fixture says: compiled on a CUDA machine, under Triton's
interpreter on a CPU, so the problems here are small and the tolerances hold both ways. Every
case compares on fresh random logits (drawn on the CPU, then moved): ids equal, weights
close, counts equal, aux statistics close; then ties, -inf and NaN logits, the degenerate
shapes, many programs with blocks straddling sequences, the gradients, the host-sync
certificate and the launch configuration (what a CUDA launch compiles is
tests/workbench/compile_report/test_specs.py's).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_lab
from moe_lab.config import MoEConfig
from moe_lab.kernels import fused_router as fr
from moe_lab.kernels.fused_router import (
    fused_route,
    fused_route_from_logits,
    fused_router,
    launch_config,
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
GPT_OSS = cfg(n_experts=32, top_k=4)  # GPT-OSS-20B's router: one group, softmax


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


def randn(*shape: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normal numbers drawn on the CPU (the same on every device), then moved to ``device``."""
    return torch.randn(*shape).to(device)


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_matches_reference_on_random_logits(name, device):
    c = CONFIGS[name]
    g = torch.Generator().manual_seed(list(CONFIGS).index(name))
    tokens = 96 if c.n_experts > 64 else 61  # not a multiple of any block
    logits = (torch.randn(tokens, c.n_experts, generator=g) * 2).to(device)
    bias = (torch.randn(c.n_experts, generator=g) * 0.1).to(device)
    want = route_from_logits(logits, c, bias)
    got = fused_route_from_logits(logits, c, bias)
    assert got.scores is None and got.logits is logits
    assert_same_routing(got, want)
    assert_same_routing(fused_route_from_logits(logits, c), route_from_logits(logits, c))


def test_statistics_per_sequence(device):
    c = CONFIGS["sigmoid-scaled"]
    logits = randn(60, 8, device=device)
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
    # Without seq_len the whole batch is one sequence: one row of statistics.
    _, _, counts, prob_sums, _ = fused_router(logits, c)
    assert counts.shape == prob_sums.shape == (1, 8) and counts.sum().item() == 60 * c.top_k
    torch.testing.assert_close(prob_sums, p.sum(0, keepdim=True), rtol=1e-5, atol=1e-5)


def test_ties_follow_the_reference_rule(device):
    for name in ("softmax", "groups-odd-width", "deepseek-v3"):
        c = CONFIGS[name]
        g = torch.Generator().manual_seed(7)
        # Logits in {-2, 0, 1}: ties everywhere, but only between scores computed alike. With
        # {-1, 0, 1}, sigmoid(1) + sigmoid(-1) = 2·sigmoid(0) would tie two *group scores*
        # computed differently, which a compiled exp may round apart.
        logits = torch.tensor([-2.0, 0.0, 1.0])[torch.randint(0, 3, (48, c.n_experts), generator=g)]
        bias = torch.randint(0, 2, (c.n_experts,), generator=g).float() * 0.25
        logits, bias = logits.to(device), bias.to(device)
        assert_same_routing(fused_route_from_logits(logits, c, bias),
                            route_from_logits(logits, c, bias))


def test_minus_inf_logits(device):
    c = cfg(score_func="sigmoid", top_k=3)
    logits = randn(20, 8)
    logits[:, :4] = NEG_INF
    logits[5] = NEG_INF
    logits[5, 6] = 0.3  # one available expert: two slots go to the lowest unavailable ones
    bias = torch.zeros(8)
    bias[:4] = 100.0
    logits, bias = logits.to(device), bias.to(device)
    got = fused_route_from_logits(logits, c, bias)
    assert_same_routing(got, route_from_logits(logits, c, bias))
    assert bool((got.topk_ids[torch.arange(20, device=device) != 5] >= 4).all())
    assert got.topk_ids[5].tolist() == [6, 0, 1]
    softmax = cfg(top_k=2)
    assert_same_routing(fused_route_from_logits(logits, softmax), route_from_logits(logits, softmax))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_nan_logits_reach_the_loss_and_ids_stay_valid(score_func, device):
    c = cfg(score_func=score_func, top_k=3)
    logits = randn(10, 8)
    logits[4, 2] = float("nan")
    logits = logits.to(device)
    got = fused_route_from_logits(logits, c)
    ids = got.topk_ids
    assert bool(((ids >= 0) & (ids < 8)).all())
    assert all(len(set(row)) == 3 for row in ids.tolist())  # distinct experts
    assert torch.isnan(got.aux_loss) and torch.isnan(got.z_loss)
    clean = [0, 1, 2, 3, 5, 6, 7, 8, 9]
    want = route_from_logits(logits[clean], c)
    assert torch.equal(ids[clean], want.topk_ids)
    torch.testing.assert_close(got.topk_weights[clean], want.topk_weights)


def test_degenerate_shapes(device):
    # One group, one expert per group and top-1 make size-1 aranges in the kernel (GP, EGP, KP).
    for c in (cfg(n_experts=1, top_k=1), cfg(top_k=8), cfg(top_k=8, n_groups=4, topk_groups=4),
              cfg(n_experts=3, top_k=3, score_func="sigmoid"),
              cfg(n_experts=4, n_groups=4, topk_groups=2, top_k=1, score_func="sigmoid")):
        logits = randn(9, c.n_experts, device=device)
        assert_same_routing(fused_route_from_logits(logits, c), route_from_logits(logits, c))
    c = cfg()
    empty = torch.randn(0, 8, device=device, requires_grad=True)
    got = fused_route_from_logits(empty, c, seq_len=4)
    assert got.topk_ids.shape == (0, 2) and got.topk_weights.shape == (0, 2)
    assert got.tokens_per_expert.tolist() == [0] * 8
    assert [float(v.detach()) for v in (got.aux_loss, got.z_loss, got.seq_aux_loss)] == [0, 0, 0]
    (got.topk_weights.sum() + got.aux_loss + got.z_loss).backward()
    assert empty.grad.shape == (0, 8)


def test_strided_logits_and_bias_dtype(device):
    c = CONFIGS["softmax-groups"]
    logits = randn(16, 40, device=device).t()  # [40, 16], not contiguous
    bias = randn(16, device=device).double() * 0.1
    assert_same_routing(fused_route_from_logits(logits, c, bias),
                        route_from_logits(logits, c, bias.float()))


def test_wrapper_refuses_bad_inputs(device):
    c = cfg()
    with pytest.raises(ValueError, match="float32"):
        fused_router(torch.randn(4, 8, dtype=torch.float64, device=device), c)
    with pytest.raises(ValueError, match="n_experts=8"):
        fused_router(torch.randn(4, 9, device=device), c)
    with pytest.raises(ValueError, match="expert_bias"):
        fused_router(torch.randn(4, 8, device=device), c, torch.zeros(9, device=device))
    with pytest.raises(ValueError, match="router_dtype"):
        fused_route(torch.randn(4, 16), torch.randn(8, 16), cfg(router_dtype="fp64"))
    with pytest.raises(ValueError, match="d_model=16"):
        fused_route(torch.randn(4, 15), torch.randn(8, 16), c)


# ------------------------------------------------------------------------------ backward


def _loss(r, grad_w, seq: bool):
    loss = (r.topk_weights * grad_w).sum() + 3.0 * r.aux_loss + 0.5 * r.z_loss
    return loss + 2.0 * r.seq_aux_loss if seq else loss


def _reference_and_fused_grads(logits, c, bias, grad_w, seq_len):
    grads = []
    for fn in (route_from_logits, fused_route_from_logits):
        x = logits.clone().requires_grad_()
        r = fn(x, c, bias, seq_len=seq_len)
        (gx,) = torch.autograd.grad(_loss(r, grad_w, seq_len is not None), x)
        grads.append(gx)
    return grads


@pytest.mark.parametrize("name", ["softmax", "sigmoid-scaled", "no-renorm", "top1",
                                  "groups-odd-width", "deepseek-v3"])
def test_gradients_match_reference_autograd(name, device):
    c = CONFIGS[name]
    g = torch.Generator().manual_seed(11)
    tokens = 64 if c.n_experts > 64 else 30
    logits = torch.randn(tokens, c.n_experts, generator=g)
    logits[0, 0] = NEG_INF  # zero gradient there, finite elsewhere
    grad_w = torch.randn(tokens, c.top_k, generator=g)
    bias = torch.randn(c.n_experts, generator=g) * 0.1
    logits, grad_w, bias = logits.to(device), grad_w.to(device), bias.to(device)
    want, got = _reference_and_fused_grads(logits, c, bias, grad_w, tokens // 2)
    assert torch.isfinite(got).all() and got[0, 0] == 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_gradients_of_single_outputs(device):
    c = CONFIGS["sigmoid-scaled"]
    logits = randn(20, 8, device=device)
    for pick in ("topk_weights", "aux_loss", "z_loss"):
        grads = []
        for fn in (route_from_logits, fused_route_from_logits):
            x = logits.clone().requires_grad_()
            out = getattr(fn(x, c), pick)
            (gx,) = torch.autograd.grad(out.sum(), x)
            grads.append(gx)
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def test_fused_router_in_a_layer_matches_the_reference_layer(device):
    c = cfg(n_experts=16, top_k=4, score_func="sigmoid", n_groups=4, topk_groups=2,
            aux_loss_coef=0.1, z_loss_coef=0.01)
    ref = MoELayer(c, dispatcher="dropless", expert_backend="loop").to(device)
    fused = MoELayer(c, dispatcher="dropless", expert_backend="loop", router_impl="triton").to(device)
    fused.load_state_dict(ref.state_dict())
    x = randn(50, 16, device=device)
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


# ------------------------------------------------------------------------------ many programs


@pytest.mark.parametrize("name", ["softmax", "groups-of-one", "deepseek-v3", "gpt-oss"])
def test_many_programs_and_blocks_straddling_sequences(name, device, monkeypatch):
    """What a GPU launch runs: many programs of a few tokens each (``BLOCK_T`` forced small
    through `launch_config`), a partial last block, and blocks whose tokens belong to two or
    more sequences, so that the per-sequence statistics are summed by several programs' atomics."""
    c = GPT_OSS if name == "gpt-oss" else CONFIGS[name]
    g = torch.Generator().manual_seed(5)
    tokens = 42  # 11 programs of 4 tokens, 6 of 8; the last one partial
    logits = torch.randn(tokens, c.n_experts, generator=g)
    bias = (torch.randn(c.n_experts, generator=g) * 0.1).to(device)
    grad_w = torch.randn(tokens, c.top_k, generator=g).to(device)
    logits = logits.to(device)
    rule = fr.launch_config
    for block_t, seq_len in ((4, 6), (8, 3)):  # a block spans 2 sequences; 3 or 4 sequences
        assert tokens > block_t and block_t % seq_len and seq_len % block_t

        def small_blocks(*args, block_t=block_t, **kwargs):
            config = rule(*args, **kwargs)
            return dataclasses.replace(config, blocks={**config.blocks, "BLOCK_T": block_t})

        monkeypatch.setattr(fr, "launch_config", small_blocks)
        want = route_from_logits(logits, c, bias, seq_len=seq_len)
        got = fused_route_from_logits(logits, c, bias, seq_len=seq_len)
        assert_same_routing(got, want)
        ids, _, counts, prob_sums, z_sum = fused_router(logits, c, bias, seq_len=seq_len)
        n_seqs = tokens // seq_len
        per_seq = torch.zeros(n_seqs, c.n_experts, dtype=torch.int32, device=device)
        per_seq.view(-1).index_add_(0, (ids + (torch.arange(tokens, device=device) // seq_len
                                               * c.n_experts)[:, None]).view(-1),
                                    torch.ones(ids.numel(), dtype=torch.int32, device=device))
        assert torch.equal(counts, per_seq)
        scores = logits.softmax(-1) if c.score_func == "softmax" else logits.sigmoid()
        p = scores / scores.sum(-1, keepdim=True)
        torch.testing.assert_close(prob_sums, p.view(n_seqs, seq_len, -1).sum(1), rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(z_sum, (logits.logsumexp(-1) ** 2).sum().view(1), rtol=1e-5,
                                   atol=1e-4)
        want_grad, got_grad = _reference_and_fused_grads(logits, c, bias, grad_w, seq_len)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------ syncs, tracing


def test_fused_router_is_sync_free_forward_and_backward(device):
    c = CONFIGS["deepseek-v3"]
    router = Router(c, impl="triton").to(device)
    x = randn(32, c.d_model, device=device)

    def step(x):
        r = router(x)
        return r.topk_weights.sum() + r.aux_loss + r.z_loss

    assert_sync_free(step, x)  # fake tensors: the custom ops' fake implementations
    _, syncs = count_syncs(lambda: step(x.requires_grad_()).backward())  # and for real
    assert sum(syncs.values()) == 0, dict(syncs)


def test_torch_compile_traces_the_custom_ops(device):
    c = CONFIGS["groups-odd-width"]
    x, w = randn(24, 16, device=device), randn(12, 16, device=device)

    def fn(x, w):
        r = fused_route(x, w, c)
        return r.topk_ids, r.topk_weights, r.aux_loss

    compiled = torch.compile(fn, backend="eager", fullgraph=True)  # no graph break
    for got, want in zip(compiled(x, w), fn(x, w), strict=True):
        torch.testing.assert_close(got, want)


def test_reference_route_and_fused_route_agree_end_to_end(device):
    c = DEEPSEEK
    x, w = randn(40, 16, device=device), randn(256, 16, device=device)
    assert_same_routing(fused_route(x, w, c), route(x, w, c))


# ------------------------------------------------------------------------------ launch


def test_launch_config_compiled_and_interpreted():
    dsv3, gpt_oss = moe_lab.preset("deepseek_v3").moe, moe_lab.preset("gpt_oss_20b").moe
    compiled = launch_config(8192, dsv3.n_experts, dsv3.n_groups, interpreted=False)
    assert compiled.blocks == {"BLOCK_T": 8, "GP": 8, "EGP": 32}  # a 2K-element tile
    assert (compiled.num_warps, compiled.num_stages) == (4, 3)
    compiled = launch_config(8192, gpt_oss.n_experts, gpt_oss.n_groups, interpreted=False)
    assert compiled.blocks == {"BLOCK_T": 64, "GP": 1, "EGP": 32}
    assert launch_config(8192, 256, 8, interpreted=True).blocks["BLOCK_T"] == 256  # 64K elements
    assert launch_config(5, 8, 1, interpreted=True).blocks["BLOCK_T"] == 8
    assert launch_config(5, 4, 4, interpreted=True).blocks == {"BLOCK_T": 8, "GP": 4, "EGP": 1}
