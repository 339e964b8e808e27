"""The budgeted exchange keeps exactly the rows that fit: each destination's first ``budget``
rows in expert order, no more, against a single-process reference that drops the rest."""

from __future__ import annotations

import torch

from moe_lab.config import MoEConfig
from moe_lab.moe.experts import SwiGLUExperts
from moe_lab.parallel.ep import EPMoELayer

CFG = dict(d_model=16, n_experts=4, top_k=2, d_expert=24)
WORLD = 2


def _reference(layer: EPMoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               budget: int) -> tuple[torch.Tensor, int]:
    """The output when every destination keeps the rows at position < ``budget`` of its
    block (assignments sorted by expert, ties in token order), and how many it dropped."""
    k, flat = ids.shape[1], ids.reshape(-1).tolist()
    seen = [0] * WORLD
    y = torch.zeros_like(x)
    for a in sorted(range(len(flat)), key=lambda a: flat[a]):  # Python's sort is stable
        dest, t = flat[a] // layer.n_local, a // k
        seen[dest] += 1
        if seen[dest] <= budget:
            y[t] += weights[t, a % k] * layer.experts.forward_expert(flat[a] % layer.n_local, x[t:t + 1])[0]
    return y, sum(max(n - budget, 0) for n in seen)


def test_budgeted_exchange_drops_exactly_the_rows_past_the_budget(one_rank_group):
    # Two destinations on one rank: the exchanges are loopbacks (the one-rank all-to-all returns
    # block j as block j), so a two-rank send buffer is packed and unpacked here, every
    # destination's rows meeting this rank's two experts.
    torch.manual_seed(0)
    cfg = MoEConfig(**CFG)
    layer = EPMoELayer(cfg, mode="budget", capacity_factor=0.5, on_overflow="drop", expert_backend="loop")
    layer.ep_size, layer.n_local = WORLD, cfg.n_experts // WORLD
    layer.experts = SwiGLUExperts(layer.n_local, cfg.d_model, cfg.d_expert, "loop")
    x = torch.randn(16, cfg.d_model)
    with torch.no_grad():
        y, stats = layer(x)
        ids, weights = stats.routing.topk_ids, stats.routing.topk_weights
        per_dest = torch.bincount(ids.reshape(-1) // layer.n_local, minlength=WORLD)
        assert (per_dest > stats.budget).all(), (per_dest, stats.budget)  # both overflow
        y_ref, dropped = _reference(layer, x, ids, weights, stats.budget)
    assert int(stats.dropped_tokens) == dropped == int((per_dest - stats.budget).sum())
    assert bool(stats.overflow) and stats.reruns == 0
    assert torch.allclose(y, y_ref, rtol=1e-4, atol=1e-5), (y - y_ref).abs().max()
