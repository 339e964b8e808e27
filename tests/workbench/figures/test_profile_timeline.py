"""A torch.profiler recording as a timeline: the host syncs are found and drawn in red."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moe_lab.workbench.figures.profile_timeline import (
    SYNC_EVENT_NAMES,
    plot_profile_timeline,
    profile_timeline,
)


@pytest.fixture(scope="module")
def recording():
    x = torch.randn(16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            y = x @ x
            y.sum().item()  # aten::item -> aten::_local_scalar_dense: a sync
            torch.where(y > 0)  # aten::where -> aten::nonzero: a sync
            y.relu()  # not a sync
    return prof


def test_the_sync_event_names_cover_item_and_nonzero():
    assert {"aten::item", "aten::_local_scalar_dense", "aten::nonzero"} <= SYNC_EVENT_NAMES
    # these sync only with some arguments, which a profiler event does not show
    assert not {"aten::index", "aten::copy_", "aten::_to_copy"} & SYNC_EVENT_NAMES


def test_timeline_marks_item_and_where_as_syncs_and_nothing_else(recording):
    tl = profile_timeline(recording)
    assert [s.name for s in tl.rows["spans"]] == ["step"]
    host = tl.rows["host"]
    by_name = {s.name: s for s in host}
    assert {"aten::matmul", "aten::item", "aten::where", "aten::relu"} <= set(by_name)
    assert [s.name for s in tl.syncs] == ["aten::item", "aten::where"]
    assert not by_name["aten::matmul"].sync and not by_name["aten::relu"].sync
    # the children of a top-level operator are not rows of their own
    assert "aten::_local_scalar_dense" not in by_name and "aten::nonzero" not in by_name
    assert all(0 <= s.start_us <= s.end_us <= tl.end_us for s in host)
    assert "device" not in tl.rows  # a CPU recording has no kernels


def test_plot_draws_the_syncs_in_red(recording):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_rgba

    ax = plot_profile_timeline(profile_timeline(recording), title="tiny")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["spans", "host"]
    red = to_rgba("tab:red")
    host_bars = ax.collections[1]
    n_red = sum(tuple(c) == red for c in host_bars.get_facecolors())
    assert n_red == 2
    assert "host syncs (2)" in ax.get_xlabel()
    matplotlib.pyplot.close(ax.figure)


def _event(name, start, end, device="DeviceType.CPU", parent=None):
    from types import SimpleNamespace

    event = SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                            cpu_parent=parent, cpu_children=[], device_type=device, thread=1,
                            is_user_annotation=False)
    if parent is not None:
        parent.cpu_children.append(event)
    return event


def test_a_gpu_recording_gets_a_device_row_with_the_gap_after_the_sync():
    # what a CUDA recording holds: host ops, a sync inside aten::where, and kernels
    mm = _event("aten::mm", 0, 5)
    where = _event("aten::where", 6, 40)
    nonzero = _event("aten::nonzero", 7, 39, parent=where)
    wait = _event("cudaStreamSynchronize", 8, 38, parent=nonzero)
    k1 = _event("gemm_kernel", 5, 30, device="DeviceType.CUDA")
    k2 = _event("add_kernel", 45, 50, device="DeviceType.CUDA")
    tl = profile_timeline([mm, where, nonzero, wait, k1, k2])
    assert list(tl.rows) == ["host", "device"]
    assert [s.name for s in tl.syncs] == ["aten::where"]
    kernels = tl.rows["device"]
    assert [k.name for k in kernels] == ["gemm_kernel", "add_kernel"]
    assert kernels[1].start_us - kernels[0].end_us == 15  # the device idles after the sync


def test_a_window_on_a_span_limits_the_axis_and_counts_its_syncs_only():
    import matplotlib

    matplotlib.use("Agg")
    outer = _event("forward", 0, 50)
    outer.is_user_annotation = True
    late = _event("optimizer", 100, 200)
    late.is_user_annotation = True
    item_early = _event("aten::item", 10, 12, parent=outer)
    item_late = _event("aten::item", 150, 151, parent=late)
    tl = profile_timeline([outer, late, item_early, item_late])
    assert len(tl.syncs) == 2
    ax = plot_profile_timeline(tl, window_us=(0.0, 50.0))
    assert ax.get_xlim()[0] == 0 and ax.get_xlim()[1] < 60
    assert "host syncs (1)" in ax.get_xlabel()
    matplotlib.pyplot.close("all")


def test_a_time_window_limits_the_axis(recording):
    import matplotlib

    matplotlib.use("Agg")
    tl = profile_timeline(recording)
    item = tl.syncs[0]
    ax = plot_profile_timeline(tl, window_us=(item.start_us, item.end_us))
    assert "host syncs (1)" in ax.get_xlabel()
    matplotlib.pyplot.close("all")
