"""Benchmark: the expert-parallel layer on N gloo ranks over an emulated link.

``python -m moe_lab bench ep [--ranks 2] [--rate-mbit 200] [--profile smoke|full] [--json]``
launches the ranks itself (`moe_lab.dist.launch.run_ranks`), each in its own network
namespace behind a rate-limited link (`moe_lab.dist.netem.EmulatedLink`) when this machine
allows it (root, iproute2), on the loopback device otherwise (said in the result's
``link`` field and notes). It measures, for one MoE layer's forward + backward:

- tokens/s (all ranks' tokens / the slowest rank's step time) for each schedule:
  ``sequential`` (every all-to-all waited at once), ``overlap`` (chunked, async handles),
  ``overlap + delayed wgrad``, and the ``compute only`` replay;
- all-to-all bytes per step (what each rank sends to the others) and the time the
  sequential step spends in them, hence the bandwidth the all-to-all achieved, and the
  bandwidth of one large all-to-all alone;
- exposed communication per schedule, as the time the ranks spent outside compute, and
  as step − compute-only (see ``moe_lab.dist.overlap``), each as a fraction of the
  sequential schedule's.

Every figure is appended to the ledger (notebook ``bench:ep`` unless ``--notebook``).
"""

from __future__ import annotations

import argparse

from moe_lab.dist import netem
from moe_lab.dist.launch import run_ranks
from moe_lab.dist.overlap import overlap_rank_main
from moe_lab.perf import ledger

DESCRIPTION = ("expert-parallel layer on N gloo ranks over an emulated link: all-to-all bytes, "
               "time, exposed communication with and without overlap")

PROFILES = {
    # per-rank tokens, chunks, timed repeats; E=8, top-2, d=256, expert width 1024, 1 shared
    "smoke": dict(tokens=1024, n_chunks=4, repeats=3),
    "full": dict(tokens=2048, n_chunks=8, repeats=7),
}
CFG = dict(d_model=256, n_experts=8, top_k=2, d_expert=1024, n_shared_experts=1)
DEFAULT_RATE_MBIT = 200.0


def spec_for(profile: str, ranks: int, tokens: int | None = None, n_chunks: int | None = None,
             repeats: int | None = None, seed: int = 0) -> dict:
    """The rank spec (``moe_lab.dist.overlap.overlap_rank_main``) of a profile."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    p = PROFILES[profile]
    if CFG["n_experts"] % ranks:
        raise ValueError(f"ranks must divide n_experts={CFG['n_experts']}, got {ranks}")
    return {"cfg": dict(CFG), "tokens": tokens or p["tokens"], "n_chunks": n_chunks or p["n_chunks"],
            "repeats": repeats or p["repeats"], "seed": seed, "warmup": 1,
            "bandwidth_rows": 2048}


def run_ep_benchmark(ranks: int = 2, rate_mbit: float | None = DEFAULT_RATE_MBIT, spec: dict | None = None,
                     timeout_s: float = 600.0) -> dict:
    """Launch ``ranks`` ranks (over the emulated link when ``rate_mbit`` is set and the
    machine allows it) and return rank 0's report, with ``link`` and ``notes`` added."""
    spec = spec or spec_for("smoke", ranks)
    notes = []
    link = None
    if rate_mbit:
        ok, why = netem.available()
        if ok:
            link = netem.EmulatedLink(ranks, rate_mbit=rate_mbit)
        else:
            notes.append(f"link not emulated ({why}): ranks talk over the loopback device, where "
                         "communication is memory copies on the same cores and overlap cannot show")
    try:
        if link is not None:
            link.setup()
        reports = run_ranks(overlap_rank_main, ranks, spec, timeout_s=timeout_s, link=link,
                            threads_per_rank=1)
        description = link.describe() if link is not None else "loopback (not emulated)"
    finally:
        if link is not None:
            link.teardown()
    report = reports[0]
    report["link"] = description
    report["link_emulated"] = link is not None
    report["rate_mbit"] = rate_mbit if link is not None else None
    report["notes"] = notes
    report["per_rank_exposed_s"] = [r["exposed_s"] for r in reports]
    report["timelines_all_ranks"] = [r["timelines"] for r in reports]
    return report


