"""``scripts/slurm/train_ep.sbatch`` passes ``sbatch --test-only`` against a throwaway
controller with two 8-GPU nodes, and requests that cannot fit are refused
(``scripts/slurm/check_sbatch.sh``). Needs root and Slurm (Debian's ``slurm-wlm``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(120)
def test_sbatch_script_passes_test_only():
    missing = [t for t in ("munged", "slurmctld", "sbatch") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found: install slurm-wlm")
    if os.geteuid() != 0:
        pytest.skip("the throwaway slurmctld runs as root")
    result = subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / "check_sbatch.sh")],
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and "-> accepted" in lines[0] and "gpunode[1-2]" in lines[0], lines
    assert all("-> refused" in line for line in lines[1:]), lines
