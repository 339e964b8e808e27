"""A CPU grouped GEMM that spreads whole experts over the cores (expert backend ``openmp``).

``torch._grouped_mm`` on a CPU is a loop: one GEMM per expert, each split across every
core. MoE experts are small GEMMs (a few hundred rows each), and splitting a small GEMM
across cores leaves each core a sliver plus a wait at the end of every expert. The kernel
here (``cpu_grouped_gemm.cpp``, beside this file) turns the loop inside out: an OpenMP loop
hands each core whole experts in turn, first come first served (a dynamic schedule: the
experts' row counts differ), and each core runs its experts' GEMMs single-threaded. It is
the CPU counterpart of the GPU grouped GEMM's tile scheduler: the unit of work is an expert's rows,
not a slice of one expert's GEMM (``python -m moe_lab bench moe-layer`` times the layers
built on it against the others).

`expert_mlp` goes one step further, the CPU form of fusing SwiGLU into the first GEMM's
epilogue: each core runs an expert's first GEMM, its SwiGLU and its second GEMM back to back
(and in the backward its five GEMMs and the SwiGLU gradient), so an expert's pre-activation
is used while still in that core's cache, and the ``[M, 2f]`` intermediate never makes a
round trip through memory between separate passes. SwiGLU runs in float32 for 16-bit inputs.
In bfloat16 (the model under BF16 autocast, where the CPU has bf16 GEMMs) each expert goes in
blocks of rows (32 forward, 64 backward) through ATen's bf16 micro-kernel instead of
whole-expert ATen GEMMs: the expert's weights are repacked once into the layout it reads, a
block's pre-activation, activation and gradients stay in the core's cache between the GEMMs
that use them, and the weight gradients accumulate in float32 over the blocks, rounded once.
The gain is the cache, not the GEMM. Where the CPU has AVX512_BF16, the first GEMM's
epilogue rounds its output to bfloat16, keeps the rounded values in registers for the SwiGLU
and rounds the activation, in one pass and one instruction per rounding
(compiled with ``-mavx512bf16`` there: `moe_lab.workbench.cpu.build`), bit for bit the same results.
The ``openmp`` expert backend uses it; `grouped_mm` alone serves where something must happen
between the GEMMs (MXFP8 emulation quantizes the activation there).

The kernels are C++, built on first use with the rest of moe_lab's CPU kernels
(`moe_lab.workbench.cpu.build`: once per machine and torch version; ``make install`` builds them
ahead). They need a C++ compiler with OpenMP — the same one ``torch.compile``
needs on a CPU. Without one, `unavailable_reason` says why, `extension` raises with it,
and the ``torch`` backend remains.

Every launch is a ``torch.library.custom_op`` with a fake implementation (`grouped_mm`
with the same autograd formula as ``moe_lab::grouped_mm``), so the sync detector and
``torch.compile`` trace through them. The offsets are read on the host, which on a CPU is where they
already are: no device is waited for, and they are checked (a bad offset raises).
"""

from __future__ import annotations

import torch

from moe_lab.checks import first_derivative_only
from moe_lab.moe.experts import SwiGLUExperts, register_grouped_mm_autograd
from moe_lab.workbench.cpu.build import bf16_gemms, kernel_op

Tensor = torch.Tensor


