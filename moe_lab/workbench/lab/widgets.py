"""ipywidgets explorers. Each explorer has a pure function that computes its figure
from the slider values; in JupyterLab the sliders redraw it, and in a headless run
(papermill, CI: ``MOE_LAB_HEADLESS=1``, or ipywidgets missing) the figure for the default
values is drawn as a static image instead, so the executed notebook still shows it.

An explorer never waits on a front end, so a kernel run by plain papermill (no
``MOE_LAB_HEADLESS``) ends too. The first figure is not drawn by capturing output into the
``Output`` widget (``with out:``, what ``ipywidgets.interactive_output`` does): nbclient,
which papermill drives, mimics a front end's ``Output`` widget by sending the captured
outputs back to the kernel on the shell channel while it is still waiting there for the
cell's reply, and that reply is then sometimes never seen: papermill and the kernel both
sit idle forever. The figure is put into the ``Output`` widget's ``outputs`` from the
kernel instead, which is only kernel-to-client traffic, both when the explorer is drawn and
when a front end moves a control. See https://github.com/jupyter/nbclient/issues/312 and
https://github.com/nteract/papermill/issues/723 for reports of the hang."""

from __future__ import annotations

import base64
import importlib.util
import io
import math
import os
from collections.abc import Callable

import matplotlib.pyplot as plt
import torch
from IPython.display import display

from moe_lab.workbench.figures.charts import plot_tokens_per_expert


def headless() -> bool:
    """True when no live front end will render widgets (a headless run, or no ipywidgets)."""
    return os.environ.get("MOE_LAB_HEADLESS") == "1" or importlib.util.find_spec("ipywidgets") is None


def simulate_routing(n_tokens: int, n_experts: int, top_k: int, skew: float,
                     seed: int = 0) -> torch.Tensor:
    """Expert ids ``[n_tokens, top_k]`` drawn without replacement from a Zipf-like
    popularity ``p_e ∝ (e + 1) ** -skew`` (skew 0 = uniform)."""
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    g = torch.Generator().manual_seed(seed)
    popularity = (torch.arange(n_experts, dtype=torch.float64) + 1) ** -skew
    probs = popularity.expand(n_tokens, n_experts)
    return torch.multinomial(probs, top_k, replacement=False, generator=g)


def routing_figure(n_experts: int = 16, top_k: int = 2, skew: float = 1.0,
                   n_tokens: int = 4096, capacity_factor: float = 1.0):
    """Tokens per expert of a simulated routing, their imbalance (max/mean) and the share of
    assignments over capacity."""
    top_k = min(top_k, n_experts)  # a slider may ask for more than there are
    ids = simulate_routing(n_tokens, n_experts, top_k, skew)
    counts = torch.zeros(n_experts, dtype=torch.int64).scatter_add_(
        0, ids.flatten(), torch.ones(ids.numel(), dtype=torch.int64))
    capacity = math.ceil(ids.numel() * capacity_factor / n_experts)
    over_frac = int((counts - capacity).clamp_min(0).sum()) / max(1, ids.numel())
    fig, ax = plt.subplots(figsize=(7, 3.2))
    plot_tokens_per_expert(
        counts.tolist(), capacity=capacity, ax=ax,
        title=(f"E={n_experts}, top-{top_k}, skew={skew:.1f}: imbalance "
               f"{float(counts.max() / counts.float().mean()):.2f}, "
               f"{100 * over_frac:.1f}% over capacity (cf {capacity_factor})"))
    return fig


def explorer(figure_fn: Callable, **sliders) -> None:
    """Controls bound to ``figure_fn``; a static figure (default values) when headless.

    ``sliders``: name -> (default, options), e.g. ``n_experts=(16, dict(min=2, max=64,
    step=2))``: an int gives an IntSlider, a float a FloatSlider, a bool a checkbox.
    ``options`` may also hold ``label`` (default: the name, with spaces), shown whole (and on
    hover) on its own line above the control, so no label is cut however many controls there
    are. The controls sit in a grid of labelled cells, two per row, above the figure.
    Displays the explorer and returns ``None``, so a cell ending in the call shows it once.
    """
    defaults = {k: v[0] for k, v in sliders.items()}
    if headless():
        fig = figure_fn(**defaults)
        display(fig)
        plt.close(fig)
        return None
    import ipywidgets as w  # optional: without it (or a front end) the figure is static

    controls, cells = {}, []
    for name, (default, opts) in sliders.items():
        options = dict(opts)
        label = options.pop("label", name.replace("_", " "))
        if isinstance(default, bool):
            controls[name] = w.Checkbox(value=default, description=label, indent=False, tooltip=label,
                                        layout=w.Layout(width="auto"))
            cells.append(w.VBox([controls[name]]))
            continue
        slider = w.IntSlider if isinstance(default, int) else w.FloatSlider
        controls[name] = slider(value=default, continuous_update=False, tooltip=label,
                                layout=w.Layout(width="95%"), **options)
        cells.append(w.VBox([w.Label(label, tooltip=label), controls[name]]))

    out = w.Output()
    out.outputs = (_display_output(figure_fn(**defaults)),)  # drawn now, nothing captured

    def redraw(_change) -> None:  # only a front end moving a control calls this
        fig = figure_fn(**{name: control.value for name, control in controls.items()})
        out.outputs = (_display_output(fig),)

    for control in controls.values():
        control.observe(redraw, names="value")
    grid = w.GridBox(cells, layout=w.Layout(grid_template_columns="repeat(2, minmax(220px, 1fr))",
                                            grid_gap="4px 24px", width="100%"))
    display(w.VBox([grid, out]))


def _display_output(fig) -> dict:
    """``fig`` as one nbformat ``display_data`` output (a PNG, and a text form), for an
    ``Output`` widget's ``outputs``; the figure is closed, so pyplot does not show it again."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    data = {"image/png": base64.b64encode(buffer.getvalue()).decode("ascii"), "text/plain": repr(fig)}
    return {"output_type": "display_data", "data": data, "metadata": {}}


def routing_explorer() -> None:
    """Routing skew, top-k and number of experts → tokens per expert, imbalance, overflow."""
    explorer(
        routing_figure,
        n_experts=(16, dict(min=2, max=64, step=1, label="experts")),
        top_k=(2, dict(min=1, max=8, step=1, label="top-k (experts per token)")),
        skew=(1.0, dict(min=0.0, max=3.0, step=0.1, label="popularity skew (0 = uniform)")),
        capacity_factor=(1.0, dict(min=0.5, max=2.0, step=0.05,
                                   label="capacity factor (x mean load)")),
    )
