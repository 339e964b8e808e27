"""The network under expert parallelism, simulated: leaf-spine, ECMP vs adaptive, incast.

Expert parallelism ends every MoE layer's dispatch and combine with an **all-to-all**:
each GPU sends the tokens routed to experts on other GPUs. Between nodes this crosses a
two-tier **leaf-spine** network: every GPU's NIC hangs off a leaf switch, and every leaf
has one uplink to every spine, so two GPUs on different leaves have ``n_spine`` equal
paths between them. Which path a flow takes decides whether the fabric delivers its
nominal bandwidth:

* **ECMP** hashes each flow's header onto one path. The hash is as good as random, so the
  flows of a leaf fall onto its uplinks like balls into bins: some uplinks get more than
  their share, and because all-to-all traffic is a few large, long-lived ("low entropy")
  flows that start together, those collisions last for the whole transfer. The busiest
  uplink sets the pace; the others idle after their flows finish.
* **Adaptive routing** (per packet, on the least-loaded path, with the receiving NIC
  putting packets back in order) spreads every flow over all spines. In the fluid limit
  modelled here — small packets, accurate load telemetry, a symmetric fabric — every
  uplink of a leaf carries the same load, so the fabric behaves as one big switch.
* **Incast**: when many senders target one GPU (a hot expert), their first packets all
  arrive together. Without **pacing** the senders start at line rate, the receiver's
  switch port queues the excess until congestion control reacts, and what does not fit
  in its buffer is dropped and retransmitted after a timeout — a tail-latency spike.
  With pacing (telemetry-driven congestion control that sets each sender to its fair
  share from the start) the queue never builds.

The model, step by step (each a documented approximation):

1. *Topology* (:class:`LeafSpine`): directed links host→leaf, leaf→host, leaf→spine,
   spine→leaf; host links run at ``link_gbps``; each leaf's ``n_spine`` uplinks together
   carry ``hosts_per_leaf × link_gbps / oversubscription``.
2. *Traffic* (:mod:`moe_lab.sim.traffic`): a GPU × GPU matrix of bytes (uniform, MoE
   dispatch with Zipf-skewed expert popularity, incast); each non-zero off-diagonal entry
   is one flow, all starting at time 0.
3. *Routing* (:func:`route`): ECMP picks one spine per flow uniformly at random (a hash);
   adaptive routing splits each flow equally over the spines, modelled as each leaf's
   uplinks acting as one link of ``n_spine`` times the capacity.
4. *Rates* (:mod:`moe_lab.sim.fair_share`): max-min fair (progressive filling: raise
   every rate together until a link fills, freeze the flows through it, repeat) — what a
   fair congestion control converges to. *Completion times*: a fluid simulation
   re-allocates the rates each time flows finish.
5. *Burst* (unpaced only, :class:`BurstModel`): before congestion control reacts
   (``reaction_us``), each sender splits its line rate evenly over its flows (a flow
   shorter than the window sends all of it); queues grow at every link that receives
   more in the window than it can forward (arrivals pass hop by hop, each congested link
   forwarding at its capacity). The queue a flow meets adds its draining
   time to the flow's completion; a queue beyond ``buffer_kb`` drops packets, and every
   flow through that port pays one retransmission timeout (``rto_us``). Paced senders
   start at their fair rates, so no queue builds. No PFC, no ECN marking dynamics, no
   packet-level reordering cost: first-order effects only.

Figures are projections ("simulated"), not measurements; they are drawn by
:mod:`moe_lab.workbench.figures.fabric`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_lab.checks import non_negative_number, one_of, positive_ints, positive_number
from moe_lab.sim.fair_share import fluid_completion_times
from moe_lab.sim.traffic import check_traffic

ROUTINGS = ("ecmp", "adaptive")


# ---------------------------------------------------------------------------- topology


@dataclass(frozen=True)
class LeafSpine:
    """A two-tier leaf-spine fabric with one NIC per GPU ("host").

    Link indices (directed): host ``h`` up ``h``; down ``H + h``; leaf ``a`` → spine ``s``
    ``2H + a·S + s``; spine ``s`` → leaf ``b`` ``2H + A·S + s·A + b`` (``H`` hosts, ``A``
    leaves, ``S`` spines).
    """

    hosts_per_leaf: int = 8
    n_leaf: int = 8
    n_spine: int = 8
    link_gbps: float = 400.0
    oversubscription: float = 1.0

    def __post_init__(self) -> None:
        positive_ints(self, "hosts_per_leaf", "n_leaf", "n_spine")
        positive_number(self.link_gbps, "LeafSpine.link_gbps")
        positive_number(self.oversubscription, "LeafSpine.oversubscription")
        if self.oversubscription < 1:
            raise ValueError(
                f"LeafSpine.oversubscription must be >= 1 (downlink : uplink capacity), "
                f"got {self.oversubscription!r}"
            )

    @property
    def n_hosts(self) -> int:
        """GPUs (one NIC each)."""
        return self.hosts_per_leaf * self.n_leaf

    @property
    def n_links(self) -> int:
        """Directed physical links."""
        return 2 * self.n_hosts + 2 * self.n_leaf * self.n_spine

    @property
    def link_bytes_per_s(self) -> float:
        """Capacity of a host link (NIC), bytes/s."""
        return self.link_gbps * 1e9 / 8

    @property
    def uplink_bytes_per_s(self) -> float:
        """Capacity of one leaf-spine link, bytes/s."""
        return self.hosts_per_leaf * self.link_bytes_per_s / (self.n_spine * self.oversubscription)

    def leaf_of(self, host: np.ndarray | int) -> np.ndarray | int:
        """The leaf switch of ``host``."""
        return np.asarray(host) // self.hosts_per_leaf

    def capacities(self) -> np.ndarray:
        """Bytes/s of every physical link, ``[n_links]``."""
        host_links = 2 * self.n_hosts
        n_per_rate = [host_links, self.n_links - host_links]  # host links, then leaf-spine links
        return np.repeat([self.link_bytes_per_s, self.uplink_bytes_per_s], n_per_rate)

    def leaf_up(self, leaf: np.ndarray, spine: np.ndarray) -> np.ndarray:
        """Link index of ``leaf`` → ``spine``."""
        return 2 * self.n_hosts + np.asarray(leaf) * self.n_spine + np.asarray(spine)

    def spine_down(self, spine: np.ndarray, leaf: np.ndarray) -> np.ndarray:
        """Link index of ``spine`` → ``leaf``."""
        base = 2 * self.n_hosts + self.n_leaf * self.n_spine
        return base + np.asarray(spine) * self.n_leaf + np.asarray(leaf)


# ---------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class Flows:
    """The flows of a traffic matrix and the links each crosses.

    ``rate_links[f]``: the links of flow ``f`` the rate allocation sees, one per hop (host up,
    leaf up, spine down, host down; ``-1`` for the middle hops of an intra-leaf flow) — the
    physical ones for ECMP; for adaptive routing, which crosses every spine, each leaf's
    uplinks (and downlinks from the spine layer) merged into one link of ``n_spine`` times the
    capacity, ``rate_capacity``. ``spine[f]``: the ECMP choice (``-1`` intra-leaf or adaptive).
    ``link_bytes``: the bytes on every physical link.
    """

    routing: str
    src: np.ndarray
    nbytes: np.ndarray
    spine: np.ndarray
    link_bytes: np.ndarray
    rate_links: np.ndarray
    rate_capacity: np.ndarray


def route(topo: LeafSpine, traffic: np.ndarray, routing: str = "ecmp",
          rng: np.random.Generator | None = None) -> Flows:
    """Turn ``traffic`` into flows with paths (ECMP hashing or adaptive spreading)."""
    one_of(routing, "routing", ROUTINGS)
    arr = check_traffic(traffic, topo.n_hosts)
    rng = rng if rng is not None else np.random.default_rng(0)
    mask = arr > 0
    np.fill_diagonal(mask, False)
    src, dst = np.nonzero(mask)
    nbytes = arr[src, dst]
    a, b = topo.leaf_of(src), topo.leaf_of(dst)
    inter = a != b
    H, A, S = topo.n_hosts, topo.n_leaf, topo.n_spine
    links = np.full((src.size, 4), -1, dtype=np.int64)
    links[:, 0] = src  # host h's uplink is link h, its downlink link H + h
    links[:, 3] = H + dst
    spine = np.full(src.size, -1, dtype=np.int64)
    if routing == "ecmp":
        spine[inter] = rng.integers(0, S, size=int(inter.sum()))  # the hash: uniform, independent
        links[inter, 1] = topo.leaf_up(a[inter], spine[inter])
        links[inter, 2] = topo.spine_down(spine[inter], b[inter])
    rate_links, rate_capacity = links, topo.capacities()
    if routing == "adaptive":  # each leaf's S uplinks act as one link of S times the capacity
        rate_links = links.copy()
        rate_links[inter, 1] = 2 * H + a[inter]
        rate_links[inter, 2] = 2 * H + A + b[inter]
        rate_capacity = np.concatenate([rate_capacity[: 2 * H], np.full(2 * A, S * topo.uplink_bytes_per_s)])
    # Each link is on one hop of a path, so the hops' byte counts add without rounding.
    link_bytes = np.zeros(rate_capacity.size)
    for hop in rate_links.T:
        link_bytes += np.bincount(hop[hop >= 0], weights=nbytes[hop >= 0], minlength=rate_capacity.size)
    if routing == "adaptive":
        link_bytes[2 * H:] /= S  # every spine carries 1/S of each inter-leaf flow
    link_bytes = _physical(link_bytes, routing, topo)
    return Flows(routing, src, nbytes, spine, link_bytes, rate_links, rate_capacity)


# ---------------------------------------------------------------------------- burst model


@dataclass(frozen=True)
class BurstModel:
    """The first moments of an unpaced transfer, before congestion control reacts.

    ``reaction_us``: how long senders keep their starting rate (feedback round trip plus
    the rate update). ``buffer_kb``: packet buffer per switch egress port. ``rto_us``:
    the retransmission timeout a flow pays when its packets are dropped. Defaults are
    illustrative orders of magnitude for a 400G RoCE fabric, not measured values.
    """

    reaction_us: float = 10.0
    buffer_kb: float = 1024.0
    rto_us: float = 500.0

    def __post_init__(self) -> None:
        for name in ("reaction_us", "buffer_kb", "rto_us"):
            non_negative_number(getattr(self, name), f"BurstModel.{name}")


def _burst(flows: Flows, topo: LeafSpine, model: BurstModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Peak queue (bytes), dropped bytes and capacity per link during the unpaced start,
    over the links the rates see (`Flows.rate_links`; an adaptive leaf's merged uplinks
    carry the figures of each of its ``n_spine`` physical links, which share the load equally).

    Hop by hop: a flow arrives at the rate the previous hop let through; over the
    reaction window ``tau`` a link receives ``sum(min(rate * tau, flow bytes))`` and
    forwards ``capacity * tau``; the difference queues, and beyond the buffer it is lost.
    """
    n_links = flows.rate_capacity.size
    cap = topo.capacities()[:n_links]  # one physical link's capacity (the uplinks' past the hosts)
    share = np.ones(n_links)
    if flows.routing == "adaptive":
        share[2 * topo.n_hosts:] = topo.n_spine  # a merged link's load spreads over the spines
    per_sender = np.bincount(flows.src, minlength=topo.n_hosts)
    # Each sender splits its NIC evenly over its flows.
    arrive = topo.link_bytes_per_s / per_sender[flows.src]
    queue = np.zeros(n_links)
    dropped = np.zeros(n_links)
    tau = model.reaction_us * 1e-6
    buffer = model.buffer_kb * 1024
    for hop in range(4):
        link = flows.rate_links[:, hop]
        on = link >= 0
        offered = np.bincount(link[on], weights=arrive[on], minlength=n_links) / share
        window = np.minimum(arrive * tau, flows.nbytes)
        window_bytes = np.bincount(link[on], weights=window[on], minlength=n_links) / share
        excess = np.maximum(window_bytes - cap * tau, 0.0)
        queue = np.maximum(queue, np.minimum(excess, buffer))
        dropped += np.maximum(excess - buffer, 0.0)
        # The share of the offered rate each link forwards: min(1, capacity / offered).
        scale = np.divide(cap, offered, out=np.ones_like(offered), where=offered > cap)
        arrive = np.where(on, arrive * scale[np.where(on, link, 0)], arrive)
    return queue, dropped, cap


