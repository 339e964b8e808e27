"""How much memory a run may use, checked before a size the user gave is allocated.

A batch size or token count is a user's number; a typo (``--batch-size 1000000000000``)
should be refused in a line, not found out by the allocator (an error deep in torch) or by
the kernel's out-of-memory killer after minutes of swapping. `check_fits` compares a lower
bound of what a request needs with `memory_limit` — the device's memory on CUDA, else the
machine's physical memory or the process's address-space limit (``ulimit -v``), whichever
is smaller — before anything is built.
"""

from __future__ import annotations

import contextlib
import os

import torch

try:
    import resource  # POSIX only
except ImportError:  # pragma: no cover - Windows
    resource = None

GIB = 2**30


def memory_limit(device: torch.device | str = "cpu") -> int | None:
    """Bytes a process may use on ``device``, or ``None`` where this cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    limits = []
    with contextlib.suppress(ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    if resource is not None:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    return min(limits) if limits else None


def check_fits(what: str, need_bytes: int, hint: str, device: torch.device | str = "cpu") -> None:
    """Raise a ``ValueError`` if ``need_bytes`` (a lower bound of what ``what`` needs) is
    more than `memory_limit` of ``device``; ``hint`` says what to change."""
    limit = memory_limit(device)
    if limit is not None and need_bytes > limit:
        raise ValueError(f"{what} needs at least {need_bytes / GIB:,.1f} GiB, more than the "
                         f"{limit / GIB:,.1f} GiB of {torch.device(device).type} memory here: "
                         f"{hint}")
