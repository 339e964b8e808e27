"""The experts: ``n_experts`` independent SwiGLU feed-forward networks, stored stacked.

Each expert computes ``down(silu(x·W_gate) ⊙ (x·W_up))``. Storing all experts as two
stacked tensors (``w_gate_up: [E, d_model, 2·d_expert]``, ``w_down: [E, d_expert, d_model]``)
rather than ``E`` separate ``nn.Linear`` modules is what lets a grouped GEMM treat them as
one batched problem. The weights are cast to the tokens' dtype at each matmul, so bf16
tokens run bf16 GEMMs against fp32 master weights (as ``torch.autocast`` does for
``nn.Linear``). Built with ``quant="mxfp8"``, every expert matmul quantizes its operands to
MXFP8 along the reduction dim first (emulated, `moe_lab.quant`).

Ways to run the dropless layout — sort the (token, expert) assignments into expert order, run
all experts over rows grouped by expert (``grouped_forward(x, offsets)``), bring the rows back —
are *expert backends*, registered in `EXPERT_BACKENDS`: one name per choice, holding its three
steps (`ExpertBackend`):

- ``loop`` — the reference: every expert on every row, each row keeping its own expert's
  result: ``n_experts`` times the work, plainly right and free of host syncs;
- ``torch`` — ``torch._grouped_mm`` over the offsets, as the custom op
  ``moe_lab::grouped_mm`` so fake tensors and ``torch.compile`` can trace it (on CUDA
  bfloat16 only: `check_no_hidden_sync`);
- ``triton`` — moe_lab's Triton grouped GEMM with SwiGLU fused into the first GEMM's
  epilogue (`moe_lab.kernels.grouped_gemm`);
- ``triton_tma`` — the persistent TMA grouped GEMM for both GEMMs, SwiGLU between them
  unfused (`moe_lab.kernels.grouped_gemm_tma`); a plug-in may add more (``openmp``).

The first two sort and unsort with PyTorch ops (`torch_permute`: a stable argsort, a gather, a
weighted scatter-add), the Triton ones with one Triton kernel per move
(`moe_lab.kernels.permute`). Each expert class names the backends it runs on (``BACKENDS``: a
variant with biases only those that call its own methods). What the experts save for backward
is kept by autograd, or by an *activation store* (`SwiGLUExperts.use_activation_store`, the paged stash of
`moe_lab.moe.stash`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from moe_lab.checks import first_derivative_only, one_of, positive_number
from moe_lab.config import ModelImpls
from moe_lab.moe.router import tokens_per_expert_from_ids
from moe_lab.quant.mx import fake_quantize
from moe_lab.registry import TRITON_MISSING, Registry

Tensor = torch.Tensor


# torch._grouped_mm as a custom op: its own meta function accepts only bf16 (the CUDA
# kernel's restriction) although the CPU kernel runs fp32; our fake function states the
# output shape for any dtype, and the backward passes contiguous gradients (the CPU
# kernel refuses the stride-0 gradient of ``.sum()``).
@torch.library.custom_op("moe_lab::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``x: [M, K]``, ``w: [E, K, N]``, ``offs: [E] int32`` cumulative row ends (last = M)."""
    return torch._grouped_mm(x.contiguous(), w, offs=offs)


