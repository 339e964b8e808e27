"""Paged stashing: the experts' saved activations in fixed pages, allocated on the device.

Backward needs what the forward pass saved: for the experts, activations with one row
per (token, expert) assignment routed to the device. How many rows that is depends on the
routing. Eager PyTorch allocates each saved tensor at its exact size, after the host has
learned the size — a sync. A captured CUDA graph cannot ask: every buffer has the size it
had at capture, so a static design must allocate for the worst case. On one device with
every expert local, moe_lab's dropless buffer is exactly ``tokens · top_k`` rows and
static for free (notebook 04). With expert parallelism it is not: a device's experts
receive between nothing and every token of every rank, so a static per-expert buffer
holds ``n_experts · tokens`` rows per device (each of its ``E / ep`` experts may receive
all ``ep · tokens`` tokens of the group) against ``tokens · top_k`` on average — and one
such buffer per layer, because each layer's activations live until its backward.

Paging decouples the two. Compute still runs in whatever buffer the dispatcher uses; what
must *live until backward* is copied into a pool of fixed-size pages shared by all layers:

1. per-expert page counts from the token counts: ``pages[e] = ceil(rows[e] / page_rows)``;
2. each expert's first page by an exclusive prefix sum of those counts, after the pages
   already taken this step (``head``) — a bump allocator on the device;
3. each row's page and slot: its expert by a binary search of the offsets, its position
   in the expert, divided by the page size;
4. a fixed pool with an ``overflow`` flag: pages past the end go to a trash page and the
   flag is raised. The step is then repeated without stashing (Megatron-Core's paged-stash
   runner and HybridEP do the same) or skipped.

All of it runs on the device with shapes known in advance: no sync, so it can be captured.
The pool costs ``capacity_factor · tokens · top_k`` rows (+ one partly filled page per
expert) per stashed tensor instead of the worst case; restoring gathers the same rows back,
so the saved activations round-trip bit for bit.

`PagedStash.attach(model, example_batch)` gives each MoE layer's experts an activation store
(`moe_lab.moe.experts.SwiGLUExperts.use_activation_store`, `PagedStash.run_paged` bound to the
layer) that runs their compute under
``torch.autograd.graph.saved_tensors_hooks``: every saved tensor with one row per sorted
assignment goes into the pool; weights and offsets are kept as they are. A first forward
pass on the example batch plans the pools (one per activation width and dtype).
`simulate_expert_parallel` measures the memory against the worst case across routing
skews, for one device of an expert-parallel group.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_lab.checks import positive_int, positive_number
from moe_lab.data import Batch

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------
# The page arithmetic (all on the device, no sync)
# --------------------------------------------------------------------------------------


def pages_per_expert(offsets: Tensor, page_rows: int) -> Tensor:
    """``[E]`` int64: ``ceil(rows[e] / page_rows)`` with ``rows[e] = offsets[e+1] - offsets[e]``
    (``offsets: [E + 1]``, on the device)."""
    counts = (offsets[1:] - offsets[:-1]).long()
    return (counts + page_rows - 1) // page_rows


def page_table(offsets: Tensor, page_rows: int, n_rows: int,
               head: Tensor | int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Where each of the ``n_rows`` rows sorted by expert goes in a page pool.

    ``offsets: [E + 1]`` (``offsets[-1] == n_rows``); ``head``: the pages already taken.
    Returns ``(page, slot, first_page)``: ``page, slot: [n_rows]`` int64 — row ``r`` lives
    at ``pool[page[r], slot[r]]`` — and ``first_page: [E]`` int64, each expert's first page
    (the page map). Expert ``e`` owns pages ``first_page[e] … first_page[e] + pages[e] - 1``;
    every page holds rows of one expert only, so a kernel can treat a page as a tile.
    """
    pages = pages_per_expert(offsets, page_rows)
    first_page = F.pad(pages.cumsum(0), (1, 0))[:-1] + head  # exclusive prefix sum
    # Row r: its expert by a binary search of the offsets, its position within the expert.
    rows = torch.arange(n_rows, device=offsets.device, dtype=offsets.dtype)
    expert = torch.searchsorted(offsets[1:], rows, right=True).clamp_(max=pages.shape[0] - 1)
    within = (rows - offsets.index_select(0, expert)).long()
    return first_page.index_select(0, expert) + within // page_rows, within % page_rows, first_page


