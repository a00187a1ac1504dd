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
from toolledger.ledger.errors import InvalidTransition
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


def in_turn(
    pg_url: str, scope: str, *writers: Callable[[], Any], held: str | None = None
) -> list[Any]:
    """Run ``writers`` each in a thread, the call's row held (or the execution ``held``)
    until every one of them waits on a lock (the first queued first), then released; their
    results or errors."""
    watch = psycopg.connect(plain_url(pg_url), autocommit=True)
    holder = psycopg.connect(plain_url(pg_url))
    out: list[Any] = [None] * len(writers)
    threads = []
    try:
        if held is None:
            holder.execute("SELECT 1 FROM operations WHERE scope = %s FOR UPDATE", (scope,))
        else:
            holder.execute("SELECT 1 FROM executions WHERE execution_id = %s FOR UPDATE", (held,))
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


def test_an_executors_commit_waiting_behind_a_proof_comes_after_it_in_the_history(
    pg_url: str, scope: str
) -> None:
    """helper-98: the fast path's terminal write drew its event's seq before it took the
    call's row (Postgres runs a CTE nobody reads last): attempt 2's own success was listed
    before attempt 1's proof, which committed first and flagged attempt 2 as still running."""
    ledger = Ledger(pg_url, fast_path=True)
    try:
        ledger.submit(scope, "c1", "notify", {"to": "ops"}, approved_by="al")
        first = ledger.claim(scope, "notify:c1", 1, worker_id="w1")
        assert first is not None
        ledger.mark_unknown(first.execution_id, reason="lease expired", actor="sweep")
        ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True)
        second = ledger.claim(scope, "notify:c1", 2, worker_id="w2")
        assert second is not None
        late = {"late_result": {"notified": "ops"}}
        proof, done = in_turn(
            pg_url,
            scope,
            lambda: ledger.record_late_result(
                first.execution_id, late, actor="w1", outcome=Status.SUCCEEDED
            ),
            lambda: ledger.finish(
                second.execution_id, second.lease_token, Status.SUCCEEDED, {"notified": "ops"}
            ),
        )
        assert not isinstance(proof, Exception) and not isinstance(done, Exception), (proof, done)
        history = [(e.kind, e.execution_id) for e in ledger.events(scope, "c1")]
        assert history[-4:] == [
            ("evidence", first.execution_id),
            ("succeeded", first.execution_id),
            ("flagged", first.execution_id),  # both ran: attempt 2 was running then
            ("succeeded", second.execution_id),
        ], history
        assert ledger.verify().ok
    finally:
        ledger.close()


def test_a_finding_waiting_behind_a_review_is_judged_against_the_corrected_decision(
    pg_ledger: Ledger, pg_url: str, scope: str
) -> None:
    """helper-98: the sweep's finding read the execution and who decided it before it took
    the call's row: a review that corrected the decision meanwhile (to what the finding
    says) got a new "contradicted" flag against the decision it had replaced."""
    ledger = pg_ledger
    eid = unknown_attempt(ledger, scope)
    ledger.resolve(eid, Status.SUCCEEDED, by="hank", evidence="I think it went out")
    late = {"late_result": {"error": "smtp 550"}}
    ledger.record_late_result(eid, late, actor="zombie", outcome=Status.FAILED)
    assert ledger.get(scope, "c1").operation.review == Review.CONTRADICTED
    reviewed, flagged = in_turn(
        pg_url,
        scope,
        lambda: ledger.review(eid, Status.FAILED, by="rita", evidence="the outbox says no"),
        lambda: ledger.record_finding_after_decision(
            eid, Status.FAILED, {"error": "smtp 550"}, evidence={"reconciler": "outbox"},
            actor="sweep",
        ),
        held=eid,
    )  # fmt: skip
    assert not isinstance(reviewed, Exception), reviewed
    assert flagged is False  # the decision it finds is the finding's own now
    view = ledger.get(scope, "c1")
    assert view.operation.review is None and view.current.status is Status.FAILED
    assert ledger.events(scope, "c1")[-1].kind == "reviewed"


