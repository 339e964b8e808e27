"""Launching ranks — from Python or a notebook, or with torchrun — and failing loudly.

A distributed job is N processes ("ranks") that find each other through a rendezvous (a
small key-value store one of them hosts) and then talk through a process group: gloo on
CPUs, NCCL on GPUs. ``torchrun`` is PyTorch's launcher for scripts:
``torchrun --standalone --nproc_per_node=2 scripts/train_ep.py`` starts the ranks, gives each
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in its environment, and
`init_from_env` turns those into a process group. A notebook cannot be a torchrun script,
so `run_ranks` starts the ranks itself with ``torch.multiprocessing`` and returns what each
rank's function returned. The ranks are forked from a *fork server*, a helper process that
imported torch once and never ran anything in parallel (forking a process that has started
compute threads is unsafe, which is why the notebook's own kernel is never forked); each
launch then costs milliseconds instead of a torch import per rank:

    results = run_ranks(moe_lab.workbench.ranks.launch.whoami, 2, timeout_s=60)

The function must be importable by name (defined in a module, not in the notebook), since
a rank looks it up by name; its arguments and result are pickled.

**No hung jobs.** A rank can die (killed, out of memory, an exception) or hang (a deadlock,
a collective the others never join). Its peers then wait inside a collective for a message
that will never come. Three guards turn that into a clear error within a bounded time:

1. ``init_process_group(timeout=...)``: every gloo collective gives up after
   ``collective_timeout_s`` and raises in the waiting rank; a peer that *died* closes its
   sockets, so the others fail at once ("Connection closed by peer").
2. `check_peers` wraps ``monitored_barrier``: rank 0 waits for every rank by name and the
   error says which ranks did not arrive.
3. The launcher watches the processes: when one exits with an error, the others get
   ``collective_timeout_s`` plus a few seconds to fail on their own, then are killed; the
   whole job has a deadline ``timeout_s``. It raises `RankFailure`, naming each rank's fate
   (exit code, signal, the last line of its exception, or "killed: still running").

With ``link=EmulatedLink(...)`` (``moe_lab.workbench.ranks.netem``) each rank first enters its own
network namespace, and gloo talks over the emulated link instead of the loopback device.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_lab.checks import positive_int, positive_number
from moe_lab.workbench.quiet import without_known_lines
from moe_lab.workbench.ranks.netem import IFNAME, EmulatedLink, enter_namespace

GRACE_S = 5.0  # beyond the collective timeout, for peers of a failed rank to exit by themselves


class RankFailure(RuntimeError):
    """One or more ranks failed, hung or overran the deadline; ``statuses`` says which and how,
    ``logs`` holds what each rank wrote to stderr (rank -> text, known-harmless lines left out),
    read once every rank has ended; a rank that raised has its traceback there."""

    def __init__(self, message: str, statuses: list[RankStatus], logs: dict[int, str]) -> None:
        super().__init__(message)
        self.statuses = statuses
        self.logs = logs


@dataclass
class RankStatus:
    rank: int
    exitcode: int | None  # None: killed by the launcher while still running
    error: str = ""  # the last line of the rank's exception, or how it ended

    @property
    def ok(self) -> bool:
        return self.exitcode == 0

    def describe(self) -> str:
        if self.exitcode == 0:
            return f"rank {self.rank}: ok"
        if self.exitcode is None:
            return f"rank {self.rank}: killed by the launcher ({self.error})"
        how = (f"killed by {signal.Signals(-self.exitcode).name}" if self.exitcode < 0
               else f"exit code {self.exitcode}")
        return f"rank {self.rank}: {how}" + (f" — {self.error}" if self.error else "")


def choose_backend(local_ranks: int, link: EmulatedLink | None = None,
                   backend: str | None = None) -> tuple[str, str]:
    """The process-group backend for ``local_ranks`` ranks on this machine, and why:
    ``(backend, reason)``.

    NCCL needs one GPU per rank (two ranks on one GPU are refused by NCCL) and carries no
    traffic over the emulated link, which is TCP between network namespaces. So: ``"gloo"``
    with a ``link``; ``"nccl"`` when CUDA has at least ``local_ranks`` GPUs; else ``"gloo"``
    on the CPU, the reason saying so (the ranks then compute on the CPU,
    `rank_device`). An explicit ``backend`` is checked against the same rules and refused
    in one line when it cannot work.
    """
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if link is not None:
        if backend == "nccl":
            raise ValueError("the emulated link carries gloo (TCP) traffic; use backend='gloo'")
        return "gloo", "emulated link: TCP between network namespaces, which gloo speaks"
    if backend == "gloo":
        return "gloo", "gloo asked for: the ranks compute on the CPU"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and gpus >= local_ranks:
        return "nccl", f"{local_ranks} ranks on {gpus} GPU(s): one GPU per rank"
    if backend == "nccl" and gpus == 0:
        raise ValueError("backend='nccl' needs CUDA, and this machine has no CUDA device; use "
                         "backend='gloo' (the ranks then compute on the CPU)")
    if backend == "nccl":
        raise ValueError(f"backend='nccl' needs one GPU per rank: {local_ranks} ranks on this "
                         f"machine, {gpus} GPU(s) (NCCL refuses two ranks on one GPU); use "
                         "backend='gloo' (the ranks then compute on the CPU)")
    if gpus == 0:
        return "gloo", "no CUDA device: gloo on the CPU"
    return "gloo", (f"{local_ranks} ranks > {gpus} GPU(s), and NCCL refuses two ranks on one "
                    "GPU: gloo on the CPU")


# Modules the fork server imports once, so that every rank forked from it starts with torch
# already loaded (a fresh interpreter per rank spends seconds importing torch). The ranks come
# from a fork server (Linux and macOS have one): forking a process that never ran a parallel
# region is safe.
PRELOAD = ["torch", "torch.distributed", "moe_lab.parallel.ep", "moe_lab.parallel.merged",
           "moe_lab.workbench.ranks.harness",
           "moe_lab.workbench.ranks.equivalence", "moe_lab.workbench.ranks.faults"]


def _last_error_line(path: Path) -> str:
    """The last non-blank line of the file ``path`` (a rank's traceback), or "" without one."""
    lines = path.read_text().strip().splitlines() if path.exists() else []
    return lines[-1].strip() if lines else ""


def _rank_entry(rank: int, world_size: int, fn: Callable, args: tuple, master_addr: str, port: int,
                backend: str, collective_timeout_s: float, netns: str | None, ifname: str,
                threads: int, result_dir: str, env: dict[str, str]) -> None:
    """The body of one spawned rank: join the link, init the group, run ``fn``, save its result."""
    out = Path(result_dir)
    # The rank's stderr (Python's and the C++ libraries') goes to a file the launcher reads
    # when the job ends (`run_ranks`).
    log = os.open(out / f"rank{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 2)
    os.close(log)
    try:
        if netns is not None:
            enter_namespace(netns)
        os.environ.update(env)
        # torchrun's environment: the ranks then join as `init_from_env` joins torchrun's
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr,
                           "MASTER_PORT": str(port)})
        if backend == "gloo":
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        torch.set_num_threads(threads)
        init_from_env(collective_timeout_s, backend)
        result = fn(*args)
        torch.save(result, out / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 — everything a rank can die of is reported
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        # On its stderr too, as Python prints an uncaught exception: a failed rank's log then
        # always holds why it failed, whether or not a library logged anything before raising
        # (gloo logs a failed monitored barrier, but not a peer found gone before it began).
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        # A broken process group can hang in its destructors; leave at once.
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
              collective_timeout_s: float = 30.0, backend: str | None = None,
              link: EmulatedLink | None = None, threads_per_rank: int | None = None,
              quiet_failure: bool = False) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes joined in a process group.

    Returns the list of each rank's return value (rank order). ``fn`` runs after
    ``torch.distributed.init_process_group``, so it can use the default group at once.

    Args:
        timeout_s: deadline for the whole job; ranks still running then are killed.
        collective_timeout_s: the process group's timeout (a collective waiting longer raises).
        backend: ``"gloo"`` or ``"nccl"``; default `choose_backend`'s pick (gloo with a
            link or with fewer GPUs than ranks; ``"nccl"`` there is refused with the reason).
        link: an active ``moe_lab.workbench.ranks.netem.EmulatedLink`` with ``world_size`` ranks, or None
            (loopback).
        threads_per_rank: torch intra-op threads per rank (default: the CPU count divided
            among the ranks, at least 1).
        quiet_failure: when the job fails, keep the ranks' stderr on the `RankFailure`
            (``failure.logs``) instead of writing it out: for a failure the caller provokes
            and explains (a fault demo). A job that succeeds writes it out either way.

    Each rank's stderr is collected and, when the job ends, written to this process's stderr
    (rank by rank), less the lines `moe_lab.workbench.quiet` knows to be harmless; a rank that
    raised has written its traceback there, as Python does.

    Raises:
        RankFailure: a rank raised, died, or the deadline passed; the message names each rank.
    """
    positive_int(world_size, "world_size")
    interactive_main = (getattr(fn, "__module__", "__main__") == "__main__"
                        and not getattr(sys.modules.get("__main__"), "__file__", None))
    if not callable(fn) or interactive_main or "<locals>" in getattr(fn, "__qualname__", ""):
        raise ValueError(f"fn must be a module-level function importable by name (a notebook's "
                         f"own functions are not: put it in a module), got {fn!r}")
    positive_number(timeout_s, "timeout_s")
    positive_number(collective_timeout_s, "collective_timeout_s")
    backend, _ = choose_backend(world_size, link, backend)
    if link is not None:
        if not link.active or link.world_size != world_size:
            raise ValueError(f"link must be an active EmulatedLink for {world_size} ranks, got {link!r}")
        # Rank 0 hosts the rendezvous, inside its namespace.
        master_addr, port, ifname = link.address(0), 29500, IFNAME
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            master_addr, port, ifname = "127.0.0.1", s.getsockname()[1], "lo"
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # A forked rank inherits the fork server's environment, not ours: send ours along.
    rank_env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="moe_lab_ranks_") as tmp:
        result_dir = Path(tmp)
        procs = []
        for rank in range(world_size):
            netns = link.namespace(rank) if link is not None else None
            p = ctx.Process(target=_rank_entry, daemon=True, name=f"moe_lab-rank{rank}",
                            args=(rank, world_size, fn, args, master_addr, port, backend,
                                  collective_timeout_s, netns, ifname, threads, tmp, rank_env))
            p.start()
            procs.append(p)
        statuses = _watch(procs, timeout_s, collective_timeout_s + GRACE_S, result_dir)
        # What each rank wrote to stderr, less the known-harmless lines; ranks with nothing
        # left are left out.
        logs = {}
        for rank in range(world_size):
            path = result_dir / f"rank{rank}.stderr"
            text = without_known_lines(path.read_text(errors="replace")) if path.exists() else ""
            if text.strip():
                logs[rank] = text if text.endswith("\n") else text + "\n"
        failed = not all(s.ok for s in statuses)
        if not (failed and quiet_failure):
            for text in logs.values():
                sys.stderr.write(text)
            sys.stderr.flush()
        if failed:
            # Name the likely culprit first: a rank killed by a signal or by the launcher is
            # more often the cause than the peers that then lost their connection to it.
            order = sorted(statuses, key=lambda s: (s.ok, s.exitcode is not None and s.exitcode > 0))
            fates = "\n  ".join(s.describe() for s in order)
            raise RankFailure(f"{sum(not s.ok for s in statuses)} of {world_size} ranks failed:\n  {fates}",
                              statuses, logs)
        return [torch.load(result_dir / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]


def _watch(procs: Sequence, timeout_s: float, grace_s: float, result_dir: Path) -> list[RankStatus]:
    start = time.monotonic()
    first_failure: float | None = None
    killed: dict[int, str] = {}
    while running := [r for r, p in enumerate(procs) if p.exitcode is None]:
        now = time.monotonic()
        if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
            first_failure = now
        reason = None
        if first_failure is not None and now - first_failure > grace_s:
            reason = (f"still running {now - first_failure:.0f} s after another rank failed "
                      f"(hung, or blocked in a collective)")
        elif now - start > timeout_s:
            reason = f"still running at the deadline of {timeout_s:g} s"
        if reason:
            killed = dict.fromkeys(running, reason)
            for r in running:
                procs[r].kill()
            for r in running:
                procs[r].join(5)
            break
        procs[running[0]].join(0.05)
    return [RankStatus(r, None, killed[r]) if r in killed
            else RankStatus(r, p.exitcode, _last_error_line(result_dir / f"rank{r}.err"))
            for r, p in enumerate(procs)]


def check_peers(timeout_s: float) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout_s`` (gloo's
    ``monitored_barrier``; a plain barrier on other backends)."""
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier()


