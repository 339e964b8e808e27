"""The tuned table (moe_lab.kernels.tuning) and the tuner (moe_lab.workbench.measure.autotune):
a committed table overrides the
grouped GEMM's rule for its GPU's launches only, its tile order (``GROUP_M``) too where a row
records one; the rule, with `tile_group`'s order, is the first config of every space; every
config of a space computes the same product; the tuner returns the fastest."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels import tuning
from moe_lab.kernels.common import tile_group
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.workbench.measure import autotune as tuner


def test_a_gpus_folder_is_its_name_in_lower_case_with_one_underscore_per_gap():
    # the folder gpu_check writes a GPU's results to, and the name of its adopted tuned table
    assert tuning.gpu_slug("NVIDIA H200") == "nvidia_h200"
    assert tuning.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert tuning.gpu_slug("Tesla V100-SXM2-16GB") == "tesla_v100-sxm2-16gb"
    assert tuning.gpu_slug("  cpu (interpreted smoke run) ") == "cpu_interpreted_smoke_run"
    assert tuning.gpu_slug("12 tokens/s of the optimised step") == "12_tokens_s_of_the_optimised_step"


def test_a_key_buckets_rows_per_expert_and_keeps_n_and_k():
    key = tuning.table_key("gemm", 65536, 7168, 2048, 32, torch.bfloat16)
    assert key == "gemm|bfloat16|rows<=2048|n=7168|k=2048"
    assert tuning.table_key("gemm", 65536 + 32, 7168, 2048, 32, torch.bfloat16).endswith(
        "rows<=4096|n=7168|k=2048")  # 2049 rows per expert: the next bucket
    assert "rows<=1|" in tuning.table_key("dw", 0, 8, 8, 4, torch.float32)


@pytest.mark.parametrize("kernel", gg.KERNELS)
@pytest.mark.parametrize("dtype", gg.KERNEL_DTYPES)
def test_the_rule_comes_first_and_the_space_has_no_repeats(kernel, dtype):
    space = tuner.tune_space(kernel, 65536, 7168, 2048, 32, dtype)
    rule = gg.choose_config(kernel, 65536, 7168, 2048, 32, dtype)
    ordered = kernel in gg.TILE_ORDERED
    group = tile_group(65536, 32, rule.blocks["BLOCK_M"]) if ordered else None
    assert space[0] == dataclasses.replace(rule, group_m=group)  # the rule, in the rule's order
    assert len(space) == len({json.dumps(tuner.table_entry(c), sort_keys=True) for c in space}) > 1
    assert {c.num_stages for c in space} >= {3, 4, 5}
    if not ordered:  # dW's grid has no tile order to tune
        assert all(c.group_m is None for c in space)
        return
    assert all(c.group_m is not None for c in space)  # a tuned row records the order it was timed in
    orders = {c.group_m for c in space if dataclasses.replace(c, group_m=None) == rule}
    assert group >= 4 and orders == {1, group // 2, group, 2 * group}  # N fastest, half, rule, twice
    others = [c for c in space if dataclasses.replace(c, group_m=None) != rule]  # other tiles, stages
    assert others and all(c.group_m == tile_group(65536, 32, c.blocks["BLOCK_M"]) for c in others)
    assert len(space) <= 3 * 3 + 3  # the tiles x 3 stages, and 3 more orders: small


def test_tile_order_alternatives_are_distinct_and_at_least_one():
    space = tuner.tune_space("gemm", 96, 256, 64, 8, torch.bfloat16)  # 12 rows per expert: GROUP_M 1
    assert space[0].group_m == 1
    same_tile = [c for c in space if c.blocks == space[0].blocks and c.num_stages == space[0].num_stages]
    assert sorted(c.group_m for c in same_tile) == [1, 2]  # 1 once; no GROUP_M 0


def test_without_a_device_or_a_table_the_rule_decides(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    cfg = gg.launch_config("gemm", 4096, 1024, 512, 8, interpreted=False, dtype=torch.bfloat16)
    assert cfg == gg.choose_config("gemm", 4096, 1024, 512, 8, torch.bfloat16)
    assert tuning.tuned_config("gemm", 4096, 1024, 512, 8, torch.bfloat16, torch.device("cpu")) is None
    # the tile order too: the compile report's and the interpreter's configs leave it to tile_group
    interpreted = gg.launch_config("gemm", 4096, 1024, 512, 8, interpreted=True, dtype=torch.bfloat16)
    for c in (cfg, interpreted):
        assert c.group_m is None and gg.launch_group(c, 4096, 8) == tile_group(4096, 8, c.blocks["BLOCK_M"])


def test_a_committed_table_overrides_the_rule_on_its_gpu_only(tmp_path, monkeypatch):
    tuning.load_table.cache_clear()
    winner = LaunchConfig({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 5)
    key = tuning.table_key("gemm", 4096, 1024, 512, 8, torch.bfloat16)
    (tmp_path / "nvidia_h200.json").write_text(
        json.dumps({"configs": {key: tuner.table_entry(winner)}}))
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert gg.launch_config("gemm", 4096, 1024, 512, 8, interpreted=False, dtype=torch.bfloat16,
                            device=cuda) == winner
    assert gg.launch_group(winner, 4096, 8) == tile_group(4096, 8, 128) == 4  # a row without GROUP_M
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


def test_a_tables_group_m_reaches_the_launch(tmp_path, monkeypatch):
    """A row that records ``GROUP_M`` gives it to the launch, not `tile_group`'s; on the same
    table a row without one keeps the rule's order (tables written before stay valid)."""
    tuning.load_table.cache_clear()
    ordered = LaunchConfig({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, 4, 4, group_m=1)
    plain = LaunchConfig({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, 4, 4)
    keys = [tuning.table_key("gemm", 4096, n, 512, 8, torch.bfloat16) for n in (1024, 2048)]
    entries = {keys[0]: tuner.table_entry(ordered), keys[1]: tuner.table_entry(plain)}
    assert entries[keys[0]]["group_m"] == 1 and "group_m" not in entries[keys[1]]
    (tmp_path / "nvidia_h200.json").write_text(json.dumps({"configs": entries}))
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    got = gg.launch_config("gemm", 4096, 1024, 512, 8, interpreted=False, dtype=torch.bfloat16, device=cuda)
    assert got == ordered and gg.launch_group(got, 4096, 8) == 1 != tile_group(4096, 8, 64)
    got = gg.launch_config("gemm", 4096, 2048, 512, 8, interpreted=False, dtype=torch.bfloat16, device=cuda)
    assert got == plain and gg.launch_group(got, 4096, 8) == tile_group(4096, 8, 64) == 8
    tuning.load_table.cache_clear()


class _RecordingKernel:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records the launch's keywords."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def __getitem__(self, grid: tuple) -> object:
        return lambda *args, **kwargs: self.launches.append(kwargs)


@pytest.mark.parametrize("kernel", gg.TILE_ORDERED)
def test_the_launch_passes_the_configs_group_m_else_the_rules(kernel, monkeypatch):
    recorder = _RecordingKernel()
    name = {"gemm": "_grouped_gemm_kernel", "swiglu": "_grouped_gemm_swiglu_kernel"}[kernel]
    monkeypatch.setattr(gg, name, recorder)
    E, m, k, n = 2, 512, 16, 32
    x, w = torch.randn(m, k), torch.randn(E, k, 2 * n if kernel == "swiglu" else n)
    offsets = torch.tensor([0, 300, m], dtype=torch.int32)
    op = gg.grouped_gemm_swiglu if kernel == "swiglu" else gg.grouped_gemm
    op(x, w, offsets)  # interpreted: the rule's order
    rule = gg.launch_config(kernel, m, n, k, E, interpreted=True, dtype=torch.float32)
    assert recorder.launches[-1]["GROUP_M"] == tile_group(m, E, rule.blocks["BLOCK_M"])
    for group in (1, 3, 64):
        with tuning.forcing(kernel, dataclasses.replace(rule, group_m=group)):
            op(x, w, offsets)
        assert recorder.launches[-1]["GROUP_M"] == group


def test_a_table_entry_round_trips_and_a_bad_group_m_is_named(tmp_path):
    tuning.load_table.cache_clear()
    configs = {"a": LaunchConfig({"BLOCK_M": 64}, 4, 3, group_m=2), "b": LaunchConfig({"BLOCK_M": 64}, 8, 5)}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"configs": {key: tuner.table_entry(c) for key, c in configs.items()}}))
    assert tuning.load_table(path) == configs
    for bad in (0, "two", [2]):
        entry = {"blocks": {"BLOCK_M": 64}, "num_warps": 4, "num_stages": 3, "group_m": bad}
        (tmp_path / "u.json").write_text(json.dumps({"configs": {"k": entry}}))
        tuning.load_table.cache_clear()
        with pytest.raises(ValueError, match=r"u\.json.*key 'k'.*group_m"):
            tuning.load_table(tmp_path / "u.json")
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
    """Forcing each config of the forward's and dW's spaces (interpreted: all run; the forward's
    in each tile order) gives the reference's product: a tuned launch cannot change the answer."""
    g = torch.Generator().manual_seed(3)
    E, n, k = 3, 160, 40  # several N tiles: the tile orders differ
    counts = torch.tensor([37, 0, 70])
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    x = torch.randn(int(counts.sum()) + 5, k, generator=g)  # 5 rows past the last expert
    w = torch.randn(E, k, n, generator=g)
    dy = torch.randn(x.shape[0], n, generator=g)
    want = gg.grouped_gemm_reference(x, w, offsets)
    want_dw = torch.stack([x[int(a):int(b)].T @ dy[int(a):int(b)]
                           for a, b in zip(offsets[:-1], offsets[1:], strict=True)])
    space = tuner.tune_space("gemm", x.shape[0], n, k, E, torch.float32)
    tiles = {}  # each tile in each order (stages change nothing interpreted)
    for config in space:
        tiles.setdefault((json.dumps(config.blocks), config.group_m), config)
    assert len({group for _, group in tiles}) >= 2
    for config in tiles.values():
        with tuning.forcing("gemm", config):
            torch.testing.assert_close(gg.grouped_gemm(x, w, offsets), want, rtol=1e-5, atol=1e-4)
    for config in tuner.tune_space("dw", x.shape[0], n, k, E, torch.float32)[:3]:
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


