"""The stages of one chunk of an expert-parallel step, written out for a schedule to order.

A schedule that hides the all-to-all (a chunked or 1F1B plan run by
`moe_lab.parallel.merged.MergedStep`) cannot call the layer's ``forward`` and let autograd run
the backward: it must start each collective itself and put compute between. So the dropless
`EPMoELayer` step is cut here into stages over one `Chunk` of a rank's tokens:

forward   route (router + permute) · [counts] · [dispatch] · experts · [combine] · unpermute,
          and the shared expert beside them
backward  unpermute⁻¹ · [combine⁻¹] · experts dgrad · [dispatch⁻¹] · route⁻¹ (permute⁻¹ and
          router), and beside them the shared expert⁻¹ and the experts' wgrad

(in brackets: the collectives, which the schedule starts). The experts' backward is written out
as grouped GEMMs in two halves: the *dgrad* (gradient of the input, which the next all-to-all
needs) and the *wgrad* (gradient of the weights, which nothing waits for, so a schedule may
delay it, as Megatron-Core's ``--delay-wgrad-compute`` does). The local pieces (route,
unpermute, shared expert, SwiGLU) are small autograd graphs on detached leaves, so each piece's
backward runs when the schedule says.

`moe_lab.parallel.merged.MergedStep` runs the stages: it starts the collectives (the count
exchange too, which gives each chunk its split sizes) and stamps each stage on a timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lab.moe.experts import check_no_hidden_sync, grouped_mm, grouped_mm_wgrad, swiglu, torch_permute
from moe_lab.parallel.ep import EPMoELayer

Tensor = torch.Tensor


def chunk_rows(tokens: int, n_chunks: int) -> list[slice]:
    """``n_chunks`` contiguous, near-equal row ranges covering ``tokens`` rows."""
    bounds = [round(i * tokens / n_chunks) for i in range(n_chunks + 1)]  # host arithmetic
    return [slice(bounds[i], bounds[i + 1]) for i in range(n_chunks)]


@dataclass
class Chunk:
    """What one chunk's stages leave for the next: its rows of the rank's tokens, the
    permuted rows it sends, the exchange's split sizes, the experts' saved activations."""

    rows: slice
    x: Tensor  # [rows, d_model], a leaf: its .grad is the chunk's input gradient
    token_of: Tensor  # [rows·k] token of each permuted row
    send: Tensor  # [rows·k, d_model] permuted rows, grouped by destination rank
    w_sorted: Tensor  # [rows·k] router weight of each permuted row
    counts: Tensor  # [W, E_local] rows for each rank's local experts
    aux: Tensor  # [] the chunk's weighted auxiliary + z losses
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    order: Tensor | None = None  # received rows (by source rank) sorted by local expert, and back
    inverse: Tensor | None = None
    offs: Tensor | None = None  # [E_local] int32 cumulative row ends of the grouped GEMMs
    saved: tuple = ()  # (xs, h, a) of the experts' forward; a = swiglu(h) keeps its graph
    wgrad_inputs: tuple = ()  # what the delayed wgrad needs
    shared_out: Tensor | None = None
    shared_leaf: Tensor | None = None
    y_back: Tensor | None = None
    w_leaf: Tensor | None = None
    out: Tensor | None = None


class ChunkStages:
    """The stage arithmetic of a dropless `EPMoELayer` step, chunk by chunk (no collectives).

    The experts run on ``moe_lab::grouped_mm`` whatever the layer's expert backend: on CUDA
    bf16 only (anything else syncs inside: `check_no_hidden_sync`). Parameter gradients
    accumulate into the layer's ``.grad``. A micro-batch's ``aux_scale`` (`route_bwd`): None
    back-propagates the output's gradient only; a number also back-propagates the chunk's
    auxiliary and z losses (weighted by the config's coefficients) with that factor (a training step:
    1 / micro-batches).
    """

    def __init__(self, layer: EPMoELayer) -> None:
        if layer.mode != "dropless":
            raise ValueError(f"the chunked stages schedule the dropless exchange; layer.mode is "
                             f"{layer.mode!r}")
        if layer.experts.quant is not None:
            raise ValueError("the chunked stages write the expert backward for unquantised experts; "
                             f"layer.experts.quant is {layer.experts.quant!r}")
        w = layer.experts.w_gate_up
        check_no_hidden_sync("torch", w.device, w.dtype, "layer (the stages run its experts on "
                             f"moe_lab::grouped_mm, not on its backend {layer.experts.backend!r})",
                             "model.bfloat16()")
        self.layer = layer

    # ------------------------------------------------------------------ forward
    def route(self, x: Tensor, rows: slice) -> Chunk:
        layer = self.layer
        with torch.enable_grad():
            xc = x[rows].detach().requires_grad_()
            routing = layer.router(xc)
            send, _, (order, token_of) = torch_permute(xc, routing.topk_ids, layer.cfg.n_experts)
            w_sorted = routing.topk_weights.reshape(-1).index_select(0, order)
            aux = routing.aux_loss * layer.cfg.aux_loss_coef + routing.z_loss * layer.cfg.z_loss_coef
        counts = routing.tokens_per_expert.view(layer.ep_size, layer.n_local)
        return Chunk(rows, xc, token_of, send, w_sorted, counts, aux)

    def shared_fwd(self, c: Chunk) -> None:
        if self.layer.shared is not None:
            with torch.enable_grad():
                c.shared_out = self.layer.shared(c.x)

    def experts_fwd(self, c: Chunk, x_recv: Tensor) -> Tensor:
        """Received rows (by source rank, then local expert) → expert outputs, same order."""
        ex = self.layer.experts
        w1, w2 = ex.w_gate_up.detach().to(x_recv.dtype), ex.w_down.detach().to(x_recv.dtype)
        xs = x_recv.index_select(0, c.order)
        with torch.enable_grad():  # SwiGLU's own backward gives the dgrad its derivative
            h = grouped_mm(xs, w1, c.offs).requires_grad_()
            a = swiglu(h)
        ys = grouped_mm(a.detach(), w2, c.offs)
        c.saved = (xs, h, a)
        return ys.index_select(0, c.inverse)

    def unpermute(self, c: Chunk, y_back: Tensor) -> None:
        with torch.enable_grad():
            c.y_back = y_back.detach().requires_grad_()
            c.w_leaf = c.w_sorted.detach().requires_grad_()
            weight = c.w_leaf.unsqueeze(1).to(c.y_back.dtype)
            out = torch.zeros_like(c.x).index_add_(0, c.token_of, c.y_back * weight)
            if c.shared_out is not None:
                c.shared_leaf = c.shared_out.detach().requires_grad_()
                out = out + c.shared_leaf
            c.out = out

    # ------------------------------------------------------------------ backward
    def unpermute_bwd(self, c: Chunk, dout: Tensor) -> Tensor:
        """Returns the gradient of the rows the combine brought back, for its reverse."""
        torch.autograd.backward([c.out], [dout])
        return c.y_back.grad

    def shared_bwd(self, c: Chunk) -> None:
        if c.shared_out is not None:
            torch.autograd.backward([c.shared_out], [c.shared_leaf.grad])

    def experts_dgrad(self, c: Chunk, dy_recv: Tensor) -> Tensor:
        """The gradient of the received rows: two grouped GEMMs, SwiGLU's backward between."""
        ex = self.layer.experts
        xs, h, a = c.saved
        w1, w2 = ex.w_gate_up.detach().to(h.dtype), ex.w_down.detach().to(h.dtype)
        dys = dy_recv.index_select(0, c.order)
        da = grouped_mm(dys, w2.transpose(-1, -2).contiguous(), c.offs)
        (dh,) = torch.autograd.grad([a], [h], [da])
        dxs = grouped_mm(dh, w1.transpose(-1, -2).contiguous(), c.offs)
        c.wgrad_inputs = (xs, dh, a.detach(), dys)
        return dxs.index_select(0, c.inverse)

    def experts_wgrad(self, c: Chunk) -> None:
        """The experts' weight gradients, added into ``.grad``: nothing waits for them."""
        ex = self.layer.experts
        xs, dh, a, dys = c.wgrad_inputs
        for param, grad in ((ex.w_gate_up, grouped_mm_wgrad(xs, dh, c.offs)),
                            (ex.w_down, grouped_mm_wgrad(a, dys, c.offs))):
            grad = grad.to(param.dtype)
            param.grad = grad if param.grad is None else param.grad + grad
        c.wgrad_inputs = ()

    def route_bwd(self, c: Chunk, dsend: Tensor, aux_scale: float | None) -> None:
        tensors, grads = [c.send, c.w_sorted], [dsend, c.w_leaf.grad]
        if aux_scale is not None and c.aux.requires_grad:
            tensors.append(c.aux)
            grads.append(torch.full_like(c.aux, aux_scale))
        torch.autograd.backward(tensors, grads)
