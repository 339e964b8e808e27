import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402

from moe_lab.interop import from_hf_mixtral  # noqa: E402


def hf_block(experts=8, top_k=2, hidden=32, inter=64, impl=None):
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                        num_experts_per_tok=top_k, router_jitter_noise=0.0)
    if impl is not None:
        cfg._experts_implementation = impl
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block


@pytest.mark.parametrize("dispatcher, backend", [("dropless", "torch"), ("dropless", "loop"),
                                                 ("naive", "loop")])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (4, 4), (1, 1)])
def test_matches_hf_block(dispatcher, backend, experts, top_k):
    block = hf_block(experts, top_k)
    layer = from_hf_mixtral(block, dispatcher, backend)
    x = torch.randn(3, 11, 32)
    with torch.no_grad():
        want = block(x)
        got, stats = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert int(stats.tokens_per_expert.sum()) == 33 * top_k


def test_gradients_match_hf_block():
    block = hf_block()
    layer = from_hf_mixtral(block)
    x = torch.randn(2, 9, 32)
    g = torch.randn(2, 9, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    block(xa).backward(g)
    layer(xb)[0].backward(g)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.experts.w_down.grad, block.experts.down_proj.grad.transpose(1, 2),
                               rtol=1e-4, atol=1e-5)


def test_refuses_jitter_and_other_blocks():
    block = hf_block()
    block.jitter_noise = 0.1
    with pytest.raises(ValueError, match="jitter_noise"):
        from_hf_mixtral(block)
    with pytest.raises(ValueError, match="MixtralSparseMoeBlock"):
        from_hf_mixtral(torch.nn.Linear(2, 2))
