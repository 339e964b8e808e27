"""The kernels compiled on a CUDA device: a short check that runs where only torch, triton,
numpy and pytest are installed (``pytest -m gpu`` from the checkout, no install step; see the
README's Hardware section). Skipped without CUDA.

The lesson's kernel tests (tests/lesson/kernels) also run compiled on a CUDA machine; these few
are what an offline GPU machine can run without the test extras: every moe_lab kernel compiled,
not interpreted; the grouped GEMM forward and backward against the loop reference at sizes that
give each expert several tiles; the fused router against the reference chain.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
# Row counts of 32 experts (one with none, some not a multiple of any block), then padding rows.
COUNTS = [160, 0, 33, 257, *range(100, 128)]
PAD = 19


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)


def test_kernels_are_compiled():
    from triton.runtime.jit import JITFunction

    from moe_lab.kernels import common
    from moe_lab.kernels import grouped_gemm as gg

    assert not common.INTERPRETED, "TRITON_INTERPRET is set: unset it to test the compiled kernels"
    assert isinstance(gg._grouped_gemm_kernel, JITFunction)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 8e-3)])
def test_grouped_gemm_forward_and_backward_match_the_loop(dtype, tol):
    from support import poison_outputs

    from moe_lab.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference

    k, n = 512, 384
    x = torch.randn(sum(COUNTS) + PAD, k).to(CUDA, dtype).requires_grad_()
    w = (torch.randn(len(COUNTS), k, n) / k**0.5).to(CUDA, dtype).requires_grad_()
    offsets = _offsets(COUNTS)
    dy = torch.randn(x.shape[0], n, device=CUDA).to(dtype)
    with poison_outputs():  # an element a kernel does not write is NaN
        y = grouped_gemm(x, w, offsets)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, w))
    want = grouped_gemm_reference(x32, w32, offsets)
    want_dx, want_dw = torch.autograd.grad(want, (x32, w32), dy.float())
    # fp32: the summation order differs; bf16: one rounding of a float32 sum on the store
    atol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=atol)
    torch.testing.assert_close(dx.float(), want_dx, rtol=tol, atol=atol)
    torch.testing.assert_close(dw.float(), want_dw, rtol=tol, atol=atol * 8)  # dW sums ~100 rows
    assert torch.all(y[sum(COUNTS):] == 0)


def test_fused_router_matches_the_reference():
    from moe_lab.config import MoEConfig
    from moe_lab.kernels.fused_router import fused_route_from_logits
    from moe_lab.moe.router import route_from_logits

    cfg = MoEConfig(d_model=64, n_experts=32, top_k=4, d_expert=32)  # GPT-OSS-20B's router
    tokens = 4099  # many programs, the last one partial
    # Every row a permutation of well-separated values: no near-tie can flip an id.
    values = torch.linspace(-3.0, 3.0, cfg.n_experts)
    logits = values[torch.argsort(torch.rand(tokens, cfg.n_experts), dim=1)].to(CUDA)
    got, want = fused_route_from_logits(logits, cfg), route_from_logits(logits, cfg)
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights.float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    torch.testing.assert_close(got.aux_loss, want.aux_loss.float(), rtol=1e-5, atol=1e-6)
