"""The CPU plug-in's embedding ``opaque_grad``: `moe_lab.workbench.cpu.embedding.embed` and its weight
gradient op (`embedding_grad`) against ``nn.Embedding``'s own autograd, eager and compiled."""

import pytest
import torch
import torch.nn as nn

import moe_lab.workbench.cpu
from moe_lab.config import preset
from moe_lab.model import EMBEDDING_IMPLS, MoETransformer
from moe_lab.workbench.cpu.embedding import embed, embedding_grad


def _grads(module, idx, dout, fn):
    module.weight.grad = None
    out = fn(idx)
    out.backward(dout)
    return out.detach(), module.weight.grad.clone()


@pytest.mark.parametrize("case", ["random", "one_token_id", "no_tokens", "3d", "noncontiguous_grad"])
def test_embed_matches_nn_embedding(case):
    g = torch.Generator().manual_seed(0)
    module = nn.Embedding(37, 24)
    shape = {"no_tokens": (0, 5), "3d": (2, 3, 9)}.get(case, (4, 11))
    idx = torch.randint(0, 37, shape, generator=g)
    if case == "one_token_id":
        idx.fill_(5)  # every token on one row: the most skewed scatter
    dout = torch.randn(*shape, 24, generator=g)
    if case == "noncontiguous_grad":
        dout = torch.randn(24, *shape, generator=g).movedim(0, -1)
        assert not dout.is_contiguous()
    out_ref, grad_ref = _grads(module, idx, dout, module)
    out, grad = _grads(module, idx, dout, lambda i: embed(module, i))
    assert torch.equal(out, out_ref)
    assert torch.equal(grad, grad_ref)  # ATen's kernel, as eager autograd runs it
    if case == "no_tokens":
        assert not grad.any()


def test_embed_compiles_into_the_opaque_gradient_op():
    g = torch.Generator().manual_seed(1)
    module = nn.Embedding(64, 16)
    idx = torch.randint(0, 64, (3, 20), generator=g)
    idx[:, :10] = 7  # repeated ids: where an unordered scatter would race
    dout = torch.randn(3, 20, 16, generator=g)
    _, grad_ref = _grads(module, idx, dout, module)
    compiled = torch.compile(lambda i: embed(module, i), fullgraph=True)
    with torch.profiler.profile() as prof:
        _, grad = _grads(module, idx, dout, compiled)
    assert torch.equal(grad, grad_ref)
    assert any(e.name == "moe_lab::embedding_grad" for e in prof.events())


def test_embed_falls_back_to_the_module_for_other_embeddings():
    module = nn.Embedding(10, 4, padding_idx=0)
    idx = torch.tensor([[0, 1, 1, 0]])
    out = embed(module, idx)
    out.sum().backward()
    assert not module.weight.grad[0].any() and (module.weight.grad[1] == 2).all()


def test_embed_rejects_ids_out_of_range():
    module = nn.Embedding(10, 4)
    with pytest.raises(IndexError):
        embed(module, torch.tensor([[3, 10]]))


def test_embedding_grad_op_checks():
    g = torch.Generator().manual_seed(2)
    torch.library.opcheck(embedding_grad, (torch.randn(2, 6, 8, generator=g),
                                           torch.randint(0, 5, (2, 6), generator=g), 5))


def test_registered_without_a_compiler_and_used_by_the_model():
    moe_lab.workbench.cpu.register()  # opaque_grad needs no C++ build: registered either way
    assert EMBEDDING_IMPLS["opaque_grad"] is embed
    with pytest.raises(ValueError, match="embedding_impl must be one of"):
        MoETransformer(preset("tiny"), embedding_impl="sparse-magic")


def test_tied_embeddings_get_both_gradients():
    moe_lab.workbench.cpu.register()
    cfg = preset("tiny").replace(tie_embeddings=True)
    idx = torch.randint(cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    grads = []
    for impl in ("opaque_grad", "reference"):  # the reference: the module's own backward
        torch.manual_seed(0)
        model = MoETransformer(cfg, dispatcher="dropless", embedding_impl=impl)
        assert model.lm_head.weight is model.embed.weight
        model(idx, idx).loss.backward()
        grads.append(model.embed.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-7)
