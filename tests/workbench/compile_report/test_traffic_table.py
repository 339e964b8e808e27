"""The committed tile-traffic table is what its generator prints today, and the grouped order
beats today's row-fastest order at every acceptance launch."""

from __future__ import annotations

from moe_lab.workbench.compile_report import traffic


def test_the_committed_table_is_generated_and_the_grouped_order_never_loses():
    rows = traffic.acceptance()
    assert len(rows) == 3 * len(traffic.ACCEPTANCE)
    assert (traffic.REPORT.parent / "traffic.md").read_text() == traffic.markdown(rows)
    for row in rows:
        assert 1.0 <= row["grouped"] < row["row"], row
        if row["wave_l2"] < 1:  # a wave fits the L2: the grouped order keeps both operands there
            assert row["grouped"] <= 1.15, row
