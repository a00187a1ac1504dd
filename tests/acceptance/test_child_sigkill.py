"""A prefork worker whose pool children are SIGKILLed (an OOM kill, a chaos run) goes on taking
jobs. On a transport without asynchronous support (the embedded broker) billiard's pool shares
one job queue between its children behind a lock, and an idle child blocks in its read holding
that lock: killed there, it never released it, and the worker took no job again (every time,
when both children were killed, before worker.pool)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest

from tests.acceptance.conftest import Stack, landed, wait_until
from toolledger.harness.processes import children_of
from toolledger.ledger.transitions import Status


def _kill_children(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("which", ["every child", "each child in turn"])
def test_pool_children_sigkilled__the_worker_goes_on_taking_jobs(world: Stack, which: str) -> None:
    # Given a prefork worker (2 children) that has run a call, its children now idle
    w = world.workers[0]
    sub, ledger = world.submitter(), world.ledger()
    scope = "kill" + ("all" if which == "every child" else "each")

    def run(n: int) -> None:
        args = {"path": f"f{n}", "content": f"#{n}"}
        sub.submit(sub.prepare(scope, f"c{n}", "probe_write", args), approved_by="al")
        wait_until(
            lambda: ledger.get(scope, f"c{n}").operation.status is Status.SUCCEEDED,
            90,
            f"call c{n} to succeed after its worker's children were killed:\n"
            + w.log_text()[-3000:],
        )
        assert landed(world.sandbox / scope / f"f{n}") == f"#{n}"

    run(0)
    time.sleep(1.0)  # both children back to waiting on the job queue
    rounds = [children_of(w.pid)] if which == "every child" else [[c] for c in children_of(w.pid)]
    for n, victims in enumerate(rounds, start=1):
        # When they are SIGKILLed where they wait
        _kill_children(victims)
        # Then the worker replaces them and the next call runs
        run(n)
        time.sleep(1.0)
    assert w.alive()
    calls = ledger.list_calls(scope=scope, limit=0)
    assert Counter(c.status for c in calls) == {Status.SUCCEEDED: len(rounds) + 1}
    assert ledger.verify().ok
    sub.close()
