"""Benchmark: the expert-parallel layer on N gloo ranks over an emulated link.

``python -m moe_lab bench ep [--ranks 2] [--rate-mbit 200] [--profile smoke|full] [--json]``
launches the ranks itself (`moe_lab.workbench.ranks.launch.run_ranks`), each in its own network
namespace behind a rate-limited link (`moe_lab.workbench.ranks.netem.EmulatedLink`) when this machine
allows it (root, iproute2), on the loopback device otherwise (said in the result's
``link`` field and notes). It measures, for one MoE layer, the steady-state unit of a 1F1B
pipeline — the forward of one micro-batch and the backward of another
(`moe_lab.parallel.merged`, timed by `moe_lab.workbench.ranks.harness`):

- tokens/s (all ranks' tokens of one micro-batch / the slowest rank's unit time) for each
  schedule: ``sequential`` (every all-to-all waited at once), ``chunked`` (chunk pipelining
  inside each micro-batch, async handles, delayed weight gradients), ``1f1b`` (the two
  micro-batches merged) and ``1f1b+chunked`` (both), and the ``compute only`` replays (one
  chunk, and chunked);
- all-to-all bytes per step (what each rank sends to the others) and the time the
  sequential step spends in them, hence the bandwidth the all-to-all achieved, and the
  bandwidth of one large all-to-all alone;
- exposed communication per schedule, as the time the ranks spent outside compute, and
  as step − compute-only (see ``moe_lab.workbench.ranks.harness``), each as a fraction of the
  sequential schedule's.

``--sweep`` adds the dispatch tuning knobs: the number of chunks and the share of the
processor given to computation (torch threads per rank; the rest is left to gloo's
threads and the kernel's TCP work — on a GPU the same trade is the number of SMs a
communication kernel such as DeepEP's or HybridEP's may occupy), each point a fresh launch,
with its exposed communication and unit time; the best point goes to the ledger.

Every figure is appended to the ledger (notebook ``bench:ep`` unless ``--notebook``).
"""

from __future__ import annotations

import argparse
import contextlib

from moe_lab.parallel.plan import SCHEDULES
from moe_lab.workbench.cli import positive_float, positive_int
from moe_lab.workbench.measure import ledger
from moe_lab.workbench.ranks import netem
from moe_lab.workbench.ranks.harness import merged_rank_main
from moe_lab.workbench.ranks.launch import choose_backend, run_ranks

DESCRIPTION = ("expert-parallel layer on N gloo ranks over an emulated link: all-to-all bytes, "
               "time, exposed communication under four schedules (sequential, chunked, 1f1b, "
               "1f1b+chunked)")

PROFILES = {
    # per-rank tokens per micro-batch, chunks, timed repeats; E=8, top-2, d=256, expert
    # width 1024, 1 shared
    "smoke": dict(tokens=1024, n_chunks=4, repeats=3),
    "full": dict(tokens=2048, n_chunks=8, repeats=7),
}
SWEEP = {  # the tuning knobs: chunks per micro-batch, torch threads per rank
    "smoke": dict(n_chunks=(2, 4), threads=(1,)),
    "full": dict(n_chunks=(1, 2, 4, 8), threads=(1, 2)),
}
CFG = dict(d_model=256, n_experts=8, top_k=2, d_expert=1024, n_shared_experts=1)
DEFAULT_RATE_MBIT = 200.0


def spec_for(profile: str, ranks: int, tokens: int | None = None, n_chunks: int | None = None,
             repeats: int | None = None, seed: int = 0) -> dict:
    """The rank spec (`moe_lab.workbench.ranks.harness.merged_rank_main`) of a profile."""
    p = PROFILES[profile]
    if CFG["n_experts"] % ranks:
        raise ValueError(f"ranks must divide n_experts={CFG['n_experts']}, got {ranks}")
    tokens, n_chunks = tokens or p["tokens"], n_chunks or p["n_chunks"]
    if tokens < n_chunks:  # refused here, not in a traceback on every rank
        raise ValueError(f"--tokens ({tokens} per rank and micro-batch) must be at least --chunks "
                         f"({n_chunks}): every chunk needs a token")
    return {"cfg": dict(CFG), "tokens": tokens, "n_chunks": n_chunks,
            "repeats": repeats or p["repeats"], "seed": seed,
            "bandwidth_rows": 2048}


