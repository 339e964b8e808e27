"""The dropless layout's token permutation on a CPU: one pass each, in C++ (``cpu_permute.cpp``).

`moe_lab.moe.dispatch.dropless_dispatch` in plain PyTorch gets each token's ``k`` copies into
expert order, and back, with a chain of ATen ops: a stable argsort of the expert ids, a
gather, a copy into the padded layout, a gather out of it, a multiply by the router
weights, a scatter-add into the tokens. Each is a pass over the whole ``[T·k, d]`` buffer
(the scatter-adds on one core), and the backward runs them all again. The
``openmp`` expert backend uses these kernels instead — the same row-id map design as the
Triton kernels of `moe_lab.kernels.permute` (and TransformerEngine's ``moe_permute``):

- `make_row_id_map` — a counting sort: ``row_id_map[t, j]`` is the row of the
  expert-sorted buffer that holds token ``t``'s copy for its ``j``-th expert, stable by
  (expert, token, slot), each expert's segment padded to a multiple of ``align``;
- `permute` — each token row copied to its ``k`` rows (padding rows zero);
- `unpermute` — ``out[t] = Σ_j w[t, j] · y[row_id_map[t, j]]``, summed in float32;
- `topk_lowest_index` — the router's choice before all of this: each token's ``k`` highest
  float32 scores, highest first, ties to the lower expert index (the order of
  `moe_lab.moe.router.topk_lowest_index`; the router ``cpu_topk`` takes it): one pass per
  row, where ``torch.topk`` of the reference's unique 64-bit keys runs a general sort
  routine per row for what is a running top-4 of 16 values.

Each is the other's transpose, so each one's backward is the other (and the router weights'
gradient a row dot product). Every pass gathers per token — no scatter-add, no two cores
writing one row — so the result does not depend on the number of cores. The semantics are
those of `moe_lab.kernels.permute`'s plain-PyTorch references, which the tests check these
against. Every kernel is a ``torch.library.custom_op`` with a fake implementation, so
``torch.compile`` and the sync detector trace through them.
"""

from __future__ import annotations

import torch

from moe_lab.checks import first_derivative_only
from moe_lab.moe.router import topk_lowest_index as reference_topk
from moe_lab.workbench.cpu.build import kernel_op

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------
# The kernels as custom ops
# --------------------------------------------------------------------------------------


def _row_id_map_shapes(topk_ids: Tensor, n_experts: int, align: int) -> tuple[Tensor, Tensor]:
    return (topk_ids.new_empty(topk_ids.shape, dtype=torch.int32),
            topk_ids.new_empty((n_experts + 1,), dtype=torch.int32))


def _permute_shapes(x: Tensor, row_id_map: Tensor, weights: Tensor | None, n_rows: int) -> Tensor:
    return x.new_empty((n_rows, x.shape[1]))


def _unpermute_shapes(y: Tensor, row_id_map: Tensor, weights: Tensor | None) -> Tensor:
    return y.new_empty((row_id_map.shape[0], y.shape[1]))


def _weight_grad_shapes(y: Tensor, row_id_map: Tensor, dout: Tensor) -> Tensor:
    return y.new_empty(tuple(row_id_map.shape), dtype=torch.float32)


def _topk_shapes(values: Tensor, k: int) -> Tensor:
    return values.new_empty((values.shape[0], k), dtype=torch.int64)


_row_id_map_op = kernel_op("cpu_row_id_map", "row_id_map", _row_id_map_shapes)
_permute_op = kernel_op("cpu_permute", "permute", _permute_shapes)
_unpermute_op = kernel_op("cpu_unpermute", "unpermute", _unpermute_shapes)
_weight_grad_op = kernel_op("cpu_unpermute_weight_grad", "unpermute_weight_grad", _weight_grad_shapes)
# the router's top-k: indices only, no autograd
_topk_op = kernel_op("cpu_topk_lowest_index", "topk_lowest_index", _topk_shapes)


# permute: y[map[t, j]] = w[t, j]·x[t]  ->  dx = unpermute(dy, map, w), dw = <dy[map[t, j]], x[t]>
def _permute_setup(ctx, inputs, output) -> None:
    x, row_id_map, weights, _n_rows = inputs
    ctx.save_for_backward(x if weights is not None else None, row_id_map, weights)


@first_derivative_only("the CPU plug-in's permute")
def _permute_backward(ctx, dy: Tensor):
    x, row_id_map, weights = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _unpermute_op(dy, row_id_map, weights)
    if weights is not None and ctx.needs_input_grad[2]:
        dw = _weight_grad_op(dy, row_id_map, x).to(weights.dtype)
    return dx, None, dw, None


