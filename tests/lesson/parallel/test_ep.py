"""The expert-parallel layer against the single-process dropless layer, on 2 and 4 gloo ranks.

Each launch runs several cases in one job (``ep_check_rank``): the dropless exchange, the
budgeted (HybridEP-style) exchange with a budget that fits, and the budgeted exchange on
skewed routing, which overflows and must re-run (or, with ``on_overflow="drop"``, drop and
count). Outputs and gradients (input, expert weights, all-reduced router weight) must
equal the single-process layer's up to float32 reduction order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_lab import preset
from moe_lab.model import MoETransformer
from moe_lab.moe.layer import MoELayer
from moe_lab.parallel.ep import EPMoELayer, from_layer, rank_experts, split_sizes, traffic_matrix
from moe_lab.workbench.ranks.equivalence import ep_check_rank
from moe_lab.workbench.ranks.launch import run_ranks

ROOT = Path(__file__).resolve().parents[3]
CFG = dict(d_model=32, n_experts=8, top_k=2, d_expert=48, n_shared_experts=1)
TOKENS = 48
CASES = (
    ("dropless", 0.0, 1.25),
    ("budget", 0.0, 2.0),  # generous budget: no overflow
    ("budget", 8.0, 1.0),  # most tokens pick expert 0: overflow, re-run
    ("budget", 8.0, 1.0, "drop"),  # overflow, dropped and counted
)


def _train_ep_under_torchrun(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """``scripts/train_ep.py args`` on 2 ranks under torchrun, output captured; past the
    deadline the whole process tree is killed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "scripts" / "train_ep.py"), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _check(results: list[dict], world: int, with_drop: bool = True) -> None:
    assert [r["rank"] for r in results] == list(range(world))
    for r in results:
        by_case = {(c["mode"], c["skew"], c["on_overflow"]): c for c in r["cases"]}
        exact = [by_case[("dropless", 0.0, "rerun")], by_case[("budget", 0.0, "rerun")],
                 by_case[("budget", 8.0, "rerun")]]
        for c in exact:
            # exact up to float32 reduction order
            assert c["y"] <= 1e-5 * c["scale"], c
            for key in ("dx", "dw_gate_up", "dw_down", "drouter"):
                assert c[key] <= 2e-5, (key, c)
            assert c["dropped"] == 0, c
            assert c["sync_gradients"] <= 2e-5, c
        plain = by_case[("budget", 0.0, "rerun")]
        # a budgeted exchange sends a block of `budget` float32 rows to every other rank, and back
        assert plain["a2a_bytes"] == 2 * (world - 1) * plain["budget"] * CFG["d_model"] * 4, plain
        assert not plain["overflow"]
        assert by_case[("budget", 0.0, "rerun")]["reruns"] == 0
        skewed = by_case[("budget", 8.0, "rerun")]
        assert skewed["overflow"] and skewed["reruns"] == 1, skewed
        if not with_drop:
            continue
        dropped = by_case[("budget", 8.0, "drop")]
        assert dropped["overflow"] and dropped["reruns"] == 0 and dropped["dropped"] > 0, dropped
        assert dropped["y"] > 1e-3  # dropping changes the output: the re-run is what keeps it exact


@pytest.mark.timeout(60)
def test_ep_equals_single_process_on_2_ranks():
    _check(run_ranks(ep_check_rank, 2, CFG, TOKENS, 0, CASES, timeout_s=50, threads_per_rank=1), 2)


@pytest.mark.timeout(90)
def test_ep_equals_single_process_on_4_ranks():
    results = run_ranks(ep_check_rank, 4, CFG, TOKENS, 1, CASES[:3], timeout_s=80, threads_per_rank=1)
    _check(results, 4, with_drop=False)


def test_split_sizes_and_traffic_matrix():
    ids = torch.tensor([[0, 5], [7, 1], [2, 3], [6, 6]])
    # 8 experts on 4 ranks: rank r owns experts 2r, 2r+1
    assert split_sizes(ids, 8, 4).tolist() == [2, 2, 1, 3]
    m = traffic_matrix([ids, ids[:2]], 8)  # 2 ranks: experts 0-3 and 4-7
    assert m.tolist() == [[4, 4], [2, 2]]
    assert list(rank_experts(8, 4, 3)) == [6, 7]
    with pytest.raises(ValueError, match="divisible"):
        split_sizes(ids, 8, 3)


