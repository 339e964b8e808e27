"""moe_lab's custom backwards have a first derivative only: a double backward (a gradient
penalty: ``torch.autograd.grad(..., create_graph=True)``, then ``backward``) is refused in one
line naming the part; the paths made of plain autograd ops differentiate twice."""

import pytest
import torch

from moe_lab import MoELayer
from moe_lab.config import MoEConfig

CFG = MoEConfig(d_model=16, n_experts=4, top_k=2, d_expert=16)


@pytest.mark.parametrize("dispatcher, expert_backend, router_impl, part", [
    ("dropless", "torch", "reference", "grouped GEMM"),
    ("dropless", "triton", "triton", "Triton"),
    ("fused", "torch", "reference", "fused"),
])
def test_a_double_backward_is_refused_naming_the_part(dispatcher, expert_backend, router_impl, part):
    torch.manual_seed(0)
    layer = MoELayer(CFG, dispatcher=dispatcher, expert_backend=expert_backend, router_impl=router_impl)
    x = torch.randn(8, 16, requires_grad=True)
    y, _ = layer(x)
    with pytest.raises(RuntimeError, match=f"{part}.* has a first derivative only: a backward with "
                                           "create_graph=True"):
        (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        gx.sum().backward()


@pytest.mark.parametrize("dispatcher, expert_backend", [
    ("naive", "torch"), ("capacity", "torch"), ("dropless", "loop")])
def test_plain_autograd_paths_differentiate_twice(dispatcher, expert_backend):
    torch.manual_seed(0)
    layer = MoELayer(CFG, dispatcher=dispatcher, expert_backend=expert_backend)
    x = torch.randn(8, 16, requires_grad=True)
    y, _ = layer(x)
    (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    gx.sum().backward()
    assert torch.isfinite(layer.experts.w_down.grad).all()


def test_a_single_backward_is_unchanged():
    torch.manual_seed(0)
    layer = MoELayer(CFG, dispatcher="dropless", expert_backend="torch")
    x = torch.randn(8, 16, requires_grad=True)
    y, _ = layer(x)
    (gx,) = torch.autograd.grad(y.pow(2).sum(), x)
    assert gx.shape == x.shape and torch.isfinite(gx).all()
