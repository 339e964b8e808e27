"""moe_lab.perf: timers, capabilities, ceilings, the hardware table, MLPerf data and the
lab-bench exercises (notebook 00 itself runs in tests/test_notebooks.py)."""

from __future__ import annotations

import importlib
import json
import math
import os
import time

import numpy as np
import pytest
import torch

import moe_lab.perf as perf
from moe_lab.lab.exercises import ExerciseError, not_done, solution
from moe_lab.lab.exercises import nb00_lab_bench as ex
from moe_lab.perf import ceilings, hardware, mlperf
from moe_lab.perf.bench import MIN_ADAPTIVE_REPEAT, BenchResult, Comparison, bench, compare

# `moe_lab.perf.bench` and `moe_lab.perf.capabilities` name functions on the package, so
# the modules themselves are reached through sys.modules.
bench_mod = importlib.import_module("moe_lab.perf.bench")
caps_mod = importlib.import_module("moe_lab.perf.capabilities")

# ------------------------------------------------------------------------------ bench


def test_bench_result_statistics():
    r = BenchResult.from_times([5.0, 1.0, 3.0, 2.0, 4.0], "cpu")
    assert (r.median_s, r.min_s, r.max_s, r.n) == (3.0, 1.0, 5.0, 5)
    assert r.iqr_s == pytest.approx(2.0)  # inclusive quartiles 2 and 4
    assert r.per_second(6.0) == pytest.approx(2.0)
    assert "median" in str(r) and "n=5" in str(r)
    one = BenchResult.from_times([0.5], "cpu")
    assert one.iqr_s == 0.0 and one.median_s == 0.5
    with pytest.raises(ValueError, match="times"):
        BenchResult.from_times([], "cpu")
    with pytest.raises(ValueError, match="items"):
        r.per_second(-1)


def test_bench_counts_warmup_and_repeat_calls():
    calls = []
    r = bench(lambda a, b=0: calls.append((a, b)), 1, b=2, warmup=3, repeat=7)
    assert len(calls) == 10 and calls[0] == (1, 2)
    assert r.n == 7 and len(r.times) == 7 and r.device == "cpu"


def test_bench_adaptive_stops_on_min_time_or_cap():
    calls = []
    r = bench(lambda: calls.append(1), warmup=0, min_time_s=0.0)
    assert r.n == MIN_ADAPTIVE_REPEAT == len(calls)
    r = bench(lambda: time.sleep(0.002), warmup=0, min_time_s=0.03)
    assert sum(r.times) >= 0.03 and r.n >= MIN_ADAPTIVE_REPEAT
    r = bench(lambda: None, warmup=0, min_time_s=100.0, max_repeat=7)
    assert r.n == 7


def test_bench_times_each_call_separately():
    # sleep never returns early, so every single timing is at least the sleep.
    r = bench(time.sleep, 0.002, warmup=1, repeat=4)
    assert min(r.times) >= 0.002 and r.min_s == min(r.times)
    assert r.min_s <= r.median_s <= r.max_s


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"repeat": 0}, "repeat"),
        ({"repeat": 2.5}, "repeat"),
        ({"warmup": -1}, "warmup"),
        ({"max_repeat": 0}, "max_repeat"),
        ({"min_time_s": -0.1}, "min_time_s"),
        ({"min_time_s": math.inf}, "min_time_s"),
    ],
)
def test_bench_validates_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench(lambda: None, **kwargs)
    with pytest.raises(ValueError, match=match):
        compare({"a": lambda: None}, **kwargs)


def test_bench_rejects_non_callable_and_compare_rejects_bad_fns():
    with pytest.raises(ValueError, match="fn must be callable"):
        bench(3)
    with pytest.raises(ValueError, match="fns"):
        compare({})
    with pytest.raises(ValueError, match=r"fns\['b'\]"):
        compare({"a": lambda: None, "b": 1})


def test_compare_interleaves_rounds_and_alternates_order():
    log = []
    fns = {"a": lambda x: log.append("a"), "b": lambda x: log.append("b")}
    res = compare(fns, torch.ones(2), warmup=1, repeat=4)
    assert list(res) == ["a", "b"] and all(r.n == 4 for r in res.values())
    # warm-up a,b; then rounds a,b / b,a / a,b / b,a
    assert "".join(log) == "ab" + "abbaabba"
    log.clear()
    compare(fns, torch.ones(2), warmup=0, repeat=3, alternate=False)
    assert "".join(log) == "aaabbb"


