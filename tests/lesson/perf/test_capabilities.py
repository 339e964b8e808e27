"""The machine probed once (`moe_lab.perf.capabilities`), the datasheet table and roofline
(`moe_lab.perf.hardware`), the MLPerf results as data."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os

import numpy as np
import pytest
import torch

import moe_lab.perf as perf
from moe_lab.perf import hardware
from moe_lab.workbench import mlperf

# `moe_lab.perf.capabilities` names the function on the package, so the module itself is reached
# through sys.modules.
caps_mod = importlib.import_module("moe_lab.perf.capabilities")


def test_the_package_name_is_the_function_whatever_was_imported():
    importlib.import_module("moe_lab.perf.capabilities")
    assert perf.capabilities is caps_mod.capabilities and callable(perf.capabilities)
    with pytest.raises(AttributeError):
        perf.no_such_thing  # noqa: B018


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
    cpu = caps_mod.Capabilities(
        device="cpu", device_name="Intel(R) Xeon(R) Platinum 8488C CPU @ 2.4GHz", n_threads=8, n_devices=1,
        cuda_capability=None, triton_mode="interpreted", transformer_engine=False, native_mxfp8=False,
        has_grouped_mm=True)
    assert cpu.hardware_label() == "cpu:Intel Xeon Platinum 8488C x8"
    amd = dataclasses.replace(cpu, device_name="AMD EPYC 9R14 96-Core Processor")
    assert amd.hardware_label() == "cpu:AMD EPYC 9R14 x8"
    h100 = dataclasses.replace(cpu, device="cuda", device_name="NVIDIA H100 80GB HBM3")
    assert h100.hardware_label() == "H100"
    assert dataclasses.replace(h100, device_name="NVIDIA H200").hardware_label() == "H200"
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
    model, flags = caps_mod.cpuinfo()
    assert model == "AMD EPYC 9R14 96-Core Processor"  # the first CPU's
    assert flags == {"fpu", "sse", "avx512f", "avx512_bf16"} and flags & caps_mod.CPU_BF16_FLAGS
    info.write_text("model name\t: old\nflags\t\t: fpu avx2\n")
    assert not caps_mod.cpuinfo()[1] & caps_mod.CPU_BF16_FLAGS


# ------------------------------------------------------------------------------ hardware


def test_hardware_table():
    assert set(hardware.GPUS) == {"A100", "L4", "H100 SXM", "H200 SXM", "B200", "GB300"}
    for spec in hardware.GPUS.values():
        assert spec.source in ("datasheet", "third-party") and spec.note
        if spec.name != "A100":  # no FP8 tensor cores
            assert spec.fp8_tflops == pytest.approx(2 * spec.bf16_tflops, rel=0.01)
    assert hardware.gpu_spec("A100").fp8_tflops is None
    with pytest.raises(ValueError, match="no native fp8"):
        hardware.gpu_spec("A100").peak_flops("fp8")
    for arch in hardware.ARCHS.values():  # the table's GPU of each architecture, where it has rates
        assert arch.gpu in hardware.GPUS or arch.arch in ("sm_75", "sm_86")
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
        hardware.gpu_spec("V100")


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
    with pytest.raises(ValueError, match="benchmark"):
        mlperf.result("ResNet-50")
    seed = mlperf.DEEPSEEK_V3_GB300
    assert seed["tflops_per_gpu"] / seed["tokens_per_s_per_gpu"] * 1e3 == pytest.approx(
        260, rel=0.01)
