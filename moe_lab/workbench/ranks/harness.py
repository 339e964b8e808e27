"""Timing the expert-parallel schedules on real ranks: what ``bench ep`` and notebook 09 run.

Every function here runs on every rank together, inside `moe_lab.workbench.ranks.launch.run_ranks`
(or torchrun). `measure_schedules` times the four 1F1B plans
(`moe_lab.parallel.merged.MergedStep`), interleaved, each run preceded by a barrier; a run's
time is its slowest rank's, and the report gives medians. Exposed communication is
measured two ways: the time the ranks spent outside compute in the step (which a busy shared
machine disturbs less), and the step minus a compute-only replay on the same data
(step time − compute-only time). They disagree where the transfers' own processor
work (gloo's copies, the kernel's TCP) slows the compute it overlaps: the first does not see
that cost, the second does. `a2a_bandwidth` times one all-to-all alone.

`merged_rank_main` is the rank entry point: a spec in, a report of plain data out. Every rank
computes on `moe_lab.workbench.ranks.launch.rank_device`.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from moe_lab.config import MoEConfig
from moe_lab.moe.layer import MoELayer
from moe_lab.parallel.ep import EPMoELayer, exchange_rows, from_layer
from moe_lab.parallel.merged import MergedStep, two_microbatch_step
from moe_lab.parallel.plan import plan
from moe_lab.parallel.timeline import Timeline
from moe_lab.workbench.ranks.launch import rank_device

Tensor = torch.Tensor

# The chunked plan's schedules (`moe_lab.parallel.plan.chunked_plan` run by `MergedStep`), as the
# equivalence check runs them (`moe_lab.workbench.ranks.equivalence.overlap_check_rank`).
OVERLAP_RUNS = {  # label: (schedule, delay_wgrad, replay)
    "sequential": ("sequential", False, False),
    "overlap": ("overlap", False, False),
    "overlap + delayed wgrad": ("overlap", True, False),
    "compute only": ("sequential", False, True),
}


def a2a_bandwidth(rows_per_rank: int, d_model: int, repeats: int = 5) -> dict:
    """Time one all-to-all of ``rows_per_rank`` rows of ``d_model`` per destination (equal
    splits, on every rank together): median seconds (the slowest rank's) and the bandwidth per
    rank (bytes each rank sends to the others / time), on `rank_device`.

    On a GPU the all-to-all is timed with CUDA events around it: the call returns to the host
    once it is *queued* (NCCL runs it on its own stream, which the current stream then waits
    for), so a host clock would time the queueing. On the CPU the call returns when gloo has
    delivered every row, and the host clock is the time."""
    world = dist.get_world_size()
    device = rank_device()
    x = torch.randn(world * rows_per_rank, d_model, device=device)

    def timed() -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            exchange_rows(x, None, None, None)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        exchange_rows(x, None, None, None)
        return time.perf_counter() - t0

    timed()  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        dist.barrier()
        times.append(timed())
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    median = statistics.median(t.tolist())
    sent = (world - 1) * rows_per_rank * d_model * x.element_size()
    return {"bytes_per_rank": sent, "median_s": median, "bytes_per_s": sent / median}


# ----------------------------------------------------------------------------- the 1F1B plans

MERGED_RUNS = {  # label: (schedule, chunked?, replay)
    "sequential": ("sequential", False, False),
    "chunked": ("chunked", True, False),
    "1f1b": ("1f1b", False, False),
    "1f1b+chunked": ("1f1b+chunked", True, False),
    "compute only": ("sequential", False, True),
    "compute only (chunked)": ("chunked", True, True),
}


def measure_schedules(layer: EPMoELayer, xa: Tensor, ga: Tensor, xb: Tensor, gb: Tensor,
                      n_chunks: int, repeats: int, runs: tuple[str, ...]) -> dict:
    """Time the steady-state unit [forward of ``xb`` + backward of ``xa``] under each plan
    of `MERGED_RUNS`, interleaved (call on every rank together), after one untimed warm-up run
    of each. Each timed unit is preceded by the untimed forward of ``xa`` and a barrier; a
    run's time is its slowest rank's.

    Returns ``{"median_s", "exposed_s" (in-step waiting, mean over ranks),
    "exposed_vs_sequential", "exposed_replay_s" (step − compute-only
    with the same chunks), "exposed_replay_vs_sequential", "timelines" (this rank's median
    run per label), "a2a_bytes", "a2a_s" (comm lane time of the sequential unit),
    "compute_s" (compute lane time of the compute-only unit), "n_chunks", "repeats",
    "world_size"}``.
    """
    steps = {False: MergedStep(layer, 1), True: MergedStep(layer, n_chunks)}
    order = sorted(runs, key=lambda r: MERGED_RUNS[r][2])  # the replays last
    real = [r for r in order if not MERGED_RUNS[r][2]]

    def one(label: str) -> Timeline:
        schedule, chunked, replay = MERGED_RUNS[label]
        step = steps[chunked]
        layer.zero_grad(set_to_none=True)
        a = step.microbatch(xa, ga, "A")
        step.run(plan(schedule, step.n_chunks, backward=False), fwd=a, replay=replay)
        b = step.microbatch(xb, gb, "B")
        dist.barrier(group=layer.group)
        return step.run(plan(schedule, step.n_chunks), fwd=b, bwd=a, replay=replay,
                        sequential=schedule == "sequential", label=label)

    for label in real:  # warm-up: allocations, first calls; fills the replay caches
        one(label)
    timelines: dict[str, list[Timeline]] = {label: [] for label in order}
    for r in range(repeats):
        for label in (order if r % 2 == 0 else order[::-1]):
            timelines[label].append(one(label))

    # Exposed communication, two ways: within each run as the time its ranks spent outside
    # compute (averaged over ranks), which a busy shared machine disturbs less, and against
    # the compute-only (replay) run with the same chunks.
    reference = {k: "compute only (chunked)" if MERGED_RUNS[k][1] and "compute only (chunked)" in timelines
                 else "compute only" for k in real}
    device = layer.experts.w_gate_up.device  # where the collectives run (NCCL: the GPU)
    steps_s = torch.tensor([[t.step_s for t in timelines[label]] for label in order],
                           dtype=torch.float64, device=device)
    waits = torch.tensor([[t.wait_s for t in timelines[label]] for label in order],
                         dtype=torch.float64, device=device)
    dist.all_reduce(steps_s, op=dist.ReduceOp.MAX, group=layer.group)
    dist.all_reduce(waits, group=layer.group)
    waits /= layer.ep_size
    median = {label: statistics.median(v) for label, v in zip(order, steps_s.tolist(), strict=True)}
    exposed = {k: statistics.median(w) for k, w in zip(order, waits.tolist(), strict=True) if k in reference}
    exposed_replay = {k: median[k] - median[ref] for k, ref in reference.items()}

    def versus_sequential(values: dict) -> dict:
        base = values["sequential"]
        return {k: (v / base if base > 0 else float("nan")) for k, v in values.items()}

    seq = timelines["sequential"]
    return {
        "n_chunks": n_chunks, "repeats": repeats, "world_size": layer.ep_size,
        "median_s": median,
        "exposed_s": exposed, "exposed_vs_sequential": versus_sequential(exposed),
        "exposed_replay_s": exposed_replay,
        "exposed_replay_vs_sequential": versus_sequential(exposed_replay),
        # this rank's Timeline of the median run of each label
        "timelines": {k: sorted(ts, key=lambda t: t.step_s)[len(ts) // 2] for k, ts in timelines.items()},
        "a2a_bytes": seq[0].comm_bytes(),
        "a2a_s": statistics.median(t.lane_time("comm") for t in seq),
        "compute_s": statistics.median(t.lane_time("compute") for t in timelines["compute only"]),
    }


def layer_and_batches(spec: dict, n_tensors: int = 4) -> tuple[EPMoELayer, list[Tensor]]:
    """This rank's part of a seeded dropless layer (``spec["cfg"]``: `MoEConfig` fields, the
    same on every rank) and ``n_tensors`` random ``[spec["tokens"], d_model]`` tensors of its
    own (inputs and output gradients), all on `rank_device`."""
    cfg = MoEConfig(**spec["cfg"])
    device = rank_device()
    torch.manual_seed(spec.get("seed", 0))  # seeds every device: the same layer on every rank
    with torch.device(device):
        ep = from_layer(MoELayer(cfg, "dropless", "torch"))
    g = torch.Generator(device).manual_seed(spec.get("seed", 0) * 1000 + dist.get_rank() + 1)
    tensors = [torch.randn(spec["tokens"], cfg.d_model, generator=g, device=device)
               for _ in range(n_tensors)]
    return ep, tensors


def merged_rank_main(spec: dict) -> dict:
    """A rank's part of the schedule benchmark (for ``run_ranks``; used by ``bench ep`` and
    notebook 09). ``spec``: ``cfg`` (MoEConfig fields), ``tokens`` (per rank and
    micro-batch), ``n_chunks``, ``repeats``, ``seed``, ``runs`` (labels of
    `MERGED_RUNS`), ``bandwidth_rows`` (0: skip the bandwidth probe), ``check`` (default True:
    compare the merged step with the plain one first). Returns the
    `measure_schedules` report (timelines as dicts), the probe, and whether the merged
    two-micro-batch step equalled the plain one bitwise."""
    ep, (xa, ga, xb, gb) = layer_and_batches(spec)
    # The merged step computes exactly what the plain one computes.
    outs = {}
    for schedule in ("sequential", "1f1b") if spec.get("check", True) else ():
        ep.zero_grad(set_to_none=True)
        ys, dxs, _ = two_microbatch_step(MergedStep(ep, 1), (xa, xb), (ga, gb), schedule)
        outs[schedule] = ys + dxs + [p.grad.clone() for p in ep.parameters()]
    identical = (all(torch.equal(a, b) for a, b in zip(outs["sequential"], outs["1f1b"], strict=True))
                 if outs else None)
    report = measure_schedules(ep, xa, ga, xb, gb, spec["n_chunks"], spec.get("repeats", 5),
                               tuple(spec.get("runs", MERGED_RUNS)))
    report.update(timelines={k: t.to_dict() for k, t in report["timelines"].items()},
                  merged_equals_plain=identical, rank=dist.get_rank(), backend=dist.get_backend(),
                  device=str(rank_device()), tokens_per_rank=spec["tokens"])
    if spec.get("bandwidth_rows"):
        report["bandwidth"] = a2a_bandwidth(spec["bandwidth_rows"], ep.cfg.d_model)
    return report