def test_a_late_results_evidence_comes_after_the_decision_it_waited_behind(
    pg_ledger: Ledger, pg_url: str, scope: str
) -> None:
    """helper-98: a late result numbered its evidence before it took the call's row, and was
    listed before Hank's resolution, which held the row and never saw it."""
    ledger = pg_ledger
    eid = unknown_attempt(ledger, scope)
    late = {"late_result": {"error": "smtp 550"}}
    hank, zombie = in_turn(
        pg_url,
        scope,
        lambda: ledger.resolve(eid, Status.SUCCEEDED, by="hank", evidence="looks sent"),
        lambda: ledger.record_late_result(eid, late, actor="zombie", outcome=Status.FAILED),
        held=eid,
    )
    assert not isinstance(hank, Exception) and not isinstance(zombie, Exception), (hank, zombie)
    kinds = [e.kind for e in ledger.events(scope, "c1")]
    assert kinds[-3:] == ["succeeded", "evidence", "flagged"], kinds


def test_a_flag_raised_while_a_review_of_another_is_on_its_way_is_not_lost(
    pg_ledger: Ledger, pg_url: str, scope: str
) -> None:
    """Attempt 1 proven succeeded while attempt 2 ran (flagged both_ran); Rita's review of it
    read the call's flags, then waited on attempt 1's row; meanwhile attempt 2's bytes were
    refused at landing: its not_landed flag, raised without the call's row (already flagged),
    committed first, and her review, which never saw it, cleared the call: bytes that never
    landed, and nobody asked."""
    ledger = pg_ledger
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True)
    second = ledger.claim(scope, "notify:c1", 2, worker_id="w2")
    assert second is not None
    ledger.reconcile(first, Status.SUCCEEDED, {"notified": "ops"}, evidence={"r": 1}, actor="s")
    ledger.finish(second.execution_id, second.lease_token, Status.SUCCEEDED, {"notified": "ops"})
    assert ledger.get(scope, "c1").operation.review == Review.BOTH_RAN
    watch = psycopg.connect(plain_url(pg_url), autocommit=True)
    holder = psycopg.connect(plain_url(pg_url))
    out: dict[str, Any] = {}

    def run(name: str, fn: Callable[[], Any]) -> threading.Thread:
        def go() -> None:
            try:
                out[name] = fn()
            except Exception as exc:  # noqa: BLE001 - said by the test
                out[name] = exc

        thread = threading.Thread(target=go)
        thread.start()
        return thread

    try:
        holder.execute("SELECT 1 FROM executions WHERE execution_id = %s FOR UPDATE", (first,))
        rita = run("rita", lambda: ledger.review(first, Status.FAILED, by="rita", evidence="no"))
        deadline = time.monotonic() + 20
        while waiting_on_locks(watch) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = {"path": "a.txt", "why": "a directory stands at its path"}
        sandbox = run("sandbox", lambda: ledger.record_not_landed(second.execution_id, refused))
        while waiting_on_locks(watch) < 2 and sandbox.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        holder.rollback()
        holder.close()
        watch.close()
    rita.join(30)
    sandbox.join(30)
    assert not isinstance(out["rita"], Exception) and out["sandbox"] is None, out
    assert ledger.get(scope, "c1").operation.review == Review.NOT_LANDED
    assert ledger.verify().ok


