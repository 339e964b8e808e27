"""The workbench: the machinery around the lesson — what runs, times, records and shows it.

``moe_lab`` outside this package is the lesson: the layer, the router, the dispatchers, the
experts, the Triton kernels, the MX format, the training step, expert parallelism and the
simulators' models. This package holds what a reader does not need in order to learn them
but does need in order to see them work:

- `measure` — the timers (`measure.timing.bench`, `measure.timing.compare`), the results
  ledger, measured ceilings, profiled breakdowns, host-overhead and kernel counts;
- `benchmarks` — one module per ``python -m moe_lab bench NAME``, and the time-to-train race;
- `compile_report` — every Triton kernel compiled for sm_90 and sm_100 without a GPU;
- `lab` — the workbook runner, the site, widgets and profiles; `figures` — the notebooks'
  plots; `exercises` — the learner's checks, one module per notebook;
- `cpu` — the CPU plug-in (C++/OpenMP kernels registered into the lesson's registries);
- `ranks` — starting ranks (`run_ranks`, torchrun), the emulated network link, and the rank
  functions the tests and benchmarks launch;
- `demos` — notebook 08's ladder and capture gallery, notebook 05's balancing comparison;
- `training` — the loop that drives a lesson step (`training.loop.train`, `Trainer`: data
  stream, step clock, evaluation, progress bar) and its durable checkpoints;
- `cli` — ``python -m moe_lab``;
- `interop` — Hugging Face MoE blocks as moe_lab layers (`interop.patch_hf_model`) and back;
- `quiet` — the third-party messages known to be harmless, silenced where they start (the one
  list; `lab.page_noise` is what checks the pages for the rest).

The arrow points one way: this package imports the lesson, and nothing in the lesson imports
this package (``tests/project/test_layering.py`` fails if it does). Importing it loads nothing.
"""
