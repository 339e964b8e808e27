"""Every exercise check, tested both ways: the reference solution passes it, and each
plausible wrong answer a learner would write (an off-by-one, a missing mask, a transposed
index, a forgotten bias or weight, a float where an int is needed, ...) fails it with an
`ExerciseError` whose message names the slip. `WRONG_ANSWERS` maps each check's exercise
name to its wrong answers; a guard test fails when a ``check_…`` of a notebook's module has
no entry, so a new check cannot be added untested. The Triton answers run under Triton's
interpreter here (compiled on a GPU)."""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import moe_lab.workbench.exercises as exercises
from moe_lab.perf.flops import TRAIN_MULTIPLIER
from moe_lab.workbench.exercises import SOLUTIONS, ExerciseError, NotDoneError
from moe_lab.workbench.exercises import nb00_lab_bench as ex00
from moe_lab.workbench.exercises import nb04_dropless_sync_free as ex04
from moe_lab.workbench.exercises import nb08_cuda_graphs as ex08
from moe_lab.workbench.exercises import nb12_time_to_train as ex12


def all_checks() -> dict[str, object]:
    """Exercise name -> ``check_…`` of every ``nbNN_*`` module of the exercises package."""
    checks = {}
    for info in pkgutil.iter_modules(exercises.__path__):
        if not info.name.startswith("nb"):
            continue
        module = importlib.import_module(f"{exercises.__name__}.{info.name}")
        for attr, fn in vars(module).items():
            if attr.startswith("check_") and inspect.isfunction(fn) and fn.__module__ == module.__name__:
                checks[fn.exercise_name] = fn
    return checks


CHECKS = all_checks()

# -------------------------------------------------------------------- 00 · lab bench


def _layer_flops_without_router(moe):
    return 6.0 * (moe.top_k + moe.n_shared_experts) * 3 * moe.d_model * moe.d_expert


def _layer_flops_without_shared(moe):
    return 6.0 * (moe.d_model * moe.n_experts + moe.top_k * 3 * moe.d_model * moe.d_expert)


def _layer_flops_forward_only(moe):
    return ex00.moe_layer_training_flops(moe) / TRAIN_MULTIPLIER


def _roofline_without_element_size(m, n, k, b, peak, bw):
    return min(peak, bw * 2 * m * n * k / (m * k + k * n + m * n))


def _roofline_without_peak(m, n, k, b, peak, bw):
    return bw * 2 * m * n * k / ((m * k + k * n + m * n) * b)


# ---------------------------------------------------------------- 01 · naive MoE


def _count_without_minlength(ids, n_experts):
    return torch.bincount(ids.reshape(-1))  # sized by the largest id seen


def _count_with_bincount(ids, n_experts):
    return torch.bincount(ids.reshape(-1), minlength=n_experts)  # right, but reads the max id


def _topk_not_renormalised(logits, top_k):
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return ids, weights


# ------------------------------------------------------- 02 · capacity and dropping


