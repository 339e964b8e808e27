"""The architecture table (`moe_lab.perf.hardware.ARCHS`) and the gates that choose by it, with
the GPU mocked (no GPU here): each refused combination is one line naming the GPU, before any
kernel is compiled; each allowed one picks the path its hardware has."""

from __future__ import annotations

import importlib

import pytest
import torch

from moe_lab.kernels import common, mx_gemm
from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels import grouped_gemm_tma as tma
from moe_lab.perf.hardware import ARCHS, gpu_arch

caps_module = importlib.import_module("moe_lab.perf.capabilities")  # moe_lab.perf binds the function
CUDA = torch.device("cuda", 0)
GPUS = {(7, 5): "Tesla T4", (8, 0): "NVIDIA A100-SXM4-80GB", (8, 6): "NVIDIA A10G", (8, 9): "NVIDIA L4",
        (9, 0): "NVIDIA H200", (10, 0): "NVIDIA B200"}


@pytest.fixture
def gpu(monkeypatch):
    """``gpu((8, 6))`` makes this process see one compiled-Triton GPU of that capability."""
    def use(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPUS[capability])
        for module in (common, mx_gemm):
            monkeypatch.setattr(module, "INTERPRETED", False)
    return use


def test_the_table_rows_and_their_features():
    assert list(ARCHS) == ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100"]
    features = {a.arch: (a.bf16_mma, a.fp8_mma, a.tma, a.block_scaled_mma) for a in ARCHS.values()}
    assert features == {"sm_75": (False, False, False, False), "sm_80": (True, False, False, False),
                        "sm_86": (True, False, False, False), "sm_89": (True, True, False, False),
                        "sm_90": (True, True, True, False), "sm_100": (True, True, True, True)}
    for a in ARCHS.values():
        assert 0 <= a.reserved_shared_per_block <= 1024 and a.l2_mb > 0
        assert a.max_warps_per_sm * 32 <= 2048 and a.registers_per_sm == 65536
    assert [ARCHS[a].max_shared_per_block // 1024 for a in ARCHS] == [64, 163, 99, 99, 227, 227]
    assert [gpu_arch(c).arch for c in [(7, 0), (8, 7), (8, 9), (9, 0), (10, 3), (12, 0)]] == [
        "sm_75", "sm_86", "sm_89", "sm_90", "sm_100", "sm_89"]  # an sm_120 has no tcgen05
    with pytest.raises(ValueError, match="arch must be one of"):
        gpu_arch("sm_70")


def test_a_gpu_older_than_sm_80_is_refused_in_one_line_naming_it(gpu):
    gpu((7, 5))
    with pytest.raises(ValueError) as refused:
        common.check_device("x", CUDA)
    assert str(refused.value) == "compiled Triton requires bf16_mma (sm_80 or newer); this Tesla T4 is sm_75"
    with pytest.raises(ValueError, match="this Tesla T4 is sm_75"):  # whatever the kernel asks for
        common.check_device("x", CUDA, "tma", "the persistent TMA grouped GEMM")
    gpu((8, 0))
    common.check_device("x", CUDA)  # an A100 runs compiled Triton


def test_the_tma_grouped_gemm_is_refused_below_sm_90_before_compiling(gpu, monkeypatch):
    asked = []

    def recorded(name, device, needs="bf16_mma", what=""):
        asked.append((name, needs, what))
        raise StopIteration  # nothing after the check runs

    monkeypatch.setattr(tma, "check_device", recorded)
    x, w = torch.zeros(4, 16), torch.zeros(2, 16, 16)
    with pytest.raises(StopIteration):
        tma.grouped_gemm_tma(x, w, torch.tensor([0, 2, 4], dtype=torch.int32))
    assert asked == [("x", "tma", "the persistent TMA grouped GEMM (expert_backend='triton_tma')")]
    for capability in ((8, 0), (8, 6), (8, 9)):
        gpu(capability)
        with pytest.raises(ValueError, match=rf"requires tma \(sm_90 or newer\); this {GPUS[capability]}"):
            common.check_device("x", CUDA, "tma", asked[0][2])
    gpu((9, 0))
    common.check_device("x", CUDA, "tma", asked[0][2])
    assert not tma.warp_specialized(CUDA)
    gpu((10, 0))
    assert tma.warp_specialized(CUDA)


def test_mxfp8_takes_the_path_its_gpu_has_and_a_forced_one_it_lacks_is_refused(gpu):
    expected = {(8, 0): "bf16", (8, 6): "bf16", (8, 9): "fp8_promote", (9, 0): "fp8_promote",
                (10, 0): "scaled"}
    for capability, mode in expected.items():
        gpu(capability)
        assert mx_gemm.mx_mma_mode(False, CUDA) == mode, capability
        mx_gemm.check_mma("a", CUDA, mode)  # what it picks, it runs
    assert mx_gemm.mx_mma_mode(True, CUDA) == "emulate"
    gpu((9, 0))
    with pytest.raises(ValueError) as refused:
        mx_gemm.check_mma("a", CUDA, "scaled")
    assert str(refused.value) == ("mma='scaled' requires block_scaled_mma (sm_100 or newer); "
                                  "this NVIDIA H200 is sm_90")
    gpu((8, 0))
    with pytest.raises(ValueError, match="requires fp8_mma \\(sm_89 or newer\\); this NVIDIA A100"):
        mx_gemm.check_mma("a", CUDA, "fp8_promote")


def test_bf16_mxfp8_is_refused_under_the_interpreter():
    with pytest.raises(ValueError, match="mma='bf16' runs compiled only"):
        mx_gemm.check_mma("a", torch.device("cpu"), "bf16")


def test_the_capability_line_names_the_paths_of_the_gpu(monkeypatch):
    """The line every notebook prints first says what this GPU runs."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    lines = {}
    for capability in ((7, 5), (8, 0), (9, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, c=capability: GPUS[c])
        caps_module.capabilities.cache_clear()
        try:
            found = caps_module.capabilities()
            lines[capability] = (found.triton_mode, found.summary())
        finally:
            caps_module.capabilities.cache_clear()
    assert lines[(7, 5)][0] == "unsupported on sm_75" and "triton unsupported on sm_75" in lines[(7, 5)][1]
    assert "kernels as sm_80, mma.sync, MXFP8 product bf16, no TMA" in lines[(8, 0)][1]
    assert lines[(9, 0)][0] == "compiled"
    assert "kernels as sm_90, wgmma, MXFP8 product fp8_promote, TMA" in lines[(9, 0)][1]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_grouped_gemm_keeps_its_stages_within_the_gpus_shared_memory(arch):
    """Each bf16 rule config's operand tiles, times its stages, fit the GPU's per-block shared
    memory; on Hopper and Blackwell the rule is unchanged."""
    a = ARCHS[arch]
    for kernel in gg.TILE_SPACE:
        for m, e in ((65536, 32), (65536, 256), (256, 8)):
            cfg = gg.launch_config(kernel, m, 2048, 7168, e, interpreted=False, dtype=torch.bfloat16, arch=a)
            rule = gg.choose_config(kernel, m, 2048, 7168, e, torch.bfloat16)
            b = cfg.blocks
            tiles = (b["BLOCK_M"] + (2 if kernel == "swiglu" else 1) * b["BLOCK_N"]) * b["BLOCK_K"] * 2
            assert cfg.num_stages * tiles <= a.max_shared_per_block and cfg.blocks == rule.blocks
            if a.max_shared_per_block >= 227 * 1024:
                assert cfg == rule
    dw = gg.launch_config("dw", 65536, 2048, 7168, 32, interpreted=False, dtype=torch.bfloat16,
                          arch=ARCHS["sm_86"])
    assert dw.num_stages == 2  # 64 x 128 x 128 bf16: 48 KB a stage, 99 KB a block
