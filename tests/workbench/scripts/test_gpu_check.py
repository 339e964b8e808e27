"""scripts/gpu_check.py stays runnable: its --cpu-smoke mode checks every kernel (interpreted,
tiny shapes) exactly as the GPU run does, times every notebook's headline figure and writes
the same files; every check the README promises is among them; a budget that runs out stops
the run cleanly with what finished written; a router id flipped by a near-tie is counted,
one flipped elsewhere fails."""

import contextlib
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
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
                     "grouped_gemm_tma bfloat16 fwd", "grouped_gemm_tma float32 dX",
                     "grouped_gemm_tma bfloat16 dW", "03 grouped matmul (solution) vs loop",
                     "04 dropless layer (torch) vs naive", "04 dropless layer (triton) vs naive"):
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
    assert json.loads((out / "kernels.json").read_text()) == []  # interpreted: nothing compiled
    sections = json.loads((out / "sections.json").read_text())
    assert [s["status"] for s in sections] == ["done"] * len(sections)
    assert {s["section"] for s in sections} >= {"fused MoE", "TMA grouped GEMM",
                                                "registers and spills", "MXFP8 kernels",
                                                "12 tokens/s of the optimised step", "tuning"}
    notes = {s["section"]: s.get("note", "") for s in sections}
    assert "no CUDA device" in notes["sync debug"]  # a no-op on a CPU, and it says so
    assert {c["section"] for c in checks if "fp8_promote" in c["check"]} == {"MXFP8 kernels"}  # a child's
    env = json.loads((out / "env.json").read_text())
    assert env["triton_mode"] == "interpreted" and not [v for v in env["preflight"].values()
                                                        if not v.startswith("ok")]
    tuned = json.loads((out / "tuned_configs.json").read_text())  # the tuner ran, its winners kept
    from moe_lab.kernels.launch import LaunchConfig

    assert tuned["configs"] and all(LaunchConfig(dict(e["blocks"]), int(e["num_warps"]), int(e["num_stages"]),
                                                 e.get("group_m")) for e in tuned["configs"].values())
    assert {b["bench"] for b in json.loads((out / "bench.json").read_text())} >= {"tuned gemm", "tuned dw"}
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
    checks = json.loads((out / "checks.json").read_text())
    assert all(c["ok"] for c in checks)  # what ran before the budget ran out, kept


def test_bad_budget_is_refused_naming_the_argument(tmp_path):
    proc, _ = run_smoke(tmp_path, "--budget-s", "-1", timeout=60)
    assert proc.returncode == 2 and "--budget-s: must be a positive number of seconds" in proc.stderr


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
        assert [(dtype, "padded" in shape) for _, _, dtype, _, _, shape, _ in layouts] == [
            (torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)]
        for layer, m, _, _, offsets, shape, _ in layouts:
            counts = offsets.diff()
            assert layer is shapes["a"] and len(counts) == 4
            assert offsets[0] == 0 and counts[idle] == 0
            if "padded" in shape:
                assert m == 48 + 4 * 15 and bool((counts % 16 == 0).all()) and offsets[-1] <= m
            else:
                assert m == int(offsets[-1]) <= 48 and shape == f"a M={m}"  # the idle's picks dropped
    first, again = (next(gc.grouped_layouts(torch, "cpu", shapes, seed=0, idle=0)) for _ in range(2))
    assert torch.equal(first[4], again[4])  # the same seed, the same routing


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

    report.run(gpu_check.Section("broken", broken))
    report.run(gpu_check.Section("wrapped", wrapped))
    assert [s["status"] for s in report.sections] == ["failed", "cut at the budget"]


# ------------------------------------------------------------------ a run that keeps its evidence


def statuses(out: Path) -> dict[str, str]:
    return {s["section"]: s["status"] for s in json.loads((out / "sections.json").read_text())}


# A child process as a GPU's fault would leave it: it records one check, then the "CUDA graph
# step" aborts (as a device-side assert or an illegal address ends a process) and every other
# section hangs with the alarm blocked, so nothing in the process can interrupt it (as a wait
# on an mbarrier that never completes, inside the driver).
STAND_IN_CHILD = """
import importlib.util, os, signal, sys, time
from pathlib import Path

args = sys.argv
section, sink = args[args.index("--child") + 1], Path(args[args.index("--child-sink") + 1])
spec = importlib.util.spec_from_file_location("gpu_check", {script!r})
gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)
gc.exit_with_parent(int(args[args.index("--child-of") + 1]))
sink.with_suffix(".started").touch()
rep = gc.Report(Path("."), {{}}, 60.0, sink=sink)
rep.current = section
rep.check("stand-in check before the fault", "-", 0.0, 0.0)
if section == "CUDA graph step":
    os.abort()
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM, signal.SIGINT}})
while True:
    time.sleep(3600)
"""


