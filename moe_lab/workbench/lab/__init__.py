"""The workbook's own tooling, not the lesson: what runs, shows and checks the notebooks.

- `workbook` — the runner behind ``python -m moe_lab workbook`` (papermill, HTML,
  ``build/RESULTS.md``)
- `site` — the executed notebooks as pages and an index; each notebook's headline figure
- `notebook_files` — what the runner and the site share: the ``NN_name.ipynb`` pattern,
  atomic writes, the HTML export
- `plots`, `dispatch_plots`, `waterfall` — the notebooks' figures
- `widgets` — ipywidgets explorers (static figures when headless)
- `profiles` — the workbook's profiles (``smoke``, ``full``), checked by every notebook
- `exercises` — the learner's checks, one module per notebook (``nb04_fused_router``, ...)

Nothing here is imported by ``import moe_lab``, and this package imports none of its
modules: a notebook imports the ones it uses.
"""
