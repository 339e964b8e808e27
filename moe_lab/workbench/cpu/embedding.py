"""An embedding whose weight gradient is one opaque op (embedding ``opaque_grad``).

``torch.compile`` generates the embedding's weight gradient — a scatter of each token's
gradient row into row ``idx`` of the weight — itself. On a CPU Inductor writes that scatter
as one atomic add per element: slower than ATen's own kernel at the small preset's shapes,
and, with the adds racing, not bit for bit the same from run to run. `embedding_grad` wraps
ATen's kernel (the one eager autograd runs) as a custom op, so that Inductor calls it as it
is. Pure PyTorch, no C++ build: `moe_lab.workbench.cpu.register` registers it wherever it runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_lab.checks import first_derivative_only

Tensor = torch.Tensor


@torch.library.custom_op("moe_lab::embedding_grad", mutates_args=())
def embedding_grad(grad: Tensor, idx: Tensor, num_weights: int) -> Tensor:
    """The weight gradient of ``F.embedding(idx, weight)`` for an output gradient ``grad``
    (``[*idx.shape, dim]``): ``[num_weights, dim]``, each token's row of ``grad`` added to
    row ``idx`` — ATen's own kernel, as eager autograd runs it."""
    return torch.ops.aten.embedding_dense_backward(grad, idx, num_weights, -1, False)


@embedding_grad.register_fake
def _(grad: Tensor, idx: Tensor, num_weights: int) -> Tensor:
    return grad.new_empty(num_weights, grad.shape[-1])


class _Embedding(torch.autograd.Function):
    """``F.embedding(idx, weight)`` whose backward is `embedding_grad`."""

    @staticmethod
    def forward(weight: Tensor, idx: Tensor) -> Tensor:
        return F.embedding(idx, weight)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        weight, idx = inputs
        ctx.save_for_backward(idx)
        ctx.num_weights = weight.shape[0]

    @staticmethod
    @first_derivative_only("the CPU plug-in's embedding")
    def backward(ctx, grad: Tensor):
        (idx,) = ctx.saved_tensors
        return embedding_grad(grad.contiguous(), idx, ctx.num_weights), None


def embed(module: nn.Embedding, idx: Tensor) -> Tensor:
    """``module(idx)``; for a plain embedding (no padding index, max norm or sparse
    gradient) with its weight gradient from `embedding_grad`."""
    if (type(module) is nn.Embedding and module.padding_idx is None and module.max_norm is None
            and not module.sparse):
        return _Embedding.apply(module.weight, idx)
    return module(idx)
