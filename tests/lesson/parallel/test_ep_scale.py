"""Expert parallelism at DeepSeek-V3's routing, on 8 gloo ranks: 256 experts, top-8 of 4 of 8
groups, sigmoid scores; skewed counts (hot experts) with idle ones (never chosen, and two ranks
that own nothing but idle experts); tiny widths. The EP layer equals the single-process layer,
forward and backward, and a second launch gives the same bits (issue 47)."""

from __future__ import annotations

import pytest
import torch

from moe_lab import preset
from moe_lab.workbench.ranks.equivalence import skewed_routing_rank
from moe_lab.workbench.ranks.launch import run_ranks

WORLD = 8
# DeepSeek-V3's routing (preset "deepseek_v3") at tiny widths.
CFG = {f: getattr(preset("deepseek_v3").moe, f) for f in
       ("n_experts", "top_k", "n_shared_experts", "score_func", "renormalize", "scaling_factor",
        "n_groups", "topk_groups")} | {"d_model": 16, "d_expert": 8}
TOKENS_PER_RANK = 32
HOT = (0, 1, 2, 3, 40, 41)
# Groups 6 and 7 (the experts of ranks 6 and 7) are idle, and every fourth expert of group 0.
IDLE = tuple(range(4, 32, 4)) + tuple(range(192, 256))


def _launch() -> list[dict]:
    return run_ranks(skewed_routing_rank, WORLD, CFG, TOKENS_PER_RANK, HOT, IDLE, 0,
                     timeout_s=150, collective_timeout_s=60, threads_per_rank=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ep_equals_single_process_at_deepseek_routing_and_reruns_bitwise():
    assert (CFG["n_experts"], CFG["top_k"], CFG["n_groups"]) == (256, 8, 8)
    first, second = _launch(), _launch()
    assert [r["rank"] for r in first] == list(range(WORLD))
    received = torch.tensor(first[0]["received"])
    assert int(received.sum()) == WORLD * TOKENS_PER_RANK * CFG["top_k"]
    assert int(received[list(IDLE)].sum()) == 0  # idle experts, and ranks 6 and 7, get nothing
    busy = received[received > 0].float()
    assert float(received[list(HOT)].float().min()) > 4 * float(busy.median()), received.tolist()
    for run in first:
        errors = run["errors"]
        assert errors["y"] <= 1e-5 * run["scale"], errors
        for name, error in errors.items():
            assert error <= 2e-5, (run["rank"], name, errors)
    for a, b in zip(first, second, strict=True):
        assert a["tensors"].keys() == b["tensors"].keys()
        for name, tensor in a["tensors"].items():
            assert torch.equal(tensor, b["tensors"][name]), (a["rank"], name)