def run_ep_benchmark(ranks: int, rate_mbit: float | None, spec: dict, timeout_s: float = 600.0,
                     threads_per_rank: int = 1) -> dict:
    """Launch ``ranks`` ranks on ``spec`` (`spec_for`; over the emulated link when
    ``rate_mbit`` is set and the machine allows it) and return rank 0's report, with ``link``
    and ``notes`` added. ``threads_per_rank``: torch threads each rank computes with."""
    notes = []
    link = None
    if rate_mbit:
        ok, why = netem.available()
        if ok:
            link = netem.EmulatedLink(ranks, rate_mbit=rate_mbit)
        else:
            notes.append(f"link not emulated ({why}): ranks talk over the loopback device, where "
                         "communication is memory copies on the same cores and overlap cannot show")
    # The backend is chosen here and passed on, never left to the launcher's default: the
    # emulated link carries gloo only, and one GPU cannot hold several NCCL ranks.
    backend, backend_reason = choose_backend(ranks, link)
    with link if link is not None else contextlib.nullcontext():
        reports = run_ranks(merged_rank_main, ranks, spec, timeout_s=timeout_s, link=link,
                            backend=backend, threads_per_rank=threads_per_rank)
    description = link.describe() if link is not None else "loopback (not emulated)"
    # report["backend"] and ["device"] are the ranks' own
    return {**reports[0], "link": description, "link_emulated": link is not None,
            "rate_mbit": rate_mbit if link is not None else None, "backend_reason": backend_reason,
            "notes": notes, "threads_per_rank": threads_per_rank}


def summarize(report: dict) -> dict:
    """Rows for the table and the ledger: one per schedule (the unit's tokens are one
    micro-batch's, on every rank)."""
    tokens = report["tokens_per_rank"] * report["world_size"]
    rows = []
    for label, step_s in report["median_s"].items():
        row = {"schedule": label, "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s}
        if label in report["exposed_s"]:
            for kind in ("exposed", "exposed_replay"):  # outside compute, and step − compute-only
                row[f"{kind}_ms"] = report[f"{kind}_s"][label] * 1e3
                row[f"{kind}_vs_sequential"] = report[f"{kind}_vs_sequential"][label]
        rows.append(row)
    return {"rows": rows, "a2a_bytes_per_step": report["a2a_bytes"],
            "a2a_s_sequential": report["a2a_s"], "compute_s": report["compute_s"],
            "a2a_bandwidth_bytes_per_s": report["a2a_bytes"] / report["a2a_s"] if report["a2a_s"] else None,
            "probe_bandwidth_bytes_per_s": report.get("bandwidth", {}).get("bytes_per_s")}


def record(report: dict, notebook: str = "bench:ep") -> None:
    """Append the benchmark's figures to the ledger."""
    s = summarize(report)
    common = dict(ranks=report["world_size"], tokens_per_rank=report["tokens_per_rank"],
                  n_chunks=report["n_chunks"], link=report["link"], repeats=report["repeats"],
                  rate_mbit=report["rate_mbit"], threads_per_rank=report.get("threads_per_rank", 1))
    for row in s["rows"]:
        step = row["schedule"]
        ledger.record(notebook, step, "tokens_per_s", row["tokens_per_s"], "tok/s", **common)
        ledger.record(notebook, step, "step_ms", row["step_ms"], "ms", **common)
        if "exposed_ms" in row:
            ledger.record(notebook, step, "exposed_comm_ms", row["exposed_ms"], "ms", **common)
            # a share of the sequential schedule's exposed time, in percent (lower is better)
            ledger.record(notebook, step, "exposed_vs_sequential", 100 * row["exposed_vs_sequential"], "%",
                          **common)
            ledger.record(notebook, step, "exposed_replay_ms", row["exposed_replay_ms"], "ms", **common)
    ledger.record(notebook, "sequential", "a2a_bytes_per_step", int(s["a2a_bytes_per_step"]), "B", **common)
    ledger.record(notebook, "sequential", "a2a_ms_per_step", s["a2a_s_sequential"] * 1e3, "ms", **common)
    ledger.record(notebook, "compute only", "compute_ms_per_step", s["compute_s"] * 1e3, "ms", **common)
    if s["a2a_bandwidth_bytes_per_s"]:
        ledger.record(notebook, "sequential", "a2a_bandwidth", s["a2a_bandwidth_bytes_per_s"] / 1e6,
                      "MB/s", **common)
    if s["probe_bandwidth_bytes_per_s"]:
        ledger.record(notebook, "a2a probe", "a2a_bandwidth", s["probe_bandwidth_bytes_per_s"] / 1e6,
                      "MB/s", **common)


# ------------------------------------------------------------------------- the tuning sweep


def sweep(ranks: int, rate_mbit: float | None, profile: str = "smoke", repeats: int = 3,
          tokens: int | None = None) -> list[dict]:
    """The dispatch tuning knobs of the profile (`SWEEP`), one fresh launch per point:
    ``n_chunks`` (chunks per micro-batch: more chunks, smaller in-flight buffers and finer
    overlap, more per-chunk overhead) and ``threads`` (torch threads per rank: the processor's
    share for compute, the rest left to communication). Each point times ``sequential``, the merged schedule
    (``1f1b`` for one chunk, ``1f1b+chunked`` otherwise) and the compute-only replay.
    Returns one row per point: ``n_chunks``, ``threads_per_rank``, ``buffer_bytes`` (the
    largest all-to-all in flight: one chunk's dispatch), ``step_ms``, ``exposed_ms``,
    ``exposed_vs_sequential``, ``sequential_step_ms``. ``tokens``: per rank and micro-batch
    (default: the profile's)."""
    rows = []
    for t in SWEEP[profile]["threads"]:
        for n in SWEEP[profile]["n_chunks"]:
            merged = "1f1b" if n == 1 else "1f1b+chunked"
            spec = spec_for(profile, ranks, tokens=tokens, n_chunks=n, repeats=repeats)
            spec.update(runs=["sequential", merged, "compute only"], bandwidth_rows=0, check=False)
            report = run_ep_benchmark(ranks, rate_mbit, spec, threads_per_rank=t)
            rows.append({"n_chunks": n, "threads_per_rank": t, "schedule": merged,
                         # a unit sends four all-to-alls of one chunk each per chunk
                         "buffer_bytes": report["a2a_bytes"] // (4 * n),
                         "step_ms": report["median_s"][merged] * 1e3,
                         "exposed_ms": report["exposed_s"][merged] * 1e3,
                         "exposed_vs_sequential": report["exposed_vs_sequential"][merged],
                         "sequential_step_ms": report["median_s"]["sequential"] * 1e3,
                         "link": report["link"], "tokens_per_rank": report["tokens_per_rank"]})
    return rows


def record_sweep(rows: list[dict], ranks: int, notebook: str = "bench:ep") -> dict:
    """Append every sweep point and the best (fastest merged unit) to the ledger; returns
    the best row."""
    for r in rows:
        extra = dict(ranks=ranks, n_chunks=r["n_chunks"], threads_per_rank=r["threads_per_rank"],
                     link=r["link"], tokens_per_rank=r["tokens_per_rank"])
        step = f"sweep {r['schedule']} c{r['n_chunks']} t{r['threads_per_rank']}"
        ledger.record(notebook, step, "step_ms", r["step_ms"], "ms", **extra)
        ledger.record(notebook, step, "exposed_comm_ms", r["exposed_ms"], "ms", **extra)
    best = min(rows, key=lambda r: r["step_ms"])
    extra = dict(ranks=ranks, n_chunks=best["n_chunks"], threads_per_rank=best["threads_per_rank"],
                 link=best["link"], buffer_bytes=best["buffer_bytes"])
    ledger.record(notebook, "tuned dispatch", "step_ms", best["step_ms"], "ms", **extra)
    ledger.record(notebook, "tuned dispatch", "exposed_comm_ms", best["exposed_ms"], "ms", **extra)
    ledger.record(notebook, "tuned dispatch", "speedup_vs_sequential",
                  best["sequential_step_ms"] / best["step_ms"], "x", **extra)
    return best


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=positive_int, default=2, help="gloo ranks (must divide 8 experts)")
    parser.add_argument("--profile", default="smoke", choices=list(PROFILES))
    parser.add_argument("--rate-mbit", type=positive_float, default=DEFAULT_RATE_MBIT,
                        help="emulated link rate per rank and direction, Mbit/s")
    parser.add_argument("--no-link", action="store_true", help="loopback: do not emulate a link")
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help="tokens per rank and micro-batch (overrides profile)")
    parser.add_argument("--chunks", type=positive_int, help="chunks per micro-batch (overrides profile)")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed units per schedule")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep the tuning knobs (chunks, threads per rank)")
    parser.add_argument("--notebook", default="bench:ep", help="ledger 'notebook' field")