def _keep_token_major(topk_ids, n_experts, capacity):
    flat = topk_ids.reshape(-1)
    one_hot = F.one_hot(flat, n_experts)
    rank = (one_hot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
    return (rank < capacity).view(topk_ids.shape)


def _keep_one_too_many(topk_ids, n_experts, capacity):
    flat = topk_ids.t().reshape(-1)  # slot-major, right
    one_hot = F.one_hot(flat, n_experts)
    rank = (one_hot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
    return (rank <= capacity).view(topk_ids.shape[1], -1).t()  # <=: one slot too many


def _buffer(x, topk_ids, n_experts, capacity, rank):
    tokens, k = topk_ids.shape
    keep = rank < capacity
    trash = n_experts * capacity
    slot = torch.where(keep, topk_ids * capacity + rank, torch.full_like(rank, trash)).reshape(-1)
    token_of = torch.arange(tokens).repeat_interleave(k)
    buffer = x.new_zeros(trash + 1, x.shape[1]).index_add_(0, slot, x.index_select(0, token_of))
    return buffer[:trash].view(n_experts, capacity, x.shape[1])


def _slot_major_rank(topk_ids, n_experts):
    flat = topk_ids.t().reshape(-1)
    one_hot = F.one_hot(flat, n_experts)
    rank = (one_hot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
    return rank.view(topk_ids.shape[1], -1).t()


def _buffer_without_multiple(x, topk_ids, n_experts, factor, multiple=1):
    capacity = math.ceil(topk_ids.numel() * factor / n_experts)
    return _buffer(x, topk_ids, n_experts, capacity, _slot_major_rank(topk_ids, n_experts))


def _buffer_token_major(x, topk_ids, n_experts, factor, multiple=1):
    capacity = -(-math.ceil(topk_ids.numel() * factor / n_experts) // multiple) * multiple
    flat = topk_ids.reshape(-1)
    rank = (F.one_hot(flat, n_experts).cumsum(0) - 1).gather(1, flat[:, None]).view(topk_ids.shape)
    return _buffer(x, topk_ids, n_experts, capacity, rank)
# ------------------------------------------------------------ 03 · Triton from zero


@triton.jit
def _softmax_zero_padding(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    # Masked lanes loaded as 0, not -inf: they count in the sum.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, num / tl.sum(num, axis=0), mask=mask)


@triton.jit
def _softmax_no_max(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    # Right on small logits; exp overflows on large ones.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=float("-inf"))
    num = tl.exp(x)
    tl.store(out_ptr + row * out_row_stride + cols, num / tl.sum(num, axis=0), mask=mask)


@triton.jit
def _softmax_rows_n_apart(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    # Right on contiguous rows only.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=float("-inf"))
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * N + cols, num / tl.sum(num, axis=0), mask=mask)


@triton.jit
def _softmax_out_stride_of_x(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    # x's row stride used for out too.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=float("-inf"))
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * x_row_stride + cols, num / tl.sum(num, axis=0), mask=mask)


@triton.jit
def _softmax_unmasked_store(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=float("-inf"))
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, num / tl.sum(num, axis=0))


@triton.jit
def _softmax_unmasked_load(x_ptr, out_ptr, N, x_row_stride, out_row_stride, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + row * x_row_stride + cols)
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, num / tl.sum(num, axis=0), mask=cols < N)



@triton.jit
def _rows_unmasked(offsets_ptr, e, t, BLOCK_M: tl.constexpr):
    rows = tl.load(offsets_ptr + e).to(tl.int64) + t * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, rows >= 0


@triton.jit
def _rows_one_past_the_end(offsets_ptr, e, t, BLOCK_M: tl.constexpr):
    rows = tl.load(offsets_ptr + e).to(tl.int64) + t * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, rows <= tl.load(offsets_ptr + e + 1)


@triton.jit
def _rows_every_tile_the_first(offsets_ptr, e, t, BLOCK_M: tl.constexpr):
    rows = tl.load(offsets_ptr + e).to(tl.int64) + tl.arange(0, BLOCK_M)
    return rows, rows < tl.load(offsets_ptr + e + 1)


@triton.jit
def _rows_from_zero(offsets_ptr, e, t, BLOCK_M: tl.constexpr):
    # Tiles counted from row 0, not from offsets[e].
    rows = (t * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return rows, rows < tl.load(offsets_ptr + e + 1)



# ----------------------------------------------------------- 04 · dropless, sync-free


def _permutation_int64_offsets(topk_ids, n_experts):
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64).scatter_add_(
        0, topk_ids.reshape(-1), torch.ones(topk_ids.numel(), dtype=torch.int64))
    return order, F.pad(counts.cumsum(0), (1, 0))  # int64: forgot .to(torch.int32)


def _permutation_with_bincount(topk_ids, n_experts):
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    counts = torch.bincount(topk_ids.reshape(-1), minlength=n_experts)
    return order, F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)


def _expert_of_row_left(offsets, n_rows):
    rows = torch.arange(n_rows, dtype=offsets.dtype)
    return torch.searchsorted(offsets[1:], rows)  # right=False: a segment's end row stays behind


@triton.jit
def _unweighted_unpermute(y_ptr, map_ptr, w_ptr, out_ptr, T, D, N_ROWS, TOP_K,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    t_ok, d_ok = t < T, d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for j in range(TOP_K):
        row = tl.load(map_ptr + t * TOP_K + j, mask=t_ok, other=0).to(tl.int64)
        acc += tl.load(y_ptr + row[:, None] * D + d[None, :], mask=t_ok[:, None] & d_ok[None, :],
                       other=0.0)
    tl.store(out_ptr + t[:, None] * D + d[None, :], acc, mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _unpermute_without_row_bound(y_ptr, map_ptr, w_ptr, out_ptr, T, D, N_ROWS, TOP_K,
                                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # Masks a negative id but not one at or past N_ROWS.
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    t_ok, d_ok = t < T, d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for j in range(TOP_K):
        row = tl.load(map_ptr + t * TOP_K + j, mask=t_ok, other=-1).to(tl.int64)
        ok = t_ok & (row >= 0)
        v = tl.load(y_ptr + row[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + t * TOP_K + j, mask=t_ok, other=0.0)
        acc += v * w[:, None]
    tl.store(out_ptr + t[:, None] * D + d[None, :], acc, mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _unpermute_weights_transposed(y_ptr, map_ptr, w_ptr, out_ptr, T, D, N_ROWS, TOP_K,
                                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # w read as if it were [TOP_K, T]: w[j, t] instead of w[t, j].
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    t_ok, d_ok = t < T, d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for j in range(TOP_K):
        row = tl.load(map_ptr + t * TOP_K + j, mask=t_ok, other=-1).to(tl.int64)
        ok = t_ok & (row >= 0) & (row < N_ROWS)
        v = tl.load(y_ptr + row[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + j * T + t, mask=t_ok, other=0.0)
        acc += v * w[:, None]
    tl.store(out_ptr + t[:, None] * D + d[None, :], acc, mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _rows_only_schedule(offsets_ptr, tile, E, M_ROWS, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    # Tiles cut from the rows, ignoring where experts start: a tile can span two experts.
    row0 = tile * BLOCK_M
    s = tl.arange(0, BLOCK_E)
    end = tl.load(offsets_ptr + s + 1, mask=s < E, other=M_ROWS)
    seg = tl.sum((end <= row0).to(tl.int32), 0)
    return seg, row0, tl.sum(tl.where(s == seg, end, 0), 0)


# ------------------------------------------------------------------ 05 · fused router


def _max_ranked_selection(scores, n_groups, topk_groups):
    # Groups ranked by their best expert, not by the sum of their two best.
    tokens, n_experts = scores.shape
    grouped = scores.view(tokens, n_groups, n_experts // n_groups)
    best = grouped.max(-1).values.topk(topk_groups, dim=-1).indices
    mask = torch.zeros(tokens, n_groups, dtype=torch.bool).scatter_(1, best, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, n_experts)


def _float_selection(scores, n_groups, topk_groups):
    return SOLUTIONS["group_limited_selection"](scores, n_groups, topk_groups).float()


def _bytes_without_bias(tokens, n_experts, itemsize):
    return SOLUTIONS["first_steps_bytes"](tokens, n_experts, itemsize) - n_experts * itemsize


def _bytes_bool_as_itemsize(tokens, n_experts, itemsize):
    te = tokens * n_experts
    return SOLUTIONS["first_steps_bytes"](tokens, n_experts, itemsize) + 2 * te * (itemsize - 1)


@triton.jit
def _plain_topk(sel, BLOCK_T: tl.constexpr, G: tl.constexpr, EG: tl.constexpr, TOP_K: tl.constexpr,
                TOPK_GROUPS: tl.constexpr):
    # No group limit: the top-k over every expert.
    e = tl.broadcast_to(tl.arange(0, G)[None, :, None] * EG + tl.arange(0, EG)[None, None, :],
                        (BLOCK_T, G, EG))
    free = e >= 0
    kk = tl.arange(0, TOP_K)
    ids = tl.zeros((BLOCK_T, TOP_K), tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(tl.where(free, sel, float("-inf")), 2), 1)
        pick = tl.min(tl.min(tl.where(free & (sel == best[:, None, None]), e, G * EG), 2), 1)
        free = free & (e != pick[:, None, None])
        ids = tl.where(kk[None, :] == k, pick[:, None], ids)
    return ids


# ----------------------------------------------------------------- 06 · MXFP8 attention


def _decode_subnormal_with_hidden_one(byte):
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    return sign * (1 + mantissa / 8) * 2.0 ** (max(exponent, 1) - 7)


def _decode_without_sign(byte):
    return abs(SOLUTIONS["decode_e4m3"](byte))


@triton.jit
def _unbiased_scale(x):
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1)
    return tl.minimum(tl.maximum((amax >> 23) - 127 - 8, -127), 127)  # the bias forgotten


@triton.jit
def _scale_without_sign_mask(x):
    amax = tl.max(x.to(tl.int32, bitcast=True), 1)  # a negative value's bits are a negative int32
    biased = tl.minimum(tl.maximum((amax >> 23) - 127 - 8, -127), 127) + 127
    return tl.where(amax > 0x7F800000, 255, biased)


@triton.jit
def _no_rescale_softmax(m_i, l_i, acc, s, v):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    return m_new, l_i + tl.sum(p, 1), acc + tl.dot(p, v)


# ---------------------------------------------------------- 07 · fused grouped GEMM


@triton.jit
def _gather_without_k_mask(x_ptr, src_ptr, rows, row_end, ks, K, TOP_K):
    src = tl.load(src_ptr + rows, mask=rows < row_end, other=-1).to(tl.int64)
    ok = (rows < row_end) & (src >= 0)
    token = tl.where(ok, src // TOP_K, 0)
    return tl.load(x_ptr + token[:, None] * K + ks[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _gather_without_source_mask(x_ptr, src_ptr, rows, row_end, ks, K, TOP_K):
    # Rows past row_end masked, but a row without a source (src = -1) loaded through it.
    src = tl.load(src_ptr + rows, mask=rows < row_end, other=0).to(tl.int64)
    ok = rows < row_end
    token = tl.where(ok, src // TOP_K, 0)
    return tl.load(x_ptr + token[:, None] * K + ks[None, :], mask=ok[:, None] & (ks[None, :] < K),
                   other=0.0)


def _bytes_without_map_and_weights(tokens, top_k, d, b):
    return 2 * tokens * d * b + 2 * tokens * top_k * d * b


# ----------------------------------------------------------------------- 08 · CUDA graphs


def _pool_without_partial_pages(tokens, top_k, n_experts, page_rows):
    return -(-tokens * top_k // page_rows)


def _pool_one_page_too_many(tokens, top_k, n_experts, page_rows):
    return -(-tokens * top_k // page_rows) + n_experts + 1


def _pool_as_float(tokens, top_k, n_experts, page_rows):
    return math.ceil(tokens * top_k / page_rows) + n_experts * 1.0


def _dispatch_weighted_twice(x, topk_ids, topk_weights, experts):
    return ex08.sync_free_dispatch(x, topk_ids, topk_weights * 2, experts)


def _capturable_half_done(model, optimizer, batch, stats):
    # The statistics on the device, but the finite-loss check still reads the loss.
    out = model(batch.x, batch.y)
    if not torch.isfinite(out.loss):
        raise FloatingPointError("the loss is not finite")
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ex08.MAX_GRAD_NORM)
    optimizer.step()
    load = torch.stack([s.tokens_per_expert for s in out.moe_stats])
    stats["loss"] += out.loss.detach()
    stats["clipped"] += grad_norm > ex08.MAX_GRAD_NORM
    stats["max_load"] = torch.maximum(stats["max_load"], load.max())
    stats["idle_experts"] += (load == 0).sum()
    return stats


# ----------------------------------------------------------- 09 · expert parallelism


def _splits_swapped(routing, n_experts, rank):
    send, receive = SOLUTIONS["a2a_splits"](routing, n_experts, rank)
    return receive, send


def _splits_round_robin(routing, n_experts, rank):
    # Expert e placed on rank e % world, not on a contiguous block of experts.
    world = len(routing)
    matrix = torch.zeros(world, world, dtype=torch.int64)
    for src, ids in enumerate(routing):
        matrix[src] += torch.bincount(ids.reshape(-1) % world, minlength=world)
    return matrix[rank].tolist(), matrix[:, rank].tolist()


def _exposed_without_overlap(comm_s, compute_s):
    return sum(comm_s)


def _exposed_first_transfer_only(comm_s, compute_s):
    return comm_s[0] if comm_s else 0.0


def _order_as_listed(stages):
    return list(stages)  # every collective waited on right after it starts


def _order_without_a_stage(stages):
    return SOLUTIONS["merged_order"](stages)[:-1]


# -------------------------------------------------------------- 10 · pipeline layout


def _gpipe_order(rank, n_ranks, n_microbatches):
    return [("F", i) for i in range(n_microbatches)] + [("B", i) for i in range(n_microbatches)]


def _one_f_one_b_one_warmup_too_many(rank, n_ranks, n_microbatches):
    warm = min(n_ranks - rank, n_microbatches)  # p - rank, not p - rank - 1
    ops = [("F", i) for i in range(warm)]
    for i in range(n_microbatches - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", i) for i in range(n_microbatches - warm, n_microbatches)]


def _cut_equal_layer_counts(costs, n_stages):
    n = len(costs)
    return [round(i * n / n_stages) for i in range(n_stages + 1)]


def _cut_without_zero(costs, n_stages):
    return SOLUTIONS["balanced_cut"](costs, n_stages)[1:]


# ------------------------------------------------------------------ 11 · network fabric


def _fullest_as_mean(n_flows, n_spines):
    return n_flows / n_spines


def _fullest_sampled(n_flows, n_spines):
    rng = np.random.default_rng(0)
    if n_flows == 0:
        return 0.0
    bins = rng.integers(0, n_spines, size=(20_000, n_flows))
    loads = np.stack([(bins == s).sum(1) for s in range(n_spines)], axis=1)
    return float(loads.max(1).mean())


def _share_equally(demands, capacity):
    return [capacity / len(demands)] * len(demands)


def _share_proportionally(demands, capacity):
    scale = min(1.0, capacity / sum(demands))
    return [d * scale for d in demands]


# --------------------------------------------------------------- 12 · time to train


def _first_strictly_below(curve, target):
    return next((p["time_s"] for p in curve if p["eval_loss"] < target), None)


def _time_of_best(curve, target):
    best = min(curve, key=lambda p: p["eval_loss"], default=None)
    return best["time_s"] if best is not None and best["eval_loss"] <= target else None


def _race_with_failed_seeds_as_zero(curves, target, baseline):
    # A seed that never reached the target counted with time 0 instead of left out.
    def median(runs):
        times = [ex12.time_to_target(c, target) or 0.0 for c in runs]
        return sorted(times)[len(times) // 2]

    if baseline not in curves:
        raise ValueError(baseline)
    return {name: (median(curves[baseline]) / median(runs) if median(runs) else None)
            for name, runs in curves.items()}


def _amdahl_unchecked(parts, speedups):
    # Amdahl's law right, a profile's mistakes (an unknown part, a zero speed-up) let through.
    new = sum(t / speedups.get(name, 1.0) for name, t in parts.items())
    return new, (sum(parts.values()) / new if new else math.inf)


# ------------------------------------------------------------------------- the registry

#: exercise name -> [(plausible wrong answer, regex its ExerciseError message must match)]
WRONG_ANSWERS: dict[str, list[tuple[object, str]]] = {
    # 00 · lab bench
    "moe_layer_training_flops": [(_layer_flops_without_router, "router's gate is a matmul"),
                                 (_layer_flops_without_shared, "also goes through the shared experts"),
                                 (_layer_flops_forward_only, "forward pass only")],
    "matmul_attainable_flops": [(lambda m, n, k, b, peak, bw: peak, "memory-bound: the peak is out of reach"),
                                (_roofline_without_element_size, "divides the FLOPs by the bytes moved"),
                                (_roofline_without_peak, "never exceeds the peak")],
    # 01 · naive MoE
    "tokens_per_expert": [(_count_without_minlength, "one count per expert"),
                          (_count_with_bincount, "syncs with the host")],
    "topk_routing": [(_topk_not_renormalised, "renormalise them to sum to one")],
    # 02 · capacity and dropping
    "keep_mask": [(_keep_token_major, "ranked token by token"),
                  (_keep_one_too_many, "each expert keeps min\\(its load, capacity\\)")],
    "capacity_buffer": [(_buffer_without_multiple, "round C up to a multiple of"),
                        (_buffer_token_major, "first choices first")],
    # 03 · Triton from zero
    "row_softmax_kernel": [(_softmax_zero_padding, "load them as -inf"),
                           (_softmax_no_max, "Subtract the row's max"),
                           (_softmax_rows_n_apart, r"row r of x starts at x_ptr \+ r · x_row_stride"),
                           (_softmax_out_stride_of_x, r"out_ptr \+ r · out_row_stride"),
                           (_softmax_unmasked_store, "wrote past the end of row .*store with mask"),
                           (_softmax_unmasked_load, "past the row's N columns were read")],
    "expert_rows": [(_rows_unmasked, r"stop at offsets\[e \+ 1\]"),
                    (_rows_one_past_the_end, r"stop at offsets\[e \+ 1\]"),
                    (_rows_every_tile_the_first, "claimed by [0-9]+ of its programs"),
                    (_rows_from_zero, r"tiles start at offsets\[e\]")],
    # 04 · dropless, sync-free
    "expert_permutation": [(_permutation_int64_offsets, "take int32 offsets"),
                           (_permutation_with_bincount, "syncs with the host")],
    "expert_of_row": [(_expert_of_row_left, r"belongs to the next expert .*right=True"),
                      (ex04.expert_of_row_with_sync, "not sync-free")],
    "unpermute_kernel": [(_unweighted_unpermute, "router weights"),
                         (_unpermute_without_row_bound, "past N_ROWS must be masked"),
                         (_unpermute_weights_transposed, r"w\[t, j\] is at w_ptr \+ t · TOP_K \+ j")],
    "tile_schedule": [(_rows_only_schedule, "should own")],
    # 05 · fused router
    "group_limited_selection": [(_max_ranked_selection, "sum of its two best"),
                                (_float_selection, "expected a bool mask")],
    "first_steps_bytes": [(_bytes_without_bias, "add reads the bias"),
                          (_bytes_bool_as_itemsize, "mask is bool: 1 byte")],
    "group_limited_topk": [(_plain_topk, "plain top-k")],
    # 06 · MXFP8 attention
    "decode_e4m3": [(_decode_subnormal_with_hidden_one, "a subnormal, 0.mmm x 2\\^-6, no hidden 1"),
                    (_decode_without_sign, "check the sign bit"),
                    (lambda byte: float(byte), r"decode_e4m3\(\d+\) = decode_e4m3\(0b[01]{8}\) returned")],
    "e8m0_block_scale": [(_unbiased_scale, "biased"),
                         (_scale_without_sign_mask, r"clear the sign bit.*0x7FFFFFFF")],
    "online_softmax_step": [(_no_rescale_softmax, "rescale")],
    # 07 · fused grouped GEMM
    "gather_tile": [(_gather_without_k_mask, "columns past K .*ks < K"),
                    # TOP_K 1 reads row -1 (a NaN row), TOP_K > 1 row 0 (a row, not zeros)
                    (_gather_without_source_mask,
                     "without a source must be masked|no source .*read as zero")],
    "permute_combine_bytes": [(_bytes_without_map_and_weights, "count the row-id map")],
    # 08 · CUDA graphs
    "sync_free_dispatch": [(ex08.dispatch_with_sync, "not sync-free: .*bincount"),
                           (_dispatch_weighted_twice, "y differs from the dropless dispatcher")],
    "pool_pages": [(_pool_without_partial_pages, "overflow when the experts get"),
                   (_pool_one_page_too_many, "memory a graph holds for nothing"),
                   (lambda t, k, e, p: e * t, "memory a graph holds for nothing"),  # in rows
                   (_pool_as_float, "return a Python int"),
                   (lambda t, k, e, p: torch.tensor(3), "return a Python int")],
    "capturable_step": [(_capturable_half_done, "host")],
    # 09 · expert parallelism
    "a2a_splits": [(_splits_swapped, "swapped"),
                   (_splits_round_robin, "contiguous block")],
    "predict_exposed": [(_exposed_without_overlap, "every transfer exposed"),
                        (_exposed_first_transfer_only, "only the first transfer")],
    "merged_order": [(_order_as_listed, "is waited on at t=.* but cannot finish"),
                     (_order_without_a_stage, r"leaves out stages \[.B\.permute")],
    # 10 · pipeline layout
    "one_f_one_b_order": [(_gpipe_order, "that is GPipe"),
                          (_one_f_one_b_one_warmup_too_many, "one warm-up forward too many")],
    "balanced_cut": [(_cut_equal_layer_counts, "slowest stage costs"),
                     (_cut_without_zero, "strictly increasing bounds from 0")],
    # 11 · network fabric
    "expected_fullest_uplink": [(_fullest_as_mean, "that is the mean load"),
                                (_fullest_sampled, "a sampled estimate is not exact")],
    "fair_share": [(_share_equally, "an equal split wastes"),
                   (_share_proportionally, "proportional sharing")],
    # 12 · time to train
    "time_to_target": [(_first_strictly_below, r"<=, not <"),
                       (_time_of_best, "time of the best evaluation")],
    "race_speedups": [(_race_with_failed_seeds_as_zero, "median over the seeds that reached")],
    "amdahl_bound": [(_amdahl_unchecked, "must raise ValueError")],
}

WRONG = [(name, i) for name in sorted(WRONG_ANSWERS) for i in range(len(WRONG_ANSWERS[name]))]


def _label(answer: object) -> str:
    fn = getattr(answer, "fn", answer)  # a Triton kernel's Python function
    return getattr(fn, "__name__", repr(answer))


def test_every_check_of_every_notebook_has_wrong_answers():
    """A ``check_…`` added to a notebook's module without an entry here fails this test, as
    does an entry for an exercise that has no check any more."""
    assert len(CHECKS) >= 33  # every check a notebook calls
    missing = sorted(set(CHECKS) - set(WRONG_ANSWERS))
    assert not missing, f"checks without plausible wrong answers in WRONG_ANSWERS: {missing}"
    stale = sorted(set(WRONG_ANSWERS) - set(CHECKS))
    assert not stale, f"WRONG_ANSWERS names exercises that have no check: {stale}"
    assert all(WRONG_ANSWERS[name] for name in CHECKS)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_reference_passes(name):
    """What ``SOLUTIONS=True`` runs: the reference solution passes its own check."""
    CHECKS[name](SOLUTIONS[name])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")  # _softmax_no_max's
@pytest.mark.parametrize("name, i", WRONG, ids=[f"{n}-{_label(WRONG_ANSWERS[n][i][0])}" for n, i in WRONG])
def test_a_plausible_wrong_answer_fails_naming_the_slip(name, i):
    """The wrong answer raises `ExerciseError` (not "not done") naming what is wrong, and in
    learner mode (``solutions=False``) it stops the cell the same way."""
    wrong, hint = WRONG_ANSWERS[name][i]
    with pytest.raises(ExerciseError, match=hint) as err:
        CHECKS[name](wrong)
    assert not isinstance(err.value, NotDoneError)
    with pytest.raises(ExerciseError, match=hint):
        CHECKS[name](wrong, solutions=False)


def test_a_sign_blind_decode_is_told_about_the_sign_on_a_negative_subnormal(monkeypatch):
    """Byte 0x81 (-2^-9, a subnormal): the sign-blind answer gives +2^-9, and the check must name
    the sign, not the subnormal rule (a random byte order tried it first once)."""
    from moe_lab.workbench.exercises import nb06_mxfp8_attention as ex06

    monkeypatch.setattr(ex06.random, "shuffle", lambda order: order.sort(key=lambda b: b != 0x81))
    with pytest.raises(ExerciseError, match="check the sign bit") as err:
        ex06.check_decode_e4m3(_decode_without_sign)
    assert "decode_e4m3(129)" in str(err.value)
