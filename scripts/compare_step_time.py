"""Is the optimised stack's training step as fast as it was? Paired runs of two revisions.

    python scripts/compare_step_time.py BASE [--pairs 8] [--steps 100] [--profile full]

exports revision ``BASE`` (any git revision) of ``moe_lab`` into a temporary folder and times
one training step of the time-to-train contest's optimised stack (`optimised_stack`, built
and compiled as the race builds it) in fresh processes, alternately on ``BASE`` and on the
working tree, in ABBA order (old-new, new-old, ...): each process reports the median of
``--steps`` steps after a warm-up (``--eager``: the stack without ``torch.compile``, a quick
check of the script itself), and the answer is the median of the paired differences
(new − old), with the pairs themselves. One process per measurement, because two revisions
of a package cannot share one; paired and alternated, because a shared machine's speed drifts
by more than the differences worth finding.

The revision must have the contest as the package ``moe_lab.workbench.benchmarks.ttt`` (every
revision since the lesson and the workbench were split), with ``optimised_stack``,
``make_trainer``, ``PROFILES`` and ``load_contest_corpus``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in each child: the working tree's or the exported revision's moe_lab, whichever the
# child's sys.path finds first.
CHILD = r"""
import json, os, statistics, sys, time
import torch
if not torch.cuda.is_available():  # as the Makefile does
    os.environ.setdefault("TRITON_INTERPRET", "1")
from moe_lab.workbench.benchmarks.ttt.contest import PROFILES, load_contest_corpus, make_trainer
from moe_lab.workbench.benchmarks.ttt.stacks import optimised_stack

profile, steps, compile = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
cfg = PROFILES[profile]
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
stack = optimised_stack(device, compile=None if compile else False)
gen = torch.Generator().manual_seed(cfg.seed + 1)
corpus = load_contest_corpus(cfg)
trainer = make_trainer(stack, cfg, device, corpus=corpus)
def one_step(batch):
    trainer.train_on(batch)
    trainer.sync()
batches = [corpus.sample(cfg.batch_size, generator=gen, split="train") for _ in range(4)]
batches = [type(b)(b.x.to(device), b.y.to(device), b.domain.to(device)) for b in batches]
for i in range(5):
    one_step(batches[i % 4])
times = []
for i in range(steps):
    t0 = time.perf_counter()
    one_step(batches[i % 4])
    times.append(time.perf_counter() - t0)
print(json.dumps({"median_ms": statistics.median(times) * 1e3, "stack": stack.describe()}))
"""


def _measure(path: Path | None, profile: str, steps: int, compile: bool) -> dict:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = str(path) + os.pathsep + env.get("PYTHONPATH", "")
        # The CPU plug-in's build is keyed by where its sources lie: the exported revision's
        # build goes with its temporary folder instead of staying in the user's cache.
        env["TORCH_EXTENSIONS_DIR"] = str(path / "extensions")
    done = subprocess.run([sys.executable, "-c", CHILD, profile, str(steps), str(int(compile))], env=env,
                          cwd=str(path or ROOT), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"a measurement failed ({'BASE' if path else 'working tree'}):\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the git revision to compare the working tree against")
    parser.add_argument("--pairs", type=int, default=8, help="ABBA pairs of processes (default 8)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per process (default 100)")
    parser.add_argument("--profile", default="full", help="the contest's profile (default full)")
    parser.add_argument("--eager", action="store_true",
                        help="the optimised stack without torch.compile (a quick check of the script)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.steps < 1:
        parser.error(f"--pairs and --steps must be positive, got {args.pairs} and {args.steps}")
    with tempfile.TemporaryDirectory(prefix="moe_lab_base_") as tmp:
        base = Path(tmp)  # revision BASE's moe_lab, exported
        archive = base / "rev.tar"
        subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), args.base,
                        "moe_lab"], check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(base, filter="data")
        rows = []
        for i in range(args.pairs):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            got = {who: _measure(base if who == "old" else None, args.profile, args.steps,
                                 not args.eager)
                   for who in order}
            rows.append({"old_ms": got["old"]["median_ms"], "new_ms": got["new"]["median_ms"],
                         "diff_ms": got["new"]["median_ms"] - got["old"]["median_ms"]})
            print(f"pair {i + 1}/{args.pairs}: old {rows[-1]['old_ms']:.2f} ms, new "
                  f"{rows[-1]['new_ms']:.2f} ms, new - old {rows[-1]['diff_ms']:+.2f} ms",
                  file=sys.stderr, flush=True)
    diffs = [r["diff_ms"] for r in rows]
    result = {"base": args.base, "profile": args.profile, "steps": args.steps,
              "median_diff_ms": statistics.median(diffs), "min_diff_ms": min(diffs),
              "max_diff_ms": max(diffs),
              "old_median_ms": statistics.median(r["old_ms"] for r in rows),
              "new_median_ms": statistics.median(r["new_ms"] for r in rows),
              "stack_new": got["new"]["stack"], "stack_old": got["old"]["stack"], "pairs": rows}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"new - old, median of {len(rows)} paired runs: {result['median_diff_ms']:+.2f} ms "
              f"(range {result['min_diff_ms']:+.2f} to {result['max_diff_ms']:+.2f}); medians "
              f"old {result['old_median_ms']:.2f} ms, new {result['new_median_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