def stand_in_child(tmp_path: Path) -> Path:
    """The file a run starts as its children in place of this script (its ``__file__``)."""
    path = tmp_path / "stand_in_child.py"
    path.write_text(STAND_IN_CHILD.format(script=str(SCRIPT)))
    return path


@pytest.mark.timeout(200)
def test_a_hang_and_a_crash_in_child_sections_cost_those_sections_only_and_a_resume_reruns_them(
        tmp_path, monkeypatch):
    """The rehearsal: one child section hangs where nothing can interrupt it (the alarm
    blocked, as in a device wait), another aborts; the sections around them finish, the two
    are named with what happened (the check each finished kept), and ``--resume`` reruns
    just those, keeping the rest."""
    gc = load_script()
    for name in ("TRITON_INTERPRET", "MOE_LAB_NO_CPU_EXTENSION", "TRITON_CACHE_DIR"):  # main sets them
        monkeypatch.setenv(name, os.environ.get(name, "1" if name != "TRITON_CACHE_DIR" else str(tmp_path)))
    monkeypatch.setattr(gc, "__file__", str(stand_in_child(tmp_path)))
    out = tmp_path / "results"
    sections = ["permute", "TMA grouped GEMM", "CUDA graph step", "MX quantizer"]
    args = ["--cpu-smoke", "--out", str(out), "--section-timeout-s", "2", "--sections", *sections]
    assert gc.main(args) == 1
    got = statuses(out)
    assert list(got) == ["permute", "MX quantizer", "TMA grouped GEMM", "CUDA graph step"]  # children last
    assert got["permute"] == got["MX quantizer"] == "done"
    assert got["TMA grouped GEMM"] == "hung: killed after 2 s"
    assert got["CUDA graph step"] == "crashed (killed by SIGABRT)"
    checks = json.loads((out / "checks.json").read_text())
    failed = {c["section"]: c["error"] for c in checks if not c["ok"]}
    assert set(failed) == {"TMA grouped GEMM", "CUDA graph step"}, failed
    kept = {c["section"] for c in checks if c["check"] == "stand-in check before the fault"}
    assert kept == {"TMA grouped GEMM", "CUDA graph step"}  # what each child finished
    assert {c["section"] for c in checks if c["ok"]} == {"permute", "MX quantizer"} | kept
    summary = (out / "summary.md").read_text()
    assert "| TMA grouped GEMM | hung: killed after 2 s |" in summary and "SIGABRT" in summary

    proc, _ = run_smoke(out, "--resume", "--sections", "TMA grouped GEMM", "permute",
                        timeout=150)  # permute: done already, not run again
    # the crash is still on record
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = statuses(out)
    assert again["TMA grouped GEMM"] == "done"
    assert {k: v for k, v in again.items() if k != "TMA grouped GEMM"} == {
        k: v for k, v in got.items() if k != "TMA grouped GEMM"}  # the first call's, kept
    checks = json.loads((out / "checks.json").read_text())
    assert any(c["check"].startswith("grouped_gemm_tma") and c["ok"] for c in checks)
    assert any(c["section"] == "permute" and c["ok"] for c in checks)  # kept from the first call
    assert not any(c["check"].startswith("stand-in") for c in checks if c["section"] == "TMA grouped GEMM")
    assert [c["section"] for c in checks if not c["ok"]] == ["CUDA graph step"]  # the crash, kept


