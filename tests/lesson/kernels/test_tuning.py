"""The grouped GEMM's launch rule and the tuner (moe_lab.workbench.measure.autotune): no launch
reads a tuned table, the rule decides unless a config is applied explicitly
(`moe_lab.kernels.grouped_gemm.FORCED`, the tuner's `forcing`), its tile order (``GROUP_M``) too;
the rule, with `tile_group`'s order, is the first config of every space; every config of a space
computes the same product; the tuner returns the fastest."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels.grouped_gemm import tile_group
from moe_lab.kernels.launch import LaunchConfig
from moe_lab.workbench.measure import autotune as tuner


def test_a_gpus_folder_is_its_name_in_lower_case_with_one_underscore_per_gap():
    # the folder gpu_check writes a GPU's results to, and the name of its adopted tuned table
    assert tuner.gpu_slug("NVIDIA H200") == "nvidia_h200"
    assert tuner.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert tuner.gpu_slug("Tesla V100-SXM2-16GB") == "tesla_v100-sxm2-16gb"
    assert tuner.gpu_slug("  cpu (interpreted smoke run) ") == "cpu_interpreted_smoke_run"
    assert tuner.gpu_slug("12 tokens/s of the optimised step") == "12_tokens_s_of_the_optimised_step"


def test_a_key_buckets_rows_per_expert_and_keeps_n_and_k():
    key = tuner.table_key("gemm", 65536, 7168, 2048, 32, torch.bfloat16)
    assert key == "gemm|bfloat16|rows<=2048|n=7168|k=2048"
    assert tuner.table_key("gemm", 65536 + 32, 7168, 2048, 32, torch.bfloat16).endswith(
        "rows<=4096|n=7168|k=2048")  # 2049 rows per expert: the next bucket
    assert "rows<=1|" in tuner.table_key("dw", 0, 8, 8, 4, torch.float32)


@pytest.mark.parametrize("kernel", gg.TILE_SPACE)
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


def test_unless_a_config_is_applied_the_rule_decides():
    cfg = gg.launch_config("gemm", 4096, 1024, 512, 8, interpreted=False, dtype=torch.bfloat16)
    assert cfg == gg.choose_config("gemm", 4096, 1024, 512, 8, torch.bfloat16) and not gg.FORCED
    # the tile order too: the compile report's and the interpreter's configs leave it to tile_group
    interpreted = gg.launch_config("gemm", 4096, 1024, 512, 8, interpreted=True, dtype=torch.bfloat16)
    for c in (cfg, interpreted):
        assert c.group_m is None  # the launch takes tile_group's, the rule's order


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
        with tuner.forcing(kernel, dataclasses.replace(rule, group_m=group)):
            op(x, w, offsets)
        assert recorder.launches[-1]["GROUP_M"] == group


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
        with tuner.forcing("gemm", config):
            torch.testing.assert_close(gg.grouped_gemm(x, w, offsets), want, rtol=1e-5, atol=1e-4)
    for config in tuner.tune_space("dw", x.shape[0], n, k, E, torch.float32)[:3]:
        with tuner.forcing("dw", config):
            got = torch.ops.moe_lab.grouped_gemm_dw(x, dy, offsets)
            torch.testing.assert_close(got, want_dw, rtol=1e-5, atol=1e-4)


def test_forcing_is_undone_and_checked():
    cfg = LaunchConfig({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, 4, 3)
    with tuner.forcing("gemm", cfg):
        assert gg.launch_config("gemm", 64, 64, 64, 2, interpreted=True) == cfg
    assert gg.launch_config("gemm", 64, 64, 64, 2, interpreted=True) != cfg
    with pytest.raises(TypeError, match="config must be a LaunchConfig"):
        with tuner.forcing("gemm", {"BLOCK_M": 16}):
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
        m = gg.FORCED["gemm"].blocks["BLOCK_M"]
        if cost[m] is None:
            raise failure
        run.last = cost[m]

    winner, times = tuner.autotune("gemm", space, run, lambda fn: (fn(), run.last)[1])
    assert winner == space[1] and times == [3.0, 1.0, float("inf")]
    assert "gemm" not in gg.FORCED
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
