"""Two "nodes" on one machine (``scripts/two_node_torchrun.sh``): torchrun's c10d rendezvous
across two network namespaces trains the tiny preset with the 1F1B schedule and gives, step
by step, the losses of the same 4 ranks on one node. Needs root and iproute2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "two_node_torchrun.sh"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_namespaces_match_one_node():
    if os.name != "posix" or os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("ip (iproute2) not found")
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=580,
                            env={**os.environ, "PYTHON": sys.executable, "STEPS": "3"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "losses equal: yes" in result.stdout
    two = next(line for line in result.stdout.splitlines() if line.startswith("two nodes  (world"))
    assert "world 4, gloo" in two
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "m2n" not in names  # torn down
