"""The workbook's own tooling: what runs, shows and checks the notebooks.

- `workbook` — the runner behind ``python -m moe_lab workbook`` (papermill,
  ``build/RESULTS.md``, then the site)
- `site` — the executed notebooks as pages and an index; each notebook's headline figure
- `page_outputs` — what a cell's outputs become on a page: an exercise the reference
  answered said so, progress bars collapsed, long outputs folded
- `notebook_files` — what the runner and the site share: the ``NN_name.ipynb`` pattern,
  atomic writes
- `widgets` — ipywidgets explorers (static figures when headless)
- `profiles` — the workbook's profiles (``smoke``, ``full``), checked by every notebook
- `triton_mode` — the one visible switch that lets a learner's own ``@triton.jit`` kernels
  run interpreted on a machine without CUDA

The notebooks' figures are `moe_lab.workbench.figures`, their exercises
`moe_lab.workbench.exercises`. This package imports none of its modules: a notebook imports
the ones it uses.
"""
