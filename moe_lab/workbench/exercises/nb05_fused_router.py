"""Exercises of notebook 05 (fused router): group-limited selection, bytes of the unfused chain,
and the group-limited top-k in Triton.

- ``group_limited_selection(scores, n_groups, topk_groups)``: the mask of each token's best
  groups' experts, in PyTorch, without a host sync.
- ``first_steps_bytes(tokens, n_experts, itemsize)``: the bytes the first kernels of the
  unfused chain move, against what `moe_lab.workbench.measure.kernel_count.count_kernels` measures.
- ``group_limited_topk`` (Triton): what the fused router does with one token's row of
  selection scores held in registers as a ``[BLOCK_T, G, EG]`` tile: score each group by its
  two best experts, keep the ``TOPK_GROUPS`` best groups, then pick the ``TOP_K`` best experts
  among them by repeated arg-max, highest first, ties to the lower index — returning the
  ``[BLOCK_T, TOP_K]`` expert ids. Checked on fresh random scores (and ones full of ties)
  against `moe_lab.moe.router.group_limited_mask` and `topk_lowest_index`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from moe_lab.kernels.common import jit
from moe_lab.moe.router import group_limited_mask, topk_lowest_index
from moe_lab.training.sync import count_syncs
from moe_lab.workbench.exercises import ExerciseError, call_answer, exercise, reference_solution
from moe_lab.workbench.exercises.kernel_checks import kernel_device, launch_answer
from moe_lab.workbench.measure.kernel_count import count_kernels


@reference_solution("group_limited_selection")
def group_limited_selection(scores: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """``scores: [tokens, n_experts]`` → ``[tokens, n_experts]`` bool, True for the experts of
    each token's ``topk_groups`` best groups (a group's score: the sum of its top-2)."""
    return group_limited_mask(scores, n_groups, topk_groups)


def first_steps_of_the_chain(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The first kernels of the unfused chain: score, bias for selection, -inf mask."""
    scores = logits.sigmoid()
    selection = scores + bias
    return selection.masked_fill(logits == float("-inf"), float("-inf"))


@reference_solution("first_steps_bytes")
def first_steps_bytes(tokens: int, n_experts: int, itemsize: int) -> int:
    """Bytes read and written by `first_steps_of_the_chain` on ``[tokens, n_experts]`` logits
    of ``itemsize`` bytes per element (the bias ``[n_experts]`` in the same dtype)."""
    te = tokens * n_experts
    sigmoid = 2 * te * itemsize  # read logits, write scores
    add = 2 * te * itemsize + n_experts * itemsize  # read scores and bias, write selection
    eq = te * itemsize + te  # read logits, write a bool mask
    masked_fill = te * itemsize + te + te * itemsize  # read selection and mask, write
    return sigmoid + add + eq + masked_fill


