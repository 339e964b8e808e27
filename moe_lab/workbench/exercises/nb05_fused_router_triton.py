"""The Triton exercise of notebook 05 (fused router); the PyTorch ones are `nb05_fused_router`.

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

from moe_lab.moe.router import group_limited_mask, topk_lowest_index
from moe_lab.workbench.exercises import ExerciseError, exercise
from moe_lab.workbench.exercises.kernel_checks import kernel_device, launch_answer


@triton.jit
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


@triton.jit
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


@exercise(group_limited_topk)
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
        # The reference chain's selection (`moe_lab.moe.router.route_from_logits` between scores
        # and ids): the group mask, then the top-k, ties to the lower index.
        kept = group_limited_mask(scores, n_groups, topk_groups)
        want = topk_lowest_index(scores.masked_fill(~kept, float("-inf")), top_k)
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
            outside = [e for e in got[t].tolist() if 0 <= e < kept.shape[1] and not kept[t, e]]
            if outside:
                hint = (f" — expert(s) {outside} are not in the token's {topk_groups} best groups "
                        "(a group's score is the sum of its two best experts)")
        raise ExerciseError(f"({where}): token {t} gets experts {got[t].tolist()}, expected "
                            f"{want[t].tolist()}{hint}")
    print("✓ group_limited_topk picks the reference's experts, in order, ties included")
