"""Notebook 07's data-flow figure reads the way the data flows: every arrow leaves one box and
enters the next one to its right (or, for a side input, the kernel above it), no two boxes
overlap, and the figure itself says what its launch counts mean."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from moe_lab.workbench.figures import fusion as plots  # noqa: E402


@pytest.fixture(scope="module")
def drawn():
    ax = plots.plot_dataflow()
    ax.figure.canvas.draw()
    boxes = [p.get_path().get_extents() for p in ax.patches if isinstance(p, FancyBboxPatch)]
    arrows = [p._posA_posB for p in ax.patches if isinstance(p, FancyArrowPatch)]
    yield ax, boxes, arrows
    plt.close(ax.figure)


def _inside(point, box):
    return box.x0 <= point[0] <= box.x1 and box.y0 <= point[1] <= box.y1


def test_no_two_boxes_overlap(drawn):
    _, boxes, _ = drawn
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)


def test_every_arrow_points_along_the_flow_from_a_box_edge_to_the_next_box(drawn):
    _, boxes, arrows = drawn
    n_lanes = sum(len(lane) - 1 for lane in plots.LANES.values())
    n_side = sum(len(side) for side in plots.SIDE_INPUTS.values())
    assert len(arrows) == n_lanes + n_side
    for (x0, y0), (x1, y1) in arrows:
        horizontal = y0 == y1
        assert (x1 > x0) if horizontal else (x0 == x1 and y1 > y0), ((x0, y0), (x1, y1))
        # it starts and ends outside every box (no arrow hidden inside one) ...
        assert not any(_inside((x0, y0), b) or _inside((x1, y1), b) for b in boxes)
        # ... just before the box it enters and just after the one it leaves
        step = (0.1, 0) if horizontal else (0, 0.1)
        assert any(_inside((x1 + step[0], y1 + step[1]), b) for b in boxes)
        assert any(_inside((x0 - step[0], y0 - step[1]), b) for b in boxes)


def test_the_figure_says_what_its_launch_counts_mean(drawn):
    ax, _, _ = drawn
    texts = " ".join(t.get_text().replace("\n", " ") for t in ax.texts)
    unfused, _ = plots.lane_counts("swiglu_epilogue")
    fused, _ = plots.lane_counts("scatter_epilogue")
    assert "Forward launches only" in texts
    assert f"({unfused} → {fused})" in texts
    assert "removes is bytes, not launches" in texts
