"""``ctx.lease_lost`` reads set once the lease's deadline has passed on this process's clock,
whether or not the lease keeper's thread has run since (after a freeze it may not have)."""

from __future__ import annotations

import threading
import time

from toolledger.effects import LeaseWatch


def test_lease_lost__reads_set_once_the_deadline_passed_with_no_keeper_running():
    """Before 12-05 the flag was a plain Event only the keeper (or valid()) set: a tool woken
    from a freeze read it clear and started an effect its ledger had revoked."""
    watch = LeaseWatch("e", deadline=time.monotonic() - 0.001)  # a freeze outlived it
    assert watch.lost.is_set()
    assert watch.lost.wait(0) is True
    assert not watch.valid()


def test_lease_lost__follows_the_deadline_the_keeper_moves():
    watch = LeaseWatch("e", deadline=time.monotonic() + 60)
    assert not watch.lost.is_set() and watch.lost.wait(0.01) is False
    watch.deadline = time.monotonic() - 1  # as if the renewals stopped long ago
    assert watch.lost.is_set()
    fresh = LeaseWatch("f", deadline=time.monotonic() + 60)
    fresh.deadline = time.monotonic() + 120  # a renewal: still held
    assert not fresh.lost.is_set()


def test_lease_lost__wait_returns_at_the_deadline_or_when_set():
    watch = LeaseWatch("e", deadline=time.monotonic() + 0.2)
    began = time.monotonic()
    assert watch.lost.wait(30) is True  # woken by the deadline, not by the 30 s
    assert 0.15 <= time.monotonic() - began < 5
    held = LeaseWatch("h", deadline=time.monotonic() + 60)
    threading.Timer(0.1, held.lost.set).start()  # the keeper learns the row is not ours
    assert held.lost.wait(30) is True
    assert LeaseWatch("x", deadline=time.monotonic() + 60).lost.wait(0.05) is False
