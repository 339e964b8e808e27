"""GPT-OSS's expert variant (`ClampedSwiGLUExperts`, registered in `EXPERT_KINDS`) against a
plain PyTorch definition, under every expert backend and dispatcher it accepts."""

import pytest
import torch
import torch.nn.functional as F

from moe_lab.config import MoEConfig
from moe_lab.moe.experts import EXPERT_KINDS, ClampedSwiGLUExperts, SwiGLUExperts, clamped_swiglu
from moe_lab.workbench.interop.gpt_oss import GptOssMoELayer


def plain_clamped_unit(h, alpha, limit):
    f = h.shape[-1] // 2
    gate, up = h[..., :f].clamp(max=limit), h[..., f:].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def plain_expert(experts, e, x):
    h = F.linear(x, experts.w_gate_up[e].t(), experts.b_gate_up[e])
    return F.linear(plain_clamped_unit(h, experts.alpha, experts.limit), experts.w_down[e].t(),
                    experts.b_down[e])


def random_experts(backend="loop", n=4, d=16, f=8, limit=0.8):
    torch.manual_seed(0)
    experts = ClampedSwiGLUExperts(n, d, f, backend, alpha=1.702, limit=limit)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5)
    return experts


def test_registered_beside_the_reference():
    assert EXPERT_KINDS["swiglu"] is SwiGLUExperts
    assert EXPERT_KINDS["clamped_swiglu"] is ClampedSwiGLUExperts


def test_unit_matches_plain_definition_and_clamps():
    h = torch.randn(64, 10) * 3
    torch.testing.assert_close(clamped_swiglu(h, 1.702, 1.0), plain_clamped_unit(h, 1.702, 1.0))


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_grouped_forward_and_backward_match_plain(backend):
    experts = random_experts(backend)
    counts = [3, 0, 5, 2]
    offsets = torch.tensor([0, 3, 3, 8, 10], dtype=torch.int32)
    x = torch.randn(sum(counts), 16, requires_grad=True)
    got = experts.grouped_forward(x, offsets)
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    want = torch.stack([plain_expert(experts, int(e), x[i]) for i, e in enumerate(rows)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, [x, experts.b_gate_up, experts.w_down], g)
    want_grads = torch.autograd.grad(want, [x, experts.b_gate_up, experts.w_down], g)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_batched_forward_matches_plain():
    experts = random_experts()
    x = torch.randn(4, 3, 16)
    want = torch.stack([torch.stack([plain_expert(experts, e, row) for row in x[e]]) for e in range(4)])
    torch.testing.assert_close(experts.batched_forward(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dispatcher, backend", [("naive", "loop"), ("dropless", "torch"),
                                                 ("dropless", "loop"), ("capacity", "loop")])
def test_every_dispatcher_agrees(dispatcher, backend):
    cfg = MoEConfig(d_model=16, n_experts=4, top_k=2, d_expert=8, capacity_factor=4.0)
    ref = GptOssMoELayer(cfg, "naive", "loop")
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
    layer = GptOssMoELayer(cfg, dispatcher, backend)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16)
    got, stats = layer(x)
    torch.testing.assert_close(got, ref(x)[0], rtol=1e-5, atol=1e-5)
    assert int(stats.dropped_tokens) == 0


def test_refuses_unfused_backends_and_bad_constants():
    with pytest.raises(ValueError, match="got 'triton'"):
        ClampedSwiGLUExperts(2, 4, 4, "triton")
    with pytest.raises(ValueError, match="limit must be a finite number > 0"):
        ClampedSwiGLUExperts(2, 4, 4, "loop", limit=0)
