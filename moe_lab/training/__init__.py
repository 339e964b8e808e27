"""Training: one loop with pluggable steps, checkpoints, and the sync certifier.

- `moe_lab.training.loop` — `TrainConfig`, the `Trainer` (a run advanced one step at a
  time) and `train` (the loop over it: evaluation, callback, checkpoints);
- `moe_lab.training.steps` — the steps the loop plugs in: `EagerStep` (the naive stack's)
  and `SyncFreeStep` (nothing read back, certified sync-free);
- `moe_lab.training.graphs` — `GraphedStep`, the sync-free step captured as a CUDA graph;
- `moe_lab.training.optim` — the two AdamWs, the schedule, and `CLIP_STEPS`, the registry
  of clip + optimizer updates a plug-in may add to;
- `moe_lab.training.build` — `build_model` (seeded, named implementations, the optimizer of
  the step kind), `random_batch`, and the compiled/autocast forward of a step;
- `moe_lab.training.sync` — `count_syncs`, `assert_sync_free`, `SyncError`;
- `moe_lab.training.checkpoint`, `moe_lab.workbench.demos.ladder` (notebook 06's fixes one by
  one), `moe_lab.workbench.demos.capture_breakers` (what breaks a CUDA graph),
  `moe_lab.workbench.demos.balancing` (three ways to balance the experts, trained side by side),
  `moe_lab.workbench.cli.train` (``python -m moe_lab train``).
"""
