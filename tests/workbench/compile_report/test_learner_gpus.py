"""The committed compile reports of the GPUs a learner may have (`make compile`): on the A100
(sm_80), the A10G (sm_86) and the L4 (sm_89) every kernel path the architecture table allows
compiled, launchable within the GPU's shared memory, spilling only where its spec says why;
no FP8 MMA below sm_89; the TMA kernel refused there, never compiled."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moe_lab.perf.hardware import ARCHS

RESULTS = Path(__file__).resolve().parents[3] / "results" / "compile"
LEARNERS = ("sm_80", "sm_86", "sm_89")


@pytest.mark.parametrize("arch", LEARNERS)
def test_every_allowed_path_compiles_within_the_gpu(arch):
    report = json.loads((RESULTS / f"{arch}.json").read_text())
    rows = [r for r in report["rows"] if r.get("arch") == arch]
    assert rows and not [r["label"][:80] for r in rows if r.get("error")]
    limit = ARCHS[arch].max_shared_per_block
    assert not [(r["label"][:80], r["shared_bytes"]) for r in rows if r["shared_bytes"] > limit]
    assert not [r["label"][:80] for r in rows if r["blocks_per_sm"] < 1]  # every row launches
    assert not [r["label"][:80] for r in rows if r["spill_bytes"] and not r["note"]]
    kinds = {k for r in rows for k in r["mma_kinds"]}
    classes = {r["mma_class"] for r in rows}
    assert classes <= {"mma.sync", "none"} and "mma.sync" in classes
    fp8 = {k for k in kinds if re.search(r"e4m3|e5m2", k)}
    assert bool(fp8) == ARCHS[arch].fp8_mma, (arch, sorted(fp8))  # no FP8 MMA below sm_89
    assert not any(r["kernel"].startswith("moe_lab.kernels.grouped_gemm_tma:") for r in rows)
    refused = [r for r in report["refused"] if r["arch"] == arch]
    assert refused and {r["needs"] for r in refused} == {"tma"}
