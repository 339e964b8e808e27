"""Scaling out: expert parallelism over torch.distributed.

- ``ep`` — the expert-parallel MoE layer (`EPMoELayer`, `from_layer`): experts sharded over
  a process group, tokens moved by two all-to-alls (dropless, or budgeted and sync-free);
- ``chunks`` — that layer's step cut into stages over chunks of tokens, the experts'
  backward written out (dgrad and wgrad), for a schedule to order;
- ``plan`` — chunk pipelining and 1F1B merging as data: the stages of a merged unit, the
  chunked plan that overlaps one chunk's all-to-all with another's experts, the four schedules,
  `check_plan`, and `simulate_plan` on a model machine;
- ``merged`` — the plans run on real ranks (`MergedStep`, `two_microbatch_step`);
- ``merged_model`` — a whole model trained on merged 1F1B units, block by block
  (`MergedModelStep`, used by ``scripts/train_ep.py --schedule 1f1b``);
- ``timeline`` — the per-chunk events such a step records (`Timeline`).

``import moe_lab.parallel`` imports nothing: import the submodule you need.
"""
