"""Ranks that fail on purpose: what the launcher's guards are tested against (and notebook 09).

A rank can die (killed, out of memory), raise, or hang; its peers then wait inside a collective
for a message that never comes. `fault_rank` fails between small all-reduces;
`moe_lab.workbench.ranks.launch.run_ranks` must raise `RankFailure` naming the rank, within its
timeouts, and never hang.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from moe_lab.checks import one_of
from moe_lab.workbench.ranks.launch import check_peers, rank_device

FAULTS = ("crash", "raise", "hang")


def stderr_rank(*lines: str) -> int:
    """A rank that writes ``lines`` to its stderr and returns its rank: what the launcher's
    handling of the ranks' stderr is tested against (collected, passed on, known lines left out)."""
    for line in lines:
        print(line, file=sys.stderr)
    return dist.get_rank()


def fault_rank(kind: str, victim: int = 1, iterations: int = 1000, check_timeout_s: float = 5.0,
               peer_delay_s: float = 0.0) -> int:
    """A rank function that fails on purpose (for the tests and notebook 09).

    Every rank joins a barrier, then loops over small all-reduces; rank ``victim`` instead
    dies (``kind="crash"``: SIGKILL, as the out-of-memory killer would), raises
    (``"raise"``), or stops answering (``"hang"``: sleeps). Before each all-reduce the others
    pass `check_peers`, so a missing rank is named. ``peer_delay_s`` holds the others back
    that long before their first `check_peers`, as a loaded machine may (the victim then
    fails first). Returns the number of iterations done.
    """
    one_of(kind, "kind", FAULTS)
    x = torch.ones(1024, device=rank_device())
    dist.barrier()
    # The victim fails only once every peer has left the barrier (each says so in the job's
    # store): a rank that leaves a barrier first may die while a peer still waits inside it,
    # which then fails there instead of in `check_peers`, the failure under test. A peer that
    # is descheduled between saying so and its first `check_peers` (a loaded machine) can
    # still find the victim gone before the barrier begins: gloo then fails it at once with
    # "Connection closed by peer", without naming the rank; its log holds that exception.
    store, past = dist.distributed_c10d._get_default_store(), "moe_lab/fault_rank/past_barrier/{}"
    if dist.get_rank() != victim:
        store.set(past.format(dist.get_rank()), "1")
        time.sleep(peer_delay_s)
    else:
        store.wait([past.format(rank) for rank in range(dist.get_world_size()) if rank != victim])
        if kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "raise":
            raise RuntimeError(f"rank {victim} failed on purpose")
        time.sleep(3600)
    for _ in range(iterations):
        check_peers(check_timeout_s)
        dist.all_reduce(x)
    return iterations
