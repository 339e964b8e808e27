"""The roofline projection: hand-checked FLOPs, bytes and times on a tiny launch, the bound
switching where the intensity crosses the ridge point, the wave efficiency, and the committed
``results/compile/roofline.md`` is what its generator writes from the committed compile reports."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from moe_lab.kernels import mx_gemm
from moe_lab.perf.hardware import gpu_spec
from moe_lab.perf.traffic import simulate
from moe_lab.workbench.compile_report import roofline, traffic


def _tiny(gpu: str, grouped_bytes: int, row_bytes: int, panels: int = 1) -> dict:
    """One projection of two experts of 4 rows, [4, 8] @ [8, 8] each, 256 programs, 132 in flight."""
    row = dict(gpu=gpu, model="tiny", launch="by hand", per_expert=4, experts=2, n=8, k=8, panels=panels,
               compulsory=512, grouped_bytes=grouped_bytes, row_bytes=row_bytes, programs=256, in_flight=132)
    return roofline.projections([row])[0]


def test_a_tiny_launch_by_hand():
    # Two experts of 4 rows, [4, 8] @ [8, 8] each: 2 * 8 rows * 8 * 8 = 1024 FLOPs. Compulsory bf16
    # bytes: x 8 * 8 * 2 = 128, the two weights 2 * 8 * 8 * 2 = 256, y 8 * 8 * 2 = 128: 512.
    moved = simulate([4, 4], 8, 8, 4, 4, 4, in_flight=4, l2_bytes=1 << 20)
    assert moved.compulsory == moved.total == 512  # everything fits the L2: each byte once
    spec = gpu_spec("H200")
    p = _tiny("H200", moved.total, 2 * moved.total)
    assert (p["flops"], p["intensity"], p["old_intensity"]) == (1024, 2.0, 1.0)
    assert p["ridge"] == spec.peak_flops("bf16") / spec.bandwidth
    assert p["bound"] == p["old_bound"] == "memory" and p["time_s"] == 512 / spec.bandwidth
    assert p["old_time_s"] == pytest.approx(2 * p["time_s"])  # twice the bytes, twice the time
    assert _tiny("H200", 512, 512, panels=2)["flops"] == 2048  # SwiGLU: gate and up


def test_the_bound_switches_where_the_intensity_crosses_the_ridge():
    spec = gpu_spec("H200")
    ridge_bytes = 1024 / spec.ridge_intensity  # the bytes that put 1024 FLOPs on the ridge
    p = _tiny("H200", 1.001 * ridge_bytes, 0.999 * ridge_bytes)
    assert p["bound"] == "memory" and p["time_s"] == pytest.approx(1.001 * ridge_bytes / spec.bandwidth)
    assert p["old_bound"] == "compute" and p["old_time_s"] == pytest.approx(1024 / spec.peak_flops("bf16"))


def test_wave_efficiency():
    assert _tiny("H200", 512, 512)["wave_efficiency"] == pytest.approx(256 / 264)  # two waves, 8 slots idle


def test_the_eight_bit_rate_is_mxfp8_only_where_there_are_units():
    blackwell, hopper = _tiny("B200", 512, 512), _tiny("H200", 512, 512)
    assert blackwell["eight_bit"] == "MXFP8"
    assert blackwell["eight_bit_compute_s"] == 1024 / gpu_spec("B200").peak_flops("mxfp8")
    assert "fp8_promote" in hopper["eight_bit"]
    assert hopper["eight_bit_compute_s"] == 1024 / gpu_spec("H200").peak_flops("fp8")


@pytest.fixture(scope="module")
def rows():
    return roofline.launch_projections(traffic.tables(), traffic.dw_tables(), traffic.kernel_tables())


def test_the_committed_roofline_is_generated_and_consistent(rows):
    assert (traffic.RESULTS / "roofline.md").read_text() == roofline.markdown(rows)
    assert "A projection, not a measurement" in roofline.markdown(rows)
    bf16 = {entry[0] for entry in traffic.KERNEL_LAUNCHES if entry[2] is not mx_gemm}  # not the 8-bit MMAs
    assert bf16 and len(bf16) == len(traffic.KERNEL_LAUNCHES) - 2
    assert {r["launch"] for r in rows} == ({entry[0] for entry in traffic.LAUNCHES}
                                           | {entry[0] for entry in traffic.DW_LAUNCHES} | bf16)
    for r in rows:
        spec = gpu_spec(r["gpu"])
        assert r["ridge"] == spec.ridge_intensity
        # The old order moved more everywhere except where it already kept everything (B200,
        # GPT-OSS-20B's MXFP8 down projection: one wave holds every row tile).
        assert r["compulsory"] <= r["modelled"] <= r["old_bytes"], r
        assert r["modelled"] < r["old_bytes"] or r["modelled"] == r["compulsory"], r
        assert r["time_s"] == max(r["flops"] / spec.peak_flops("bf16"), r["modelled"] / spec.bandwidth)
        assert r["time_s"] <= r["old_time_s"], r  # a better order is never projected slower
        assert r["bound"] == ("compute" if r["intensity"] >= r["ridge"] else "memory"), r
        assert r["eight_bit_compute_s"] < r["flops"] / spec.peak_flops("bf16")
        assert 0 < r["wave_efficiency"] <= 1


def test_the_plot_draws_a_line_per_gpu_and_both_orders(rows):
    ax = roofline.plot(rows)
    assert len(ax.lines) == len({r["gpu"] for r in rows})
    assert len(ax.collections) == 2 * len(ax.lines)
    assert "projection" in ax.get_title()
    plt.close(ax.figure)


def test_a_full_compile_writes_both_tables_from_its_own_reports(monkeypatch, tmp_path, rows):
    """``python -m moe_lab compile``, its compiling replaced by the committed reports: after the
    json reports it writes traffic.md and roofline.md beside them, as they are committed."""
    import json

    from moe_lab.__main__ import main
    from moe_lab.workbench.compile_report import report as compile_report

    parts = [json.loads(path.read_text()) for path in traffic.reports().values()]
    merged = {**parts[0], "archs": [a for p in parts for a in p["archs"]],
              "limits": {k: v for p in parts for k, v in p["limits"].items()},
              "rows": [r for p in parts for r in p["rows"]]}
    monkeypatch.setattr(compile_report, "compile_report", lambda archs, modules=None: merged)
    assert main(["compile", "--out", str(tmp_path)]) == 0
    for name in ("traffic.md", "roofline.md"):
        assert (tmp_path / name).read_text() == (traffic.RESULTS / name).read_text()
    # A compile of one target leaves the tables alone.
    monkeypatch.setattr(compile_report, "compile_report", lambda archs, modules=None: parts[0])
    assert main(["compile", "--arch", "sm_90", "--out", str(tmp_path / "one")]) == 0
    assert not (tmp_path / "one" / "roofline.md").exists()