def _physical(values: np.ndarray, routing: str, topo: LeafSpine) -> np.ndarray:
    """Per-rate-link figures (`Flows.rate_links`) per physical link: under adaptive routing a
    leaf's merged uplink (downlink) stands for each of its ``n_spine`` physical ones."""
    if routing != "adaptive":
        return values
    H, A, S = topo.n_hosts, topo.n_leaf, topo.n_spine
    leaves, spines = np.repeat(np.arange(A), S), np.tile(np.arange(S), A)
    out = np.zeros(topo.n_links)
    out[: 2 * H] = values[: 2 * H]
    out[topo.leaf_up(leaves, spines)] = np.repeat(values[2 * H: 2 * H + A], S)
    out[topo.spine_down(spines, leaves)] = np.repeat(values[2 * H + A:], S)
    return out


# ---------------------------------------------------------------------------- results


@dataclass(frozen=True)
class FabricResult:
    """One simulated transfer: per-flow completion times and the fabric's figures.

    ``fct`` in seconds per flow; ``algbw_fraction``: bytes each GPU sends on average,
    over the transfer time, as a fraction of its link capacity (1 = line rate);
    ``efficiency``: the time a perfectly balanced fabric would need (the busiest NIC or
    leaf's uplinks) over the simulated time. ``dropped_bytes``: per physical link, during the
    unpaced burst (zeros when paced); ``timed_out[f]``: flow ``f`` lost packets and paid a
    retransmission timeout.
    """

    topology: LeafSpine
    routing: str
    pacing: bool
    flows: Flows
    fct: np.ndarray
    makespan: float
    lower_bound: float
    dropped_bytes: np.ndarray
    timed_out: np.ndarray

    @property
    def algbw_fraction(self) -> float:
        """Mean bytes sent per GPU / transfer time / link capacity."""
        per_gpu = self.flows.nbytes.sum() / self.topology.n_hosts
        return float(per_gpu / self.makespan / self.topology.link_bytes_per_s)

    @property
    def efficiency(self) -> float:
        """Perfectly balanced transfer time / simulated transfer time."""
        return float(self.lower_bound / self.makespan)

    def fct_percentile(self, q: float) -> float:
        """Flow completion time percentile ``q`` (0–100), microseconds."""
        return float(np.percentile(self.fct, q) * 1e6)

    def uplink_bytes(self) -> np.ndarray:
        """Bytes on every leaf→spine and spine→leaf link, ``[2 · n_leaf · n_spine]``."""
        return self.flows.link_bytes[2 * self.topology.n_hosts :]

    @property
    def uplink_max_over_mean(self) -> float:
        """Bytes on the busiest leaf-spine link over the mean."""
        up = self.uplink_bytes()
        return float(up.max() / up.mean()) if up.mean() > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        """The figures as plain JSON-able values, marked ``kind="simulated"``."""
        return {"routing": self.routing, "pacing": self.pacing, "n_gpus": self.topology.n_hosts,
                "n_flows": int(self.flows.src.size), "makespan_us": self.makespan * 1e6,
                "lower_bound_us": self.lower_bound * 1e6, "algbw_fraction": self.algbw_fraction,
                "efficiency": self.efficiency, "fct_p50_us": self.fct_percentile(50),
                "fct_p99_us": self.fct_percentile(99), "uplink_max_over_mean": self.uplink_max_over_mean,
                "dropped_bytes": float(self.dropped_bytes.sum()),
                "flows_with_timeout": int(self.timed_out.sum()), "kind": "simulated"}


