"""The notebooks' figures draw what they are given: one bar per simulated operation, one cell
per page, one host launch per kernel. (Notebooks 08 and 10 draw them in
tests/workbench/lab/test_notebooks.py; these check the pictures' contents.)"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from moe_lab.moe.stash import pages_per_expert  # noqa: E402
from moe_lab.sim.schedule import simulate  # noqa: E402
from moe_lab.workbench.figures.pipeline import plot_gantt, step_figure  # noqa: E402
from moe_lab.workbench.figures.stash import plot_page_map  # noqa: E402
from moe_lab.workbench.figures.timelines import plot_launch_timeline  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _bars(ax) -> list[tuple[float, float]]:
    """Every (start, width) of the axes' broken bars."""
    out = []
    for coll in ax.collections:
        for path in coll.get_paths():
            xs = path.vertices[:, 0]
            out.append((float(xs.min()), float(xs.max() - xs.min())))
    return sorted(out)


def test_the_gantt_chart_draws_every_operation_of_the_simulated_step_where_it_ran():
    run = simulate([1.0, 1.0, 1.0], n_microbatches=4, n_ranks=3, schedule="1f1b")
    ax = plot_gantt(run, title="t")
    expected = sorted(zip(run.start.tolist(), (run.end - run.start).tolist(), strict=True))
    assert len(_bars(ax)) == len(expected)
    assert [v for bar in _bars(ax) for v in bar] == pytest.approx([v for bar in expected for v in bar])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert ax.get_title() == "t"
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"F", "B"}


def test_the_layout_explorer_draws_both_layouts_and_the_searched_step():
    fig = step_figure(n_ranks=4, microbatches=4, preset_name="deepseek_v3")
    top, bottom = fig.axes[:2]
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert [lab.split(":")[0] for lab in labels] == ["even", "searched"]
    assert len(top.patches) == 2 * 4  # a bar per rank per layout
    assert bottom.collections  # the searched layout's Gantt chart


def test_the_page_map_has_one_cell_per_page_filled_as_far_as_the_page_is():
    counts, page_rows = torch.tensor([5, 0, 8, 1]), 4
    ax = plot_page_map(counts, page_rows, n_pages=6)
    pages = int(pages_per_expert(torch.tensor([0, 5, 5, 13, 14]), page_rows).sum())
    assert pages == 2 + 0 + 2 + 1
    labels = [t.get_text() for t in ax.texts if t.get_text().startswith("e")]
    assert labels == ["e0", "e0", "e2", "e2", "e3"]
    filled = [p for p in ax.patches if p.get_alpha() is None and p.get_fill() and not p.get_hatch()]
    assert sorted(round(p.get_width() / 0.92, 3) for p in filled) == [0.25, 0.25, 1.0, 1.0, 1.0]
    empty = [p for p in ax.patches if not p.get_fill()]
    assert len(empty) == 6 - 5  # the pool's one unused page
    assert sum(bool(p.get_hatch()) for p in ax.patches) == 1  # the trash page
    assert "5 of 6 pages used" in ax.get_title() and "OVERFLOW" not in ax.get_title()
    over = plot_page_map(counts, page_rows, n_pages=3)
    assert "OVERFLOW" in over.get_title()
    assert sum(p.get_edgecolor()[:3] == (1.0, 0.0, 0.0) for p in over.patches if not p.get_fill()) == 2


def test_the_launch_timeline_shows_one_host_launch_per_kernel_eager_and_one_graphed():
    eager, graphed = plot_launch_timeline(n_kernels=6, launch_us=5.0, kernel_us=2.0, graph_launch_us=8.0)
    host_eager = [c for c in eager.collections if c.get_facecolor()[0][:3] == pytest.approx(
        matplotlib.colors.to_rgb("tab:orange"))]
    assert len(_bars(eager)) == 12 and len(_bars(graphed)) == 7  # launches + kernels
    assert len(host_eager) == 1 and len(host_eager[0].get_paths()) == 6
    assert max(s + w for s, w in _bars(eager)) > max(s + w for s, w in _bars(graphed))
