"""The experts: ``n_experts`` independent SwiGLU feed-forward networks, stored stacked.

Each expert computes ``down(silu(x·W_gate) ⊙ (x·W_up))``. Storing all experts as two
stacked tensors (``w_gate_up: [E, d_model, 2·d_expert]``, ``w_down: [E, d_expert, d_model]``)
rather than ``E`` separate ``nn.Linear`` modules is what lets a grouped GEMM treat them as
one batched problem; the loop below uses them one expert at a time, which is the
reference every faster backend is checked against.

The weights are cast to the tokens' dtype at each matmul, so bf16 tokens run bf16 GEMMs
against fp32 master weights (what ``torch.autocast`` does for ``nn.Linear``; the gradient
flows back to the fp32 weights through the cast). `moe_lab.moe.layer.MoELayer` sends the
tokens in the autocast dtype when autocast is on.

``quant = "mxfp8"`` makes every expert matmul quantize its inputs and weights to MXFP8
along the reduction dim first (emulated: quantize → dequantize → matmul), see
``moe_lab.quant``.

Four ways to run all experts over tokens already grouped by expert
(``grouped_forward(x, offsets)``, rows ``offsets[e]:offsets[e+1]`` belong to expert ``e``),
selected by ``backend``:

- ``loop`` — the reference: every expert on every row, each row keeping its own expert's
  result. ``n_experts`` times the work, but plainly right and free of host syncs (a loop that
  slices each expert's rows would need their count on the host).
- ``torch`` — ``torch._grouped_mm``: one grouped GEMM over the offsets, wrapped as the
  custom op ``moe_lab::grouped_mm`` so fake tensors and ``torch.compile`` can trace it.
- ``openmp`` — on a CPU only: moe_lab's C++ kernels that hand each core whole experts, each
  expert's two GEMMs and SwiGLU run back to back on its core (``moe_lab.kernels.cpu_grouped``;
  built on first use, needs a C++ compiler).
- ``triton`` — moe_lab's own Triton grouped GEMM with SwiGLU fused into the first GEMM's
  epilogue (``moe_lab.kernels.grouped_gemm``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

Tensor = torch.Tensor
EXPERT_BACKENDS = ("loop", "torch", "openmp", "triton")


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


def register_grouped_mm_autograd(forward_op, wgrad_op) -> None:
    """Give the grouped GEMM custom op ``forward_op(x, w, offs)`` its backward: two more
    grouped GEMMs over the same offsets, ``dx = forward_op(dy, wᵀ)`` and
    ``dw = wgrad_op(x, dy)``."""

    def setup(ctx, inputs, output) -> None:
        x, w, offs = inputs
        ctx.save_for_backward(x, w, offs)

    def backward(ctx, dy: Tensor):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        # The transposed weight is a strided view: the kernels read it in place (a
        # .contiguous() here would copy every expert's weights each backward).
        dx = forward_op(dy, w.transpose(-1, -2), offs) if ctx.needs_input_grad[0] else None
        dw = wgrad_op(x, dy, offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None

    forward_op.register_autograd(backward, setup_context=setup)


register_grouped_mm_autograd(grouped_mm, grouped_mm_wgrad)


def _fake_quantize(t: Tensor, dim: int, quantize_grad: bool = True) -> Tensor:
    from moe_lab.quant.mx import fake_quantize

    return fake_quantize(t, dim=dim, quantize_grad=quantize_grad)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` with a backward that writes both halves' gradients into one
    ``[..., 2f]`` buffer.

    Autograd's own graph for ``h.chunk(2)`` → ``silu`` → ``*`` joins the two halves'
    gradients with a ``cat`` at the end of the backward, a full extra pass over ``[M, 2f]``
    that on a CPU cost about as much as the rest of the SwiGLU forward and backward together
    (2.4 ms of 5.1 ms at ``[2048, 1024]`` fp32). Same formulas as autograd's
    (``silu_backward`` for the gate), so the gradients agree bit for bit. Used in eager mode
    only: under ``torch.compile`` Inductor fuses the plain expression itself.
    """

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        gate, up = h.chunk(2, dim=-1)
        ctx.save_for_backward(h)
        return F.silu(gate).mul_(up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor) -> Tensor:
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        f = gate.shape[-1]
        dh = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        torch.mul(dy, F.silu(gate), out=dh[..., f:])
        torch.ops.aten.silu_backward.grad_input(dy * up, gate, grad_input=dh[..., :f])
        return dh


