"""The experts: ``n_experts`` independent SwiGLU feed-forward networks, stored stacked.

Each expert computes ``down(silu(x·W_gate) ⊙ (x·W_up))``. Storing all experts as two
stacked tensors (``w_gate_up: [E, d_model, 2·d_expert]``, ``w_down: [E, d_expert, d_model]``)
rather than ``E`` separate ``nn.Linear`` modules is what lets a grouped GEMM treat them as
one batched problem; the loop below uses them one expert at a time, which is the
reference every faster backend is checked against.

``quant = "mxfp8"`` makes every expert matmul quantize its inputs and weights to MXFP8
along the reduction dim first (emulated: quantize → dequantize → matmul), see
``moe_lab.quant``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

Tensor = torch.Tensor


def swiglu(h: Tensor) -> Tensor:
    """``[..., 2f] -> [..., f]``: ``silu(gate) * up`` with gate and up the two halves."""
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
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate_up, std=1 / math.sqrt(self.d_model))
        nn.init.normal_(self.w_down, std=1 / math.sqrt(self.d_expert))

    def _mm(self, x: Tensor, w: Tensor) -> Tensor:
        # x: [n, K], w: [K, N]; the reduction dim is x's last and w's first.
        if self.quant == "mxfp8":
            from moe_lab.quant.mx import fake_quantize

            x, w = fake_quantize(x, dim=-1), fake_quantize(w, dim=0)
        elif self.quant is not None:
            raise ValueError(f"SwiGLUExperts.quant must be None or 'mxfp8', got {self.quant!r}")
        return x @ w

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
