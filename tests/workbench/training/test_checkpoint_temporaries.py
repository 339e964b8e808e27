"""A save removes the temporary files that killed runs left beside the checkpoint, and only
those: a save in progress in a running process (this one or another) and the user's own
files stay (`moe_lab.workbench.training.checkpoint.save_checkpoint`)."""

from __future__ import annotations

import os
import subprocess
import sys

from moe_lab.workbench.training.checkpoint import save_checkpoint


def test_a_save_removes_what_killed_runs_left_and_nothing_else(tmp_path):
    ckpt = tmp_path / "run.pt"
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def temporary(pid: int) -> os.PathLike:
            return tmp_path / f".run.pt.moe_lab-{pid}-abcd_123.tmp"

        left = temporary(int(finished.stdout))  # its process has ended: a killed run's
        kept = [temporary(alive.pid), temporary(os.getpid()), tmp_path / ".run.pt.moe_lab-notes.tmp"]
        for f in (left, *kept):
            f.write_bytes(b"partial")
        save_checkpoint(ckpt, {"step": 1})
        assert not left.exists()
        assert all(f.exists() for f in kept), [f.name for f in kept if not f.exists()]
        assert ckpt.is_file()
    finally:
        alive.kill()
        alive.wait()