def swiglu(h: Tensor) -> Tensor:
    """``[..., 2f] -> [..., f]``: ``silu(gate) * up`` with gate and up the two halves."""
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim of h holds gate and up halves and must be even, "
                         f"got shape {tuple(h.shape)}")
    if h.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _SwiGLU.apply(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLUExperts(nn.Module):
    """``n_experts`` SwiGLU FFNs ``d_model -> d_expert -> d_model`` in two stacked weights."""

    def __init__(self, n_experts: int, d_model: int, d_expert: int) -> None:
        super().__init__()
        self.n_experts, self.d_model, self.d_expert = n_experts, d_model, d_expert
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_expert))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.quant: str | None = None
        self.backend = "loop"
        # Rows of each expert's group rounded up to a multiple of this in the dropless
        # layout (1: packed). See `moe_lab.moe.dispatch.dropless_dispatch`.
        self.row_align = 1
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate_up, std=1 / math.sqrt(self.d_model))
        nn.init.normal_(self.w_down, std=1 / math.sqrt(self.d_expert))

    def _mm(self, x: Tensor, w: Tensor) -> Tensor:
        # x: [n, K], w: [K, N]; the reduction dim is x's last and w's first.
        x, w = self._quantized(x, w, 0)
        return x @ w.to(x.dtype)

    def _quantized(self, x: Tensor, w: Tensor, w_dim: int) -> tuple[Tensor, Tensor]:
        if self.quant == "mxfp8":
            # Activations' gradients are quantized (they feed the next GEMM); the weights'
            # gradient goes to the optimizer in full precision, as the recipe does.
            return _fake_quantize(x, -1), _fake_quantize(w, w_dim, quantize_grad=False)
        if self.quant is not None:
            raise ValueError(f"SwiGLUExperts.quant must be None or 'mxfp8', got {self.quant!r}")
        return x, w

    def grouped_forward(self, x: Tensor, offsets: Tensor) -> Tensor:
        """All experts over rows grouped by expert.

        ``x: [M, d_model]``; ``offsets: [n_experts + 1] int32`` on x's device, with
        ``offsets[-1] <= M``. Returns ``[M, d_model]``; rows past ``offsets[-1]`` belong to
        no expert and their output is undefined (the aligned dropless layout never reads
        them).
        No host sync in any backend.
        """
        if self.backend not in EXPERT_BACKENDS:
            raise ValueError(f"expert backend must be one of {EXPERT_BACKENDS}, got {self.backend!r}")
        if self.backend == "loop":
            return self._loop_forward(x, offsets)
        if self.backend in ("torch", "openmp"):
            if self.backend == "openmp":
                from moe_lab.kernels.cpu_grouped import expert_mlp
                from moe_lab.kernels.cpu_grouped import grouped_mm as mm

                if x.device.type != "cpu":
                    raise ValueError(f"expert backend 'openmp' runs on the CPU, got tokens on "
                                     f"{x.device}; use expert_backend='torch' or 'triton'")
                if self.quant is None:  # both GEMMs and the SwiGLU per expert, on one core
                    # the weights as they are: the kernel casts them (or, fp32 with bf16
                    # tokens, rounds them as it repacks them and returns fp32 gradients)
                    return expert_mlp(x, self.w_gate_up, self.w_down, offsets[1:])
            else:
                mm = grouped_mm
                if x.is_cuda and x.dtype != torch.bfloat16:
                    raise ValueError(
                        f"expert backend 'torch' on CUDA needs bfloat16 (torch._grouped_mm's CUDA "
                        f"kernel), got {x.dtype}; use .bfloat16() or expert_backend='triton'")
            xq, w1 = self._quantized(x, self.w_gate_up, 1)
            h = swiglu(mm(xq, w1.to(x.dtype), offsets[1:]))
            hq, w2 = self._quantized(h, self.w_down, 1)
            return mm(hq, w2.to(x.dtype), offsets[1:])
        from moe_lab.kernels.grouped_gemm import grouped_gemm, grouped_gemm_swiglu

        xq, w1 = self._quantized(x, self.w_gate_up, 1)
        h = grouped_gemm_swiglu(xq, w1.to(xq.dtype), offsets)
        hq, w2 = self._quantized(h, self.w_down, 1)
        return grouped_gemm(hq, w2.to(hq.dtype), offsets)

    def _loop_forward(self, x: Tensor, offsets: Tensor) -> Tensor:
        rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
        row_expert = torch.searchsorted(offsets[1:], rows, right=True)  # [M]
        out = x.new_zeros(x.shape[0], self.d_model)
        for e in range(self.n_experts):
            mine = (row_expert == e).unsqueeze(-1)
            out = torch.where(mine, self.forward_expert(e, x), out)
        return out

    def batched_forward(self, x: Tensor) -> Tensor:
        """``x: [n_experts, capacity, d_model]`` → same shape: expert ``e`` on ``x[e]``
        (the capacity dispatcher's padded buffers; one batched matmul per weight)."""
        xq, w1 = self._quantized(x, self.w_gate_up, 1)
        h = swiglu(torch.bmm(xq, w1.to(xq.dtype)))
        hq, w2 = self._quantized(h, self.w_down, 1)
        return torch.bmm(hq, w2.to(hq.dtype))

    def forward_expert(self, expert: int, x: Tensor) -> Tensor:
        """Expert ``expert`` on its tokens ``x: [n, d_model]`` → ``[n, d_model]``."""
        h = swiglu(self._mm(x, self.w_gate_up[expert]))
        return self._mm(h, self.w_down[expert])


class SwiGLU(nn.Module):
    """A dense SwiGLU FFN ``d_model -> d_ff -> d_model`` (dense layers, shared experts)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(swiglu(self.gate_up(x)))
