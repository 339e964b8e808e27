"""Notebook 04's GPU-internals pictures and its table of down-projection settings
(`moe_lab.workbench.figures.gpu_internals`): the schematics draw their data, the toy schedules
keep their rules, and the projection is the roofline of the stated assumptions."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from moe_lab.perf import hardware  # noqa: E402
from moe_lab.workbench.figures import gpu_internals as gi  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _texts(ax) -> str:
    return "\n".join(t.get_text() for t in ax.texts) + "\n" + ax.get_title()


def test_the_tensor_core_picture_draws_every_instruction_and_where_its_accumulator_lives():
    ax = gi.plot_tensor_core_paths()
    text = _texts(ax)
    for name, (gen, issuer, _path, acc) in gi.TENSOR_CORE_PATHS.items():
        assert name in text and gen in text and issuer in text and f"acc. in\n{acc}" in text
    # mma.sync goes through registers, wgmma and tcgen05 read shared memory; only tcgen05 keeps
    # its accumulator in tensor memory.
    assert "registers" in gi.TENSOR_CORE_PATHS["mma.sync"][2]
    assert "registers" not in gi.TENSOR_CORE_PATHS["wgmma.mma_async"][2]
    assert [acc for *_, acc in gi.TENSOR_CORE_PATHS.values()].count("tensor memory") == 1
    boxes = sum(len(path) + 1 for _, _, path, _ in gi.TENSOR_CORE_PATHS.values())
    assert sum(type(p).__name__ == "FancyBboxPatch" for p in ax.patches) == boxes


def test_the_tma_picture_colours_every_piece_by_its_thread():
    ax = gi.plot_tma_vs_cp_async(tile=4, threads=4)
    cells = [p for p in ax.patches if type(p).__name__ == "Rectangle"]
    assert len(cells) == 4 * 4 + 1  # the cp.async tile's pieces, then the TMA tile
    assert len({p.get_facecolor() for p in cells[:16]}) == 4
    assert "4 threads, each copies\n4 pieces" in _texts(ax)


@pytest.mark.parametrize("n_tiles, n_sms", [(10, 4), (8, 4), (3, 5), (1, 1)])
def test_the_persistent_schedule_runs_every_tile_once_and_pays_setup_once_per_sm(n_tiles, n_sms):
    setup, tile = 0.4, 1.0
    per_tile = gi.persistent_schedule(n_tiles, n_sms, setup, tile, persistent=False)
    persistent = gi.persistent_schedule(n_tiles, n_sms, setup, tile, persistent=True)
    for sched in (per_tile, persistent):
        tiles = sorted(i for spans in sched for _, _, kind, i in spans if kind == "tile")
        assert tiles == list(range(n_tiles))
        for sm, spans in enumerate(sched):
            assert all(i % n_sms == sm for *_, i in spans)
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))
    setups = lambda sched: sum(kind == "setup" for spans in sched for _, _, kind, _ in spans)  # noqa: E731
    assert setups(per_tile) == n_tiles and setups(persistent) == min(n_tiles, n_sms)
    waves = -(-n_tiles // n_sms)
    end = lambda sched: max(s[-1][1] for s in sched if s)  # noqa: E731
    assert end(per_tile) == pytest.approx(waves * (setup + tile))
    assert end(persistent) == pytest.approx(setup + waves * tile)


def test_the_persistent_picture_draws_both_grids():
    ax = gi.plot_persistent_grid(n_tiles=6, n_sms=3, setup=0.5, tile=1.0)
    text = _texts(ax)
    assert "(ends at 3)" in text and "(ends at 2.5)" in text  # per tile: 2 x 1.5; persistent: 0.5 + 2
    assert len(ax.collections) == 2 * 6 + 6 + 3  # tiles twice, setups per tile, setups per SM


def _filled(ax) -> list[tuple[int, int]]:
    """The (row tile, column tile) of each filled cell of a `plot_tile_order` picture."""
    t_m = int(ax.get_ylim()[1])
    orange = matplotlib.colors.to_rgb("tab:orange")
    return sorted((t_m - 1 - int(p.get_y()), int(p.get_x())) for p in ax.patches
                  if p.get_facecolor()[:3] == orange)


def test_a_grouped_order_reads_fewer_operand_tiles_than_row_fastest():
    row = gi.plot_tile_order(t_m=8, t_n=6, group_m=8, in_flight=8)
    assert _filled(row) == [(m, 0) for m in range(8)]
    assert "8 row tiles + 1 weight tile = 9" in row.get_title()
    ax = gi.plot_tile_order(8, 6, 2, 8)
    assert _filled(ax) == [(m, n) for m in range(2) for n in range(4)]
    assert len(ax.patches) == 48
    assert "2 row tiles + 4 weight tiles = 6" in ax.get_title()
    assert sorted(int(t.get_text()) for t in ax.texts) == list(range(48))
    assert len(_filled(gi.plot_tile_order(3, 2, 1, 100))) == 6  # never more than the grid


def test_the_down_projection_settings_are_the_roofline_of_their_assumptions():
    e, d, f, rows = 256, 7168, 2048, 65536
    table = gi.down_projection_rows(e, d, f, rows, experts_per_gpu=(256, 32), gpus=("H200", "B200"))
    assert [(r["ep"], r["gpu"]) for r in table] == [(1, "H200 SXM"), (1, "B200"), (8, "H200 SXM"),
                                                    (8, "B200")]
    for r in table:
        local = r["experts_per_gpu"]
        assert r["flops"] == 2 * rows * d * f  # the same work in every setting
        assert r["weight_bytes"] == 2 * local * d * f
        assert r["moved_bytes"] == 2 * (local * d * f + rows * (d + f))
        assert r["rows_per_expert"] == rows / local
        gpu = hardware.gpu_spec(r["gpu"])
        expected = max(r["flops"] / gpu.peak_flops("bf16"), r["moved_bytes"] / gpu.bandwidth)
        assert r["time_s"] == pytest.approx(expected)
        memory_s, compute_s = r["moved_bytes"] / gpu.bandwidth, r["flops"] / gpu.peak_flops("bf16")
        assert r["bound"] == ("memory" if memory_s > compute_s else "compute")
    by = {(r["ep"], r["gpu"]): r for r in table}
    # Eight times fewer weight bytes per GPU at EP8: on the B200 that crosses the ridge.
    assert by[(1, "B200")]["bound"] == "memory" and by[(8, "B200")]["bound"] == "compute"
    assert by[(1, "B200")]["time_s"] > by[(8, "B200")]["time_s"]
    markdown = gi.projection_markdown(table, unrealistic="⚠")
    lines = markdown.strip().splitlines()
    assert len(lines) == 2 + len(table)
    assert [("⚠" in line) for line in lines[2:]] == [True, True, False, False]
    assert "855 µs" in lines[-1] and "| memory |" in lines[3]