def lower_bound_time(topo: LeafSpine, traffic: np.ndarray) -> float:
    """The transfer time of a perfectly balanced fabric: the busiest NIC (send or
    receive) or the busiest leaf's uplinks (inter-leaf bytes over their total capacity)."""
    arr = np.array(traffic, dtype=float)
    np.fill_diagonal(arr, 0.0)
    nic = max(arr.sum(axis=1).max(), arr.sum(axis=0).max()) / topo.link_bytes_per_s
    leaves = topo.leaf_of(np.arange(topo.n_hosts))
    per_leaf = np.zeros((topo.n_leaf, topo.n_leaf))
    np.add.at(per_leaf, (leaves[:, None], leaves[None, :]), arr)
    np.fill_diagonal(per_leaf, 0.0)
    up_cap = topo.n_spine * topo.uplink_bytes_per_s
    core = max(per_leaf.sum(axis=1).max(), per_leaf.sum(axis=0).max()) / up_cap
    return float(max(nic, core))


def simulate(topo: LeafSpine, traffic: np.ndarray, *, routing: str = "ecmp", pacing: bool = True,
             burst: BurstModel = BurstModel(), rng: np.random.Generator | None = None) -> FabricResult:
    """Route ``traffic`` over ``topo`` and simulate the transfer.

    Flow completion time = fluid max-min completion (:func:`fluid_completion_times`)
    + without pacing, the draining time of the burst queues on the flow's path and one
    ``rto_us`` if any port on its path dropped packets (:class:`BurstModel`).
    """
    flows = route(topo, traffic, routing, rng)
    if flows.src.size == 0:
        raise ValueError("traffic has no bytes between different GPUs: nothing to simulate")
    fct = fluid_completion_times(flows.nbytes, flows.rate_links, flows.rate_capacity)
    dropped = np.zeros(topo.n_links)
    timed_out = np.zeros(flows.src.size, dtype=bool)
    if not pacing:
        queue, dropped, cap = _burst(flows, topo, burst)
        on = flows.rate_links >= 0
        padded = np.where(on, flows.rate_links, 0)
        wait = np.where(on, (queue / cap)[padded], 0.0).sum(axis=1)
        timed_out = (np.where(on, dropped[padded], 0.0) > 0).any(axis=1)
        fct = fct + wait + timed_out * burst.rto_us * 1e-6
        dropped = _physical(dropped, routing, topo)
    return FabricResult(topo, routing, pacing, flows, fct, float(fct.max()), lower_bound_time(topo, traffic),
                        dropped, timed_out)