# unpermute: out[t] = Σ_j w[t, j]·y[map[t, j]]  ->  dy = permute(dout, map, w), dw = <dout[t], y[map[t, j]]>
def _unpermute_setup(ctx, inputs, output) -> None:
    y, row_id_map, weights = inputs
    ctx.save_for_backward(y, row_id_map, weights)


@first_derivative_only("the CPU plug-in's unpermute")
def _unpermute_backward(ctx, dout: Tensor):
    y, row_id_map, weights = ctx.saved_tensors
    dy = dw = None
    if ctx.needs_input_grad[0]:
        dy = _permute_op(dout, row_id_map, weights, y.shape[0])
    if weights is not None and ctx.needs_input_grad[2]:
        dw = _weight_grad_op(y, row_id_map, dout).to(weights.dtype)
    return dy, None, dw


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)
_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# --------------------------------------------------------------------------------------
# The public functions (the kernels check their arguments and indices themselves)
# --------------------------------------------------------------------------------------


def make_row_id_map(topk_ids: Tensor, n_experts: int, *, align: int = 1) -> tuple[Tensor, Tensor]:
    """Where each (token, slot) goes in the expert-sorted buffer, and where experts start.

    ``topk_ids: [T, k]`` int64 or int32 expert ids in ``[0, n_experts)`` (an id out of range
    raises). Returns ``row_id_map: [T, k]`` int32, stable by (expert, token, slot), and
    ``offsets: [E + 1]`` int32: expert ``e``'s rows are ``offsets[e]:offsets[e+1]``, its
    tokens first, then zero padding up to a multiple of ``align``: the buffer needs at least
    ``offsets[-1]`` rows.
    """
    return _row_id_map_op(topk_ids, n_experts, align)


def permute(x: Tensor, row_id_map: Tensor, n_rows: int, weights: Tensor | None = None) -> Tensor:
    """Copy token row ``x[t]`` to rows ``row_id_map[t, :]`` of a new ``[n_rows, d]`` buffer
    (scaled by ``weights[t, j]`` in float32 if given); rows no (token, slot) maps to are zero.

    ``x: [T, d]`` float32, bfloat16 or float16 (any strides); ``row_id_map: [T, k]`` int32
    from `make_row_id_map`; ``n_rows >= T·k``. Differentiable in ``x`` and ``weights``.
    """
    return _permute_op(x, row_id_map, weights, n_rows)


def unpermute(y: Tensor, row_id_map: Tensor, weights: Tensor | None = None) -> Tensor:
    """``out[t] = Σ_j weights[t, j] · y[row_id_map[t, j]]`` (or the plain sum), in float32.

    ``y: [n_rows, d]``; ``row_id_map: [T, k]`` int32; ``weights: [T, k]`` floating (e.g. the
    router's float32) or None. Returns ``[T, d]`` in ``y``'s dtype. Differentiable in ``y``
    and ``weights``. It is ``EXPERT_BACKENDS["openmp"].unpermute`` as it is.
    """
    return _unpermute_op(y, row_id_map, weights)


def topk_lowest_index(values: Tensor, k: int) -> Tensor:
    """``[T, k]`` int64: the indices of each row's ``k`` largest ``values``, highest first,
    equal values to the lower index — `moe_lab.moe.router.topk_lowest_index`'s order for
    float32 (``-0.0`` equal to ``+0.0``, a NaN above ``+inf`` unless its sign bit is set).

    ``values: [T, n]`` float32 on the CPU (any strides); ``0 <= k <= n``. Indices carry no
    gradient: ``values`` is read detached.
    """
    return _topk_op(values.detach(), k)


def permute_tokens(x: Tensor, topk_ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """``EXPERT_BACKENDS["openmp"].permute``: ``(x_sorted [T·k, d], offsets [E + 1], row_id_map)``."""
    row_id_map, offsets = make_row_id_map(topk_ids, n_experts)
    return permute(x, row_id_map, topk_ids.numel()), offsets, row_id_map


def router_topk(values: Tensor, k: int) -> Tensor:
    """The lowest-index top-k of the ``cpu_topk`` router: `topk_lowest_index` for a 2-D
    float32 CPU tensor with at least one column, `moe_lab.moe.router.topk_lowest_index`
    (the same indices) for anything else."""
    if values.dim() == 2 and values.dtype == torch.float32 and values.device.type == "cpu" \
            and values.shape[-1] > 0:
        return topk_lowest_index(values, k)
    return reference_topk(values, k)
