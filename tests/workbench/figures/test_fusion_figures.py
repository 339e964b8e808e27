"""The fusion figures draw what `moe_lab.perf.fusion` counts: one box per launch, titles that
agree with the table, and the bytes axis names its phases."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from moe_lab.perf import fusion  # noqa: E402
from moe_lab.workbench.figures import fusion as plots  # noqa: E402


@pytest.mark.parametrize("variant", sorted(plots.LANES))
def test_each_lane_is_its_variants_forward(variant):
    shape = fusion.preset_shape("deepseek_v3")
    forward = [x for x in fusion.launches(variant, shape) if x.phase == "fwd"]
    launches, _ = plots.lane_counts(variant)
    assert launches == len(forward) == fusion.summary(variant, shape)["launches_fwd"]


def test_the_titles_count_the_lanes():
    ax = plots.plot_dataflow()
    titles = [t.get_text() for t in ax.texts if t.get_text().endswith("tensors between them")]
    assert titles == ["notebook 04's chain (SwiGLU epilogue): 4 launches, 3 tensors between them",
                      "gather prologue + scatter epilogue: 5 launches, 3 tensors between them"]
    matplotlib.pyplot.close("all")


def test_bytes_axis_names_its_phases():
    table = fusion.fusion_table(("deepseek_v3",))
    assert plots.plot_bytes(table, "deepseek_v3").get_ylabel() == "GB per layer (fwd + bwd), counted"
    matplotlib.pyplot.close("all")
