"""The tuned table and the tuner (moe_lab.kernels.tuning): a committed table overrides the
grouped GEMM's rule for its GPU's launches only; the rule is the first config of every
space; every config of a space computes the same product; the tuner returns the fastest."""

from __future__ import annotations

import json

import pytest
import torch

from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels import tuning
from moe_lab.kernels.launch import LaunchConfig


def test_a_key_buckets_rows_per_expert_and_keeps_n_and_k():
    key = tuning.table_key("gemm", 65536, 7168, 2048, 32, torch.bfloat16)
    assert key == "gemm|bfloat16|rows<=2048|n=7168|k=2048"
    assert tuning.table_key("gemm", 65536 + 32, 7168, 2048, 32, torch.bfloat16).endswith(
        "rows<=4096|n=7168|k=2048")  # 2049 rows per expert: the next bucket
    assert "rows<=1|" in tuning.table_key("dw", 0, 8, 8, 4, torch.float32)


@pytest.mark.parametrize("kernel", gg.KERNELS)
@pytest.mark.parametrize("dtype", gg.KERNEL_DTYPES)
def test_the_rule_comes_first_and_the_space_has_no_repeats(kernel, dtype):
    space = gg.tune_space(kernel, 65536, 7168, 2048, 32, dtype)
    assert space[0] == gg.choose_config(kernel, 65536, 7168, 2048, 32, dtype)
    assert len(space) == len({json.dumps(tuning.table_entry(c), sort_keys=True) for c in space}) > 1
    assert {c.num_stages for c in space} >= {3, 4, 5}


def test_without_a_device_or_a_table_the_rule_decides(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "RESULTS", tmp_path)
    cfg = gg.launch_config("gemm", 4096, 1024, 512, 8, interpreted=False, dtype=torch.bfloat16)
    assert cfg == gg.choose_config("gemm", 4096, 1024, 512, 8, torch.bfloat16)
    assert tuning.tuned_config("gemm", 4096, 1024, 512, 8, torch.bfloat16, torch.device("cpu")) is None


def test_a_committed_table_overrides_the_rule_on_its_gpu_only(tmp_path, monkeypatch):
    tuning.load_table.cache_clear()
    winner = LaunchConfig({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 5)
    key = tuning.table_key("gemm", 4096, 1024, 512, 8, torch.bfloat16)
    (tmp_path / "nvidia_h200").mkdir()
    (tmp_path / "nvidia_h200" / tuning.TUNED_FILE).write_text(
        json.dumps({"configs": {key: tuning.table_entry(winner)}}))
    monkeypatch.setattr(tuning, "RESULTS", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    assert gg.launch_config("gemm", 4096, 1024, 512, 8, interpreted=False, dtype=torch.bfloat16,
                            device=cuda) == winner
    # another shape, another kernel, another GPU, or no device: the rule
    rule = gg.choose_config("gemm", 4096, 2048, 512, 8, torch.bfloat16)
    assert gg.launch_config("gemm", 4096, 2048, 512, 8, interpreted=False, dtype=torch.bfloat16,
                            device=cuda) == rule
    assert tuning.tuned_config("dw", 4096, 1024, 512, 8, torch.bfloat16, cuda) is None
    assert gg.launch_config("gemm", 4096, 1024, 512, 8, interpreted=False,
                            dtype=torch.bfloat16) != winner  # the compile report's call
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    assert tuning.tuned_config("gemm", 4096, 1024, 512, 8, torch.bfloat16, cuda) is None
    tuning.load_table.cache_clear()


def test_a_malformed_table_is_an_error_naming_it(tmp_path):
    tuning.load_table.cache_clear()
    bad = tmp_path / "t.json"
    entry = {"blocks": {"BLOCK_M": 64}, "num_warps": 3, "num_stages": 3}  # 3 warps: not a power of 2
    bad.write_text(json.dumps({"configs": {"k": entry}}))
    with pytest.raises(ValueError, match=r"t\.json.*key 'k'.*num_warps"):
        tuning.load_table(bad)
    (tmp_path / "u.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"u\.json is not JSON"):
        tuning.load_table(tmp_path / "u.json")
    (tmp_path / "v.json").write_text("[]")
    with pytest.raises(ValueError, match="must be"):
        tuning.load_table(tmp_path / "v.json")
    tuning.load_table.cache_clear()


def test_every_config_of_a_space_computes_the_same_product():
    """Forcing each config of the forward's and dW's spaces (interpreted: all run) gives the
    reference's product: a tuned launch cannot change the answer."""
    g = torch.Generator().manual_seed(3)
    E, n, k = 3, 48, 40
    counts = torch.tensor([37, 0, 70])
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    x = torch.randn(int(counts.sum()) + 5, k, generator=g)  # 5 rows past the last expert
    w = torch.randn(E, k, n, generator=g)
    dy = torch.randn(x.shape[0], n, generator=g)
    want = gg.grouped_gemm_reference(x, w, offsets)
    want_dw = torch.stack([x[int(a):int(b)].T @ dy[int(a):int(b)]
                           for a, b in zip(offsets[:-1], offsets[1:], strict=True)])
    for config in gg.tune_space("gemm", x.shape[0], n, k, E, torch.float32)[:3]:
        with tuning.forcing("gemm", config):
            torch.testing.assert_close(gg.grouped_gemm(x, w, offsets), want, rtol=1e-5, atol=1e-4)
    for config in gg.tune_space("dw", x.shape[0], n, k, E, torch.float32)[:3]:
        with tuning.forcing("dw", config):
            got = torch.ops.moe_lab.grouped_gemm_dw(x, dy, offsets, x.shape[0])
            torch.testing.assert_close(got, want_dw, rtol=1e-5, atol=1e-4)


def test_forcing_is_undone_and_checked():
    cfg = LaunchConfig({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, 4, 3)
    with tuning.forcing("gemm", cfg):
        assert gg.launch_config("gemm", 64, 64, 64, 2, interpreted=True) == cfg
    assert gg.launch_config("gemm", 64, 64, 64, 2, interpreted=True) != cfg
    with pytest.raises(TypeError, match="config must be a LaunchConfig"):
        with tuning.forcing("gemm", {"BLOCK_M": 16}):
            pass


def test_autotune_returns_the_fastest_and_survives_a_config_that_cannot_launch():
    space = [LaunchConfig({"BLOCK_M": m}, 4, 3) for m in (16, 32, 64)]
    cost = {16: 3.0, 32: 1.0, 64: None}  # 64: out of shared memory on this GPU

    def run() -> None:
        m = tuning._FORCED["gemm"].blocks["BLOCK_M"]
        if cost[m] is None:
            raise RuntimeError("out of resources")
        run.last = cost[m]

    winner, times = tuning.autotune("gemm", space, run, lambda fn: (fn(), run.last)[1])
    assert winner == space[1] and times == [3.0, 1.0, float("inf")]
    assert "gemm" not in tuning._FORCED
    with pytest.raises(ValueError, match="at least one"):
        tuning.autotune("gemm", [], run, lambda fn: 0.0)
    cost[16] = cost[32] = None
    with pytest.raises(RuntimeError, match="out of resources"):
        tuning.autotune("gemm", space, run, lambda fn: (fn(), 0.0)[1])
