"""The persistent TMA grouped GEMM compiled on a CUDA device (Hopper or Blackwell: TMA needs
compute capability 9 or later), at its launch config (128 x 128 x 64 bf16 tiles, 4 stages, one
program per SM, warp-specialised on Blackwell), against the loop reference: forward and backward
over 32 experts, one with no rows, most not a multiple of the block, padding rows after them.
Skipped elsewhere; it needs only torch, triton, numpy and pytest (``pytest -m gpu``).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a CUDA device with TMA (compute capability 9 or later)"),
]

COUNTS = [160, 0, 33, 257, *range(100, 128)]
PAD = 19


@pytest.mark.parametrize("programs", [None, 7])  # None: one program per SM
def test_tma_grouped_gemm_forward_and_backward_match_the_loop(programs, monkeypatch):
    from support import poison_outputs

    from moe_lab.kernels import grouped_gemm_tma as tma
    from moe_lab.kernels.grouped_gemm import grouped_gemm_reference

    if programs is not None:
        monkeypatch.setattr(tma, "default_programs", lambda device: programs)

    cuda, k, n = torch.device("cuda"), 512, 384
    offsets = torch.tensor([0, *torch.tensor(COUNTS).cumsum(0).tolist()], dtype=torch.int32, device=cuda)
    x = torch.randn(sum(COUNTS) + PAD, k).to(cuda, torch.bfloat16).requires_grad_()
    w = (torch.randn(len(COUNTS), k, n) / k**0.5).to(cuda, torch.bfloat16).requires_grad_()
    dy = torch.randn(x.shape[0], n, device=cuda).to(torch.bfloat16)
    with poison_outputs():  # an element the kernel does not write is NaN
        y = tma.grouped_gemm_tma(x, w, offsets)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, w))
    want = grouped_gemm_reference(x32, w32, offsets)
    want_dx, want_dw = torch.autograd.grad(want, (x32, w32), dy.float())
    # one rounding of a float32 sum on the store (the products of bf16 values are exact in fp32)
    torch.testing.assert_close(y.float(), want, rtol=8e-3, atol=2e-3)
    torch.testing.assert_close(dx.float(), want_dx, rtol=8e-3, atol=2e-3)
    torch.testing.assert_close(dw.float(), want_dw, rtol=8e-3, atol=1.6e-2)
    assert torch.all(y[sum(COUNTS):] == 0)
