"""All timing (`moe_lab.workbench.measure.timing`): statistics, warm-up, adaptive repeats,
interleaved comparisons, and the ledger's hardware label."""

from __future__ import annotations

import importlib
import math
import time

import pytest
import torch

import moe_lab.perf as perf
from moe_lab.workbench.measure import ledger
from moe_lab.workbench.measure.timing import MIN_ADAPTIVE_REPEAT, BenchResult, Comparison, bench, compare

bench_mod = importlib.import_module("moe_lab.workbench.measure.timing")

# ------------------------------------------------------------------------------ bench


def test_bench_result_statistics():
    r = BenchResult.from_times([5.0, 1.0, 3.0, 2.0, 4.0], "cpu")
    assert (r.median_s, r.min_s, r.max_s, r.n) == (3.0, 1.0, 5.0, 5)
    assert r.iqr_s == pytest.approx(2.0)  # inclusive quartiles 2 and 4
    assert r.per_second(6.0) == pytest.approx(2.0)
    assert "median" in str(r) and "n=5" in str(r)
    one = BenchResult.from_times([0.5], "cpu")
    assert one.iqr_s == 0.0 and one.median_s == 0.5
    with pytest.raises(ValueError, match="items"):
        r.per_second(-1)


def test_bench_counts_warmup_and_repeat_calls():
    calls = []
    r = bench(lambda a, b=0: calls.append((a, b)), 1, b=2, warmup=3, repeat=7)
    assert len(calls) == 10 and calls[0] == (1, 2)
    assert r.n == 7 and len(r.times) == 7 and r.device == "cpu"


def test_bench_adaptive_stops_on_min_time_or_cap(monkeypatch):
    calls = []
    r = bench(lambda: calls.append(1), warmup=0, min_time_s=0.0)
    assert r.n == MIN_ADAPTIVE_REPEAT == len(calls)
    r = bench(lambda: time.sleep(0.002), warmup=0, min_time_s=0.03)
    assert sum(r.times) >= 0.03 and r.n >= MIN_ADAPTIVE_REPEAT
    monkeypatch.setattr(bench_mod, "MAX_ADAPTIVE_REPEAT", 7)
    r = bench(lambda: None, warmup=0, min_time_s=100.0)
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


def test_compare_adaptive_is_paced_by_the_slowest_provider(monkeypatch):
    res = compare({"fast": lambda: None, "slow": lambda: time.sleep(0.002)},
                  warmup=0, min_time_s=0.02)
    assert res["fast"].n == res["slow"].n >= MIN_ADAPTIVE_REPEAT  # one call each per round
    assert sum(res["slow"].times) >= 0.02
    # 0.02 s of 2 ms sleeps needs at most 10 rounds; pacing by the fast one would need ~max
    assert res["slow"].n <= 11
    monkeypatch.setattr(bench_mod, "MAX_ADAPTIVE_REPEAT", 6)
    capped = compare({"a": lambda: None, "b": lambda: None}, warmup=0, min_time_s=10.0)
    assert capped["a"].n == capped["b"].n == 6


def test_comparison_ratios():
    c = Comparison(
        base=BenchResult.from_times([2.0, 2.0, 2.0], "cpu"),
        fast=BenchResult.from_times([0.5, 0.5, 0.5], "cpu"),
    )
    assert c.ratios() == {"base": 1.0, "fast": 4.0}
    assert "x4.00 vs base" in str(c)


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


# ------------------------------------------------------------------------------ ledger


def test_ledger_record_carries_hardware_label(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_LAB_RESULTS_DIR", str(tmp_path))
    ledger.record("00_lab_bench", "test", "matmul_gflops", 1.5, "GFLOP/s")
    (rec,) = ledger.read()
    assert rec["hardware"] == perf.capabilities().hardware_label()
    assert rec["versions"]["torch"] == torch.__version__
