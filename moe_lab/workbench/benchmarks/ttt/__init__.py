"""Time to train: one model, one data stream, one target loss — the naive stack against the
optimised stack (a mini MLPerf).

MLPerf Training does not rank systems by tokens per second. It ranks them by *time to
train*: the wall-clock minutes from the start of the run until an evaluation on a fixed
held-out set first reaches a target quality. Throughput only counts through that clock, and
so do evaluation, host stalls, and anything that changes how many steps the model needs.
This package runs the same contest on whatever machine the reader has:

- `moe_lab.workbench.benchmarks.ttt.stacks` — what races: a `Stack` of registered implementation names,
  `NAIVE`, `optimised_stack` (on a CPU with the CPU plug-in's kernels where they build),
  and the `ladder` between them;
- `moe_lab.workbench.benchmarks.ttt.contest` — the rules (`TTTConfig`, `PROFILES`): the model is a
  preset trained on the synthetic corpus or any UTF-8 text file, from the same seed, on the
  same batches in the same order, with the same warm-up + cosine schedule; every
  ``eval_every`` steps the eval loss on a fixed eval set is measured, and the clock stops
  after the first evaluation at or below ``target_loss``. `make_trainer` builds a stack's
  `moe_lab.workbench.training.loop.Trainer`, the object `moe_lab.workbench.training.loop.train` drives;
- `moe_lab.workbench.benchmarks.ttt.racing` — the race itself: the stacks' trainers advanced in lockstep,
  each on its own clock (`race`, `time_to_train`, `compare_stacks`), and single-step
  timings of the same trainers (`ladder_throughput`, `step_breakdowns`);
- `moe_lab.workbench.benchmarks.ttt.report` — statistics over seeds, MFU, the GB300 projection, the ledger;
- `moe_lab.workbench.benchmarks.ttt.cli` — ``python -m moe_lab bench time-to-train [--profile full]
  [--seeds 3] [--corpus FILE] [--json]``.
"""

from moe_lab.workbench.benchmarks.ttt.cli import DESCRIPTION, add_arguments, run
from moe_lab.workbench.benchmarks.ttt.contest import PROFILES, pick_router_impl, stack_model
from moe_lab.workbench.benchmarks.ttt.racing import compare_stacks, ladder_throughput, step_breakdowns
from moe_lab.workbench.benchmarks.ttt.report import (
    NOTEBOOK,
    loss_gap,
    mfu_rows,
    record_ladder,
    record_summary,
    speedup_bound,
    stack_ceilings,
    summarise,
)
from moe_lab.workbench.benchmarks.ttt.stacks import NAIVE, ladder, optimised_stack

__all__ = [
    "DESCRIPTION", "NAIVE", "NOTEBOOK", "PROFILES", "add_arguments", "compare_stacks", "ladder",
    "ladder_throughput", "loss_gap", "mfu_rows", "optimised_stack", "pick_router_impl", "record_ladder",
    "record_summary", "run", "speedup_bound", "stack_ceilings", "stack_model", "step_breakdowns", "summarise",
]
