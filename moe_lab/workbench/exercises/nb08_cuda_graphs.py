"""Exercises of notebook 08 (CUDA graphs): find the sync in a dispatcher; size a page pool.

- ``sync_free_dispatch(x, topk_ids, topk_weights, experts)``: `dispatch_with_sync` below is a
  correct dropless dispatcher with one host sync hidden in it. The learner runs
  ``assert_sync_free`` on it, finds the operator and the line, and writes the same function
  without it. Returns ``y: [tokens, d_model]``.
- ``pool_pages(tokens, top_k, n_experts, page_rows)``: the number of pages of
  ``page_rows`` rows that one layer's expert activations can need on one device, over every
  routing — the smallest pool that never overflows (`moe_lab.moe.stash.max_pages`). The
  simpler bound ``ceil(tokens · top_k / page_rows) + n_experts`` (one partly filled page per
  expert) is accepted as safe; anything smaller overflows on some routing, anything larger
  wastes memory.
- ``capturable_step(model, optimizer, batch, stats)``: `step_with_syncs` below is one correct
  training step — forward, backward, clipping, AdamW, four running statistics and a check
  that the loss is finite — that a CUDA graph cannot hold: it makes the host wait several
  times. The learner certifies it (`certify_step`, which runs `assert_sync_free` on the whole
  step, optimizer included), rewrites each line the certificate flags and certifies again
  until it passes. The statistics stay 0-dim tensors on the device, read by the host only
  when it wants them; the finite-loss check becomes a device-side assert. Checked against
  `step_with_syncs`: same weights and statistics after two steps, no host sync counted in
  a real step, and the certificate.

Each ``check_…`` raises `ExerciseError` when the answer is wrong, with a counterexample.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_lab.config import preset
from moe_lab.moe.dispatch import dropless_dispatch
from moe_lab.moe.experts import SwiGLUExperts
from moe_lab.moe.stash import max_pages, pages_per_expert
from moe_lab.training.build import build_model, random_batch
from moe_lab.training.steps import optimizer_on_fake_params
from moe_lab.training.sync import SyncError, assert_sync_free, count_syncs
from moe_lab.workbench.exercises import (
    ExerciseError,
    call_answer,
    close,
    exercise,
    random_routing,
    require_tensor,
)


def dispatch_with_sync(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       experts: SwiGLUExperts) -> torch.Tensor:
    """Dropless dispatch, correct — and one host sync per call, somewhere."""
    tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.n_experts)
    offsets = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    token_of = order // k
    y_sorted = experts.grouped_forward(x.index_select(0, token_of), offsets)
    weight = topk_weights.reshape(-1).index_select(0, order).unsqueeze(1).to(y_sorted.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, y_sorted * weight)


def sync_free_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       experts: SwiGLUExperts) -> torch.Tensor:
    """`dispatch_with_sync` without its sync: the lesson's `dropless_dispatch`, which counts
    with ``scatter_add_`` (``bincount`` sizes its output by the largest id, which it reads on
    the host even when ``minlength`` is given)."""
    return dropless_dispatch(x, topk_ids, topk_weights, experts)[0]


@exercise(sync_free_dispatch)
def check_sync_free_dispatch(fn: Callable[..., torch.Tensor]) -> None:
    """Raise `ExerciseError` unless ``fn(x, topk_ids, topk_weights, experts)`` equals the
    dropless dispatcher on several routings and passes ``assert_sync_free`` (forward and
    backward)."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    # The top-1 case routes every token to expert 5: experts with no tokens at all.
    cases = [(37, 8, 2), (64, 16, 4), (5, 4, 4), (0, 8, 2), (19, 8, 1)]
    for tokens, n_experts, top_k in cases:
        experts = SwiGLUExperts(n_experts, 16, 24, backend="torch")
        x = torch.randn(tokens, 16, generator=g)
        ids = torch.full((tokens, 1), 5) if top_k == 1 else random_routing(g, tokens, n_experts, top_k)
        weights = torch.rand(tokens, top_k, generator=g)
        with torch.no_grad():
            want, _ = dropless_dispatch(x, ids, weights, experts)
            got = call_answer(fn, x, ids, weights, experts)
        where = f"{tokens} tokens, {n_experts} experts, top-{top_k}"
        if isinstance(got, tuple):
            got = got[0]
        require_tensor(got, want.shape, f"({where}): return y of shape {tuple(want.shape)}")
        try:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        except AssertionError as err:
            raise ExerciseError(f"({where}): y differs from the dropless dispatcher: {err}") from None
    x = torch.randn(24, 16, generator=g, requires_grad=True)
    try:
        assert_sync_free(fn, x, random_routing(g, 24, 8, 2), torch.rand(24, 2, generator=g), experts)
    except SyncError as err:
        raise ExerciseError(f"correct, but not sync-free: {err}\nThe number of experts is known "
                            "without the data: count with a fixed-size operator") from None
    print("✓ sync_free_dispatch matches the dropless dispatcher and passes assert_sync_free")


