"""The ``sim`` command of ``python -m moe_lab``: the pipeline and fabric simulators.

``sim pipeline``: a preset's layers cut into pipeline stages — the naive even split and
the searched layout (and ``--layout`` if given) — with each layout's stage imbalance and
its simulated step (bubble, step time). ``sim fabric``: an all-to-all over a leaf-spine
fabric with ECMP and adaptive routing, with and without sender pacing. Every figure is a
simulation; ``--json`` prints one JSON object marked ``"kind": "simulated"``.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from moe_lab.config import PRESETS, preset
from moe_lab.sim import fabric
from moe_lab.sim.layout import Layout, check_layout, parse_layout
from moe_lab.sim.layout_search import (
    even_layout,
    layer_costs,
    layout_report,
    search_layout,
    simulate_layout,
)
from moe_lab.sim.traffic import incast_traffic, moe_traffic, uniform_traffic
from moe_lab.workbench.cli import non_negative_float, non_negative_int, positive_float, positive_int
from moe_lab.workbench.jsonout import dumps

#: The most operations (forwards, backwards and weight gradients over every virtual stage and
#: micro-batch) ``sim pipeline`` simulates: it holds each as Python objects, about
#: PIPELINE_OP_BYTES bytes apiece, and steps through them one by one (this many: half a GiB and
#: half a minute on a laptop).
MAX_PIPELINE_OPS = 2**20
PIPELINE_OP_BYTES = 500


def pipeline_report(args: argparse.Namespace) -> dict[str, Any]:
    """The ``sim pipeline`` answer as a dict: per layout, its string, rank loads,
    imbalance and the simulated step (makespan in GFLOP/token units, bubble)."""
    n_ranks, n_chunks, n_microbatches = args.stages, args.vpp, args.microbatches
    delay_wgrad, logits_scale = args.delay_wgrad, args.logits_scale
    cfg = preset(args.preset)
    costs = layer_costs(cfg, args.seq_len, logits_scale=logits_scale)
    layouts: dict[str, Layout] = {}
    if args.layout is not None:
        given = parse_layout(args.layout, n_ranks)
        if given.n_chunks != n_chunks and n_chunks != 1:
            raise ValueError(f"--layout has {given.n_chunks} chunks per rank but --vpp is {n_chunks}")
        n_chunks = given.n_chunks
        check_layout(given, cfg)
        layouts["given"] = given
    ops = n_ranks * n_chunks * n_microbatches * (3 if delay_wgrad else 2)
    if ops > MAX_PIPELINE_OPS:
        raise ValueError(
            f"stages x vpp x microbatches = {n_ranks} x {n_chunks} x {n_microbatches}, a forward and a "
            f"backward{' and a weight gradient' if delay_wgrad else ''} each, is {ops:,} operations "
            f"to simulate, about {ops * PIPELINE_OP_BYTES / 2**30:,.1f} GiB: more than the "
            f"{MAX_PIPELINE_OPS:,} this simulator runs (here at most "
            f"{MAX_PIPELINE_OPS // (ops // n_microbatches):,} micro-batches)")
    if n_ranks * n_chunks <= cfg.n_layers:
        layouts["even"] = even_layout(cfg, n_ranks, n_chunks)
    layouts["searched"] = search_layout(cfg, costs, n_ranks, n_chunks,
                                        n_microbatches=n_microbatches if n_chunks > 1 else None)
    out: dict[str, Any] = {
        "preset": args.preset, "stages": n_ranks, "vpp": n_chunks, "microbatches": n_microbatches,
        "schedule": "1f1b" if n_chunks == 1 else "interleaved", "delay_wgrad": delay_wgrad,
        "logits_scale": logits_scale, "unit": costs.unit, "kind": "simulated", "layouts": {}}
    for name, lay in layouts.items():
        step = simulate_layout(lay, cfg, costs, n_microbatches, delay_wgrad=delay_wgrad)
        out["layouts"][name] = {**layout_report(lay, cfg, costs), "makespan": step.makespan,
                                "bubble_fraction": step.bubble_fraction}
    if "even" in out["layouts"]:
        out["searched_over_even_step_time"] = (out["layouts"]["searched"]["makespan"]
                                               / out["layouts"]["even"]["makespan"])
    return out


def pipeline_command(args: argparse.Namespace) -> int:
    """Print the ``sim pipeline`` report (a summary, or one JSON object with ``--json``)."""
    report = pipeline_report(args)
    if args.json:
        print(dumps(report))
        return 0
    print(f"{report['preset']}: {report['stages']} pipeline stages x {report['vpp']} chunks, "
          f"{report['microbatches']} micro-batches, {report['schedule']}, logits cost x "
          f"{report['logits_scale']:g} (simulated)")
    for name, item in report["layouts"].items():
        print(f"  {name:<9} {item['layout']}")
        print(f"  {'':<9} imbalance {item['imbalance']:.2%}, bubble "
              f"{item['bubble_fraction']:.2%}, step {item['makespan']:.1f} {item['unit']}")
    if "searched_over_even_step_time" in report:
        print(f"  searched / even step time: {report['searched_over_even_step_time']:.3f}")
    return 0


#: The most GPU pairs ``sim fabric`` simulates (4,096 GPUs): it keeps several float64
#: values per pair, so a fabric beyond this needs gigabytes and minutes on a laptop.
MAX_FABRIC_PAIRS = 4096 ** 2
#: The most directed links it simulates: it keeps several float64 arrays of one value per link,
#: about FABRIC_LINK_BYTES bytes per link in all (this many: 400 MiB, seconds).
MAX_FABRIC_LINKS = 2**22
FABRIC_LINK_BYTES = 100


def fabric_report(args: argparse.Namespace) -> dict[str, Any]:
    """The ``sim fabric`` answer as a dict: one entry per routing × pacing.

    Refuses, before allocating anything, a fabric of more than `MAX_FABRIC_PAIRS` GPU pairs:
    the traffic matrix and the simulator hold a value per pair (several arrays of them)."""
    n_leaf, n_spine = args.leaves, args.spines
    topo = fabric.LeafSpine(args.hosts_per_leaf, n_leaf, n_spine, args.link_gbps, args.oversubscription)
    if topo.n_hosts ** 2 > MAX_FABRIC_PAIRS:
        raise ValueError(
            f"hosts_per_leaf x leaves = {args.hosts_per_leaf} x {n_leaf} = {topo.n_hosts} GPUs is "
            f"{topo.n_hosts ** 2:.3g} GPU pairs, more than the {MAX_FABRIC_PAIRS:,} this simulator "
            f"holds in memory (at most {math.isqrt(MAX_FABRIC_PAIRS):,} GPUs)")
    if topo.n_links > MAX_FABRIC_LINKS:
        raise ValueError(
            f"leaves x spines = {n_leaf} x {n_spine} makes {topo.n_links:,} directed links, about "
            f"{topo.n_links * FABRIC_LINK_BYTES / 2**30:,.1f} GiB of per-link arrays: more than the "
            f"{MAX_FABRIC_LINKS:,} this simulator holds (here at most "
            f"{(MAX_FABRIC_LINKS - 2 * topo.n_hosts) // (2 * n_leaf):,} spines)")
    rng = np.random.default_rng(args.seed)
    nbytes = args.mb_per_pair * 2**20
    makers = {"uniform": lambda: uniform_traffic(topo.n_hosts, nbytes),
              "moe": lambda: moe_traffic(topo.n_hosts, zipf_s=args.zipf, rng=rng),
              "incast": lambda: incast_traffic(topo.n_hosts, args.senders, nbytes, rng=rng)}
    matrix = makers[args.traffic]()
    routings = ("ecmp", "adaptive") if args.routing == "both" else (args.routing,)
    pacings = {"both": (True, False), "on": (True,), "off": (False,)}[args.pacing]
    runs = [fabric.simulate(topo, matrix, routing=routing, pacing=pacing,
                            rng=np.random.default_rng(args.seed + 1)).to_dict()
            for routing in routings for pacing in pacings]
    topology = {"hosts_per_leaf": args.hosts_per_leaf, "leaves": n_leaf, "spines": n_spine,
                "link_gbps": args.link_gbps, "oversubscription": args.oversubscription,
                "n_gpus": topo.n_hosts}
    return {"topology": topology, "traffic": args.traffic,
            "total_bytes": float(matrix.sum() - np.trace(matrix)), "seed": args.seed, "kind": "simulated",
            "runs": runs}


def fabric_command(args: argparse.Namespace) -> int:
    """Print the ``sim fabric`` report (a summary, or one JSON object with ``--json``)."""
    report = fabric_report(args)
    if args.json:
        print(dumps(report))
        return 0
    topo = report["topology"]
    print(f"{topo['n_gpus']} GPUs: {topo['leaves']} leaves x {topo['hosts_per_leaf']} GPUs, "
          f"{topo['spines']} spines, {topo['link_gbps']:g} Gb/s, oversubscription "
          f"{topo['oversubscription']:g}:1; traffic {report['traffic']} (simulated)")
    for run in report["runs"]:
        print(f"  {run['routing']:<8} pacing {'on ' if run['pacing'] else 'off'}  "
              f"bandwidth {run['algbw_fraction']:.1%} of link, efficiency "
              f"{run['efficiency']:.1%}, FCT p50 {run['fct_p50_us']:,.0f} us, "
              f"p99 {run['fct_p99_us']:,.0f} us, timeouts {run['flows_with_timeout']}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``sim`` command (sub-commands ``pipeline`` and ``fabric``)."""
    sim = subparsers.add_parser(
        "sim", help="pipeline-layout and network-fabric simulators (projections)",
        description=__doc__.splitlines()[0],
    )
    which = sim.add_subparsers(dest="simulator", required=True, metavar="SIMULATOR")

    pipe = which.add_parser("pipeline", help="stage imbalance and bubble of pipeline layouts")
    pipe.add_argument("--preset", default="deepseek_v3", choices=sorted(PRESETS))
    pipe.add_argument("--stages", type=positive_int, default=8, help="pipeline ranks")
    pipe.add_argument("--vpp", type=positive_int, default=1, help="virtual stages per rank")
    pipe.add_argument("--microbatches", type=positive_int, default=16)
    pipe.add_argument("--layout", default=None,
                      help='a Megatron layout string to evaluate too, e.g. "Et*3|(tt|)*29,m|L"')
    pipe.add_argument("--logits-scale", type=positive_float, default=1.0,
                      help="cost factor of the logits GEMM (0.5: MXFP8)")
    pipe.add_argument("--delay-wgrad", action="store_true",
                      help="split backward into B and W and let W fill the bubbles")
    pipe.add_argument("--seq-len", type=positive_int, default=None)
    pipe.add_argument("--json", action="store_true", help="print one JSON object")
    pipe.set_defaults(func=pipeline_command)

    fab = which.add_parser("fabric", help="all-to-all over a leaf-spine fabric")
    fab.add_argument("--hosts-per-leaf", type=positive_int, default=8)
    fab.add_argument("--leaves", type=positive_int, default=8)
    fab.add_argument("--spines", type=positive_int, default=8)
    fab.add_argument("--link-gbps", type=positive_float, default=400.0)
    fab.add_argument("--oversubscription", type=positive_float, default=1.0)
    fab.add_argument("--traffic", choices=("uniform", "moe", "incast"), default="uniform")
    fab.add_argument("--mb-per-pair", type=positive_float, default=1.0,
                     help="MiB per GPU pair (uniform) or per sender (incast)")
    fab.add_argument("--zipf", type=non_negative_float, default=1.0,
                     help="expert-popularity skew (moe)")
    fab.add_argument("--senders", type=positive_int, default=32, help="incast senders")
    fab.add_argument("--routing", choices=("ecmp", "adaptive", "both"), default="both")
    fab.add_argument("--pacing", choices=("on", "off", "both"), default="both")
    fab.add_argument("--seed", type=non_negative_int, default=0)
    fab.add_argument("--json", action="store_true", help="print one JSON object")
    fab.set_defaults(func=fabric_command)