def test_compare_adaptive_is_paced_by_the_slowest_provider():
    res = compare({"fast": lambda: None, "slow": lambda: time.sleep(0.002)},
                  warmup=0, min_time_s=0.02)
    assert res["fast"].n == res["slow"].n >= MIN_ADAPTIVE_REPEAT  # one call each per round
    assert sum(res["slow"].times) >= 0.02
    # 0.02 s of 2 ms sleeps needs at most 10 rounds; pacing by the fast one would need ~max
    assert res["slow"].n <= 11
    capped = compare({"a": lambda: None, "b": lambda: None}, warmup=0, min_time_s=10.0,
                     max_repeat=6)
    assert capped["a"].n == capped["b"].n == 6


def test_comparison_ratios_and_fastest():
    c = Comparison(
        base=BenchResult.from_times([2.0, 2.0, 2.0], "cpu"),
        fast=BenchResult.from_times([0.5, 0.5, 0.5], "cpu"),
    )
    assert c.ratios() == {"base": 1.0, "fast": 4.0}
    assert c.ratios("fast")["base"] == pytest.approx(0.25)
    assert c.fastest() == "fast" and c.baseline == "base"
    assert "x4.00" in str(c)
    with pytest.raises(ValueError, match="baseline"):
        c.ratios("nope")


def test_infer_device_follows_tensor_arguments():
    assert bench_mod.infer_device((torch.ones(1),), {}) == "cpu"
    assert bench_mod.infer_device((), {"x": [torch.ones(1)]}) == "cpu"
    no_tensors = bench_mod.infer_device((), {})
    assert no_tensors == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_cuda_uses_events():
    a = torch.randn(1024, 1024, device="cuda")
    r = bench(torch.matmul, a, a, repeat=5)
    assert r.device == "cuda" and r.n == 5 and r.min_s > 0


# ------------------------------------------------------------------------------ package


def test_package_names_are_functions_whatever_was_imported():
    importlib.import_module("moe_lab.perf.bench")
    importlib.import_module("moe_lab.perf.capabilities")
    assert perf.bench is bench and callable(perf.capabilities)
    assert perf.compare is compare and perf.BenchResult is BenchResult
    assert perf.ledger.__name__ == "moe_lab.perf.ledger"
    with pytest.raises(AttributeError):
        perf.no_such_thing  # noqa: B018


def test_ledger_record_carries_hardware_label(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_LAB_RESULTS_DIR", str(tmp_path))
    perf.ledger.record("00_lab_bench", "test", "matmul_gflops", 1.5, "GFLOP/s")
    (rec,) = perf.ledger.read()
    assert rec["hardware"] == perf.capabilities().hardware_label()
    assert rec["versions"]["torch"] == torch.__version__


# ------------------------------------------------------------------------------ capabilities


def test_capabilities_detected_once_and_consistent():
    c = perf.capabilities()
    assert c is perf.capabilities()
    assert c.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert c.n_threads == torch.get_num_threads()
    assert c.has_grouped_mm == hasattr(torch, "_grouped_mm")
    assert caps_mod.is_cuda() == (c.device == "cuda")
    assert caps_mod.native_mxfp8() == c.native_mxfp8
    assert caps_mod.triton_interpreted() == (c.triton_mode == "interpreted")
    if c.triton_mode == "compiled":
        assert c.device == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    for key in ("python", "torch", "triton", "numpy"):
        assert key in c.versions
    assert json.loads(json.dumps(c.to_dict()))["hardware_label"] == c.hardware_label()
    assert c.hardware_label() in c.summary() and c.triton_mode in c.summary()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machine only")
def test_capabilities_on_cpu():
    c = perf.capabilities()
    assert c.triton_mode == "interpreted" and c.cuda_capability is None
    assert not c.native_mxfp8
    assert c.hardware_label().startswith("cpu:") and c.hardware_label().endswith(
        f"x{c.n_threads}")


def test_label_helpers():
    assert caps_mod._short_gpu_name("NVIDIA H200") == "H200"
    assert caps_mod._short_gpu_name("NVIDIA H100 80GB HBM3") == "H100"
    assert caps_mod._short_cpu_name("Intel(R) Xeon(R) Platinum 8488C CPU @ 2.4GHz") == \
        "Intel Xeon Platinum 8488C"
    assert caps_mod._short_cpu_name("AMD EPYC 9R14 96-Core Processor") == "AMD EPYC 9R14"
    c = caps_mod.Capabilities(
        device="cuda", device_name="NVIDIA GB300", n_threads=8, cuda_capability=(10, 3),
        n_devices=4, triton_mode="compiled", transformer_engine=True, native_mxfp8=True,
        has_grouped_mm=True, versions={"torch": "x"},
    )
    assert c.hardware_label() == "GB300 x4" and "sm_103" in c.summary()
    assert c.cpu_bf16 is False and c.to_dict()["cpu_bf16"] is False  # not detected: off


def test_cpuinfo_reads_model_and_flags(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n"
                    "flags\t\t: fpu sse avx512f avx512_bf16\n\nprocessor\t: 1\n"
                    "model name\t: other\nflags\t\t: fpu\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(
        info if path == "/proc/cpuinfo" else path, *a, **k))
    model, flags = caps_mod._cpuinfo()
    assert model == "AMD EPYC 9R14 96-Core Processor"  # the first CPU's
    assert flags == {"fpu", "sse", "avx512f", "avx512_bf16"} and flags & caps_mod.CPU_BF16_FLAGS
    info.write_text("model name\t: old\nflags\t\t: fpu avx2\n")
    assert not caps_mod._cpuinfo()[1] & caps_mod.CPU_BF16_FLAGS