def _grouped_mm_shapes(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


def _grouped_mm_wgrad_shapes(x: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(offs.shape[0], x.shape[1], dy.shape[1])


def _expert_mlp_shapes(x: Tensor, w1: Tensor, w2: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape[0], w2.shape[-1]), x.new_empty(x.shape[0], w1.shape[-1])


def _expert_mlp_backward_shapes(x: Tensor, h: Tensor, w1: Tensor, w2: Tensor, offs: Tensor,
                                dy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return x.new_empty(x.shape), w1.new_empty(w1.shape), w2.new_empty(w2.shape)


# grouped_mm(x [M, K], w [E, K, N] (any strides), offs [E] cumulative row ends) -> [M, N], rows
# past offs[-1] zero; grouped_mm_wgrad(x, dy, offs): dW[e] = x[rows of e]ᵀ · dy[rows of e],
# [E, K, N] (zeros for an empty expert).
grouped_mm = kernel_op("openmp_grouped_mm", "grouped_mm", _grouped_mm_shapes)
grouped_mm_wgrad = kernel_op("openmp_grouped_mm_wgrad", "grouped_mm_wgrad", _grouped_mm_wgrad_shapes)
_expert_mlp = kernel_op("openmp_expert_mlp", "expert_mlp", _expert_mlp_shapes)
_expert_mlp_backward = kernel_op("openmp_expert_mlp_backward", "expert_mlp_backward",
                                 _expert_mlp_backward_shapes)


def _mlp_setup(ctx, inputs, output) -> None:
    x, w1, w2, offs = inputs
    ctx.save_for_backward(x, output[1], w1, w2, offs)
    ctx.mark_non_differentiable(output[1])


@first_derivative_only("the CPU plug-in's expert MLP")
def _mlp_backward(ctx, dy: Tensor, _dh: Tensor | None):
    x, h, w1, w2, offs = ctx.saved_tensors
    dx, dw1, dw2 = _expert_mlp_backward(x, h, w1, w2, offs, dy)
    needs = ctx.needs_input_grad
    return (dx if needs[0] else None, dw1 if needs[1] else None, dw2 if needs[2] else None, None)


_expert_mlp.register_autograd(_mlp_backward, setup_context=_mlp_setup)


def expert_mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor, offs: Tensor) -> Tensor:
    """Every expert's SwiGLU MLP over its rows in one pass over the experts:
    ``y[rows of e] = swiglu(x[rows of e] · w_gate_up[e]) · w_down[e]``.

    ``x: [M, d]``, ``w_gate_up: [E, d, 2f]``, ``w_down: [E, f, d_out]``, ``offs: [E]``
    cumulative row ends. The same function as two `grouped_mm` calls with `swiglu` between
    them, but each core runs an expert's first GEMM, SwiGLU and second GEMM back to back, so
    the expert's ``[rows, 2f]`` pre-activation is read while still in that core's cache; the
    backward does the same per expert (five GEMMs and the SwiGLU gradient). Saves ``x`` and
    the pre-activation for the backward, not the activation (recomputed per expert).

    Weights of another dtype than ``x`` are cast to it first — except float32 (master)
    weights with bfloat16 ``x`` where this CPU runs bf16 GEMMs (`takes_fp32_weights`): the
    kernel rounds them to bfloat16 as it repacks them for its GEMMs, and their gradients come
    back in float32, accumulated in float32 and never rounded (no cast pass either way)."""
    if (w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype) and not takes_fp32_weights(
            x, w_gate_up, w_down):
        w_gate_up, w_down = w_gate_up.to(x.dtype), w_down.to(x.dtype)
    return _expert_mlp(x, w_gate_up, w_down, offs)[0]


def takes_fp32_weights(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> bool:
    """Whether `expert_mlp` takes these float32 weights as they are with bfloat16 ``x``: on a
    CPU with bf16 GEMMs, for even ``d``, ``f`` and ``d_out``."""
    return (x.dtype == torch.bfloat16 and w_gate_up.dtype == w_down.dtype == torch.float32
            and x.shape[-1] % 2 == 0 and w_gate_up.shape[-1] % 4 == 0 and w_down.shape[-1] % 2 == 0
            and bf16_gemms())


register_grouped_mm_autograd(grouped_mm, grouped_mm_wgrad)


def openmp_mlp(experts: SwiGLUExperts, x: Tensor, offsets: Tensor) -> Tensor:
    """``EXPERT_BACKENDS["openmp"].mlp``: `expert_mlp` (both GEMMs and the SwiGLU per expert, on
    one core), or two `grouped_mm` calls where the experts quantize between the GEMMs."""
    if x.device.type != "cpu":
        raise ValueError(f"expert backend 'openmp' runs on the CPU, got tokens on {x.device}; "
                         "use expert_backend='torch' or 'triton'")
    if experts.quant is None:
        # the weights as they are: the kernel casts them (or, fp32 with bf16 tokens, rounds
        # them as it repacks them and returns fp32 gradients)
        return expert_mlp(x, experts.w_gate_up, experts.w_down, offsets[1:])
    return experts.grouped_two_gemms(x, offsets, grouped_mm)
