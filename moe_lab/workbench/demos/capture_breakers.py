"""What breaks CUDA-graph capture: a gallery of small snippets, each beside its rewrite.

Each entry of `CAPTURE_BREAKERS` holds a snippet that needs the host in the middle of a step
(a value read back, a branch on a tensor, an output sized by the data, the stock AdamW's host
step count), and a rewrite with the same arguments that does not. `capture_gallery` runs
`moe_lab.training.sync.assert_sync_free` on both: the operator the certificate names for the
snippet, and whether the rewrite passes. Notebook 08 shows them side by side.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_lab.training.sync import SyncError, assert_sync_free

# --------------------------------------------------------------------------------------
# The gallery: what breaks capture, and the rewrite that does not
# --------------------------------------------------------------------------------------


def _loss_item(loss):
    return loss.item()


def _loss_kept(loss, total):
    return total.add_(loss.detach())


def _branch_on_norm(grad, norm):
    if norm > 1.0:
        return grad / norm
    return grad


def _branch_as_where(grad, norm):
    return grad / norm.clamp_min(1.0)


def _bool_mask(x, scores):
    return x[scores > 0.5]


def _mask_kept(x, scores):
    return x * (scores > 0.5).unsqueeze(-1)


def _where_per_expert(ids, n_experts=8):
    return [torch.where(ids == e)[0] for e in range(n_experts)]


def _sort_by_expert(ids, n_experts=8):
    return torch.argsort(ids, stable=True)


def _bincount(ids, n_experts=8):
    return torch.bincount(ids, minlength=n_experts)


def _scatter_count(ids, n_experts=8):
    return torch.zeros(n_experts, dtype=torch.int64).scatter_add_(0, ids, torch.ones_like(ids))


def _repeat_counts(counts):
    return torch.repeat_interleave(torch.arange(counts.shape[0]), counts)


def _search_offsets(counts, n_rows=32):
    ends = counts.cumsum(0)
    return torch.searchsorted(ends, torch.arange(n_rows), right=True)


def _unique_experts(ids, n_experts=8):
    return torch.unique(ids)


def _experts_present(ids, n_experts=8):
    return F.one_hot(ids, n_experts).amax(0).bool()


def _counts_tolist(counts):
    return counts.tolist()


def _counts_summed(counts, window):
    return window.add_(counts)


def _log_loss(loss):
    return f"loss {loss:.3f}"


def _clip_checked(w, g):
    w.grad = g
    return torch.nn.utils.clip_grad_norm_([w], 1.0, error_if_nonfinite=True)


def _clip_unchecked(w, g):
    w.grad = g
    return torch.nn.utils.clip_grad_norm_([w], 1.0, error_if_nonfinite=False)


def _adamw_stock(w, g):
    opt = torch.optim.AdamW([w], lr=1e-3)
    w.grad = g
    opt.step()


def _adamw_capturable(w, g):
    opt = torch.optim.AdamW([w], lr=1e-3, fused=True, capturable=True)
    w.grad = g
    opt.step()


def _ids() -> tuple:
    return (torch.randint(0, 8, (32,)),)


def _param_and_grad() -> tuple:
    return torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)


#: ``(title, broken, fixed, make_args)`` per entry: a snippet that breaks capture, its
#: sync-free rewrite (same arguments), and a function building their arguments.
CAPTURE_BREAKERS: tuple[tuple[str, Callable, Callable, Callable[[], tuple]], ...] = (
    ("reading the loss every step", _loss_item, lambda loss: _loss_kept(loss, torch.zeros(())),
     lambda: (torch.rand(()),)),
    ("branching on a tensor", _branch_on_norm, _branch_as_where,
     lambda: (torch.randn(8), torch.rand(()) * 2)),
    ("a boolean mask", _bool_mask, _mask_kept, lambda: (torch.randn(16, 4), torch.rand(16))),
    ("torch.where per expert (naive dispatch)", _where_per_expert, _sort_by_expert, _ids),
    ("bincount, even with minlength", _bincount, _scatter_count, _ids),
    ("repeat_interleave by counts", _repeat_counts, _search_offsets,
     lambda: (torch.tensor([5, 0, 11, 16]),)),
    ("unique", _unique_experts, _experts_present, _ids),
    ("statistics to a list", _counts_tolist,
     lambda counts: _counts_summed(counts, torch.zeros(8, dtype=torch.int64)),
     lambda: (torch.randint(0, 9, (8,)),)),
    ("formatting a tensor", _log_loss, lambda loss: _loss_kept(loss, torch.zeros(())),
     lambda: (torch.rand(()),)),
    ("clipping with a finiteness check", _clip_checked, _clip_unchecked, _param_and_grad),
    ("the stock AdamW", _adamw_stock, _adamw_capturable, _param_and_grad),
)


def capture_gallery() -> list[dict]:
    """Run `assert_sync_free` on each snippet and its rewrite. One row per snippet:
    ``title``, ``broken_source``, ``fixed_source``, ``op`` (what the certificate named),
    ``fixed_passes`` (whether the rewrite is certified sync-free)."""
    rows = []
    for title, broken, fixed, make_args in CAPTURE_BREAKERS:
        rows.append({"title": title, "broken_source": inspect.getsource(broken).strip(),
                     "fixed_source": inspect.getsource(fixed).strip(),
                     "op": _refused_op(broken, make_args()),
                     "fixed_passes": _refused_op(fixed, make_args()) is None})
    return rows


def _refused_op(fn: Callable, args: tuple) -> str | None:
    """The operator the certificate names in refusing ``fn(*args)``, or None when it is sync-free."""
    try:
        assert_sync_free(fn, *args, backward=False)
    except SyncError as err:
        return err.op
    return None
