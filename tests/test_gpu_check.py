"""scripts/gpu_check.py stays runnable: its --cpu-smoke mode checks every kernel (interpreted,
tiny shapes) exactly as the GPU run does, and writes the same files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_gpu_check_cpu_smoke(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu-smoke",
                           "--no-bench", "--out", str(out)], capture_output=True, text=True,
                          timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads((out / "checks.json").read_text())
    names = {c["check"] for c in checks}
    for expected in ("grouped_gemm float32 fwd", "grouped_gemm bfloat16 dW", "permute",
                     "mx_quantize colwise", "mxfp8 attention vs emulation", "fused router grad",
                     "graphed step loss vs eager"):
        assert expected in names
    assert all(c["ok"] for c in checks)
    env = json.loads((out / "env.json").read_text())
    assert env["torch"] and "summary.md" in {p.name for p in out.iterdir()}
