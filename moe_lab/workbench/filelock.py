"""One exclusive lock on a file, for one process at a time: the CPU plug-in's build folder
(`moe_lab.workbench.cpu.build.build_guard`) and a training run's checkpoint
(`moe_lab.workbench.training.checkpoint.checkpoint_lock`).

The lock is the operating system's (``fcntl.flock``; the project runs on Linux and macOS), so
it ends with the process that held it, however that process ends: a lock file left by a
killed holder guards nothing and is simply taken. The file holds its holder's process id,
for the message that names it, and is removed when the block ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path, refuse: Callable[[str], BaseException], wait_limit_s: float = 0.0,
              waiting: str = "") -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (its folder made if missing) for the block.

    While another process holds it, wait up to ``wait_limit_s`` seconds, saying so on stdout
    after 2 s and every 30 s (``"waiting for process 1234, which holds {waiting}"``: progress,
    not a problem); past that, raise ``refuse(holder)``, where ``holder`` names the process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    said = -1
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode("ascii", "replace").strip()  # what its holder wrote there
            holder = f"process {pid}" if pid.isdigit() else "another process"
            os.close(fd)
            waited = time.monotonic() - start
            if waited >= wait_limit_s:
                raise refuse(holder) from None
            if waited >= 2 and int((waited - 2) // 30) > said:
                said = int((waited - 2) // 30)
                print(f"moe_lab: waiting for {holder}, which holds {waiting} ({waited:.0f} s so far)...",
                      flush=True)
            time.sleep(0.2)
            continue
        # The holder before us removes the file as it lets go: if we locked the file it
        # removed, the lock guards nothing; take the one now there.
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)
