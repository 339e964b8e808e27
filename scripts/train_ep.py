"""Train the MoE transformer with expert parallelism, one process per rank.

    torchrun --standalone --nproc_per_node=2 scripts/train_ep.py --preset small
    torchrun --standalone --nproc_per_node=4 scripts/train_ep.py --preset tiny --steps 100
    torchrun --standalone --nproc_per_node=2 scripts/train_ep.py --schedule 1f1b --microbatches 4

CPU ranks talk through gloo, GPU ranks through NCCL (``--backend auto``: NCCL where the node
has one GPU per local rank, else gloo on the CPU, said in the summary's ``backend_reason``).
Every rank builds the same model from the same seed, then keeps only its shard of each MoE
layer's experts (`moe_lab.parallel.ep.from_layer`); attention, router, shared expert and
embeddings are replicated. Each rank draws its own batches. After each
backward, replicated gradients are averaged over all ranks and expert gradients (already
summed over the EP group by the all-to-all's backward) are divided by the world size, so
the update is that of the mean loss over all ranks' tokens.

``--ep-size`` smaller than the world size makes several EP groups of consecutive ranks;
the copies of each expert shard are then averaged over the ranks that hold them (expert
data parallelism). For multi-node runs see ``scripts/slurm/train_ep.sbatch``, and
``scripts/two_node_torchrun.sh`` for two "nodes" (network namespaces) on one machine.

``--schedule 1f1b`` splits each rank's batch into ``--microbatches`` micro-batches and runs
them as the steady state of a 1F1B pipeline does (`moe_lab.parallel.merged_model`): the forward
of micro-batch ``i+1`` merged, block by block, with the backward of micro-batch ``i``, so that
each one's expert-parallel all-to-alls travel while the other computes (``--chunks`` > 1
also chunk-pipelines each MoE layer). The default ``--schedule plain`` runs the whole batch
through autograd at once. The update is the same up to rounding and the auxiliary losses,
which 1f1b computes per micro-batch (as gradient accumulation does).

On a GPU the model runs in bfloat16 (`model_dtype`), on a CPU in float32: the 1F1B stages
run their expert GEMMs on ``torch._grouped_mm``, which on CUDA syncs the host inside the op
in any other dtype (`moe_lab.moe.experts.check_no_hidden_sync`), and the schedule would stall there.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moe_lab.workbench.jsonout import dumps  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=["tiny", "small"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default="dropless", choices=["dropless", "budget"],
                   help="EP exchange: exact counts, or a static budget with overflow re-runs")
    p.add_argument("--capacity-factor", type=float, default=1.5, help="budget mode: rows per rank "
                   "pair = capacity_factor x the average")
    p.add_argument("--ep-size", type=int, default=0, help="ranks per EP group (0: all)")
    p.add_argument("--schedule", default="plain", choices=["plain", "1f1b"],
                   help="plain: the batch through autograd at once; 1f1b: micro-batches, the "
                   "forward of one merged with the backward of the previous (dropless mode)")
    p.add_argument("--microbatches", type=int, default=2, help="1f1b: micro-batches per step "
                   "(must divide --batch-size)")
    p.add_argument("--chunks", type=int, default=1, help="1f1b: chunks per MoE layer and micro-batch")
    p.add_argument("--expert-backend", default=None, choices=["loop", "torch", "triton"],
                   help="grouped GEMM (default: torch on CPU, triton on GPU)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="process group (auto: nccl with one GPU per local rank, else gloo on the CPU)")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON summary line")
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad values before any process group forms: one line on stderr, exit 1 (on
    every rank, so no rank waits for a peer that has left)."""
    from moe_lab.checks import non_negative_int, positive_int, positive_number
    from moe_lab.workbench.training.loop import MAX_SEED

    try:
        for name in ("steps", "batch_size", "log_every", "microbatches", "chunks"):
            positive_int(getattr(args, name), "--" + name.replace("_", "-"))
        for name in ("lr", "capacity_factor", "timeout"):
            positive_number(getattr(args, name), "--" + name.replace("_", "-"))
        non_negative_int(args.ep_size, "--ep-size (0: all ranks)")
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.schedule == "1f1b":
        if args.mode != "dropless":
            raise SystemExit("error: --schedule 1f1b schedules the dropless exchange; got --mode "
                             f"{args.mode}")
        if args.microbatches < 2 or args.batch_size % args.microbatches:
            raise SystemExit(f"error: --microbatches must be >= 2 and divide --batch-size="
                             f"{args.batch_size}, got {args.microbatches}")
    world = os.environ.get("WORLD_SIZE", "")  # set by torchrun before any process group
    if args.ep_size and world.isdigit() and int(world) % args.ep_size:
        raise SystemExit(f"error: --ep-size must divide the world size {world} (torchrun's "
                         f"--nnodes x --nproc-per-node), got {args.ep_size}")
    if not 0 <= args.seed <= MAX_SEED:
        raise SystemExit(f"error: --seed must be an integer in [0, {MAX_SEED}], got {args.seed}")


# What torchrun (or any launcher of env:// process groups) gives every rank it starts.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_launched_by_torchrun(argv: list[str]) -> None:
    """Refuse, in one line saying how to launch it (with ``argv``, the script's arguments), a
    run that no launcher started (``python scripts/train_ep.py``): its process group would
    have no rendezvous to find."""
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        command = shlex.join(["torchrun", "--standalone", "--nproc_per_node=2",
                              "scripts/train_ep.py", *argv])
        raise SystemExit(f"error: scripts/train_ep.py runs one process per rank, started by "
                         f"torchrun ({', '.join(missing)} not set): {command}")


