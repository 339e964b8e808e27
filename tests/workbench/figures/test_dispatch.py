"""The toy model behind notebook 04's pipelining picture (`moe_lab.workbench.figures.dispatch`)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from moe_lab.workbench.figures.dispatch import pipeline_schedule, plot_pipeline  # noqa: E402


def test_one_stage_serialises_and_enough_stages_hide_the_loads():
    load, mma, steps = 3.0, 1.0, 12
    one = pipeline_schedule(steps, load, mma, 1)
    assert one[-1][3] == pytest.approx(steps * (load + mma))  # nothing overlaps
    for k, (l0, l1, m0, m1) in enumerate(one):
        assert l1 - l0 == load and m1 - m0 == mma and m0 >= l1
        if k:
            assert l0 >= one[k - 1][3]  # the only buffer is free once the last MMA is done
    # With S buffers a step costs max(mma, (load + mma) / S) in the steady state.
    for stages in (2, 3, 4, 6):
        sched = pipeline_schedule(steps, load, mma, stages)
        per_step = (sched[-1][3] - sched[-1 - stages][3]) / stages  # one period
        assert per_step == pytest.approx(max(mma, (load + mma) / stages))
        for k in range(stages, steps):  # a buffer is reused only after its MMA finished
            assert sched[k][0] >= sched[k - stages][3]
        assert all(sched[k][2] >= sched[k - 1][3] for k in range(1, steps))  # MMAs in order


def test_the_pipeline_plot():
    ax = plot_pipeline(3.0, 1.0, stages=(1, 4))
    assert len(ax.patches) == 2 * 2 * 8
