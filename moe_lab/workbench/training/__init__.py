"""The training harness: `loop` (`TrainConfig`, `Trainer`, `train`) drives one of the lesson's
steps (`moe_lab.training.steps`) over a corpus, with evaluation, progress and `checkpoint`'s
durable, resumable checkpoints."""