def test_a_review_reads_the_execution_once_the_call_is_its_own(
    pg_ledger: Ledger, pg_url: str, scope: str
) -> None:
    """Two reviews of a contradicted attempt 1 queue on the call's row: r1 corrects it to
    succeeded (flagging both_ran: attempt 2 failed), r2 confirms carol's failed. r2 read the
    execution before it waited for the lock, and "confirmed" failed on a row r1 had made
    succeeded: it settled the both_ran flag and the history said failed where the row said
    succeeded (a cold review). Read under the lock, r2's is a correction of r1's decision,
    said as such."""
    ledger = pg_ledger
    first = unknown_attempt(ledger, scope)
    ledger.resolve(first, Status.FAILED, by="carol", evidence="no charge in the dashboard")
    ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True)
    second = ledger.claim(scope, "notify:c1", 2, worker_id="w2")
    assert second is not None
    ledger.finish(second.execution_id, second.lease_token, Status.FAILED, {"error": "declined"})
    late = {"late_result": {"notified": "ops"}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(first, late, actor="zombie", outcome=Status.SUCCEEDED)
    assert ledger.get(scope, "c1").operation.review == Review.CONTRADICTED
    in_turn(
        pg_url,
        scope,
        lambda: ledger.review(first, Status.SUCCEEDED, by="r1", evidence="the receipt is real"),
        lambda: ledger.review(first, Status.FAILED, by="r2", evidence="I trust carol"),
    )
    events = ledger.events(scope, "c1")
    row = next(e for e in ledger.get(scope, "c1").executions if e.execution_id == first)
    for said in [e for e in events if e.kind == "reviewed" and e.actor == "r2"]:
        # what r2's review says it found is what the row holds once it was given
        assert said.detail["status"] == row.status.value, (said.detail, row.status)
        decided = [e for e in events if e.actor == "r2" and e.kind in ("succeeded", "failed")]
        assert decided, "r2's review changed r1's decision without saying so"
    assert ledger.verify().ok


def test_a_retry_waiting_behind_a_flag_is_refused_by_it(
    pg_ledger: Ledger, pg_url: str, scope: str
) -> None:
    """Carol resolved attempt 1 failed; its executor's late success, on its way, flagged the
    call contradicted while Bob's retry waited behind it. The retry had read the call (not
    flagged) before it waited, and its compare-and-set on status and attempt still held once
    the flag committed: attempt 2 was authorised on a flagged call, which no retry may be
    (README "The state machine"), by a person who never saw the flag."""
    ledger = pg_ledger
    first = unknown_attempt(ledger, scope)
    ledger.resolve(first, Status.FAILED, by="carol", evidence="no charge in the dashboard")
    late = {"late_result": {"notified": "ops"}, "status": "succeeded", "proves": "succeeded"}
    zombie, bob = in_turn(
        pg_url,
        scope,
        lambda: ledger.record_late_result(first, late, actor="zombie", outcome=Status.SUCCEEDED),
        lambda: ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True),
    )
    assert not isinstance(zombie, Exception), zombie
    # the flag came first: the retry is refused by it, nothing authorised
    assert isinstance(bob, InvalidTransition) and "flagged contradicted" in str(bob), bob
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.authorized_attempts) == (Status.FAILED, 1)
    assert view.operation.review == Review.CONTRADICTED
    assert [e.kind for e in ledger.events(scope, "c1")][-1] == "flagged"
    assert ledger.verify().ok


def test_events_paged_while_a_link_and_an_approval_commit_miss_none(
    pg_ledger: Ledger, pg_url: str, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new id linked to a call drew its event's seq, then committed after an approval that
    drew a later one: a history paged between the two commits showed the approval, and the
    next page (``after`` its seq) never showed the link (a cold review; README's Known
    limitations). The link now takes the call's row before its event draws a seq."""
    from toolledger.ledger.base import LedgerBase
    from toolledger.ledger.transitions import EventKind

    ledger = pg_ledger
    args = {"path": "a.txt", "content": "x"}
    key = ledger.submit(scope, "c1", "write_file", args).operation.idempotency_key
    appended, release = threading.Event(), threading.Event()
    append = LedgerBase._append

    def slow_link(conn: Any, *events: Any) -> None:
        append(conn, *events)
        if any(e["kind"] == EventKind.LINKED.value for e in events):
            appended.set()
            release.wait(30)  # the link's transaction stays open, its seq drawn

    monkeypatch.setattr(LedgerBase, "_append", staticmethod(slow_link))
    done: dict[str, Any] = {}

    def run(name: str, fn: Callable[[], Any]) -> threading.Thread:
        def go() -> None:
            try:
                done[name] = fn()
            except Exception as exc:  # noqa: BLE001 - said by the test
                done[name] = exc

        thread = threading.Thread(target=go)
        thread.start()
        return thread

    watch = psycopg.connect(plain_url(pg_url), autocommit=True)
    try:
        linker = run("link", lambda: ledger.submit(scope, "c2", "write_file", args, key=key))
        assert appended.wait(20), ("the link never appended its event", done)
        approver = run("approve", lambda: ledger.approve(scope, "c1", by="alice"))
        deadline = time.monotonic() + 20  # the approval commits, or waits for the link
        while approver.is_alive() and not waiting_on_locks(watch):
            assert time.monotonic() < deadline, "the approval neither ended nor waited"
            time.sleep(0.02)
        page = ledger.events(scope, "c1")  # a reader pages the history meanwhile
    finally:
        release.set()
        watch.close()
    linker.join(30)
    approver.join(30)
    assert not isinstance(done.get("link"), Exception), done
    assert not isinstance(done.get("approve"), Exception), done
    rest = ledger.events(scope, "c1", after=page[-1].seq)
    whole = ledger.events(scope, "c1")
    assert [e.seq for e in page + rest] == [e.seq for e in whole], (page, rest, whole)
    assert {"linked", "approved"} <= {e.kind for e in whole}