def summarize(report: dict) -> dict:
    """Rows for the table and the ledger: one per schedule."""
    tokens = report["tokens_per_rank"] * report["world_size"]
    rows = []
    for label, step_s in report["median_s"].items():
        row = {"schedule": label, "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s}
        if label in report["exposed_s"]:
            row["exposed_ms"] = report["exposed_s"][label] * 1e3
            row["exposed_vs_sequential"] = report["exposed_vs_sequential"][label]
            row["exposed_replay_ms"] = report["exposed_replay_s"][label] * 1e3
            row["exposed_replay_vs_sequential"] = report["exposed_replay_vs_sequential"][label]
        rows.append(row)
    return {"rows": rows, "a2a_bytes_per_step": report["a2a_bytes"],
            "a2a_s_sequential": report["a2a_s"],
            "a2a_bandwidth_bytes_per_s": report["a2a_bytes"] / report["a2a_s"] if report["a2a_s"] else None,
            "probe_bandwidth_bytes_per_s": report.get("bandwidth", {}).get("bytes_per_s")}


def record(report: dict, notebook: str = "bench:ep") -> None:
    """Append the benchmark's figures to the ledger."""
    s = summarize(report)
    common = dict(ranks=report["world_size"], tokens_per_rank=report["tokens_per_rank"],
                  n_chunks=report["n_chunks"], link=report["link"], repeats=report["repeats"])
    for row in s["rows"]:
        step = row["schedule"]
        ledger.record(notebook, step, "tokens_per_s", row["tokens_per_s"], "tok/s", **common)
        ledger.record(notebook, step, "step_ms", row["step_ms"], "ms", **common)
        if "exposed_ms" in row:
            ledger.record(notebook, step, "exposed_comm_ms", row["exposed_ms"], "ms", **common)
            ledger.record(notebook, step, "exposed_vs_sequential", row["exposed_vs_sequential"], "",
                          **common)
            ledger.record(notebook, step, "exposed_replay_ms", row["exposed_replay_ms"], "ms", **common)
    ledger.record(notebook, "sequential", "a2a_bytes_per_step", int(s["a2a_bytes_per_step"]), "B", **common)
    ledger.record(notebook, "sequential", "a2a_ms_per_step", s["a2a_s_sequential"] * 1e3, "ms", **common)
    if s["a2a_bandwidth_bytes_per_s"]:
        ledger.record(notebook, "sequential", "a2a_bandwidth", s["a2a_bandwidth_bytes_per_s"] / 1e6,
                      "MB/s", **common)
    if s["probe_bandwidth_bytes_per_s"]:
        ledger.record(notebook, "a2a probe", "a2a_bandwidth", s["probe_bandwidth_bytes_per_s"] / 1e6,
                      "MB/s", **common)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (must divide 8 experts)")
    parser.add_argument("--profile", default="smoke", choices=list(PROFILES))
    parser.add_argument("--rate-mbit", type=float, default=DEFAULT_RATE_MBIT,
                        help="emulated link rate per rank and direction, Mbit/s")
    parser.add_argument("--no-link", action="store_true", help="loopback: do not emulate a link")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (overrides profile)")
    parser.add_argument("--chunks", type=int, default=None, help="chunks per step (overrides profile)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per schedule")
    parser.add_argument("--notebook", default="bench:ep", help="ledger 'notebook' field")


def run(args: argparse.Namespace) -> dict:
    spec = spec_for(args.profile, args.ranks, args.tokens, args.chunks, args.repeats)
    report = run_ep_benchmark(args.ranks, None if args.no_link else args.rate_mbit, spec)
    record(report, args.notebook)
    s = summarize(report)
    return {"ranks": report["world_size"], "tokens_per_rank": report["tokens_per_rank"],
            "n_chunks": report["n_chunks"], "link": report["link"],
            "a2a_bytes_per_step": s["a2a_bytes_per_step"],
            "a2a_ms_per_step_sequential": round(s["a2a_s_sequential"] * 1e3, 1),
            "a2a_bandwidth_MB_s": round((s["a2a_bandwidth_bytes_per_s"] or 0) / 1e6, 2),
            "probe_bandwidth_MB_s": round((s["probe_bandwidth_bytes_per_s"] or 0) / 1e6, 2),
            "matches_autograd": report["matches_autograd"],
            "rows": s["rows"], "notes": report["notes"]}
