"""The lease keeper's thread is woken only when a new claim is due before it would wake by
itself (pure logic: a ledger that renews everything, no database)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

from toolledger.worker.pipeline import LeaseKeeper


class _Book:
    """What the keeper asks of the ledger: every renewal succeeds."""

    def renew_leases(self, held: list[tuple[str, str]], lease_seconds: float) -> set[str]:
        return {eid for eid, _ in held}


class _CountingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__()
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def _claim(i: int) -> Any:
    from toolledger.ledger.records import Claim

    return Claim(
        execution_id=f"00000000-0000-4000-8000-{i:012d}",
        scope="s",
        idempotency_key=f"k{i}",
        attempt=1,
        lease_token="t" * 32,
        lease_expires_at=datetime.now(UTC),
        worker_id="w",
        tool="write_file",
        args={},
    )


def _keeper(lease: float, time_limit: float = 0.0) -> tuple[LeaseKeeper, _CountingCondition]:
    keeper = LeaseKeeper(_Book(), lease, time_limit)  # type: ignore[arg-type]
    cv = keeper._cv = _CountingCondition()
    return keeper, cv


def _asleep(keeper: LeaseKeeper) -> None:
    deadline = time.monotonic() + 5
    while keeper._wakes_at == float("inf"):
        assert time.monotonic() < deadline, "the keeper never went to sleep"
        time.sleep(0.005)


def test_keeper__claims_one_after_another_never_wake_it():
    """A job at a time (the protocol bench, a quiet worker): each claim found the keeper idle
    and woke it, a thread switch per job. Its first renewal is a third of a lease away, and
    an idle keeper sleeps no longer than that: nothing to wake it for."""
    keeper, cv = _keeper(lease=30.0)
    first = _claim(0)
    keeper.track(first, time.monotonic())
    keeper.untrack(first)
    _asleep(keeper)
    for i in range(1, 50):
        claim = _claim(i)
        keeper.track(claim, time.monotonic())
        keeper.untrack(claim)
    assert cv.notified == 0
    assert keeper._wakes_at <= time.monotonic() + keeper.idle_wait


def test_keeper__a_claim_due_before_the_keeper_wakes_wakes_it():
    """A claim whose statement was sent long before it was tracked (a slow commit) can be past
    its time limit already: the keeper, asleep for up to 5 s, is woken and gives it up now."""
    keeper, cv = _keeper(lease=30.0, time_limit=5.0)
    idle = _claim(0)
    keeper.track(idle, time.monotonic())
    keeper.untrack(idle)
    _asleep(keeper)
    late = _claim(1)
    watch = keeper.track(late, time.monotonic() - 6.0)  # sent 6 s ago: past the 5 s limit
    assert cv.notified == 1
    assert watch.lost.wait(2.5), "not given up until the keeper woke by itself"
    assert watch.timed_out