# ------------------------------------------------------------------------------ ceilings


def test_matmul_peak_is_flops_over_median_and_never_on_zeros(monkeypatch):
    seen = []

    def spy(fn, *args, **kwargs):
        seen.extend(t for t in args if isinstance(t, torch.Tensor))
        return bench(fn, *args, **kwargs)

    monkeypatch.setattr(ceilings, "bench", spy)
    c = ceilings.matmul_peak("fp32", 128, min_time_s=0.0)
    assert c.value == pytest.approx(2 * 128**3 / c.result.median_s)
    assert c.unit == "FLOP/s" and c.name == "matmul_fp32" and c.params["n"] == 128
    assert seen and all(t.abs().sum() > 0 for t in seen)
    assert c.hardware == perf.capabilities().hardware_label()
    b = ceilings.matmul_peak(torch.bfloat16, 64, min_time_s=0.0)
    assert b.name == "matmul_bf16" and b.value > 0


def test_copy_bandwidth_counts_read_and_write():
    c = ceilings.copy_bandwidth(4 * 2**20, min_time_s=0.0)
    assert c.value == pytest.approx(2 * 4 * 2**20 / c.result.median_s)
    assert c.unit == "B/s" and c.giga == pytest.approx(c.value / 1e9)


def test_ceilings_validate():
    with pytest.raises(ValueError, match="dtype"):
        ceilings.matmul_peak("int8", 64)
    with pytest.raises(ValueError, match="n must"):
        ceilings.matmul_peak("fp32", 0)
    with pytest.raises(ValueError, match="nbytes"):
        ceilings.copy_bandwidth(2)
    with pytest.raises(ValueError, match="profile"):
        ceilings.measure_ceilings("huge")
    with pytest.raises(ValueError, match="device"):
        ceilings.matmul_peak("fp32", 64, device="tpu")


@pytest.mark.slow
def test_measure_ceilings_smoke():
    out = ceilings.measure_ceilings("smoke")
    assert set(out) == {"matmul_fp32", "matmul_bf16", "copy"}
    assert all(c.value > 0 and c.result.n >= MIN_ADAPTIVE_REPEAT for c in out.values())


# ------------------------------------------------------------------------------ hardware


