"""Training: one loop with pluggable steps, checkpoints, and the sync certifier.

`moe_lab.training.loop` (`TrainConfig`, `Trainer`, `train`), `moe_lab.training.steps` (the
steps it plugs in: `EagerStep`, `SyncFreeStep`), `moe_lab.training.graphs` (`GraphedStep`),
`moe_lab.training.optim` (the AdamWs, `Schedule`, `CLIP_STEPS`), `moe_lab.training.build`
(`BuildConfig`, `build_model`, the step's forward), `moe_lab.training.sync` (`count_syncs`,
`assert_sync_free`) and `moe_lab.training.checkpoint`.
"""
