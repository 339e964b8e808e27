"""Every tensor a rank function creates is on the rank's device: run on 2 gloo ranks with
torch's default device set to ``meta`` (`with_default_device`), so that a tensor or layer made
without naming its device fails here as it would under NCCL on a GPU."""

from __future__ import annotations

import pytest

from moe_lab.workbench.ranks import equivalence, harness
from moe_lab.workbench.ranks.devcheck import with_default_device
from moe_lab.workbench.ranks.launch import run_ranks, whoami

CFG = dict(d_model=32, n_experts=8, top_k=2, d_expert=48, n_shared_experts=1)


@pytest.mark.timeout(120)
def test_rank_functions_create_everything_on_the_rank_device():
    spec = {"cfg": CFG, "tokens": 32, "n_chunks": 2, "repeats": 1, "seed": 0,
            "bandwidth_rows": 16}
    calls = [
        (whoami, ()),
        (equivalence.ep_check_rank, (CFG, 24, 0, (("dropless", 0.0, 1.25), ("budget", 8.0, 1.0)))),
        (equivalence.overlap_check_rank, (CFG, 24, 2)),
        (equivalence.merged_check_rank, (CFG, 24, 2)),
        (equivalence.merged_model_check_rank, ("tiny", 2, 2, 1)),
        (harness.merged_rank_main, (spec,)),
    ]
    results = run_ranks(with_default_device, 2, "meta", calls, timeout_s=110, threads_per_rank=1)
    for rank, (who, ep, overlap, merged, model, merged_report) in enumerate(results):
        assert who["sum_of_ranks"] == 1 and who["device"] == "cpu"
        assert ep["rank"] == rank and all(c["y"] <= 1e-5 * c["scale"] for c in ep["cases"])
        assert all(e["y"] <= 1e-5 for e in overlap.values())
        assert all(s["bitwise"] for s in merged["schedules"].values())
        assert model["bitwise"]
        assert merged_report["merged_equals_plain"]
        assert merged_report["device"] == "cpu" and merged_report["backend"] == "gloo"


def test_the_meta_default_catches_a_tensor_made_without_its_device():
    import torch

    def forgets_the_device() -> torch.Tensor:
        return torch.zeros(3) + torch.ones(3, device="cpu")

    with pytest.raises((RuntimeError, NotImplementedError)):
        with_default_device("meta", [(forgets_the_device, ())])
    assert torch.zeros(1).device.type == "cpu"  # the default is restored