def model_dtype(device: torch.device) -> torch.dtype:
    """What the model computes in: bfloat16 on CUDA (the only dtype in which the 1F1B stages'
    ``torch._grouped_mm`` keeps off the host there), float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_groups(ep_size: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """EP groups of consecutive ranks, and the expert-data-parallel groups across them (``ep_size``
    divides the world size: `check_args`). Every rank creates every group, in the same order,
    and keeps the two it is in: its EP group first."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_size == world:
        return None, None
    mine = []
    for ranks in [*(range(g * ep_size, (g + 1) * ep_size) for g in range(world // ep_size)),
                  *(range(i, world, ep_size) for i in range(ep_size))]:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine.append(group)
    return mine[0], mine[1]


def main(argv: list[str] | None = None) -> int:
    if not torch.cuda.is_available():
        # This script owns its process: without CUDA, Triton kernels (--expert-backend triton)
        # run under Triton's interpreter, decided before anything imports Triton.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from moe_lab.config import preset
    from moe_lab.data import SyntheticCorpus
    from moe_lab.model import MoETransformer
    from moe_lab.moe.layer import MoELayer
    from moe_lab.parallel.ep import clip_grad_norm_ep, from_layer, sync_gradients
    from moe_lab.parallel.merged_model import MergedModelStep
    from moe_lab.training.optim import BETAS, Schedule, param_groups
    from moe_lab.workbench.ranks.launch import choose_backend, init_from_env

    args = parse_args(argv)
    try:  # refused on every rank alike (e.g. --backend nccl with fewer GPUs than local ranks)
        backend_name, backend_reason = choose_backend(
            int(os.environ.get("LOCAL_WORLD_SIZE", "1")), None,
            None if args.backend == "auto" else args.backend)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    check_launched_by_torchrun(sys.argv[1:] if argv is None else argv)
    rank, world, device = init_from_env(collective_timeout_s=args.timeout, backend=backend_name)
    cfg = preset(args.preset)
    ep_size = args.ep_size or world
    if cfg.moe.n_experts % ep_size:
        raise SystemExit(f"the {args.preset} preset has {cfg.moe.n_experts} experts: --ep-size "
                         f"(or the world size) must divide it, got {ep_size}")
    ep_group, dp_group = build_groups(ep_size)
    backend = args.expert_backend or ("triton" if device.type == "cuda" else "torch")
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = MoETransformer(cfg, dispatcher="dropless", expert_backend=backend)
    for block in model.blocks:
        if isinstance(block.ffn, MoELayer):
            block.ffn = from_layer(block.ffn, ep_group, mode=args.mode,
                                   capacity_factor=args.capacity_factor)
    dtype = model_dtype(device)
    model.to(device, dtype)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=BETAS)
    schedule = Schedule(lr=args.lr, warmup_steps=max(1, args.steps // 10), steps=args.steps)
    corpus = SyntheticCorpus(seq_len=cfg.seq_len, seed=args.seed)
    data_gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batches
    tokens_per_step = args.batch_size * cfg.seq_len * world
    merged = MergedModelStep(model, args.chunks) if args.schedule == "1f1b" else None
    history, times = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = corpus.sample(args.batch_size, generator=data_gen)
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        if merged is not None:
            loss = merged.step(batch.x.to(device), batch.y.to(device), args.microbatches)
            reruns = 0
            a2a = sum(e.nbytes for t in merged.timelines for e in t.events if e.phase == "fwd")
        else:
            out = model(batch.x.to(device), batch.y.to(device))
            out.loss.backward()
            loss = out.loss.detach().clone()
            reruns = sum(getattr(s, "reruns", 0) for s in out.moe_stats)
            a2a = sum(getattr(s, "a2a_bytes", 0) for s in out.moe_stats)
        sync_gradients(model, None, dp_group)
        clip_grad_norm_ep(model, 1.0, ep_group)
        optimizer.step()
        dist.all_reduce(loss)
        loss = float(loss) / world
        if device.type == "cuda":  # the host clock times the step only once the GPU is done
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        history.append({"step": step, "loss": loss, "reruns": reruns, "a2a_bytes": a2a})
        if rank == 0 and not args.json and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss:.4f}  {tokens_per_step / times[-1]:,.0f} tok/s  "
                  f"a2a {a2a / 1e6:.2f} MB/rank  reruns {reruns}", flush=True)
    steady = sorted(times[1:] or times)
    summary = {
        "preset": args.preset, "world_size": world, "ep_size": ep_size, "backend": dist.get_backend(),
        "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "backend_reason": backend_reason, "mode": args.mode,
        "steps": args.steps, "schedule": args.schedule,
        "microbatches": args.microbatches if merged is not None else 1,
        "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
        "losses": [h["loss"] for h in history],
        "tokens_per_s": tokens_per_step / steady[len(steady) // 2],
        "a2a_bytes_per_step_rank0": history[-1]["a2a_bytes"],
        "reruns": sum(h["reruns"] for h in history),
    }
    if rank == 0:
        print(dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()),
              flush=True)
    # Every rank reaches this barrier before any tears its sockets down: a rank that closes
    # its gloo pairs while a peer is still inside a collective can abort that peer.
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's finalisation: gloo's worker threads can still hold
    # tensors there, and freeing them while the interpreter is torn down can abort the process
    # (seen once in a full test run on a loaded 2-core machine, after the barrier and
    # destroy_process_group above: "terminate called without an active exception"). Everything
    # the run reports is flushed first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
