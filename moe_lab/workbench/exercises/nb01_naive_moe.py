"""Exercises of notebook 01 (naive MoE): counting tokens per expert, top-k routing."""

from __future__ import annotations

import torch

from moe_lab.moe.router import tokens_per_expert_from_ids
from moe_lab.workbench.exercises import (
    ExerciseError,
    call_answer,
    exercise,
    require_sync_free,
    require_tensor,
)


def tokens_per_expert(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``expert_ids: [tokens, top_k]`` → ``[n_experts]`` int64 counts, with no host sync."""
    return tokens_per_expert_from_ids(expert_ids, n_experts)


def topk_routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, the top-k, weights renormalised to sum to one."""
    probs = logits.softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


@exercise(tokens_per_expert)
def check_tokens_per_expert(fn) -> None:
    """Raises ExerciseError unless ``fn`` counts correctly, including empty inputs and
    experts that receive nothing."""
    g = torch.Generator().manual_seed(1)
    cases = [(torch.randint(0, 8, (50, 2), generator=g), 8),
             (torch.randint(0, 3, (17, 1), generator=g), 16),  # experts 3..15 get nothing
             (torch.zeros(0, 4, dtype=torch.int64), 5)]
    for ids, n in cases:
        got = call_answer(fn, ids.clone(), n)
        want = tokens_per_expert(ids, n)
        require_tensor(got, want.shape, f"expected a tensor of shape {tuple(want.shape)}",
                       f": one count per expert ({n} here), zero for an expert that gets no token — "
                       "the largest id seen is not the number of experts")
        if not torch.equal(got.to(torch.int64), want):
            raise ExerciseError(f"counts differ for ids of shape {tuple(ids.shape)} with "
                                f"{n} experts: got {got.tolist()}, expected {want.tolist()}")
    require_sync_free(fn, (cases[0][0], 8), "try scatter_add_ or one_hot(...).sum(...)")
    print("✓ tokens_per_expert is correct and sync-free")


@exercise(topk_routing)
def check_topk_routing(fn) -> None:
    g = torch.Generator().manual_seed(2)
    for tokens, experts, k in [(40, 8, 2), (7, 4, 4), (25, 16, 1)]:
        logits = torch.randn(tokens, experts, generator=g)
        ids, w = call_answer(fn, logits.clone(), k)
        want_ids, want_w = topk_routing(logits, k)
        if tuple(ids.shape) != (tokens, k):
            raise ExerciseError(f"ids must be [tokens, top_k]=({tokens}, {k}), got {tuple(ids.shape)}")
        # compare as sets per token (order within the top-k may differ)
        got_sorted, want_sorted = ids.sort(-1), want_ids.sort(-1)
        if not torch.equal(got_sorted.values, want_sorted.values):
            raise ExerciseError("the chosen experts differ from the top-k of the softmax scores")
        w_aligned = w.gather(1, got_sorted.indices)
        want_aligned = want_w.gather(1, want_sorted.indices)
        if not torch.allclose(w_aligned.float(), want_aligned.float(), atol=1e-5):
            raise ExerciseError("the weights differ: softmax over all experts, take the top-k, "
                                "then renormalise them to sum to one")
    print("✓ topk_routing is correct")