def pool_pages(tokens: int, top_k: int, n_experts: int, page_rows: int) -> int:
    """The worst routing: one row to as many experts as possible (each costs a page), the
    remaining rows in full pages, at most ``ceil(tokens / page_rows)`` pages per expert."""
    return max_pages(tokens, top_k, n_experts, page_rows)


def worst_routing(tokens: int, top_k: int, n_experts: int, page_rows: int) -> list[int]:
    """Rows per expert of a routing that needs `pool_pages` pages (each at most ``tokens``,
    summing to ``tokens · top_k``)."""
    rows = tokens * top_k
    m = min(n_experts, rows)
    counts = [1] * m + [0] * (n_experts - m)
    left = rows - m
    more = math.ceil(tokens / page_rows) - 1 if tokens else 0
    for e in range(m):
        add = min(more, left // page_rows)
        counts[e] += add * page_rows
        left -= add * page_rows
    for e in range(n_experts):  # the rest into pages already opened, none new
        if not left:
            break
        room = min(math.ceil(counts[e] / page_rows) * page_rows, tokens) - counts[e]
        take = min(room, left)
        counts[e] += take
        left -= take
    return counts


@exercise(pool_pages)
def check_pool_pages(fn: Callable[[int, int, int, int], int]) -> None:
    """Raise `ExerciseError` unless ``fn(tokens, top_k, n_experts, page_rows)`` is a pool no
    routing overflows, no larger than one partly filled page per expert beyond the rows."""
    rng = random.Random()
    cases = [(64, 2, 8, 16), (256, 4, 16, 32), (10, 2, 8, 4), (3, 2, 8, 16), (100, 1, 1, 7),
             (128, 8, 8, 16), (0, 2, 4, 8), (1000, 6, 64, 64)]
    cases += [(rng.randint(1, 300), k, e, rng.choice([1, 4, 8, 16, 32]))
              for e in (rng.randint(1, 32),) for k in (rng.randint(1, e),)]
    tight_everywhere = True
    for tokens, top_k, n_experts, page_rows in cases:
        want = max_pages(tokens, top_k, n_experts, page_rows)
        simple = -(-tokens * top_k // page_rows) + n_experts if tokens else 0
        got = call_answer(fn, tokens, top_k, n_experts, page_rows)
        where = f"{tokens} tokens, top-{top_k} of {n_experts} experts, {page_rows} rows per page"
        if isinstance(got, torch.Tensor) or isinstance(got, bool) or not isinstance(got, int):
            raise ExerciseError(f"({where}): return a Python int (the pool is sized before the "
                                f"step, from shapes), got {type(got).__name__}")
        if got < want:
            counts = worst_routing(tokens, top_k, n_experts, page_rows)
            need = int(pages_per_expert(F.pad(torch.tensor(counts).cumsum(0), (1, 0)),
                                        page_rows).sum())
            raise ExerciseError(f"({where}): {got} pages overflow when the experts get "
                                f"{counts} rows: that routing needs {need} pages")
        if got > max(simple, want):
            raise ExerciseError(f"({where}): {got} pages never overflow, but no routing needs "
                                f"more than {want} — that is memory a graph holds for nothing")
        tight_everywhere &= got == want
    if tight_everywhere:
        print("✓ pool_pages: never overflows, and as small as it can be")
    else:
        print("✓ pool_pages: never overflows (one spare page per expert at most); the tightest "
              "pool counts the first page of an expert as costing one row")


# ------------------------------------------------------------ a capturable training step

MAX_GRAD_NORM = 1.0


def new_stats(device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The running statistics a step adds to: 0-dim tensors on ``device``."""
    return {"loss": torch.zeros((), device=device),  # sum of the step losses
            "clipped": torch.zeros((), dtype=torch.int64, device=device),  # steps clipped
            "max_load": torch.zeros((), dtype=torch.int64, device=device),  # busiest expert
            # (layer, expert) pairs that got no token:
            "idle_experts": torch.zeros((), dtype=torch.int64, device=device)}


def step_with_syncs(model, optimizer, batch, stats: dict) -> dict:
    """One training step, correct — and not capturable: the host waits for the device
    several times."""
    out = model(batch.x, batch.y)
    if not torch.isfinite(out.loss):
        raise FloatingPointError("the loss is not finite")
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    load = torch.stack([s.tokens_per_expert for s in out.moe_stats])  # [layers, experts]
    stats["loss"] += out.loss.item()
    stats["clipped"] += int(grad_norm > MAX_GRAD_NORM)
    stats["max_load"] = torch.clamp(stats["max_load"], min=load.max().item())
    stats["idle_experts"] += load[load == 0].numel()
    return stats


def capturable_step(model, optimizer, batch, stats: dict) -> dict:
    """`step_with_syncs` with nothing read on the host: the statistics are summed into
    device tensors and the finite-loss check is a device-side assert."""
    out = model(batch.x, batch.y)
    torch._assert_async(torch.isfinite(out.loss), "the loss is not finite")
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    load = torch.stack([s.tokens_per_expert for s in out.moe_stats])
    stats["loss"] += out.loss.detach()
    stats["clipped"] += grad_norm > MAX_GRAD_NORM
    stats["max_load"] = torch.maximum(stats["max_load"], load.max())
    stats["idle_experts"] += (load == 0).sum()
    return stats


def certify_step(step: Callable, model, optimizer, batch, stats: dict) -> None:
    """Run ``step(model, optimizer, batch, stats)`` under `assert_sync_free` — forward,
    backward, clipping, the optimizer (pointed at its parameters' fake twins) and the
    statistics, on fake tensors, nothing real touched — and raise its ``SyncError`` at the
    first host sync, naming the operator and the line."""

    def run(model, batch, stats):
        with optimizer_on_fake_params(optimizer, model):
            step(model, optimizer, batch, stats)

    assert_sync_free(run, model, batch, stats, backward=False)


def step_setup(seed: int = 0, batch_size: int = 2):
    """A fresh tiny model, its capturable AdamW and a random batch (the same for the same
    seed): what the check and the notebook run the steps on."""
    cfg = preset("tiny")
    model, optimizer = build_model(cfg, seed=seed)
    batch = random_batch(cfg, batch_size, generator=torch.Generator().manual_seed(seed))
    return model, optimizer, batch


@exercise(capturable_step)
def check_capturable_step(fn: Callable) -> None:
    """Raise `ExerciseError` unless two steps of ``fn`` leave the same weights and statistics
    as two of `step_with_syncs`, a real step counts no host sync, and the whole step passes
    `certify_step`."""
    seed = random.randrange(2**16)
    runs = {}
    for name, step in (("reference", step_with_syncs), ("yours", fn)):
        model, optimizer, batch = step_setup(seed)
        stats = new_stats()
        for _ in range(2):
            got = call_answer(step, model, optimizer, batch, stats)
            if not isinstance(got, dict) or set(got) != set(stats):
                raise ExerciseError(f"return the stats dict (keys {sorted(stats)}), got "
                                    f"{type(got).__name__}")
            stats = got
        runs[name] = (model, stats)
    (ref_model, ref_stats), (model, stats) = runs["reference"], runs["yours"]
    for key, value in stats.items():
        if not isinstance(value, torch.Tensor):
            raise ExerciseError(f"stats[{key!r}] is a {type(value).__name__}: keep every "
                                "statistic a tensor on the device, so that the host need not read it")
    for key, want in ref_stats.items():
        if not close(stats[key], float(want), rel=1e-5, abs_tol=1e-6):
            raise ExerciseError(f"after two steps stats[{key!r}] = {float(stats[key]):g}, expected "
                                f"{float(want):g}")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        if not torch.allclose(p, q, rtol=1e-5, atol=1e-6):
            raise ExerciseError(f"after two steps the weight {name} differs from the reference "
                                "step's: change where the statistics are kept, not the step")
    model, optimizer, batch = step_setup(seed)
    _, syncs = count_syncs(fn, model, optimizer, batch, new_stats())
    if sum(syncs.values()):
        raise ExerciseError(f"correct, but a real step still makes the host wait: {dict(syncs)}; "
                            "run certify_step on it to find the lines")
    try:
        certify_step(fn, model, optimizer, batch, new_stats())
    except SyncError as err:
        raise ExerciseError(f"correct, but not certified sync-free: {err}") from None
    print("✓ capturable_step: the same training step, certified free of host syncs")
