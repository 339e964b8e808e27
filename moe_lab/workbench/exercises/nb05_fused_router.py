"""Exercises of notebook 05 (fused router) in PyTorch: group-limited selection and the bytes of
the unfused chain (the group-limited top-k in Triton is `nb05_fused_router_triton`, which needs
Triton).

- ``group_limited_selection(scores, n_groups, topk_groups)``: the mask of each token's best
  groups' experts, in PyTorch, without a host sync.
- ``first_steps_bytes(tokens, n_experts, itemsize)``: the bytes the first kernels of the
  unfused chain move, against what `moe_lab.workbench.measure.kernel_count.count_kernels` measures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_lab.moe.router import group_limited_mask
from moe_lab.workbench.exercises import (
    ExerciseError,
    call_answer,
    exercise,
    require_sync_free,
    require_tensor,
)
from moe_lab.workbench.measure.kernel_count import count_kernels


def group_limited_selection(scores: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """``scores: [tokens, n_experts]`` → ``[tokens, n_experts]`` bool, True for the experts of
    each token's ``topk_groups`` best groups (a group's score: the sum of its top-2)."""
    return group_limited_mask(scores, n_groups, topk_groups)


def first_steps_of_the_chain(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The first kernels of the unfused chain: score, bias for selection, -inf mask."""
    scores = logits.sigmoid()
    selection = scores + bias
    return selection.masked_fill(logits == float("-inf"), float("-inf"))


def first_steps_bytes(tokens: int, n_experts: int, itemsize: int) -> int:
    """Bytes read and written by `first_steps_of_the_chain` on ``[tokens, n_experts]`` logits
    of ``itemsize`` bytes per element (the bias ``[n_experts]`` in the same dtype)."""
    te = tokens * n_experts
    sigmoid = 2 * te * itemsize  # read logits, write scores
    add = 2 * te * itemsize + n_experts * itemsize  # read scores and bias, write selection
    eq = te * itemsize + te  # read logits, write a bool mask
    masked_fill = te * itemsize + te + te * itemsize  # read selection and mask, write
    return sigmoid + add + eq + masked_fill


@exercise(group_limited_selection)
def check_group_limited_selection(fn: Callable) -> None:
    """Raises ExerciseError unless ``fn`` picks the right groups' experts on random scores,
    as a bool ``[tokens, n_experts]`` mask, without a host sync."""
    g = torch.Generator().manual_seed(4)
    cases = [(64, 256, 8, 4), (40, 16, 4, 2), (30, 12, 4, 1), (25, 8, 8, 3), (0, 16, 4, 2)]
    for tokens, n_experts, n_groups, topk_groups in cases:
        scores = torch.rand(tokens, n_experts, generator=g)
        where = f"{tokens} tokens, {n_experts} experts in {n_groups} groups, best {topk_groups} kept"
        try:
            got = call_answer(fn, scores.clone(), n_groups, topk_groups)
        except (RuntimeError, IndexError) as exc:
            hint = ""
            if n_experts // n_groups == 1:
                hint = (" Here each group holds one expert, so it has no second best: a group's "
                        "score is the sum of its top min(2, experts per group) scores.")
            raise ExerciseError(f"({where}) your function raised {type(exc).__name__}: {exc}."
                                + hint) from None
        want = group_limited_selection(scores, n_groups, topk_groups)
        require_tensor(got, want.shape, f"expected a tensor of shape {tuple(want.shape)}")
        if got.dtype != torch.bool:
            raise ExerciseError(f"expected a bool mask, got dtype {got.dtype}")
        if not torch.equal(got, want):
            bad = int((got != want).any(-1).sum())
            raise ExerciseError(
                f"{bad} of {tokens} tokens get the wrong experts ({where}). Hint: view the scores as "
                "[tokens, groups, experts per group], score each group by the sum of its two "
                "best experts, keep the best groups, and expand the group mask back")
    require_sync_free(fn, (torch.rand(32, 64, generator=g), 8, 4), "build the mask with scatter_ or a "
                      "comparison, not with nonzero or a loop")
    print("✓ group_limited_selection is correct and sync-free")


@exercise(first_steps_bytes)
def check_first_steps_bytes(fn: Callable) -> None:
    """Raises ExerciseError unless ``fn(tokens, n_experts, itemsize)`` predicts the bytes
    that `moe_lab.workbench.measure.kernel_count.count_kernels` measures for `first_steps_of_the_chain`."""
    for tokens, n_experts, dtype in [(1024, 256, torch.float64), (1024, 256, torch.float32),
                                     (300, 8, torch.float64), (7, 3, torch.float32)]:
        logits = torch.randn(tokens, n_experts, dtype=dtype)
        bias = torch.randn(n_experts, dtype=dtype)
        measured = count_kernels(first_steps_of_the_chain, logits, bias)
        itemsize = logits.element_size()
        got = call_answer(fn, tokens, n_experts, itemsize)
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            raise ExerciseError(f"return a number of bytes, got {type(got).__name__}")
        if got != measured.bytes:
            te = tokens * n_experts
            hint = ""
            if got == measured.bytes - n_experts * itemsize:
                hint = " The add reads the bias too: [n_experts] values of the logits' dtype."
            elif itemsize > 1 and got == measured.bytes + 2 * te * (itemsize - 1):
                hint = (" The mask is bool: 1 byte per element, whatever the logits' dtype (eq "
                        "writes it, masked_fill reads it).")
            per_op = ", ".join(f"{name}: {calls} call" for name, (calls, _) in
                               measured.by_name().items())
            raise ExerciseError(
                f"[{tokens}, {n_experts}] {dtype}: you predict {got:,} bytes, the chain moves "
                f"{measured.bytes:,} in {measured.ops} kernels ({per_op}). Count, for each "
                "kernel, every tensor it reads and the one it writes; a bool is 1 byte." + hint)
    print("✓ first_steps_bytes matches the measured bytes")
