"""Which backend a run gets, on a machine that pretends to have GPUs: NCCL only with one GPU
per rank and no emulated link; gloo on the CPU otherwise, with the reason, or a one-line
refusal when NCCL is asked for and cannot work."""

from __future__ import annotations

import pytest
import torch

from moe_lab.workbench.ranks import launch


def _gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_one_gpu_per_rank_gets_nccl(monkeypatch):
    _gpus(monkeypatch, 8)
    assert launch.choose_backend(4)[0] == "nccl"
    assert launch.choose_backend(8, backend="nccl")[0] == "nccl"


def test_more_ranks_than_gpus_run_on_gloo_and_say_why(monkeypatch):
    _gpus(monkeypatch, 1)
    backend, why = launch.choose_backend(4)
    assert backend == "gloo" and "4 ranks > 1 GPU" in why
    with pytest.raises(ValueError, match=r"backend='nccl' needs one GPU per rank: 4 ranks .* 1 GPU"):
        launch.choose_backend(4, backend="nccl")
    _gpus(monkeypatch, 0)
    assert launch.choose_backend(2) == ("gloo", "no CUDA device: gloo on the CPU")
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA, and this machine has no CUDA"):
        launch.choose_backend(1, backend="nccl")


def test_an_emulated_link_runs_on_gloo_even_with_gpus(monkeypatch):
    _gpus(monkeypatch, 8)
    link = object()  # any link: the choice does not look inside
    backend, why = launch.choose_backend(2, link)
    assert backend == "gloo" and "emulated link" in why
    with pytest.raises(ValueError, match="the emulated link carries gloo"):
        launch.choose_backend(2, link, backend="nccl")
    with pytest.raises(ValueError, match="backend must be 'gloo', 'nccl' or None, got 'mpi'"):
        launch.choose_backend(2, backend="mpi")


def test_run_ranks_refuses_nccl_on_too_few_gpus_before_starting_a_rank(monkeypatch):
    _gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match="needs one GPU per rank: 2 ranks"):
        launch.run_ranks(launch.whoami, 2, backend="nccl", timeout_s=10)


def test_torchrun_ranks_sharing_one_gpu_fall_back_to_gloo_on_the_cpu(monkeypatch):
    _gpus(monkeypatch, 1)
    seen = {}
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(launch.dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend))
    monkeypatch.setattr(launch.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(launch.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) called"))
    assert launch.init_from_env() == (1, 2, torch.device("cpu"))
    assert seen["backend"] == "gloo"