def test_hardware_table():
    assert set(hardware.GPUS) == {"H100 SXM", "H200 SXM", "B200", "GB200", "GB300"}
    for spec in hardware.GPUS.values():
        assert spec.source in ("datasheet", "third-party") and spec.note
        assert spec.fp8_tflops == pytest.approx(2 * spec.bf16_tflops, rel=0.01)
    h200 = hardware.gpu_spec("H200")
    assert h200 is hardware.gpu_spec("h200 sxm") is hardware.gpu_spec("NVIDIA H200 SXM")
    assert (h200.bf16_tflops, h200.hbm_tbps, h200.hbm_gb) == (989, 4.8, 141)
    assert not h200.native_mxfp8 and hardware.gpu_spec("GB300").native_mxfp8
    assert hardware.gpu_spec("GB300").peak_flops("fp8") == 5000e12
    with pytest.raises(ValueError, match="no native mxfp8"):
        h200.peak_flops("mxfp8")
    with pytest.raises(ValueError, match="dtype"):
        h200.peak_flops("fp4")
    with pytest.raises(ValueError, match="name must be one of"):
        hardware.gpu_spec("A100")


def test_roofline():
    assert hardware.roofline(100.0, 10.0, 2.0) == 20.0  # memory-bound
    assert hardware.roofline(100.0, 10.0, 50.0) == 100.0  # compute-bound
    arr = hardware.roofline(100.0, 10.0, np.array([1.0, 10.0, 100.0]))
    np.testing.assert_allclose(arr, [10.0, 100.0, 100.0])
    h200 = hardware.gpu_spec("H200")
    ridge = h200.ridge_intensity
    assert hardware.roofline(h200.peak_flops(), h200.bandwidth, ridge) == pytest.approx(
        h200.peak_flops())
    with pytest.raises(ValueError, match="bandwidth"):
        hardware.roofline(1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="intensity"):
        hardware.roofline(1.0, 1.0, -1.0)


def test_matmul_intensity():
    # square n: 2n^3 / (3 n^2 * b) = 2n / (3b)
    assert hardware.matmul_intensity(96, 96, 96, 2.0) == pytest.approx(32.0)
    with pytest.raises(ValueError, match="k must"):
        hardware.matmul_intensity(1, 1, 0)


# ------------------------------------------------------------------------------ MLPerf data


def test_mlperf_table():
    assert len(mlperf.RESULTS) == 7
    ds = mlperf.result("deepseek-v3 671b")
    assert (ds.n_gpus, ds.minutes, ds.system, ds.moe) == (8192, 2.02, "GB300 NVL72", True)
    assert ds.gpu_hours == pytest.approx(8192 * 2.02 / 60)
    md = mlperf.results_table()
    assert md.count("\n| ") == 7 and "NVIDIA" in md and "2.02" in md
    plain = mlperf.results_table(markdown=False)
    assert "GPT-OSS-20B" in plain and "|" not in plain.splitlines()[0]
    with pytest.raises(ValueError, match="benchmark"):
        mlperf.result("ResNet-50")
    seed = mlperf.DEEPSEEK_V3_GB300
    assert seed["tflops_per_gpu"] / seed["tokens_per_s_per_gpu"] * 1e3 == pytest.approx(
        260, rel=0.01)


# ------------------------------------------------------------------------------ exercises


def test_exercise_checks_accept_the_reference():
    ex.check_expert_training_flops(solution("expert_training_flops"))
    ex.check_matmul_attainable_flops(solution("matmul_attainable_flops"))
    assert solution("expert_training_flops") is ex.expert_training_flops


def test_exercise_checks_reject_wrong_answers():
    with pytest.raises(ExerciseError, match="not solved"):
        ex.check_expert_training_flops(not_done)
    with pytest.raises(ExerciseError, match="forward pass only"):
        ex.check_expert_training_flops(lambda d, f: 2 * 3 * d * f)
    with pytest.raises(ExerciseError, match="three matrices"):
        ex.check_expert_training_flops(lambda d, f: 2 * d * f * 6)
    with pytest.raises(ExerciseError, match="not solved"):
        ex.check_matmul_attainable_flops(not_done)
    # Forgetting the roofline's min: always the peak -> wrong on memory-bound shapes.
    with pytest.raises(ExerciseError, match="memory-bound"):
        ex.check_matmul_attainable_flops(lambda m, n, k, b, peak, bw: peak)
    # Forgetting bytes per element.
    with pytest.raises(ExerciseError):
        ex.check_matmul_attainable_flops(
            lambda m, n, k, b, peak, bw: min(peak, bw * 2 * m * n * k / (m * k + k * n + m * n)))