def run(args: argparse.Namespace) -> dict:
    # The sizes are checked at the door (their argparse types).
    spec = spec_for(args.profile, args.ranks, args.tokens, args.chunks, args.repeats)
    rate = None if args.no_link else args.rate_mbit
    report = run_ep_benchmark(args.ranks, rate, spec, threads_per_rank=args.threads)
    record(report, args.notebook)
    s = summarize(report)
    result = {"ranks": report["world_size"], "tokens_per_rank": report["tokens_per_rank"],
              "n_chunks": report["n_chunks"], "link": report["link"],
              "backend": report["backend"], "device": report["device"],
              "backend_reason": report["backend_reason"],
              "threads_per_rank": args.threads,
              "a2a_bytes_per_step": s["a2a_bytes_per_step"],
              "a2a_ms_per_step_sequential": round(s["a2a_s_sequential"] * 1e3, 1),
              "compute_ms_per_step": round(s["compute_s"] * 1e3, 1),
              "a2a_bandwidth_MB_s": round((s["a2a_bandwidth_bytes_per_s"] or 0) / 1e6, 2),
              "probe_bandwidth_MB_s": round((s["probe_bandwidth_bytes_per_s"] or 0) / 1e6, 2),
              "merged_equals_plain": report["merged_equals_plain"],
              "schedules": [r for r in s["rows"] if r["schedule"] in SCHEDULES],
              "rows": s["rows"], "notes": report["notes"]}
    if args.sweep:
        rows = sweep(args.ranks, rate, args.profile, repeats=args.repeats or 3)
        result["sweep"] = rows
        result["tuned"] = record_sweep(rows, args.ranks, args.notebook)
    return result
