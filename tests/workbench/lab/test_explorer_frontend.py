"""The widget explorers never wait on a front end: plain papermill (no ``MOE_LAB_HEADLESS``)
runs the explorer notebooks to the end.

Why plain papermill hung: ``ipywidgets.interactive_output`` drew the first figure by
capturing it into an ``Output`` widget (``with out:``), and nbclient, mimicking a front
end's ``Output`` widget, sent the captured outputs back to the kernel on the shell channel
while still waiting there for the cell's reply, a reply that was then sometimes never seen
(papermill and the kernel both idle). The fast test checks the mechanism directly: while an
explorer's cells run, the client sends the kernel nothing but the cells themselves, and the
figure still reaches the ``Output`` widget. The slow one runs notebooks 10 and 11 through the
``papermill`` command several times, each under a time limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS_DIR = ROOT / "notebooks"
EXPLORER_NOTEBOOKS = [NOTEBOOKS_DIR / "10_pipeline_layout.ipynb", NOTEBOOKS_DIR / "11_network_fabric.ipynb"]
SMOKE_BUDGET_S = 90.0
RUNS_EACH = 3
RUN_LIMIT_S = 3 * SMOKE_BUDGET_S  # a hung run is killed here (a run takes well under it)

SETUP = """\
import matplotlib.pyplot as plt
from moe_lab.workbench.lab.widgets import explorer

def figure(height=1, dashed=False):
    fig, ax = plt.subplots(figsize=(4, 2))
    ax.plot([0, height], linestyle="--" if dashed else "-")
    return fig
"""
EXPLORE = 'explorer(figure, height=(1, dict(min=0, max=3)), dashed=(False, dict(label="dashed")))'


def _tiny_notebook(n_explorers: int) -> nbformat.NotebookNode:
    cells = [nbformat.v4.new_code_cell(SETUP)]
    cells += [nbformat.v4.new_code_cell(EXPLORE) for _ in range(n_explorers)]
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    return notebook


@pytest.mark.timeout(120)
def test_an_explorer_cell_gets_nothing_back_from_the_client_and_shows_its_figure(monkeypatch):
    monkeypatch.delenv("MOE_LAB_HEADLESS", raising=False)  # the widget path, as plain papermill
    notebook = _tiny_notebook(n_explorers=3)
    client = NotebookClient(notebook, kernel_name="python3", timeout=60,
                            resources={"metadata": {"path": str(ROOT)}})
    sent: list[str] = []
    with client.setup_kernel():
        send = client.kc.shell_channel.send

        def recording_send(msg):
            sent.append(msg["header"]["msg_type"])
            return send(msg)

        client.kc.shell_channel.send = recording_send
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
    # Old explorers also sent comm_msg (nbclient's Output widget syncing captured outputs).
    assert sent == ["execute_request"] * len(notebook.cells), sent
    state = client.widget_state
    outputs = [model for model in state.values() if model.get("_model_name") == "OutputModel"]
    assert len(outputs) == 3
    for model in outputs:
        (figure,) = model["outputs"]
        assert figure["output_type"] == "display_data"
        assert figure["data"]["image/png"].startswith("iVBOR")  # base64 of the PNG signature
    sliders = [model for model in state.values() if model.get("_model_name") == "IntSliderModel"]
    assert [model["value"] for model in sliders] == [1, 1, 1]


def test_the_figure_output_is_a_png_and_the_figure_is_closed():
    import base64

    import matplotlib.pyplot as plt

    from moe_lab.workbench.lab.widgets import _display_output

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    output = _display_output(fig)
    assert output["output_type"] == "display_data"
    assert base64.b64decode(output["data"]["image/png"]).startswith(b"\x89PNG\r\n\x1a\n")
    assert not plt.fignum_exists(fig.number)


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.timeout(int(2 * RUNS_EACH * RUN_LIMIT_S) + 60)
@pytest.mark.parametrize("notebook", EXPLORER_NOTEBOOKS, ids=lambda path: path.stem)
def test_plain_papermill_runs_the_explorer_notebook_to_the_end(notebook, tmp_path):
    environment = {k: v for k, v in os.environ.items() if k != "MOE_LAB_HEADLESS"}
    environment.setdefault("TRITON_INTERPRET", "1")
    # The kernel runs in notebooks/: without this it imports whichever moe_lab is installed,
    # which need not be this checkout's.
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    papermill = [sys.executable, "-m", "papermill", "--cwd", str(NOTEBOOKS_DIR),
                 "--no-progress-bar"]  # as a CI user runs it: no parameters
    for run in range(RUNS_EACH):
        output = tmp_path / f"run{run}.ipynb"
        start = time.perf_counter()
        try:
            done = subprocess.run([*papermill, str(notebook), str(output)], env=environment,
                                  capture_output=True, text=True, timeout=RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"plain papermill of {notebook.name} did not end within {RUN_LIMIT_S:.0f} s "
                        f"(run {run + 1} of {RUNS_EACH})")
        seconds = time.perf_counter() - start
        assert done.returncode == 0, f"{notebook.name} run {run + 1}:\n{done.stderr[-3000:]}"
        print(f"{notebook.name} run {run + 1}: {seconds:.1f} s")
        executed = nbformat.read(output, as_version=4)
        explorer_cells = [cell for cell in executed.cells
                          if cell.cell_type == "code" and cell.source.startswith("explorer(")]
        assert explorer_cells, f"{notebook.name} has no explorer(...) cell"
        for cell in explorer_cells:
            views = [out for out in cell.outputs
                     if "application/vnd.jupyter.widget-view+json" in out.get("data", {})]
            assert views, f"{notebook.name}: the explorer drew no widget without MOE_LAB_HEADLESS"


def test_moving_a_control_redraws_the_figure_with_the_controls_values(monkeypatch):
    pytest.importorskip("ipywidgets")
    import matplotlib.pyplot as plt

    from moe_lab.workbench.lab import widgets

    monkeypatch.delenv("MOE_LAB_HEADLESS", raising=False)
    shown, drawn = [], []
    monkeypatch.setattr(widgets, "display", shown.append)

    def figure(height=1, dashed=False):
        drawn.append((height, dashed))
        fig, ax = plt.subplots(figsize=(2, 1))
        ax.plot([0, height], linestyle="--" if dashed else "-")
        return fig

    open_before = set(plt.get_fignums())
    widgets.explorer(figure, height=(1, dict(min=0, max=3)), dashed=(False, {}))
    (box,) = shown
    grid, out = box.children
    height, dashed = (cell.children[-1] for cell in grid.children)
    assert drawn == [(1, False)]
    (first,) = out.outputs
    height.value = 3
    dashed.value = True
    assert drawn == [(1, False), (3, False), (3, True)]
    (last,) = out.outputs
    assert last["data"]["image/png"] != first["data"]["image/png"]
    assert set(plt.get_fignums()) == open_before  # every figure drawn was closed