def test_budget_is_capacity_factor_over_the_average(one_rank_group):
    from moe_lab.config import MoEConfig

    x = torch.randn(25, CFG["d_model"])  # one rank: a block's average share is all 25·2 rows
    for capacity_factor, budget in ((1.0, 50), (1.25, 63)):  # 62.5 rounds up
        layer = EPMoELayer(MoEConfig(**CFG), mode="budget", capacity_factor=capacity_factor,
                           expert_backend="torch")
        assert layer(x)[1].budget == budget


def test_ep_layer_needs_a_process_group():
    from moe_lab.config import MoEConfig

    with pytest.raises(RuntimeError, match="not initialised"):
        EPMoELayer(MoEConfig(**CFG))


def test_from_layer_composes_the_layers_pieces(one_rank_group):
    """The EP layer holds the router, shared expert and this rank's experts, built with the
    single-process layer's names and precision (nothing copied onto it afterwards)."""
    from moe_lab.config import MoEConfig

    layer = MoELayer(MoEConfig(**CFG), "dropless", "torch", quant="mxfp8")
    ep = from_layer(layer)
    assert not isinstance(ep, MoELayer)
    assert (ep.experts.backend, ep.experts.quant, ep.router.impl) == ("torch", "mxfp8", "reference")
    assert [n for n, _ in ep.named_children()] == ["router", "experts", "shared"]
    assert torch.equal(ep.experts.w_down, layer.experts.w_down) and ep.n_local == CFG["n_experts"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_ep_script_under_torchrun():
    result = _train_ep_under_torchrun("--preset", "tiny", "--steps", "8", "--batch-size", "4", "--json",
                                      timeout_s=110)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert summary, result.stdout[-2000:]
    import json

    s = json.loads(summary[-1])
    assert s["world_size"] == 2 and s["backend"] == "gloo" and s["steps"] == 8
    assert s["final_loss"] < s["first_loss"]
    assert s["a2a_bytes_per_step_rank0"] > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_ep_script_runs_the_merged_1f1b_schedule():
    result = _train_ep_under_torchrun("--preset", "tiny", "--steps", "8", "--batch-size", "4",
                                      "--schedule", "1f1b", "--microbatches", "2", "--json", timeout_s=110)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert summary, result.stdout[-2000:]
    import json

    s = json.loads(summary[-1])
    assert s["schedule"] == "1f1b" and s["microbatches"] == 2 and s["world_size"] == 2
    assert s["final_loss"] < s["first_loss"]
    assert s["a2a_bytes_per_step_rank0"] > 0


def test_train_ep_script_refuses_bad_schedule_arguments():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_ep", ROOT / "scripts" / "train_ep.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for argv, words in ((["--schedule", "1f1b", "--mode", "budget"], ["--schedule 1f1b", "dropless"]),
                        (["--schedule", "1f1b", "--microbatches", "3"], ["--microbatches", "got 3"]),
                        (["--chunks", "0"], ["--chunks", "got 0"])):
        with pytest.raises(SystemExit) as stop:
            script.parse_args(argv)
        message = str(stop.value.code)
        assert message.startswith("error:") and all(w in message for w in words), message
    args = script.parse_args(["--schedule", "1f1b", "--microbatches", "4"])
    assert (args.schedule, args.microbatches, args.chunks) == ("1f1b", 4, 1)


def test_train_ep_script_runs_bfloat16_on_cuda(one_rank_group, monkeypatch):
    import importlib.util

    from moe_lab.moe import experts
    from moe_lab.parallel.merged_model import MergedModelStep

    spec = importlib.util.spec_from_file_location("train_ep", ROOT / "scripts" / "train_ep.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.model_dtype(torch.device("cuda")) == torch.bfloat16
    assert script.model_dtype(torch.device("cpu")) == torch.float32
    # a model as the script builds it, in the dtype it picks for CUDA, passes the 1F1B step's check
    monkeypatch.setattr(experts, "_on_cuda", lambda device: True)  # no GPU here
    torch.manual_seed(0)
    model = MoETransformer(preset("tiny"), dispatcher="dropless", expert_backend="loop")
    for block in model.blocks:
        if isinstance(block.ffn, MoELayer):
            block.ffn = from_layer(block.ffn)
    with pytest.raises(ValueError, match="in torch.float32 on CUDA"):
        MergedModelStep(model)
    MergedModelStep(model.to(dtype=script.model_dtype(torch.device("cuda"))))


def test_train_ep_script_refuses_nccl_without_a_gpu_per_rank(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_ep", ROOT / "scripts" / "train_ep.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit) as stop:  # before any process group forms
        script.main(["--preset", "tiny", "--backend", "nccl"])
    message = str(stop.value.code)
    assert message.startswith("error: backend='nccl' needs one GPU per rank: 2 ranks"), message


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
