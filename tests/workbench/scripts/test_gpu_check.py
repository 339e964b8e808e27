"""scripts/gpu_check.py stays runnable: its --cpu-smoke mode checks every kernel (interpreted,
tiny shapes) exactly as the GPU run does, times every notebook's headline figure and writes
the same files; every check the README promises is among them; a budget that runs out stops
the run cleanly with what finished written; a router id flipped by a near-tie is counted,
one flipped elsewhere fails."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def run_smoke(out: Path, *args: str, timeout: float = 280) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, time.monotonic() - t0


@pytest.mark.timeout(300)
def test_gpu_check_cpu_smoke(tmp_path):
    out = tmp_path / "results"
    proc, _ = run_smoke(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads((out / "checks.json").read_text())
    names = {c["check"] for c in checks}
    for expected in ("grouped_gemm float32 fwd", "grouped_gemm bfloat16 dW",
                     "grouped_gemm_swiglu bfloat16 dX", "grouped_gemm_swiglu float32 dW",
                     "permute", "permute backward dX", "unpermute backward dY",
                     "unpermute backward d(router weights)", "mx_quantize colwise",
                     "mxfp8 attention vs emulation", "mx_gemm float32 out vs float64",
                     "mxfp8 attention (fp8_promote) vs emulation",
                     "mx_gemm float32 out (fp8_promote) vs float64",
                     "grouped_mx_gemm float32 out (fp8_promote) vs float64",
                     "mx_gemm bfloat16 out vs float64", "grouped_mx_gemm bfloat16 out vs float64",
                     "fused router grad", "fused router ids",
                     "fused router counts per sequence", "fused router score sums per sequence",
                     "fused router seq_aux_loss", "graphed step loss vs eager reference (step 1)",
                     "paged stash round trip", "paged step gradients (vs unpaged)",
                     "grouped_gemm_tma bfloat16 fwd", "grouped_gemm_tma float32 dX",
                     "grouped_gemm_tma bfloat16 dW"):
        assert expected in names, expected
    from moe_lab.kernels.fusions import FUSIONS

    for fusion in FUSIONS:  # every fused expert MLP, forward
        assert f"fused_moe {fusion} fwd" in names, fusion
    assert "fused_moe fused_mlp grad 3" in names  # the routing weights' gradient
    shapes = {c["shape"] for c in checks}
    for expected in ("padded to 16", "float32->e5m2 floor", "bfloat16->e4m3 floor",
                     "float32->e4m3 rceil", "seqs of 6", "1x2x64x64", "1x2x64x128",
                     "1x2x64x192"):  # layouts, formats, statistics, head dims
        assert any(expected in shape for shape in shapes), expected
    graphed = next(c for c in checks if c["check"].startswith("graphed step loss vs eager reference"))
    assert "eager: ModelImpls(dispatcher='naive'" in graphed["reference"]  # not Triton vs Triton
    assert all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]
    gains = json.loads((out / "gains.json").read_text())
    assert {"04", "05", "06", "08", "12"} <= {g["notebook"] for g in gains}
    assert all(g["value"] > 0 for g in gains)
    kernels = json.loads((out / "kernels.json").read_text())  # the compile report's, interpreted
    assert kernels and all(k["registers"] is None and k["report_registers"] for k in kernels)
    sections = json.loads((out / "sections.json").read_text())
    assert [s["status"] for s in sections] == ["done"] * len(sections)
    assert {s["section"] for s in sections} >= {"fused MoE", "TMA grouped GEMM", "paged stash",
                                                "registers and spills",
                                                "12 tokens/s of the optimised step"}
    assert len(list((out / "sections").glob("*.json"))) == len(sections)
    tuned = json.loads((out / "tuned_configs.json").read_text())  # the tuner ran, its winners kept
    from moe_lab.kernels import tuning

    assert tuned["configs"] and all(tuning._config(e, "test") for e in tuned["configs"].values())
    assert {b["bench"] for b in json.loads((out / "bench.json").read_text())} >= {"tuned gemm", "tuned dw"}
    env = json.loads((out / "env.json").read_text())
    assert env["torch"] and "summary.md" in {p.name for p in out.iterdir()}


@pytest.mark.timeout(120)
def test_a_spent_budget_stops_the_run_cleanly_with_what_finished_written(tmp_path):
    out, budget = tmp_path / "results", 3
    proc, wall = run_smoke(out, "--budget-s", str(budget), timeout=110)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    sections = json.loads((out / "sections.json").read_text())
    statuses = [s["status"] for s in sections]
    stopped = next(i for i, s in enumerate(statuses) if not s.startswith("done"))
    assert statuses[stopped] in ("cut at the budget", "not run (budget spent)"), statuses
    assert all(s == "not run (budget spent)" for s in statuses[stopped + 1:]), statuses
    assert len(statuses) > stopped + 5  # most of the run never started
    seconds = sum(s["seconds"] for s in sections)
    assert seconds < budget + 2  # the running section was cut near the budget, not at its end
    assert wall < budget + 60  # imports and writing included
    summary = (out / "summary.md").read_text()
    unfinished = [s["section"] for s in sections[stopped:]]
    assert f"unfinished sections: {', '.join(unfinished)}" in summary
    from moe_lab.kernels.tuning import gpu_slug

    for s in sections:  # every section's file, the unfinished ones saying so
        part = json.loads((out / "sections" / f"{gpu_slug(s['section'])}.json").read_text())
        assert part["status"] == s["status"]
    checks = json.loads((out / "checks.json").read_text())
    assert all(c["ok"] for c in checks)  # what ran before the budget ran out, kept


def test_bad_budget_is_refused_naming_the_argument(tmp_path):
    proc, _ = run_smoke(tmp_path, "--budget-s", "-1", timeout=60)
    assert proc.returncode == 2 and "--budget-s must be a positive number of seconds" in proc.stderr


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_grouped_gemm_sections_layouts():
    """Both grouped GEMM sections' layouts (`grouped_layouts`): per layer, fp32 and bf16, packed
    and padded; the idle expert gets no rows, padded segments are whole multiples of the
    alignment inside the static bound, packed ones fill their rows exactly."""
    gc = load_script()
    shapes = {"a": dict(n_experts=4, tokens=24, top_k=2, d_model=16, d_expert=8)}
    for idle in (0, -1):
        layouts = list(gc.grouped_layouts(torch, "cpu", shapes, seed=0, idle=idle, align=16))
        assert [(c.dtype, "padded" in c.shape) for c in layouts] == [
            (torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)]
        for c in layouts:
            counts = c.offsets.diff()
            assert (c.n_experts, c.d_model, c.d_expert) == (4, 16, 8)
            assert c.offsets[0] == 0 and counts[idle] == 0
            if "padded" in c.shape:
                assert c.m == 48 + 4 * 15 and bool((counts % 16 == 0).all()) and c.offsets[-1] <= c.m
            else:
                assert c.m == int(c.offsets[-1]) <= 48 and c.shape == f"a M={c.m}"  # the idle's picks dropped
    first, again = (next(gc.grouped_layouts(torch, "cpu", shapes, seed=0, idle=0)) for _ in range(2))
    assert torch.equal(first.offsets, again.offsets)  # the same seed, the same routing


def test_the_router_margin_is_the_closest_ranked_pair_in_float32_ulps():
    from moe_lab.config import MoEConfig

    gc = load_script()
    cfg = MoEConfig(d_model=8, n_experts=4, top_k=2, d_expert=8, score_func="sigmoid")
    one = torch.tensor(0.3)
    near = torch.nextafter(one, torch.tensor(1.0))
    logits = torch.stack([torch.tensor([2.0, 0.3, -1.0, 0.9]),  # far apart everywhere
                          torch.stack([torch.tensor(2.0), one, near, torch.tensor(-3.0)])])
    margin = gc.topk_margin_ulps(torch, logits, cfg, None)
    assert margin[0] > 1e5 and margin[1] < gc.ROUTER_TIE_ULPS  # 0.3 vs its neighbour: a tie
    grouped = MoEConfig(d_model=8, n_experts=4, top_k=1, d_expert=8, n_groups=2, topk_groups=1,
                        score_func="sigmoid")
    # groups {0, 1} and {2, 3} score the same (the sums of their two experts): a group tie
    tie = gc.topk_margin_ulps(torch, torch.tensor([[1.0, -1.0, -1.0, 1.0]]), grouped, None)
    assert tie[0] < gc.ROUTER_TIE_ULPS


def test_a_near_tie_id_is_counted_and_an_id_flipped_elsewhere_fails(monkeypatch, tmp_path):
    from moe_lab.moe import router

    gc = load_script()
    shapes = {"T=48 E=8 top2 softmax, seqs of 6": (48, 6, dict(d_model=32, n_experts=8, top_k=2))}
    real = router.ROUTER_IMPLS["triton"]
    for flip_near in (True, False):
        def fused(x, w, cfg, bias, seq_len=None, flip_near=flip_near):
            out = real(x, w, cfg, bias, seq_len=seq_len)
            ids = out.topk_ids.clone()
            ids[5] = ids[5].flip(0)  # token 5's two ids swapped
            return dataclasses.replace(out, topk_ids=ids)

        monkeypatch.setitem(router.ROUTER_IMPLS, "triton", fused)
        margins = torch.full((48,), 1e9)
        margins[5] = 1.0 if flip_near else 1e9
        monkeypatch.setattr(gc, "topk_margin_ulps", lambda *a, m=margins: m)
        rep = gc.Report(tmp_path, {}, 60.0)
        gc.section_router(torch, "cpu", rep, shapes)
        ids = next(c for c in rep.checks if c["check"] == "fused router ids")
        assert ids["ok"] is flip_near and ids["differing_tokens"] == 1
        assert ids["near_ties"] == (1 if flip_near else 0)


def test_the_budget_cuts_a_section_even_when_a_library_wraps_its_interrupt(tmp_path):
    """The budget's interrupt raised inside Triton's interpreter came back as an
    InterpreterError (a TypeError inside), and the run reported a failure instead of a cut.
    A section whose interrupt is caught and re-raised as another error is still a cut; an
    error with no interrupt behind it is still a failure."""
    gpu_check = load_script()
    report = gpu_check.Report(tmp_path, {}, budget_s=0.3)

    def wrapped():
        try:
            time.sleep(5)
        except BaseException as exc:  # what a library that catches everything does
            raise RuntimeError("wrapped") from exc

    def broken():
        raise RuntimeError("a real failure")

    report.run("broken", broken)
    report.run("wrapped", wrapped)
    assert [s["status"] for s in report.sections] == ["failed", "cut at the budget"]
