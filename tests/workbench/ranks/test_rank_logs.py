"""A failed rank's log always holds why it failed (issue 47: the provoked-failure test found
rank 0's log missing one run in three under load).

The cause was not the launcher reading the logs early (it reads them once every rank has
ended), but what rank 0 had to log: when the victim dies before rank 0's monitored barrier
begins, gloo raises "Connection closed by peer" while posting its receives and logs nothing.
`peer_delay_s` makes that ordering happen every time; the launcher now writes a rank's
exception to its log, as Python does for an uncaught one."""

from __future__ import annotations

import pytest

from moe_lab.workbench.ranks.faults import fault_rank
from moe_lab.workbench.ranks.launch import RankFailure, run_ranks


@pytest.mark.timeout(45)
def test_a_peer_that_finds_the_victim_gone_before_its_barrier_has_its_exception_on_its_log(capsys):
    with pytest.raises(RankFailure) as failure:
        run_ranks(fault_rank, 2, "crash", 1, 1000, 2.0, 0.5, timeout_s=30, collective_timeout_s=10,
                  threads_per_rank=1, quiet_failure=True)
    statuses, logs = failure.value.statuses, failure.value.logs
    assert statuses[1].exitcode == -9 and statuses[0].exitcode == 1, statuses
    assert 0 in logs and statuses[0].error in logs[0], (statuses, logs)
    assert capsys.readouterr().err == ""


@pytest.mark.timeout(45)
def test_a_rank_that_raises_has_its_traceback_on_its_log():
    with pytest.raises(RankFailure) as failure:
        run_ranks(fault_rank, 2, "raise", 0, timeout_s=30, collective_timeout_s=10,
                  threads_per_rank=1, quiet_failure=True)
    log = failure.value.logs.get(0, "")
    assert "Traceback (most recent call last)" in log, failure.value.logs
    assert log.rstrip().endswith("RuntimeError: rank 0 failed on purpose"), log