def max_pages(tokens: int, top_k: int, n_experts: int, page_rows: int) -> int:
    """The most pages one layer's ``tokens · top_k`` rows can take on one device, over every
    routing (each token picks ``top_k`` distinct experts, so an expert gets at most
    ``tokens`` rows): the smallest pool that never overflows.

    An expert's first page costs one row, each further page a full ``page_rows``. So the
    worst routing gives one row to as many experts as it can, ``m = min(E, T·k)``, and
    spends the rest on further pages — at most ``ceil(T / page_rows) - 1`` more per expert.
    """
    rows = tokens * top_k
    m = min(n_experts, rows)
    if m == 0:
        return 0
    more_per_expert = -(-tokens // page_rows) - 1
    return m + min((rows - m) // page_rows, m * more_per_expert)


# --------------------------------------------------------------------------------------
# The pool and the hooks
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StashCall:
    """One activation the experts save, as planned: width, dtype, rows (``T·k``), experts and
    ``top_k`` (so ``rows / top_k`` tokens)."""

    width: int
    dtype: torch.dtype
    rows: int
    n_experts: int
    top_k: int


@dataclass
class _Stashed:
    """The handle autograd keeps instead of a tensor: where its rows went (its pool, and the
    offsets and the pool's ``head`` from which `page_table` places them again)."""

    pool: int
    offsets: Tensor
    head: Tensor
    shape: tuple[int, ...]


class PagedStash(nn.Module):
    """A device page pool for the activations the MoE experts save for backward.

    ``stash = PagedStash(page_rows=32, capacity_factor=1.25).attach(model, example_batch)``;
    then every training forward pass pages the experts' saved activations into fixed pools
    (buffers ``pool{i}: [n_pages + 1, page_rows, width]``, the last page a trash page; ``heads:
    [n_pools]`` the pages taken this step), and backward reads them back. Call `reset` at the
    start of each step (the `moe_lab.training.steps.SyncFreeStep` does). ``overflow`` (``[]``
    bool buffer) is raised when a step needed more pages than a pool holds; those rows went to
    the trash page, so the step must be repeated with the stash `disabled` (or skipped).

    Pool size per planned activation: ``ceil(capacity_factor · rows / page_rows) + E`` pages.
    With ``capacity_factor >= 1`` a single device never overflows (see `max_pages`); under
    expert parallelism the rows a device receives vary, and the factor is the margin.
    """

    def __init__(self, page_rows: int = 32, capacity_factor: float = 1.25) -> None:
        super().__init__()
        self.page_rows = positive_int(page_rows, "page_rows")
        self.capacity_factor = positive_number(capacity_factor, "capacity_factor")
        self.enabled = True
        self.planning = False
        self.plan: list[StashCall] = []
        self.pool_keys: list[tuple[int, torch.dtype]] = []
        self._model_ref = lambda: None
        self.register_buffer("overflow", torch.zeros((), dtype=torch.bool))
        self.register_buffer("heads", torch.zeros(0, dtype=torch.int64))

    # -- setting up ----------------------------------------------------------------------

    def attach(self, model: nn.Module, example_batch: Batch) -> PagedStash:
        """Wrap the expert compute of every MoE layer of ``model`` and size the pools from
        one forward pass on ``example_batch`` (``.x``: ``[batch, seq]``): each planned
        activation (`StashCall`) sets aside ``ceil(capacity_factor · rows / page_rows) + E``
        pages of the pool of its width and dtype. Returns self."""
        layers = list(getattr(model, "moe_layers", []))
        if not layers:
            raise ValueError("PagedStash.attach: the model has no MoE layers (model.moe_layers)")
        if self._model_ref() is not None:
            raise ValueError("PagedStash.attach: already attached (a stash serves one model)")
        for index, layer in enumerate(layers):
            if layer.dispatcher != "dropless":
                raise ValueError(f"PagedStash.attach: MoE layer {index} uses dispatcher "
                                 f"{layer.dispatcher!r}; paging needs the dropless dispatcher's "
                                 "expert-sorted rows and offsets")
            layer.experts.use_activation_store(functools.partial(self.run_paged, layer.cfg.top_k))
        self._model_ref = weakref.ref(model)  # not a submodule: the stash does not own the model
        self.planning = True
        try:
            with torch.enable_grad():
                model(example_batch.x)
        finally:
            self.planning = False
        device = next(model.parameters()).device
        self.pool_keys = list(dict.fromkeys((call.width, call.dtype) for call in self.plan))
        for i, (width, dtype) in enumerate(self.pool_keys):
            n_pages = sum(math.ceil(self.capacity_factor * c.rows / self.page_rows) + c.n_experts
                          for c in self.plan if (c.width, c.dtype) == (width, dtype))
            self.register_buffer(f"pool{i}", torch.zeros(n_pages + 1, self.page_rows, width,
                                                         dtype=dtype, device=device))
        self.heads = torch.zeros(len(self.pool_keys), dtype=torch.int64, device=device)
        self.overflow = torch.zeros((), dtype=torch.bool, device=device)
        return self

    def check_attached(self, model: nn.Module) -> None:
        if self._model_ref() is not model:
            raise ValueError("the paged stash is not attached to this model: "
                             "call stash.attach(model, example_batch) first")

    # -- one step --------------------------------------------------------------------------

    def reset(self) -> None:
        """Start a step: every pool empty, the overflow flag down (device ops only)."""
        self.heads.zero_()
        self.overflow.zero_()

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run without paging (the saved activations stay ordinary tensors)."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    def _rows(self, handle: _Stashed) -> tuple[Tensor, Tensor]:
        """The pool of ``handle`` as ``[pages · page_rows, width]`` rows, and the row each of its
        rows goes to (pages past the pool: its trash page)."""
        pool = getattr(self, f"pool{handle.pool}")
        page, slot, _ = page_table(handle.offsets, self.page_rows, handle.shape[0], handle.head)
        return pool.view(-1, pool.shape[-1]), page.clamp_max(pool.shape[0] - 1) * self.page_rows + slot

    def run_paged(self, top_k: int, compute: Callable[[], Tensor], x: Tensor, offsets: Tensor) -> Tensor:
        """``compute()`` — a layer's expert MLP on ``x`` grouped by ``offsets`` — with its saved
        activations paged (planned, during `attach`): the activation store `attach` gives each
        layer's experts, with the layer's ``top_k`` bound."""
        if not self.enabled or not (self.planning or self.pool_keys):
            return compute()
        rows = x.shape[0]

        def pack(t: Tensor) -> Tensor | _Stashed:
            # Activations: one row per sorted assignment. Not the weights (leaves that
            # require grad) nor the offsets.
            pageable = (t.dim() == 2 and t.shape[0] == rows and t.is_floating_point()
                        and not (t.is_leaf and t.requires_grad))
            if not pageable:
                return t
            key = (t.shape[1], t.dtype)
            if self.planning:
                self.plan.append(StashCall(*key, rows, offsets.shape[0] - 1, top_k))
                return t  # planning: kept as it is
            if key not in self.pool_keys:
                raise ValueError(f"PagedStash: no pool for width {key[0]} and dtype {key[1]} "
                                 f"(planned: {self.pool_keys}); attach with this model and batch shape")
            i = self.pool_keys.index(key)
            # Copy t into its pool after the pages taken so far; raise the flag where it does not fit.
            head = self.heads[i]
            handle = _Stashed(i, offsets, head.clone(), tuple(t.shape))
            pool_rows, dest = self._rows(handle)
            used = pages_per_expert(offsets, self.page_rows).sum()
            self.overflow.logical_or_(head + used > getattr(self, f"pool{i}").shape[0] - 1)
            head.add_(used)
            pool_rows.index_copy_(0, dest, t)
            return handle

        def unpack(t: Tensor | _Stashed) -> Tensor:
            if not isinstance(t, _Stashed):
                return t
            pool_rows, dest = self._rows(t)
            return pool_rows.index_select(0, dest).view(t.shape)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return compute()

    # -- what it costs ---------------------------------------------------------------------

    @property
    def pool_bytes(self) -> int:
        """Bytes of all pools (trash pages included): the fixed allocation."""
        return sum(getattr(self, f"pool{i}").numel() * getattr(self, f"pool{i}").element_size()
                   for i in range(len(self.pool_keys)))

    @property
    def exact_bytes(self) -> int:
        """Bytes of the planned activations at their exact size, the routed rows (eager PyTorch,
        one device)."""
        return sum(c.rows * c.width * c.dtype.itemsize for c in self.plan)

    @property
    def worst_case_bytes(self) -> int:
        """Bytes of static per-expert buffers with room for every token at every expert:
        ``E · T`` rows per planned activation."""
        return sum(c.n_experts * (c.rows // c.top_k) * c.width * c.dtype.itemsize for c in self.plan)

    def pages_used(self) -> list[int]:
        """Pages taken in each pool by the last step (reads the device: for reports only)."""
        return self.heads.tolist()

    def pool_pages(self) -> list[int]:
        return [getattr(self, f"pool{i}").shape[0] - 1 for i in range(len(self.pool_keys))]

    def extra_repr(self) -> str:
        pools = [(w, str(d).replace("torch.", ""), n)
                 for (w, d), n in zip(self.pool_keys, self.pool_pages(), strict=True)]
        return f"page_rows={self.page_rows}, capacity_factor={self.capacity_factor}, pools={pools}"


# --------------------------------------------------------------------------------------
# Memory across routing skews, one device of an expert-parallel group
# --------------------------------------------------------------------------------------


def simulate_expert_parallel(tokens_per_rank: int, n_experts: int, top_k: int, ep_size: int,
                             skews: Sequence[float], page_rows: int = 32, capacity_factor: float = 1.25,
                             seed: int = 0) -> list[dict]:
    """Rows of expert activations one device must keep, per routing skew, in units of rows
    (multiply by width × bytes for memory): ``exact`` (eager, the busiest device),
    ``paged`` (its pages × page_rows), ``pool`` (the fixed pool:
    ``ceil(cf · T·k / page_rows) + E_local`` pages), ``worst_case`` (a static buffer for
    every token of the group at each local expert: ``E_local · ep · T = E · T``), and
    whether any device ``overflow`` s its pool. The pages come from `pages_per_expert`.

    The routing is simulated: every one of ``ep_size`` ranks routes ``tokens_per_rank``
    tokens top-k among ``n_experts`` with Zipf-like popularity ``p_e ∝ (e + 1) ** -skew``
    (skew 0: uniform; device 0 holds the most popular experts)."""
    if n_experts % ep_size:
        raise ValueError(f"ep_size must divide n_experts={n_experts}, got {ep_size}")
    local = n_experts // ep_size
    pool_pages = math.ceil(capacity_factor * tokens_per_rank * top_k / page_rows) + local
    rows_out = []
    for skew in skews:
        g = torch.Generator().manual_seed(seed)
        popularity = (torch.arange(n_experts, dtype=torch.float64) + 1) ** -skew
        ids = torch.multinomial(popularity.expand(tokens_per_rank * ep_size, n_experts), top_k,
                                replacement=False, generator=g)
        counts = torch.bincount(ids.reshape(-1), minlength=n_experts).view(ep_size, local)
        pages = [int(pages_per_expert(F.pad(c.cumsum(0), (1, 0)), page_rows).sum()) for c in counts]
        busiest = int(counts.sum(1).argmax())
        rows_out.append({
            "skew": float(skew), "exact": int(counts[busiest].sum()),
            "paged": pages[busiest] * page_rows, "pool": pool_pages * page_rows,
            "worst_case": n_experts * tokens_per_rank, "overflow": any(p > pool_pages for p in pages),
        })
    return rows_out
