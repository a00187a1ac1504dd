"""SIGTERM to a prefork worker's whole process group (systemd's default
``KillMode=control-group``, ``timeout``, ``kill -TERM -- -PGID``): the worker exits, 0, with
nothing lost. Billiard's pool waited for ever on a lock of its queues a child died holding:
8 times in 8 on the embedded broker before worker.app.exit_when_stuck."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.acceptance.conftest import Stack, landed, wait_until
from toolledger.ledger.transitions import Status


@pytest.mark.parametrize("round_", range(2))
def test_group_sigterm__the_worker_exits_0_and_every_call_stays_done(
    world: Stack, round_: int
) -> None:
    # Given a prefork worker (2 children) that has just run 6 calls
    w = world.workers[0]
    sub, ledger = world.submitter(), world.ledger()
    scope = f"grp{round_}"
    for i in range(6):
        args = {"path": f"f{i}", "content": f"#{i}"}
        sub.submit(sub.prepare(scope, f"c{i}", "probe_write", args), approved_by="al")

    def done() -> Counter[Status]:
        return Counter(c.status for c in ledger.list_calls(scope=scope, limit=0))

    wait_until(lambda: done()[Status.SUCCEEDED] == 6, 60, "6 calls succeeded")
    # When SIGTERM reaches every process of its group at once
    w.signal(signal.SIGTERM, group=True)
    # Then it exits, as a warm shutdown does, within the grace of a stuck exit (15 s)
    assert w.wait(45), f"the worker did not exit:\n{w.log_text()[-2000:]}"
    assert w.proc is not None and w.proc.returncode == 0, w.log_text()[-3000:]
    assert done() == {Status.SUCCEEDED: 6}
    for i in range(6):
        assert landed(world.sandbox / scope / f"f{i}") == f"#{i}"
    assert ledger.verify().ok
    sub.close()