# ---------------------------------------------------------------------------- balls into bins


def expected_empty_bins(n_balls: int, n_bins: int) -> float:
    """Expected empty bins when ``n_balls`` fall uniformly into ``n_bins``: m(1 - 1/m)^n."""
    return n_bins * (1.0 - 1.0 / n_bins) ** n_balls


def expected_pair_collisions(n_balls: int, n_bins: int) -> float:
    """Expected pairs of balls sharing a bin: C(n, 2) / m."""
    return n_balls * (n_balls - 1) / 2 / n_bins


def expected_max_load(n_balls: int, n_bins: int) -> float:
    """Exact expected fullest bin for ``n_balls`` uniform balls in ``n_bins`` bins.

    ``P(max <= k)`` by Poissonisation: with independent Poisson(n/m) bins, condition on
    the total being ``n``; ``P(all <= k, total = n)`` is the coefficient of ``x^n`` in the
    ``m``-th power of the truncated Poisson generating function, computed by convolution.
    Then ``E[max] = sum_k P(max > k)``.
    """
    if n_balls == 0:
        return 0.0
    lam = n_balls / n_bins
    j = np.arange(n_balls + 1)
    log_pmf = -lam + j * math.log(lam) - np.array([math.lgamma(x + 1) for x in j])
    pmf = np.exp(log_pmf)
    total_pmf = math.exp(-n_balls + n_balls * math.log(n_balls) - math.lgamma(n_balls + 1))
    expected = 0.0
    for k in range(n_balls):
        base = np.where(j <= k, pmf, 0.0)
        acc = np.zeros(n_balls + 1)
        acc[0] = 1.0
        for _ in range(n_bins):
            acc = np.convolve(acc, base)[: n_balls + 1]
        p_le = min(1.0, acc[n_balls] / total_pmf)
        expected += 1.0 - p_le
        if p_le > 1.0 - 1e-12:
            break
    return expected
