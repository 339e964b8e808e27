"""Max-min fair rates and flow completion times: what a fair congestion control converges to.

Flows share links; each link has a capacity. *Max-min fairness* (progressive filling):
raise every flow's rate together until some link is full, freeze the flows through it at
that rate, and repeat with the rest. No flow can then go faster without slowing a flow
that is no faster than it. *Completion times*: a fluid simulation re-allocates the fair
rates each time flows finish. Both work on any set of links — the leaf-spine fabric
(:mod:`moe_lab.sim.fabric`) hands them its flows' paths and link capacities.
"""

from __future__ import annotations

import numpy as np


class _Incidence:
    """Flow-link incidence in both directions, built once and reused by every water-fill.

    ``padded[f]``: the links of flow ``f`` (``n_links`` pads a missing hop); the flows of
    link ``l`` are ``by_link[starts[l]:starts[l + 1]]``.
    """

    def __init__(self, flow_links: np.ndarray, capacity: np.ndarray) -> None:
        links = np.asarray(flow_links, dtype=np.int64)
        self.capacity = np.asarray(capacity, dtype=float)
        self.n_links = self.capacity.size
        valid = links >= 0
        self.padded = np.where(valid, links, self.n_links)
        flow_of = np.repeat(np.arange(links.shape[0]), links.shape[1])[valid.ravel()]
        link_of = links.ravel()[valid.ravel()]
        order = np.argsort(link_of, kind="stable")
        self.by_link = flow_of[order]
        self.starts = np.searchsorted(link_of[order], np.arange(self.n_links + 1))

    def rates(self, active: np.ndarray, rel_tol: float) -> np.ndarray:
        """Max-min fair rates of the flows where ``active`` is True (0 for the others)."""
        rate = np.zeros(len(self.padded))
        free = active.copy()
        counts = np.bincount(self.padded[free].ravel(), minlength=self.n_links + 1)
        counts = counts[: self.n_links].astype(float)
        residual = self.capacity.copy()
        level = 0.0
        while (live := counts > 0).any():
            share = np.divide(residual, counts, out=np.full(self.n_links, np.inf), where=live)
            inc = float(share.min())
            level += inc
            residual -= inc * counts
            full = np.flatnonzero(share <= inc * (1.0 + rel_tol))
            members = np.concatenate([self.by_link[self.starts[k] : self.starts[k + 1]] for k in full])
            # A flow through two links that fill together is counted once.
            members = np.unique(members[free[members]])
            free[members] = False
            rate[members] = level
            counts -= np.bincount(self.padded[members].ravel(), minlength=self.n_links + 1)[: self.n_links]
            residual[full] = 0.0
            counts[full] = 0.0
        return rate


def max_min_rates(flow_links: np.ndarray, capacity: np.ndarray, *, rel_tol: float = 1e-9) -> np.ndarray:
    """Max-min fair rates by progressive filling.

    Args:
        flow_links: ``[n_flows, hops]`` link indices per flow, ``-1`` for "no link".
        capacity: ``[n_links]`` capacities (the rates come back in the same unit).
        rel_tol: links whose fair share is within this factor of the smallest fill in the
            same round (1e-9: exact up to rounding; larger merges rounds, for speed).

    Every unfrozen flow's rate rises together until some link is full; the flows through
    it are frozen at that rate; repeat. The result is the allocation in which no flow can
    go faster without slowing a flow that is no faster than it.
    """
    inc = _Incidence(flow_links, capacity)
    return inc.rates(np.ones(inc.padded.shape[0], dtype=bool), rel_tol)


def fluid_completion_times(nbytes: np.ndarray, flow_links: np.ndarray, capacity: np.ndarray, *,
                           rel_tol: float = 0.01, step_quantile: float = 0.1) -> np.ndarray:
    """Completion time of every flow (all starting at 0) under max-min fair sharing.

    A fluid simulation in epochs: compute the max-min rates of the unfinished flows,
    advance time, re-allocate. Each epoch runs until the ``step_quantile`` quantile of the
    unfinished flows' finishing times at the current rates (at least the next completion),
    so the epochs stay few (about ``log(n_flows) / -log(1 - step_quantile)``). A flow that
    finishes inside an epoch does so at the epoch's rates, not at the rates the flows
    finishing before it would have left it (a few per cent on the percentiles with the
    defaults; ``test_sim_fair_share`` holds it to 5 %). ``step_quantile=0`` with a tiny
    ``rel_tol`` is exact: one epoch per completion.
    """
    size = np.asarray(nbytes, dtype=float)
    incidence = _Incidence(flow_links, capacity)
    done = np.zeros(size.size)
    remaining = size.copy()
    active = remaining > 0
    now = 0.0
    while active.any():
        idx = np.flatnonzero(active)
        rates = incidence.rates(active, rel_tol)[idx]
        to_finish = remaining[idx] / rates
        step = max(float(to_finish.min()) * (1.0 + rel_tol), float(np.quantile(to_finish, step_quantile)))
        finishing = to_finish <= step
        done[idx[finishing]] = now + to_finish[finishing]
        active[idx[finishing]] = False
        keep = idx[~finishing]
        remaining[keep] -= rates[~finishing] * step
        now += step
    return done
