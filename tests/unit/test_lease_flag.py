"""``ctx.lease_lost`` reads set once the lease's deadline has passed on this process's clock,
whether or not the lease keeper's thread has run since (after a freeze it may not have)."""

from __future__ import annotations

import threading
import time

import pytest

from toolledger import effects
from toolledger.effects import LeaseWatch, lease_clock


def test_lease_lost__reads_set_once_the_deadline_passed_with_no_keeper_running():
    """Before 12-05 the flag was a plain Event only the keeper (or valid()) set: a tool woken
    from a freeze read it clear and started an effect its ledger had revoked."""
    watch = LeaseWatch("e", deadline=lease_clock() - 0.001)  # a freeze outlived it
    assert watch.lost.is_set()
    assert watch.lost.wait(0) is True
    assert not watch.valid()


def test_lease_lost__follows_the_deadline_the_keeper_moves():
    watch = LeaseWatch("e", deadline=lease_clock() + 60)
    assert not watch.lost.is_set() and watch.lost.wait(0.01) is False
    watch.deadline = lease_clock() - 1  # as if the renewals stopped long ago
    assert watch.lost.is_set()
    fresh = LeaseWatch("f", deadline=lease_clock() + 60)
    fresh.deadline = lease_clock() + 120  # a renewal: still held
    assert not fresh.lost.is_set()


def test_lease_lost__wait_returns_at_the_deadline_or_when_set():
    watch = LeaseWatch("e", deadline=lease_clock() + 0.2)
    began = time.monotonic()
    assert watch.lost.wait(30) is True  # woken by the deadline, not by the 30 s
    assert 0.15 <= time.monotonic() - began < 5
    held = LeaseWatch("h", deadline=lease_clock() + 60)
    threading.Timer(0.1, held.lost.set).start()  # the keeper learns the row is not ours
    assert held.lost.wait(30) is True
    assert LeaseWatch("x", deadline=lease_clock() + 60).lost.wait(0.05) is False


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="Linux's CLOCK_BOOTTIME")
def test_lease_lost__reads_set_after_the_host_slept_past_the_deadline(monkeypatch):
    """A host suspended (a laptop asleep) for an hour: CLOCK_MONOTONIC, which time.monotonic()
    reads, stopped meanwhile, and a lease kept on it read as held on waking, the database
    having revoked it by its own clock (a cold review, 12-07). The lease's clock counts the
    sleep (CLOCK_BOOTTIME): the flag reads set at once."""
    watch = LeaseWatch("e", deadline=lease_clock() + 60)
    assert not watch.lost.is_set()
    real = time.clock_gettime
    slept = 3600.0

    def after_sleep(clock: int) -> float:  # the clock the kernel moves on resume, not the other
        return real(clock) + (slept if clock == time.CLOCK_BOOTTIME else 0.0)

    monkeypatch.setattr(effects.time, "clock_gettime", after_sleep)
    assert watch.lost.is_set() and watch.lost.wait(0) is True
    assert not watch.valid()