@exercise("group_limited_selection")
def check_group_limited_selection(fn: Callable) -> None:
    """Raises ExerciseError unless ``fn`` picks the right groups' experts on random scores,
    as a bool ``[tokens, n_experts]`` mask, without a host sync."""
    g = torch.Generator().manual_seed(4)
    cases = [(64, 256, 8, 4), (40, 16, 4, 2), (30, 12, 4, 1), (25, 8, 8, 3), (0, 16, 4, 2)]
    for tokens, n_experts, n_groups, topk_groups in cases:
        scores = torch.rand(tokens, n_experts, generator=g)
        got = call_answer(fn, scores.clone(), n_groups, topk_groups)
        want = group_limited_selection(scores, n_groups, topk_groups)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            raise ExerciseError(f"expected a tensor of shape {tuple(want.shape)}, got "
                                f"{getattr(got, 'shape', type(got).__name__)}")
        if got.dtype != torch.bool:
            raise ExerciseError(f"expected a bool mask, got dtype {got.dtype}")
        if not torch.equal(got, want):
            bad = int((got != want).any(-1).sum())
            raise ExerciseError(
                f"{bad} of {tokens} tokens get the wrong experts ({n_experts} experts in "
                f"{n_groups} groups, best {topk_groups} kept). Hint: view the scores as "
                "[tokens, groups, experts per group], score each group by the sum of its two "
                "best experts, keep the best groups, and expand the group mask back")
        per_token = got.view(tokens, n_groups, n_experts // n_groups).any(-1).sum(-1)
        if tokens and not bool((per_token == topk_groups).all()):
            raise ExerciseError(f"each token must keep exactly {topk_groups} groups")
    _, syncs = count_syncs(fn, torch.rand(32, 64, generator=g), 8, 4)
    if sum(syncs.values()):
        raise ExerciseError(f"correct, but it syncs with the host: {dict(syncs)}; build the "
                            "mask with scatter_ or a comparison, not with nonzero or a loop")
    print("✓ group_limited_selection is correct and sync-free")


@exercise("first_steps_bytes")
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


# ------------------------------------------------------ Triton: the group-limited top-k


@reference_solution("group_limited_topk")
@jit
def group_limited_topk(sel, BLOCK_T: tl.constexpr, G: tl.constexpr, EG: tl.constexpr,
                       TOP_K: tl.constexpr, TOPK_GROUPS: tl.constexpr):
    """``sel: [BLOCK_T, G, EG]`` float32 selection scores (expert ``g · EG + j``) →
    ``[BLOCK_T, TOP_K]`` int32 expert ids, best first, from the ``TOPK_GROUPS`` groups with
    the best sums of their two best scores; ties go to the lower group / expert index."""
    g = tl.arange(0, G)
    j = tl.arange(0, EG)
    jj = tl.broadcast_to(j[None, None, :], (BLOCK_T, G, EG))
    # Group score: the best plus the second best (the best's lane masked out).
    m1 = tl.max(sel, 2)
    j1 = tl.min(tl.where(sel == m1[:, :, None], jj, EG), 2)
    gscore = m1 + tl.max(tl.where(jj == j1[:, :, None], float("-inf"), sel), 2)
    gg = tl.broadcast_to(g[None, :], (BLOCK_T, G))
    g_free = gg >= 0
    chosen = gg < 0
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.max(tl.where(g_free, gscore, float("-inf")), 1)
        pick = tl.min(tl.where(g_free & (gscore == best[:, None]), gg, G), 1)
        hit = gg == pick[:, None]
        chosen = chosen | hit
        g_free = g_free & ~hit
    sel = tl.where(chosen[:, :, None], sel, float("-inf"))
    # Top-k by repeated arg-max over the experts left.
    e = tl.broadcast_to(g[None, :, None] * EG + j[None, None, :], (BLOCK_T, G, EG))
    free = e >= 0
    kk = tl.arange(0, TOP_K)
    ids = tl.zeros((BLOCK_T, TOP_K), tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(tl.where(free, sel, float("-inf")), 2), 1)
        pick = tl.min(tl.min(tl.where(free & (sel == best[:, None, None]), e, G * EG), 2), 1)
        free = free & (e != pick[:, None, None])
        ids = tl.where(kk[None, :] == k, pick[:, None], ids)
    return ids


@jit
def _group_topk_kernel(scores_ptr, ids_ptr, T, FN: tl.constexpr, BLOCK_T: tl.constexpr,
                       G: tl.constexpr, EG: tl.constexpr, TOP_K: tl.constexpr,
                       TOPK_GROUPS: tl.constexpr):
    # scores: [T, G·EG] float32 contiguous; ids: [T, TOP_K] int32. Grid: (cdiv(T, BLOCK_T),).
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    e = tl.arange(0, G)[:, None] * EG + tl.arange(0, EG)[None, :]
    t_ok = t < T
    sel = tl.load(scores_ptr + t[:, None, None] * (G * EG) + e[None, :, :],
                  mask=t_ok[:, None, None], other=0.0)
    ids = FN(sel, BLOCK_T, G, EG, TOP_K, TOPK_GROUPS)
    k = tl.arange(0, TOP_K)
    tl.store(ids_ptr + t[:, None] * TOP_K + k[None, :], ids.to(tl.int32), mask=t_ok[:, None])


def group_limited_topk_reference(scores: torch.Tensor, n_groups: int, topk_groups: int,
                                 top_k: int) -> torch.Tensor:
    """The reference chain's selection: the group mask, then the top-k, ties to the lower
    index (what `moe_lab.moe.router.route_from_logits` does between scores and ids)."""
    mask = group_limited_mask(scores, n_groups, topk_groups)
    return topk_lowest_index(scores.masked_fill(~mask, float("-inf")), top_k)


@exercise("group_limited_topk")
def check_group_limited_topk(fn: Callable) -> None:
    """Raise `ExerciseError` unless the learner's ``@triton.jit`` ``fn`` picks the reference's
    experts, in the reference's order, on fresh random scores: DeepSeek-V3's 8 groups / 4
    kept / top-8 in miniature, other group shapes, and scores full of ties."""
    device = kernel_device()
    g = torch.Generator().manual_seed(random.randrange(2**31))
    cases = [  # tokens, groups, experts per group, top-k, groups kept, ties?
        (50, 8, 8, 8, 4, False), (33, 4, 4, 4, 2, False), (20, 8, 4, 2, 1, False),
        (40, 4, 8, 8, 3, True), (17, 2, 16, 4, 2, True),
    ]
    for tokens, n_groups, per_group, top_k, topk_groups, ties in cases:
        scores = torch.rand(tokens, n_groups * per_group, generator=g)
        if ties:
            scores = (scores * 4).floor() / 4  # five values: equal scores and equal groups
        want = group_limited_topk_reference(scores, n_groups, topk_groups, top_k)
        got = torch.full((tokens, top_k), -1, dtype=torch.int32, device=device)
        block_t = 64
        launch_answer("group_limited_topk", _group_topk_kernel, (triton.cdiv(tokens, block_t),),
                      scores.to(device), got, tokens, FN=fn, BLOCK_T=block_t, G=n_groups,
                      EG=per_group, TOP_K=top_k, TOPK_GROUPS=topk_groups)
        got = got.cpu().long()
        where = (f"{n_groups} groups of {per_group} experts, best {topk_groups} groups kept, "
                 f"top-{top_k}{', scores with ties' if ties else ''}")
        if torch.equal(got, want):
            continue
        t = int((got != want).any(1).nonzero()[0])
        hint = ""
        if torch.equal(got.sort(1).values, want.sort(1).values):
            hint = (" — the right experts in the wrong order: pick the best first, and among "
                    "equal scores the lower expert index")
        elif torch.equal(got, topk_lowest_index(scores, top_k)):
            hint = " — that is the plain top-k: only experts of the best groups may be picked"
        else:
            kept = group_limited_mask(scores, n_groups, topk_groups)[t]
            outside = [e for e in got[t].tolist() if 0 <= e < kept.numel() and not kept[e]]
            if outside:
                hint = (f" — expert(s) {outside} are not in the token's {topk_groups} best groups "
                        "(a group's score is the sum of its two best experts)")
        raise ExerciseError(f"({where}): token {t} gets experts {got[t].tolist()}, expected "
                            f"{want[t].tolist()}{hint}")
    print("✓ group_limited_topk picks the reference's experts, in order, ties included")
