"""The committed tile-traffic table is what its generator prints today, and the grouped order
beats today's row-fastest order at every acceptance launch (the 1.15x target is not met at
every launch: see the table)."""

from __future__ import annotations

from moe_lab.workbench.compile_report import traffic


def test_the_committed_table_is_generated_and_the_grouped_order_never_loses():
    rows = traffic.acceptance()
    assert len(rows) == 3 * len(traffic.ACCEPTANCE)
    assert (traffic.REPORT.parent / "traffic.md").read_text() == traffic.markdown(rows)
    for row in rows:
        assert 1.0 <= row["grouped"] < row["row"], row
    # A wave that fits the L2 is not enough for the issue's 1.15x target: at DeepSeek-V3's
    # K = 7168 launches the grouped order's own wave shape is not the least one, and the table
    # shows them above it. What the model guarantees is only that no order can beat
    # compulsory and that the grouped order beats row-fastest, asserted above.
