"""A whole `MoETransformer` trained on a 1F1B schedule with merged forward/backward units.

`moe_lab.parallel.merged` merges two micro-batches inside one MoE layer. In the steady state
of 1F1B over a whole model, the forward of micro-batch ``i+1`` runs the blocks ``0 … L−1``
while the backward of micro-batch ``i`` runs them ``L−1 … 0``. `MergedModelStep` pairs them
block by block, as Megatron-Core's combined 1F1B does: the forward of block ``k`` with the
backward of block ``L−1−k``. The dense parts (attention, norms) run as ordinary autograd
pieces; the two MoE layers run one merged plan (`moe_lab.parallel.plan`) in which each one's
all-to-alls travel under the other's compute.

One training step over ``m`` micro-batches (``m ≥ 2``) of one rank's batch::

    F(0) · [F(1) + B(0)] · [F(2) + B(1)] · … · [F(m−1) + B(m−2)] · B(m−1)

The warm-up forward and the cool-down backward have no partner and run chunked. The loss is
the mean over micro-batches of each micro-batch's loss (language-model loss plus its MoE
layers' auxiliary losses, each computed on the micro-batch's own tokens, as gradient
accumulation does; with ``n_chunks > 1`` the auxiliary losses are taken per chunk and
averaged over the chunks). Parameter gradients accumulate in ``.grad``; the caller averages
replicated gradients over ranks (`moe_lab.parallel.ep.sync_gradients`) and steps the optimiser.

Every block is run as a separate autograd piece (its input a fresh leaf), so that the
backward of one block can be interleaved with the forward of another; the pieces' gradients
are chained by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moe_lab.checks import one_of, positive_int
from moe_lab.model import EMBEDDING_IMPLS, MoETransformer
from moe_lab.parallel.ep import EPMoELayer
from moe_lab.parallel.merged import MergedStep, MicroBatch
from moe_lab.parallel.plan import plan
from moe_lab.parallel.timeline import Timeline

Tensor = torch.Tensor


@dataclass
class _Pass:
    """One micro-batch's way through the model: per block its input leaf and what its
    backward needs."""

    idx: Tensor
    targets: Tensor
    key: str
    aux_scale: float  # the weight of its MoE layers' auxiliary losses in the step's loss
    inputs: list[Tensor] = field(default_factory=list)  # leaf input of each block (and of the head)
    # per block: (a, z, its MoE micro-batch) of the dense part, or (the block's output, None, None)
    pre: list[tuple] = field(default_factory=list)
    embed_out: Tensor | None = None
    loss: Tensor | float = 0.0  # the MoE layers' auxiliary losses, then plus the language-model loss
    grad: Tensor | None = None  # gradient flowing down, into the current block's output


class MergedModelStep:
    """Forward + backward of ``model`` (its MoE blocks `EPMoELayer`s in ``dropless`` mode) on
    micro-batches, on the ``schedule`` ``"1f1b"`` (merged units; with ``n_chunks > 1`` each
    MoE layer also chunked) or ``"sequential"`` (the same pieces, every micro-batch's forward
    and backward one after the other, every collective waited at once: the reference).
    Every rank must call `step` together with the same number of micro-batches."""

    def __init__(self, model: MoETransformer, n_chunks: int = 1, schedule: str = "1f1b") -> None:
        one_of(schedule, "schedule", ("1f1b", "sequential"))
        blocks = list(model.blocks)
        if not any(isinstance(b.ffn, EPMoELayer) for b in blocks):
            raise ValueError("model has no EPMoELayer: convert its MoE layers with "
                             "moe_lab.parallel.ep.from_layer")
        self.model, self.n_chunks, self.schedule = model, n_chunks, schedule
        self.steps = [MergedStep(b.ffn, n_chunks, keep_for_replay=False) if isinstance(b.ffn, EPMoELayer)
                      else None for b in blocks]
        self.timelines: list[Timeline] = []

    # ------------------------------------------------------------------ pieces
    def _fwd_pre(self, p: _Pass, k: int) -> MicroBatch | None:
        """Block ``k``'s dense part (a dense block: all of it); the MoE micro-batch it leaves."""
        block, h = self.model.blocks[k], p.inputs[k]
        if self.steps[k] is None:  # a dense block: one autograd piece
            out = block(h)[0]
            p.pre.append((out, None, None))
            p.inputs.append(out.detach().requires_grad_())
            return None
        a = h + block.attn(block.norm1(h))
        z = block.norm2(a)
        mb = self.steps[k].microbatch(z.detach().reshape(-1, z.shape[-1]), None, f"{p.key}/{k}", p.aux_scale)
        p.pre.append((a, z, mb))
        return mb

    def _fwd_post(self, p: _Pass, k: int) -> None:
        a, _, mb = p.pre[k]
        if mb is None:
            return
        y = mb.y.view_as(a)
        p.loss = p.loss + sum(c.aux.detach() for c in mb.chunks) / len(mb.chunks)
        p.inputs.append((a.detach() + y).requires_grad_())

    def _head(self, p: _Pass, n_micro: int) -> None:
        m = self.model
        h = p.inputs[-1]
        logits = m._logits(m.norm(h))
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), p.targets.reshape(-1))
        p.loss = lm.detach() + p.loss
        (lm / n_micro).backward()  # the head's backward can run at once: it waits for nothing
        p.grad = h.grad

    def _bwd_pre(self, p: _Pass, k: int) -> None:
        a, z, mb = p.pre[k]  # a dense block: a is its output
        if mb is None:
            torch.autograd.backward([a], [p.grad])
        else:  # residual + the MoE's input gradient
            torch.autograd.backward([a, z], [p.grad, mb.dx.view_as(z)])
        p.grad = p.inputs[k].grad
        p.pre[k] = None

    def _unit(self, f: _Pass | None, b: _Pass | None, n_micro: int) -> None:
        """F's forward through blocks 0…L−1 paired with B's backward through L−1…0; either may
        be None (the warm-up forward, the cool-down backward). Their MoE layers run one plan:
        under "1f1b" F and B merged (each chunked, with several chunks); with one of them only,
        the chunked order of that half."""
        n_blocks, m = len(self.steps), self.model
        with torch.enable_grad():
            if f is not None:
                f.embed_out = EMBEDDING_IMPLS[m.embedding_impl](m.embed, f.idx)
                f.inputs = [f.embed_out.detach().requires_grad_()]
            for k in range(n_blocks):
                j = n_blocks - 1 - k  # B's block
                fwd = self._fwd_pre(f, k) if f is not None else None
                bwd = b.pre[j][2] if b is not None else None
                if bwd is not None:  # the gradient into block j's output, the residual's kept for later
                    bwd.grad_out = b.grad.reshape(-1, b.grad.shape[-1])
                if fwd is not None or bwd is not None:
                    order = plan(self.schedule, self.n_chunks, fwd is not None, bwd is not None)
                    label = f"F{k if fwd is not None else None} + B{j if bwd is not None else None}"
                    self.timelines.append((fwd or bwd).owner.run(
                        order, fwd, bwd, sequential=self.schedule == "sequential", label=label))
                if f is not None:
                    self._fwd_post(f, k)
                if b is not None:
                    self._bwd_pre(b, j)
            if f is not None:
                self._head(f, n_micro)
            if b is not None:
                torch.autograd.backward([b.embed_out], [b.grad])

    # ------------------------------------------------------------------ the step
    def step(self, idx: Tensor, targets: Tensor, n_micro: int) -> Tensor:
        """Forward + backward of the batch ``idx, targets: [batch, seq]`` in ``n_micro``
        micro-batches (``batch`` divisible by it). Gradients accumulate into the model's
        ``.grad``; returns the mean loss over micro-batches (detached)."""
        positive_int(n_micro, "n_micro")
        if idx.dim() != 2 or idx.shape != targets.shape or idx.shape[0] % n_micro:
            raise ValueError(f"idx and targets must be [batch, seq] with batch divisible by "
                             f"n_micro={n_micro}, got {tuple(idx.shape)} and {tuple(targets.shape)}")
        self.timelines = []
        aux_scale = 1.0 / (n_micro * self.n_chunks)
        passes = [_Pass(i, t, f"mb{n}", aux_scale) for n, (i, t) in
                  enumerate(zip(idx.chunk(n_micro), targets.chunk(n_micro), strict=True))]
        # 1F1B: F(0) · [F(1) + B(0)] · … · B(m−1); sequential: F(0) · B(0) · F(1) · B(1) · …
        units = list(zip([*passes, None], [None, *passes], strict=True))
        if self.schedule == "sequential":
            units = [unit for p in passes for unit in ((p, None), (None, p))]
        for f, b in units:
            self._unit(f, b, n_micro)
        return torch.stack([p.loss for p in passes]).mean()
