"""Hiding the all-to-all behind compute: chunks, async work handles, delayed weight gradients.

The expert-parallel layer (`moe_lab.parallel.ep`) waits on the network twice in the forward
(dispatch, combine) and twice in the backward (their reverses); waiting in turn leaves the
processor idle for all of it. The remedy is a pipeline: cut the step's tokens into ``n``
chunks and, while chunk ``c``'s experts compute, let chunk ``c+1``'s dispatch and chunk
``c``'s combine travel. A collective started with ``async_op=True`` returns a *work handle*
at once; ``work.wait()`` blocks only when its result is needed. On CUDA, NCCL runs
collectives on its own streams, so the same handles overlap kernels.

`ChunkedStep` runs the forward and backward of one dropless `EPMoELayer` stage by stage
(`moe_lab.parallel.chunks`), so that the schedule is explicit:

forward   route+permute all chunks · one count exchange · dispatch(0) in flight while the
          shared expert runs · for each chunk: wait dispatch(c), start dispatch(c+1),
          experts(c), start combine(c) · then unpermute each chunk as its combine lands
backward  unpermute⁻¹ all chunks · combine⁻¹(0) in flight while the shared expert's
          backward runs · for each chunk: wait combine⁻¹(c), start combine⁻¹(c+1),
          expert dgrad(c), start dispatch⁻¹(c), [expert wgrad(c)] · then, for each chunk,
          [expert wgrad(c)] and permute⁻¹(c) as its dispatch⁻¹ lands

``schedule="sequential"`` runs the same stages but waits for every collective as soon as it
starts: the baseline. ``delay_wgrad=True`` postpones the experts' weight gradients, which
nothing waits for, to fill the last dispatch⁻¹, the one gap nothing else can fill.

**What is hidden.** ``exposed communication = step time − compute-only time`` (`exposed_time`),
where the compute-only step runs every stage on the same data with the collectives replaced by
the tensors they delivered last time (``ChunkedStep.run(..., replay=True)``). Each run also
records per-chunk events on a compute and a communication lane (`moe_lab.parallel.timeline`).
"""

from __future__ import annotations

import torch

from moe_lab.checks import one_of, positive_int
from moe_lab.parallel.ep import EPMoELayer
from moe_lab.parallel.merged import MergedStep
from moe_lab.parallel.plan import chunked_plan
from moe_lab.parallel.timeline import Timeline

Tensor = torch.Tensor

SCHEDULES = ("sequential", "overlap")


def exposed_time(step_s: float, compute_only_s: float) -> float:
    """Exposed communication: how much longer the step took than its compute alone."""
    return step_s - compute_only_s


class ChunkedStep:
    """Forward + backward of ``layer`` (an `EPMoELayer` in ``dropless`` mode) in ``n_chunks``
    chunks of this rank's tokens, on an explicit schedule: the `chunked_plan` of one
    micro-batch, run by a `MergedStep` (``self.merged``).

    ``run(x, grad_out, schedule=..., delay_wgrad=..., replay=...)`` returns ``(y, dx,
    Timeline)``; parameter gradients accumulate into ``layer``'s ``.grad`` as ``backward()``
    would (see `ChunkStages` for ``merged.ops.aux_scale``).
    """

    def __init__(self, layer: EPMoELayer, n_chunks: int) -> None:
        self.merged = MergedStep(layer, n_chunks)  # checks the layer

    def run(self, x: Tensor, grad_out: Tensor, schedule: str = "overlap", delay_wgrad: bool = False,
            replay: bool = False, label: str | None = None,
            lookahead: int = 1) -> tuple[Tensor, Tensor, Timeline]:
        """One forward + backward. ``replay=True`` skips every collective and uses what the
        previous real run received (the compute-only reference; same data, same shapes).
        ``lookahead``: how many chunks' dispatch (and combine⁻¹) are kept in flight ahead
        of the chunk being computed; more absorbs more jitter, at the cost of buffers."""
        positive_int(lookahead, "lookahead")
        one_of(schedule, "schedule", SCHEDULES)
        mb = self.merged.microbatch(x, grad_out, "x")
        order = chunked_plan(self.merged.n_chunks, lookahead=lookahead, delay_wgrad=delay_wgrad)
        label = label or ("compute only" if replay else schedule) + " + delayed wgrad" * delay_wgrad
        timeline = self.merged.run(order, mb, mb, replay, schedule == "sequential", label)
        return mb.y, mb.dx, timeline