def init_from_env(collective_timeout_s: float = 60.0,
                  backend: str | None = None) -> tuple[int, int, torch.device]:
    """Initialise the default process group from torchrun's environment.

    Picks NCCL (one GPU per local rank, with high-priority communication streams) where
    this node has a GPU for each of its ``LOCAL_WORLD_SIZE`` ranks, gloo on the CPU otherwise
    (`choose_backend`, which also refuses ``backend="nccl"`` there). Returns ``(rank,
    world_size, device)``.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend, _ = choose_backend(local_ranks, None, backend)
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # Collectives on high-priority streams: the all-to-all is scheduled ahead of the
        # compute kernels it overlaps with.
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
        dist.init_process_group("nccl", timeout=timeout, pg_options=options, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def rank_device() -> torch.device:
    """The device this rank computes on, the one place rank functions take it from:
    ``cuda:LOCAL_RANK`` under NCCL (`run_ranks` and torchrun set ``LOCAL_RANK``), the CPU
    under gloo (gloo's ranks compute on the CPU even where there is a GPU: see
    `choose_backend`)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def whoami() -> dict:
    """A rank's view of the job: its rank, the world size, the backend, its address, and an
    all-reduce of ranks (``0 + 1 + ... + N-1``) to show they really talk."""
    total = torch.tensor([dist.get_rank()], device=rank_device())
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "device": str(rank_device()), "pid": os.getpid(),
            "interface": os.environ.get("GLOO_SOCKET_IFNAME", ""),
            "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
            "sum_of_ranks": int(total)}
