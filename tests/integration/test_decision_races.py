"""Two decisions about one call at the same moment, on Postgres (SQLite's writers' queue takes
them in turn): each is before the other or after it, in the event history as in fact, and a
late result that contradicts a person's decision committed a moment before it is flagged.

Each test holds the call's row in a third session, lets the two writers queue behind it in a
known order, then lets them go (helper-97 reproduced both with real CLI processes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from tests.integration.test_proof import unknown_attempt
from toolledger.harness.bench.common import plain_url
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Review, Status

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_ledger(pg_url: str) -> Iterator[Ledger]:
    led = Ledger(pg_url)
    yield led
    led.close()


def waiting_on_locks(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database()"
    ).fetchone()
    return int(row[0]) if row else 0


def in_turn(pg_url: str, scope: str, *writers: Callable[[], Any]) -> list[Any]:
    """Run ``writers`` each in a thread, the call's row held until every one of them waits
    on a lock (the first queued first), then released; their results or errors."""
    watch = psycopg.connect(plain_url(pg_url), autocommit=True)
    holder = psycopg.connect(plain_url(pg_url))
    out: list[Any] = [None] * len(writers)
    threads = []
    try:
        holder.execute("SELECT 1 FROM operations WHERE scope = %s FOR UPDATE", (scope,))
        for n, writer in enumerate(writers):

            def run(n: int = n, writer: Callable[[], Any] = writer) -> None:
                try:
                    out[n] = writer()
                except Exception as exc:  # noqa: BLE001 - said by the test
                    out[n] = exc

            threads.append(threading.Thread(target=run))
            threads[-1].start()
            deadline = time.monotonic() + 20
            while waiting_on_locks(watch) < n + 1:
                assert time.monotonic() < deadline, f"writer {n} never waited on a lock"
                time.sleep(0.02)
    finally:
        holder.rollback()
        for t in threads:
            t.join(30)
        holder.close()
        watch.close()
    return out


def test_a_proof_waiting_behind_a_retry_comes_after_it_in_the_history(
    pg_ledger: Ledger, pg_url: str, scope: str
) -> None:
    """Alice's proof that attempt 1 succeeded drew its event's seq, then waited for the call's
    row while Bob's retry took it: the history said "succeeded" before "approved", and
    verify's replay of a correct ledger failed (cannot go from succeeded to approved)."""
    ledger = pg_ledger
    eid = unknown_attempt(ledger, scope)
    bob, alice = in_turn(
        pg_url,
        scope,
        lambda: ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True),
        lambda: ledger.resolve(eid, Status.SUCCEEDED, by="alice", evidence="the bank says so"),
    )
    assert not isinstance(bob, Exception) and not isinstance(alice, Exception), (bob, alice)
    view = ledger.get(scope, "c1")
    assert view.operation.status is Status.SUCCEEDED  # proof beats Bob's permission
    kinds = [e.kind for e in ledger.events(scope, "c1")]
    assert kinds[-3:] == ["approved", "succeeded", "withdrawn"], kinds
    report = ledger.verify()
    assert report.ok, report.differences


def test_a_late_result_against_a_resolution_committed_a_moment_before_is_flagged(
    pg_ledger: Ledger, pg_url: str, scope: str
) -> None:
    """Dana resolved the call failed while its executor's late success was on its way: the
    late result read "unknown", lost its compare-and-set to her resolution, and was kept as
    evidence only: no flag, nothing in the inbox, while the world held the effect."""
    ledger = pg_ledger
    eid = unknown_attempt(ledger, scope)
    late = {"late_result": {"notified": "ops"}, "status": "succeeded", "proves": "succeeded"}
    dana, zombie = in_turn(
        pg_url,
        scope,
        lambda: ledger.resolve(eid, Status.FAILED, by="dana", evidence="nothing in the outbox"),
        lambda: ledger.record_late_result(eid, late, actor="zombie", outcome=Status.SUCCEEDED),
    )
    assert not isinstance(dana, Exception) and not isinstance(zombie, Exception), (dana, zombie)
    view = ledger.get(scope, "c1")
    assert view.current.status is Status.FAILED  # nothing overwritten: a person decides again
    assert view.operation.review == Review.CONTRADICTED
    flag = ledger.events(scope, "c1")[-1]
    assert flag.kind == "flagged" and flag.detail["late"]["status"] == "succeeded"
    assert ledger.verify().ok