@pytest.mark.timeout(150)
def test_a_run_killed_from_outside_names_the_section_it_died_in(tmp_path):
    out = tmp_path / "results"
    args = ["--cpu-smoke", "--out", str(out), "--sections", "permute", "TMA grouped GEMM"]
    run = ("import importlib.util, sys\n"
           f"spec = importlib.util.spec_from_file_location('gpu_check', {str(SCRIPT)!r})\n"
           "gc = importlib.util.module_from_spec(spec)\n"
           "spec.loader.exec_module(gc)\n"
           f"gc.__file__ = {str(stand_in_child(tmp_path))!r}\n"  # its TMA child hangs
           f"sys.exit(gc.main({args!r}))\n")
    proc = subprocess.Popen([sys.executable, "-c", run],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline:
            if (out / "sections.json").exists() and statuses(out).get("TMA grouped GEMM") == "running":
                break
            time.sleep(0.2)
        else:
            pytest.fail("the run never marked its section running")
    finally:
        os.killpg(proc.pid, 9)  # the parent and its child, as a lost machine would
        proc.wait()
    got = statuses(out)
    assert got == {"permute": "done", "TMA grouped GEMM": "running"}
    # The hung child (its own group, which the kill above did not reach) ends with its parent.
    deadline = time.monotonic() + 20
    while (alive := children_writing_to(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"the hung child outlived the run that started it: pids {alive}"


def children_writing_to(out: Path) -> list[int]:
    """The pids of live processes whose command line names ``out`` (a run's children)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if str(out).encode() in cmd and state != "Z":
                pids.append(int(proc.name))
    return pids


def test_sections_and_skip_are_checked_at_the_door(tmp_path, monkeypatch, capsys):
    gc = load_script()
    for name in ("TRITON_INTERPRET", "MOE_LAB_NO_CPU_EXTENSION", "TRITON_CACHE_DIR"):  # main sets them
        monkeypatch.setenv(name, os.environ.get(name, "1" if name != "TRITON_CACHE_DIR" else str(tmp_path)))
    for args, message in ((["--sections", "permutation"], "unknown section 'permutation'"),
                          (["--skip", "nope"], "unknown section 'nope'"),
                          (["--resume"], "no earlier run")):
        with pytest.raises(SystemExit) as stop:
            gc.main(["--cpu-smoke", "--out", str(tmp_path / "never"), *args])
        assert stop.value.code == 2 and message in capsys.readouterr().err, args
        assert not (tmp_path / "never" / "checks.json").exists()


def test_the_smoke_run_writes_under_build_and_a_gpu_run_under_results():
    gc = load_script()
    assert gc.default_out(None).is_relative_to(gc.ROOT / "build")
    gpu_out = gc.default_out("NVIDIA H200")
    assert gpu_out == gc.ROOT / "results" / "nvidia_h200"


def test_the_tuned_table_is_rewritten_after_every_launch_in_the_out_folder(tmp_path, monkeypatch):
    from moe_lab.kernels import grouped_gemm  # noqa: F401 (registers the grouped GEMM ops)
    from moe_lab.workbench.measure import autotune as tuning

    gc = load_script()
    out = tmp_path / "nvidia_h200"
    out.mkdir()
    rep = gc.Report(out, {"gpu": "NVIDIA H200"}, 60.0)
    shapes = {"a": dict(n_experts=2, tokens=8, top_k=2, d_model=32, d_expert=16)}
    launches = gc.layer_launches(32, 16)
    written, layouts = [], []
    real_put = gc.put

    def put(path, text):
        real_put(path, text)
        if path.name == tuning.TUNED_FILE:
            written.append(len(json.loads(text)["configs"]))

    def seconds(fn):  # what the launches were handed
        fn()
        return 1.0

    real_op = torch.ops.moe_lab.grouped_gemm

    def record_layout(x, w, offsets):
        layouts.append(w.is_contiguous())
        return real_op(x, w, offsets)

    monkeypatch.setattr(gc, "put", put)
    monkeypatch.setattr(gc, "seconds", seconds)
    monkeypatch.setattr(torch.ops.moe_lab, "grouped_gemm", record_layout)
    gc.bench_tuning(torch, "cpu", rep, shapes, small=True)
    keys = {tuning.table_key(kernel, 16, n, k, 2, torch.bfloat16) for kernel, n, k, _ in launches}
    assert written == list(range(1, len(keys) + 1))  # one write per launch tuned, growing
    assert (out / tuning.TUNED_FILE).is_file() and not any(tmp_path.glob("**/*.tmp"))
    # the dX launches (the transposed view of the weight) are timed as the layer runs them
    transposed = [la for la in launches if la[0] == "gemm" and la[3]]
    assert transposed and layouts.count(False) == 2 * len(transposed)  # two configs each


def preflight_failures(found: dict[str, str]) -> list[str]:
    return [f"{what}: {why}" for what, why in found.items() if not why.startswith("ok")]


def test_the_preflight_stops_a_run_that_would_silently_interpret_on_a_gpu(tmp_path, monkeypatch):
    gc = load_script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    assert gc.main(["--out", str(tmp_path / "out")]) == 2
    env = json.loads((tmp_path / "out" / "env.json").read_text())
    assert "every kernel would run interpreted" in env["preflight"]["TRITON_INTERPRET"]
    assert env["triton_mode"] == "interpreted"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["env.json"]  # nothing ran
    found = gc.preflight(True, {"CC": str(tmp_path / "no-such-cc"),
                                "TRITON_CACHE_DIR": str(tmp_path / "c")})
    assert preflight_failures(found) == [f"C compiler: no C compiler ({tmp_path / 'no-such-cc'}): "
                                         "Triton builds each kernel's launcher with one"]
    monkeypatch.setattr(gc.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    (tmp_path / "a-file").write_text("")  # a cache path under a file: unwritable, even for root
    found = gc.preflight(True, {"TRITON_CACHE_DIR": str(tmp_path / "a-file" / "cache")})
    failures = preflight_failures(found)
    assert [f.split(":")[0] for f in failures] == ["Python.h", "Triton cache"]
    assert failures[0].startswith("Python.h: no Python.h in") and "set TRITON_CACHE_DIR" in failures[1]
    found = gc.preflight(False, {"TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path / "c")})
    assert not preflight_failures(found) and "C compiler" not in found  # interpreted: not needed


def stand_in_for_cuda_sync_debug(monkeypatch) -> None:
    """What ``torch.cuda.set_sync_debug_mode`` does to a sync, on a CPU (``is_available`` says
    yes, the mode is a variable): in mode ``"error"`` ``.item()``, ``.tolist()`` and ``.cpu()``
    (a copy to the host, which the host-side counter does not see on a CPU: the stand-in for a
    sync inside a C++ operator) raise with CUDA's words, in ``"warn"`` they warn; in any other
    mode they are torch's own."""
    names = ("item", "tolist", "cpu")
    real = {name: getattr(torch.Tensor, name) for name in names}
    mode = ["default"]

    def syncing(name):
        def call(self, *args, **kwargs):
            if mode[0] == "error":
                raise RuntimeError("called a synchronizing CUDA operation")
            warnings.warn("called a synchronizing CUDA operation", stacklevel=2)
            return real[name](self, *args, **kwargs)
        return call

    def set_mode(new):
        mode[0] = new
        for name in names:
            setattr(torch.Tensor, name, syncing(name) if new in ("warn", "error") else real[name])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode[0])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)


def test_the_sync_debug_section_passes_the_sync_free_paths_and_names_a_planted_sync(tmp_path, monkeypatch):
    gc = load_script()
    rep = gc.Report(tmp_path, {}, 60.0)
    rep.current = "sync debug"
    rep.sections.append({"section": "sync debug", "status": "running"})
    gc.section_sync_debug(torch, "cpu", rep, True)  # no CUDA, no stand-in: a no-op that says why
    assert rep.checks == [] and "no CUDA device" in rep.sections[0]["note"]

    paths = gc.sync_free_paths(torch, "cpu", small=True)
    assert {"dropless layer fwd+bwd (torch, float32)", "sync-free training step (tiny)"} <= set(paths)
    stand_in_for_cuda_sync_debug(monkeypatch)
    x = torch.ones(3)
    paths["planted"] = lambda: x.sum().item() and None
    counted = {"two reads": lambda: (x.tolist(), x.sum().item()) and None,
               "a read the counter misses": lambda: (x.tolist(), x.cpu()) and None}
    monkeypatch.setattr(gc, "sync_free_paths", lambda *args: paths)
    monkeypatch.setattr(gc, "one_f_one_b_path", lambda *args: contextlib.nullcontext(counted))
    gc.section_sync_debug(torch, "cpu", rep, True)
    by_name = {c["check"].split(": ", 1)[1]: c for c in rep.checks}
    assert set(by_name) == set(paths) | set(counted)
    planted = by_name.pop("planted")
    assert not planted["ok"] and planted["counted_syncs"] == 1
    assert "synchronizing" in planted["cuda_detector"] and "test_gpu_check.py" in planted["cuda_detector"]
    assert (by_name["two reads"]["ok"], by_name["two reads"]["cuda_syncs"]) == (True, 2)
    missed = by_name.pop("a read the counter misses")
    assert not missed["ok"] and (missed["cuda_syncs"], missed["counted_syncs"]) == (2, 1)
    assert all(c["ok"] and c["counted_syncs"] == 0 for name, c in by_name.items() if name != "two reads")


def test_the_sync_debug_section_counts_the_1f1b_schedules_syncs(tmp_path, monkeypatch):
    gc = load_script()
    stand_in_for_cuda_sync_debug(monkeypatch)
    rep = gc.Report(tmp_path, {}, 60.0)
    monkeypatch.setattr(gc, "sync_free_paths", lambda *args: {})
    gc.section_sync_debug(torch, "cpu", rep, True)
    (check,) = rep.checks
    assert check["check"] == "CUDA's sync count = the counter's: 1F1B schedule step (tiny, one rank)"
    assert check["counted_syncs"] >= 1 and check["cuda_syncs"] >= 1  # the count exchange, by design