def triton_launch_errors() -> list[BaseException]:
    """What Triton really raises when a config cannot run on a GPU (none is a RuntimeError)."""
    import ast

    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    return [OutOfResources(232448, 232448 - 1024, "shared memory"),
            PTXASError("ptxas fatal: too many registers"),
            CompilationError("def k(): pass", ast.parse("x").body[0], "unsupported layout"),
            RuntimeError("CUDA error: too many resources requested for launch")]


@pytest.mark.parametrize("error", range(4))
def test_autotune_returns_the_fastest_and_survives_a_config_that_cannot_launch(error):
    failure = triton_launch_errors()[error]
    assert error == 3 or not isinstance(failure, RuntimeError)  # the real types, not a stand-in
    space = [LaunchConfig({"BLOCK_M": m}, 4, 3) for m in (16, 32, 64)]
    cost = {16: 3.0, 32: 1.0, 64: None}  # 64: cannot launch on this GPU

    def run() -> None:
        m = tuning._FORCED["gemm"].blocks["BLOCK_M"]
        if cost[m] is None:
            raise failure
        run.last = cost[m]

    winner, times = tuner.autotune("gemm", space, run, lambda fn: (fn(), run.last)[1])
    assert winner == space[1] and times == [3.0, 1.0, float("inf")]
    assert "gemm" not in tuning._FORCED
    with pytest.raises(ValueError, match="at least one"):
        tuner.autotune("gemm", [], run, lambda fn: 0.0)
    cost[16] = cost[32] = None
    with pytest.raises(type(failure)):  # every config failed: the error, not a silent winner
        tuner.autotune("gemm", space, run, lambda fn: (fn(), 0.0)[1])


def test_autotune_does_not_hide_a_bug_in_the_op():
    """Only launch failures make a config infinite: a bug in the caller's op is raised."""
    space = [LaunchConfig({"BLOCK_M": m}, 4, 3) for m in (16, 32)]

    def run() -> None:
        raise TypeError("grouped_gemm() got an unexpected keyword argument")

    with pytest.raises(TypeError):
        tuner.autotune("gemm", space, run, lambda fn: (fn(), 0.0)[1])
