"""scripts/compare_step_time.py: paired step times of a git revision and the working tree."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_one_pair_against_head_reports_the_paired_difference():
    # Without the CPU plug-in: the exported revision lies in a folder of its own, where the
    # plug-in would be compiled again, for longer than the rest of the test; the script is under test here,
    # the plug-in in tests/workbench/cpu.
    environment = {**os.environ, "MOE_LAB_NO_CPU_EXTENSION": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare_step_time.py"), "HEAD", "--pairs", "1",
         "--steps", "2", "--profile", "smoke", "--eager", "--json"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (pair,) = result["pairs"]
    assert pair["old_ms"] > 0 and pair["new_ms"] > 0
    assert result["median_diff_ms"] == pytest.approx(pair["new_ms"] - pair["old_ms"])
    assert "dropless dispatch" in result["stack_new"] and "dropless dispatch" in result["stack_old"]


def test_bad_arguments_are_refused():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_step_time.py"), "HEAD",
                           "--pairs", "0"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "--pairs and --steps must be positive" in done.stderr