@grouped_mm.register_fake
def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("moe_lab::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(x: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    """``dW[e] = x[rows of e]ᵀ · dy[rows of e]``: ``[E, K, N]`` (zeros for an empty expert)."""
    return torch._grouped_mm(x.contiguous().t(), dy.contiguous(), offs=offs)


@grouped_mm_wgrad.register_fake
def _(x: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(offs.shape[0], x.shape[1], dy.shape[1])


def register_grouped_mm_autograd(forward_op: torch.library.CustomOpDef,
                                 wgrad_op: Callable[[Tensor, Tensor, Tensor], Tensor]) -> None:
    """Give the grouped GEMM custom op ``forward_op(x, w, offs)`` its backward: two more
    grouped GEMMs over the same offsets, ``dx = forward_op(dy, wᵀ)`` and
    ``dw = wgrad_op(x, dy)``."""

    def setup(ctx: FunctionCtx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
        x, w, offs = inputs
        ctx.save_for_backward(x, w, offs)

    @first_derivative_only(f"the grouped GEMM {forward_op._qualname}")
    def backward(ctx: FunctionCtx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        # The transposed weight is a strided view: the kernels read it in place (a
        # .contiguous() here would copy every expert's weights each backward).
        dx = forward_op(dy, w.transpose(-1, -2), offs) if ctx.needs_input_grad[0] else None
        dw = wgrad_op(x, dy, offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None

    forward_op.register_autograd(backward, setup_context=setup)


register_grouped_mm_autograd(grouped_mm, grouped_mm_wgrad)


def swiglu(h: Tensor) -> Tensor:
    """``[..., 2f] -> [..., f]``: ``silu(gate) * up`` with gate and up the two halves (every
    caller's ``h`` comes from a ``2f``-wide GEMM)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _on_cuda(device: torch.device) -> bool:  # a named gate: the tests stand in for it
    return device.type == "cuda"


def check_no_hidden_sync(backend: str, device: torch.device, dtype: torch.dtype, name: str,
                         fix: str = ".bfloat16() or expert_backend='triton'") -> None:
    """Raise a ValueError naming ``name`` (and the ``fix``) where the expert backend ``backend``
    would, for rows of ``dtype`` on ``device``, sync the host inside a C++ operator, out of sight
    of `count_syncs` and of the fake-tensor certificate: ``torch`` on CUDA in any dtype but
    bfloat16, where ``torch._grouped_mm`` takes a fallback that copies the offsets to the host,
    https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/native/GroupedMMUtils.h"""
    if backend == "torch" and _on_cuda(device) and dtype != torch.bfloat16:
        raise ValueError(f"{name}: torch._grouped_mm (expert backend 'torch') in {dtype} on CUDA "
                         "syncs the host inside the op, unseen by count_syncs and the certificate "
                         f"(only bfloat16 takes its sync-free kernel); use {fix}")


def sort_by_expert(topk_ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """The dropless permutation, on the device.

    Returns ``order: [T·k]`` (the flattened assignments sorted by expert, stable, so ties
    keep token order) and ``offsets: [n_experts + 1] int32`` (expert ``e``'s rows are
    ``offsets[e]:offsets[e+1]`` of the sorted buffer).
    """
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    counts = tokens_per_expert_from_ids(topk_ids, n_experts)
    offsets = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    return order, offsets


def torch_permute(x_TD: Tensor, topk_ids_TK: Tensor, n_experts: int) -> tuple[Tensor, Tensor, object]:
    """The reference permute: ``(x_sorted [T·k, d], offsets [E + 1], layout)``, row ``i`` of
    ``x_sorted`` the token of the ``i``-th assignment in expert order (`sort_by_expert`)."""
    order, offsets = sort_by_expert(topk_ids_TK, n_experts)
    token_of = order // topk_ids_TK.shape[1]  # the token behind each sorted row
    return x_TD.index_select(0, token_of), offsets, (order, token_of)


def torch_unpermute(y_sorted: Tensor, layout: tuple[Tensor, Tensor], topk_weights_TK: Tensor) -> Tensor:
    """The reference unpermute: ``out[t] = Σ_j topk_weights[t, j] · y_sorted[row of (t, j)]``."""
    order, token_of = layout
    weight = topk_weights_TK.reshape(-1).index_select(0, order).unsqueeze(1).to(y_sorted.dtype)
    out = y_sorted.new_zeros(topk_weights_TK.shape[0], y_sorted.shape[1])
    return out.index_add_(0, token_of, y_sorted * weight)


@dataclass(frozen=True)
class ExpertBackend:
    """One way to run the dropless layout's three steps, without a host sync.

    ``permute(x, topk_ids, n_experts) -> (x_sorted, offsets, layout)``: ``x: [T, d]``,
    ``topk_ids: [T, k]``; ``x_sorted: [T·k, d]`` in expert order, ``offsets: [n_experts + 1]``
    int32 on the device, ``layout`` whatever ``unpermute`` needs.
    ``mlp(experts, x_sorted, offsets) -> y_sorted``: ``[M, d_model]``; rows past
    ``offsets[-1]`` belong to no expert and their output is undefined.
    ``unpermute(y_sorted, layout, topk_weights) -> [T, d]``:
    ``out[t] = Σ_j topk_weights[t, j] · y_sorted[row of (t, j)]``."""

    mlp: Callable[[SwiGLUExperts, Tensor, Tensor], Tensor]
    permute: Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor, object]] = torch_permute
    unpermute: Callable[[Tensor, object, Tensor], Tensor] = torch_unpermute


# Each is tested against "loop" (tests/lesson/moe/test_dispatch.py).
EXPERT_BACKENDS: Registry[ExpertBackend] = Registry(
    "expert backend", "ways to run every expert over expert-sorted rows (an ExpertBackend)",
    plugin=True)


#: Where the experts' saved activations live until backward (see `SwiGLUExperts`):
#: ``store(compute, x, offsets)`` runs ``compute()`` (the expert MLP on ``x`` grouped by
#: ``offsets``) with its saved activations kept by the store.
ActivationStore = Callable[[Callable[[], Tensor], Tensor, Tensor], Tensor]


class SwiGLUExperts(nn.Module):
    """``n_experts`` SwiGLU FFNs ``d_model -> d_expert -> d_model`` in two stacked weights,
    run by the expert backend named ``backend`` (`EXPERT_BACKENDS`; ``BACKENDS`` lists the
    ones a class runs on, ``None`` every one), on MXFP8 operands where ``quant`` is ``"mxfp8"``
    (`quantized`). Every way of running them but the fused Triton kernels is `two_gemms` through
    some GEMM, with `gated` between the GEMMs (a variant changes the unit and adds biases:
    `ClampedSwiGLUExperts`)."""

    BACKENDS: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, n_experts: int, d_model: int, d_expert: int, backend: str = ModelImpls.expert_backend,
                 quant: str | None = None) -> None:
        super().__init__()
        self.n_experts, self.d_model, self.d_expert = n_experts, d_model, d_expert
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_expert))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.impl = EXPERT_BACKENDS.lookup(backend, "expert_backend")
        if self.BACKENDS is not None and backend not in self.BACKENDS:
            raise ValueError(f"expert_backend for {type(self).__name__} must be one of "
                             f"{self.BACKENDS} (the others do not run its own methods), got {backend!r}")
        self.backend, self.quant = backend, one_of(quant, "quant", (None, "mxfp8"))
        self.activation_store: ActivationStore | None = None
        nn.init.normal_(self.w_gate_up, std=1 / math.sqrt(d_model))
        nn.init.normal_(self.w_down, std=1 / math.sqrt(d_expert))

    def use_activation_store(self, store: ActivationStore | None) -> None:
        """Keep the saved activations of `grouped_forward` in ``store`` (None: autograd's)."""
        self.activation_store = store

    def quantized(self, x: Tensor, w: Tensor, w_dim: int) -> tuple[Tensor, Tensor]:
        """``(x, w)`` as the expert GEMMs take them: with ``quant = "mxfp8"`` both quantized
        along the reduction dim (``x``'s last, ``w``'s ``w_dim``), else unchanged."""
        if self.quant is None:
            return x, w
        # Activations' gradients are quantized (they feed the next GEMM); the weights'
        # gradient goes to the optimizer in full precision, as the recipe does.
        return (fake_quantize(x, dim=-1, quantize_grad=True),
                fake_quantize(w, dim=w_dim, quantize_grad=False))

    def gated(self, h: Tensor) -> Tensor:
        """The unit between the two GEMMs, ``[..., 2f] -> [..., f]``: `swiglu`."""
        return swiglu(h)

    def grouped_forward(self, x: Tensor, offsets: Tensor) -> Tensor:
        """All experts over rows grouped by expert (see `ExpertBackend`): ``x: [M, d_model]``,
        ``offsets: [n_experts + 1] int32`` → ``[M, d_model]``. No host sync in any backend."""
        if self.activation_store is None:
            return self.impl.mlp(self, x, offsets)
        return self.activation_store(lambda: self.impl.mlp(self, x, offsets), x, offsets)

    def two_gemms(self, x: Tensor, gemm: Callable[..., Tensor], *grouping: Tensor,
                  weights: Sequence[Tensor] = (), w_dim: int = 1, biases: Sequence[Tensor] = ()) -> Tensor:
        """``gemm(gated(gemm(x, W_gate_up, *grouping) + b_gate_up), W_down, *grouping) + b_down``:
        the experts' MLP through any GEMM that runs each expert on its own rows (``grouping`` says
        which), on quantized operands where ``quant`` says. ``weights``: ``(W_gate_up, W_down)``,
        reduced along ``w_dim`` (default: the stacked weights); ``biases``: the two biases,
        shaped to add to the GEMMs' outputs (none: plain SwiGLU has none)."""
        w_gate_up, w_down = weights or (self.w_gate_up, self.w_down)
        xq, w1 = self.quantized(x, w_gate_up, w_dim)
        h = gemm(xq, w1.to(x.dtype), *grouping)
        hq, w2 = self.quantized(self.gated(h + biases[0].to(x.dtype) if biases else h), w_down, w_dim)
        y = gemm(hq, w2.to(x.dtype), *grouping)
        return y + biases[1].to(x.dtype) if biases else y

    def grouped_two_gemms(self, x: Tensor, offsets: Tensor,
                          mm: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        """`two_gemms` with ``mm(x, w, ends)`` a grouped GEMM over the groups' row ends
        ``offsets[1:]``."""
        return self.two_gemms(x, mm, offsets[1:])

    def batched_forward(self, x: Tensor) -> Tensor:
        """``x: [n_experts, capacity, d_model]`` → same shape: expert ``e`` on ``x[e]``
        (the capacity dispatcher's padded buffers; one batched matmul per weight)."""
        return self.two_gemms(x, torch.bmm)

    def per_expert(self) -> list[tuple[Tensor, ...]]:
        """Each expert's slice of every parameter (``w_gate_up, w_down``, then any biases), views
        of the stacked parameters, for a loop over the experts (`naive_dispatch`, the ``loop``
        backend): take them once per forward and pass them to `forward_expert`. Their backward
        stacks the experts' gradients into one buffer, where ``w[e]`` inside the loop would, in
        backward, zero-fill a gradient of the whole stack for each expert and add it: E times the
        weights' bytes, quadratic in E."""
        return list(zip(*(p.unbind(0) for p in self.parameters()), strict=True))

    def forward_expert(self, expert: int, x: Tensor,
                       weights: Sequence[tuple[Tensor, ...]] | None = None) -> Tensor:
        """Expert ``expert`` on its tokens ``x: [n, d_model]`` → ``[n, d_model]``, with its
        weights from ``weights`` (`per_expert`) where given."""
        w1, w2, *biases = weights[expert] if weights is not None else [p[expert] for p in self.parameters()]
        return self.two_gemms(x, torch.matmul, weights=(w1, w2), w_dim=0, biases=biases)


def _loop_backend(experts: SwiGLUExperts, x: Tensor, offsets: Tensor) -> Tensor:
    # Every expert on every row; each row keeps its own expert's result.
    rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
    row_expert = torch.searchsorted(offsets[1:], rows, right=True)  # [M]
    out = x.new_zeros(x.shape[0], experts.d_model)
    weights = experts.per_expert()
    for e in range(experts.n_experts):
        mine = (row_expert == e).unsqueeze(-1)
        out = torch.where(mine, experts.forward_expert(e, x, weights), out)
    return out


def _torch_backend(experts: SwiGLUExperts, x: Tensor, offsets: Tensor) -> Tensor:
    check_no_hidden_sync("torch", x.device, x.dtype, "x")
    return experts.grouped_two_gemms(x, offsets, grouped_mm)


def _triton_backend(experts: SwiGLUExperts, x_MD: Tensor, offsets: Tensor) -> Tensor:
    # Imported on first use: importing the layer does not import Triton. The custom ops (their
    # backward registered on them), not the checking wrappers: the layer checked its input at its door.
    from moe_lab.kernels.grouped_gemm import grouped_gemm_op, grouped_gemm_swiglu_op

    offsets = offsets.contiguous()
    xq, w1_EDF2 = experts.quantized(x_MD, experts.w_gate_up, 1)
    h_MF = grouped_gemm_swiglu_op(xq, w1_EDF2.to(xq.dtype), offsets)
    hq, w2_EFD = experts.quantized(h_MF, experts.w_down, 1)
    return grouped_gemm_op(hq, w2_EFD.to(hq.dtype), offsets)


def _triton_permute(x_TD: Tensor, topk_ids_TK: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    from moe_lab.kernels.permute import build_row_id_map, permute_op

    row_id_map_TK, offsets = build_row_id_map(topk_ids_TK, n_experts)
    return permute_op(x_TD, row_id_map_TK, None, topk_ids_TK.numel(), False), offsets, row_id_map_TK


def _triton_unpermute(y_sorted: Tensor, row_id_map_TK: Tensor, topk_weights_TK: Tensor) -> Tensor:
    from moe_lab.kernels.permute import permute_op

    return permute_op(y_sorted, row_id_map_TK, topk_weights_TK.to(y_sorted.dtype), y_sorted.shape[0], True)


def _triton_tma_backend(experts: SwiGLUExperts, x: Tensor, offsets: Tensor) -> Tensor:
    from moe_lab.kernels.grouped_gemm_tma import grouped_gemm_tma

    return experts.two_gemms(x, grouped_gemm_tma, offsets)


EXPERT_BACKENDS.register("loop", ExpertBackend(_loop_backend))
EXPERT_BACKENDS.register("torch", ExpertBackend(_torch_backend))
EXPERT_BACKENDS.register("triton", ExpertBackend(_triton_backend, _triton_permute, _triton_unpermute),
                         missing=TRITON_MISSING)
EXPERT_BACKENDS.register("triton_tma", ExpertBackend(_triton_tma_backend, _triton_permute, _triton_unpermute),
                         missing=TRITON_MISSING)


class SwiGLU(nn.Module):
    """A dense SwiGLU FFN ``d_model -> d_ff -> d_model`` (dense layers, shared experts)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(swiglu(self.gate_up(x)))


def clamped_swiglu(h: Tensor, alpha: float, limit: float) -> Tensor:
    """``[..., 2f] -> [..., f]``: GPT-OSS's gated unit, ``(clamp(up, ±limit) + 1) ·
    g·sigmoid(alpha·g)`` with ``g = min(gate, limit)`` and gate and up the two halves.

    The clamp bounds the activations (the model was trained with it, so it is part of the
    function); ``g·sigmoid(alpha·g)`` is a sharpened SiLU and the ``+ 1`` on ``up`` is a
    residual-like offset, both as GPT-OSS defines them."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwiGLUExperts(SwiGLUExperts):
    """GPT-OSS's experts: `SwiGLUExperts` with biases on both GEMMs (``b_gate_up: [E, 2f]``,
    ``b_down: [E, d_model]``) and `clamped_swiglu` as the gated unit.

    Same weight layout as the reference (gate columns first), so the backends that run the
    experts through `forward_expert` or `grouped_two_gemms` run this variant too (``BACKENDS``);
    those that fuse plain SwiGLU into a kernel or bring their own MLP do not.
    """

    BACKENDS = ("loop", "torch")

    def __init__(self, n_experts: int, d_model: int, d_expert: int, backend: str = ModelImpls.expert_backend,
                 quant: str | None = None, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__(n_experts, d_model, d_expert, backend, quant)
        self.alpha = positive_number(alpha, "ClampedSwiGLUExperts alpha")
        self.limit = positive_number(limit, "ClampedSwiGLUExperts limit")
        self.b_gate_up = nn.Parameter(torch.zeros(n_experts, 2 * d_expert))
        self.b_down = nn.Parameter(torch.zeros(n_experts, d_model))

    def gated(self, h: Tensor) -> Tensor:
        return clamped_swiglu(h, self.alpha, self.limit)

    def grouped_two_gemms(self, x: Tensor, offsets: Tensor,
                          mm: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
        # Rows past offsets[-1] belong to no expert (their output is undefined): clamp the
        # index so they read some expert's bias rather than out of range.
        row_expert = torch.searchsorted(offsets[1:], rows, right=True).clamp_max(self.n_experts - 1)
        biases = (self.b_gate_up.to(x.dtype)[row_expert], self.b_down.to(x.dtype)[row_expert])
        return self.two_gemms(x, mm, offsets[1:], biases=biases)

    def batched_forward(self, x: Tensor) -> Tensor:
        biases = (self.b_gate_up.to(x.dtype).unsqueeze(1), self.b_down.to(x.dtype).unsqueeze(1))
        return self.two_gemms(x, torch.bmm, biases=biases)


# "swiglu" is the reference.
EXPERT_KINDS: Registry[type[SwiGLUExperts]] = Registry(
    "expert kind", "expert classes a layer is built with, each called as "
    "cls(n_experts, d_model, d_expert, backend, quant=, **options)")
EXPERT_KINDS.register("swiglu", SwiGLUExperts)
EXPERT_KINDS.register("clamped_swiglu", ClampedSwiGLUExperts)
