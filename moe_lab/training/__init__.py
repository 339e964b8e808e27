"""Training: the steps a loop plugs in, the optimizers, and the sync certifier.

`moe_lab.training.steps` (the steps: `EagerStep`, `SyncFreeStep`), `moe_lab.training.graphs`
(`GraphedStep`), `moe_lab.training.optim` (the AdamWs, `Schedule`, `CLIP_STEPS`),
`moe_lab.training.build` (`BuildConfig`, `build_model`, the step's forward) and
`moe_lab.training.sync` (`count_syncs`, `assert_sync_free`). The loop that drives a step, with
its data stream, evaluation and checkpoints, is machinery: `moe_lab.workbench.training`.
"""
