"""The ledger's invariants on both backends (the ``ledger`` fixture is parametrised)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from toolledger.ledger.errors import (
    ConflictError,
    InvalidTransition,
    NoReceipt,
    NotFound,
    StaleFence,
    StateError,
)
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.models import execution_events, executions, operations
from toolledger.ledger.transitions import TRANSITIONS, Status
from toolledger.ledger.types import db_now

ARGS = {"path": "diagnosis.txt", "content": "done"}


def approved(
    ledger: Ledger, scope: str, cid: str = "c1", args: dict[str, Any] | None = None
) -> str:
    return ledger.submit(
        scope, cid, "write_file", args or ARGS, approved_by="alice"
    ).operation.idempotency_key


def snapshot(ledger: Ledger, scope: str) -> dict[str, Any]:
    """Everything stored for a scope, to prove a refused change wrote nothing."""
    with ledger.engine.connect() as conn:

        def rows(table: sa.Table, order: sa.ColumnElement[Any]) -> list[dict[str, Any]]:
            query = sa.select(table).where(table.c.scope == scope).order_by(order)
            return [dict(r._mapping) for r in conn.execute(query)]

        return {
            "operations": rows(operations, operations.c.idempotency_key),
            "executions": rows(executions, executions.c.execution_id),
            "events": rows(execution_events, execution_events.c.seq),
        }


# ---------------------------------------------------------------------------- submit & claim


def test_claim__first_insert_wins(ledger, scope):
    key = approved(ledger, scope)
    claim = ledger.claim(scope, key, 1, worker_id="w1")
    assert claim is not None
    assert claim.tool == "write_file" and claim.args == ARGS
    assert ledger.get(scope, "c1").operation.status is Status.RUNNING


def test_claim__same_key_and_hash_again_loses_and_nothing_runs(ledger, scope):
    key = approved(ledger, scope)
    again = ledger.submit(
        scope, "c1", "write_file", dict(reversed(ARGS.items())), approved_by="bob"
    )
    assert again.outcome == "existing"
    assert ledger.claim(scope, key, 1, worker_id="w1") is not None
    before = snapshot(ledger, scope)
    assert ledger.claim(scope, key, 1, worker_id="w2") is None  # a lost claim, not an error
    assert snapshot(ledger, scope) == before
    assert len(ledger.get(scope, "c1").executions) == 1


def test_claim__same_key_other_hash_is_a_conflict_with_both_hashes(ledger, scope):
    approved(ledger, scope)
    before = snapshot(ledger, scope)
    other = {"path": "diagnosis.txt", "content": "DIFFERENT"}
    with pytest.raises(ConflictError) as err:
        ledger.submit(scope, "c1", "write_file", other, approved_by="alice")
    assert err.value.stored_sha256 == before["operations"][0]["args_sha256"]
    assert err.value.requested_sha256 != err.value.stored_sha256
    assert err.value.idempotency_key == "write_file:c1"
    assert snapshot(ledger, scope) == before


def test_submit__explicit_key_shared_by_two_calls_same_args_links(ledger, scope):
    first = ledger.submit(scope, "c1", "write_file", ARGS, key="report", approved_by="a")
    second = ledger.submit(scope, "c2", "write_file", ARGS, key="report")
    assert (first.outcome, second.outcome) == ("created", "linked")
    assert ledger.get(scope, "c2").operation.idempotency_key == "report"
    with pytest.raises(ConflictError):
        ledger.submit(scope, "c3", "write_file", {"path": "x", "content": "y"}, key="report")
    with pytest.raises(NotFound):
        ledger.get(scope, "c3")


def test_submit__tool_call_id_reused_for_another_key_is_a_conflict(ledger, scope):
    ledger.submit(scope, "c1", "write_file", ARGS, key="k1")
    before = snapshot(ledger, scope)
    with pytest.raises(ConflictError):
        ledger.submit(scope, "c1", "write_file", ARGS, key="k2")
    assert snapshot(ledger, scope) == before


def test_submit__a_conflict_names_what_differs_and_only_that(ledger, scope):
    """The message named the key and both hashes whatever differed: a call sent again under
    another tool, same arguments, read "args_sha256 X, this request has X"."""
    ledger.submit(scope, "c1", "write_file", ARGS, key="k1")
    sha = ledger.get(scope, "c1").operation.args_sha256
    other = {"path": "diagnosis.txt", "content": "DIFFERENT"}
    cases = [  # tool, args, tool_call_id, key; what the message must say
        ("write_file", other, "c2", "k1", ["key 'k1'", f"args_sha256 {sha}, this request has"]),
        ("append_file", ARGS, "c2", "k1", ["for tool 'write_file', this request is for"]),
        (
            "write_file",
            ARGS,
            "c1",
            "k2",
            ["tool_call_id 'c1'", "key 'k1', this request has key 'k2'"],
        ),
        ("write_file", other, "c1", "k2", ["under key 'k1'", "key 'k2'", "args_sha256"]),
    ]
    for tool, args, cid, key, said in cases:
        with pytest.raises(ConflictError) as err:
            ledger.submit(scope, cid, tool, args, key=key)
        message = str(err.value)
        assert all(part in message for part in said), message
        assert message.endswith("nothing was changed"), message
        if args == ARGS:  # the arguments are the same: no hash is named
            assert "args_sha256" not in message, message
        if tool == "write_file" and cid != "c1":  # the same tool: none is named
            assert "for tool" not in message, message


def test_submit__pending_call_cannot_be_claimed_until_approved(ledger, scope):
    key = ledger.submit(scope, "c1", "write_file", ARGS).operation.idempotency_key
    assert ledger.claim(scope, key, 1, worker_id="w") is None
    ledger.approve(scope, "c1", by="bob")
    assert ledger.claim(scope, key, 1, worker_id="w") is not None


def test_scopes__same_key_in_two_scopes_is_two_operations(ledger, scope):
    other = scope + "-b"
    key_a, key_b = (
        approved(ledger, scope),
        approved(ledger, other, args={"path": "p", "content": "b"}),
    )
    assert key_a == key_b
    assert ledger.claim(scope, key_a, 1, worker_id="w") is not None
    assert ledger.claim(other, key_b, 1, worker_id="w") is not None  # not a lost claim
    assert ledger.get(other, "c1").operation.args == {"path": "p", "content": "b"}


def test_scopes__no_lookup_crosses_scopes(ledger, scope):
    approved(ledger, scope)
    other = scope + "-b"
    with pytest.raises(NotFound):
        ledger.get(other, "c1")
    with pytest.raises(NotFound):
        ledger.events(other, "c1")
    with pytest.raises(NotFound):
        ledger.approve(other, "c1", by="x")
    assert ledger.claim(other, "write_file:c1", 1, worker_id="w") is None
    assert ledger.list_calls(scope=other) == []


# ---------------------------------------------------------------------------- transitions


def _in_state(ledger: Ledger, scope: str, status: Status) -> dict[str, Any]:
    """A call brought to ``status`` through the public API; returns what actions need."""
    approve_now = status not in (Status.PENDING_APPROVAL, Status.REJECTED)
    sub = ledger.submit(scope, "c1", "append_file", ARGS, approved_by="a" if approve_now else None)
    ctx: dict[str, Any] = {"key": sub.operation.idempotency_key, "claim": None}
    if status is Status.REJECTED:
        ledger.reject(scope, "c1", by="carol")  # bob's reject below is refused, not replayed
    if status in (Status.RUNNING, Status.SUCCEEDED, Status.FAILED, Status.UNKNOWN):
        ctx["claim"] = ledger.claim(scope, ctx["key"], 1, worker_id="w")
    if status in (Status.SUCCEEDED, Status.FAILED):
        c = ctx["claim"]
        ledger.finish(c.execution_id, c.lease_token, status, {"done": status.value})
    if status is Status.UNKNOWN:
        ledger.mark_unknown(ctx["claim"].execution_id, reason="test", actor="t")
    assert ledger.get(scope, "c1").operation.status is status
    return ctx


def _execution_id(ledger: Ledger, scope: str) -> str:
    view = ledger.get(scope, "c1")
    return (
        view.executions[-1].execution_id
        if view.executions
        else "00000000-0000-7000-8000-000000000000"
    )


# action name -> (target status, the one or more statuses it may start from, how to run it)
ACTIONS: dict[str, tuple[Status, set[Status], Callable[[Ledger, str, dict[str, Any]], Any]]] = {
    "approve": (
        Status.APPROVED,
        {Status.PENDING_APPROVAL},
        lambda led, s, c: led.approve(s, "c1", by="bob"),
    ),
    "retry": (
        Status.APPROVED,
        {Status.UNKNOWN, Status.FAILED},
        lambda led, s, c: led.authorize_retry(s, "c1", by="bob", accept_duplicate=True),
    ),
    "reject": (
        Status.REJECTED,
        {Status.PENDING_APPROVAL},
        lambda led, s, c: led.reject(s, "c1", by="bob"),
    ),
    "claim": (
        Status.RUNNING,
        {Status.APPROVED},
        lambda led, s, c: led.claim(
            s, c["key"], led.get(s, "c1").operation.authorized_attempts, worker_id="w2"
        ),
    ),
    "finish_succeeded": (
        Status.SUCCEEDED,
        {Status.RUNNING},
        lambda led, s, c: led.finish(_execution_id(led, s), _token(c), Status.SUCCEEDED, {"r": 1}),
    ),
    "finish_failed": (
        Status.FAILED,
        {Status.RUNNING},
        lambda led, s, c: led.finish(_execution_id(led, s), _token(c), Status.FAILED, {"r": 0}),
    ),
    "mark_unknown": (
        Status.UNKNOWN,
        {Status.RUNNING},
        lambda led, s, c: led.mark_unknown(_execution_id(led, s), reason="t", actor="t"),
    ),
    "reconcile_succeeded": (
        Status.SUCCEEDED,
        {Status.UNKNOWN},
        lambda led, s, c: led.reconcile(
            _execution_id(led, s), Status.SUCCEEDED, {"r": 1}, evidence={}, actor="t"
        ),
    ),
    "reconcile_failed": (
        Status.FAILED,
        {Status.UNKNOWN},
        lambda led, s, c: led.resolve(
            _execution_id(led, s), Status.FAILED, by="h", evidence="checked"
        ),
    ),
}


def _token(ctx: dict[str, Any]) -> str:
    return ctx["claim"].lease_token if ctx["claim"] else "no-token"


#: Pairs reached only from a call with history (an earlier attempt, a flag): each has tests
#: of its own in test_proof, named here so that this table cannot silently lose one.
ELSEWHERE = {
    (
        Status.APPROVED,
        Status.SUCCEEDED,
    ): "test_withdrawal__proof_that_attempt_1_succeeded_withdraws_unclaimed_attempt_2",
    (
        Status.FAILED,
        Status.SUCCEEDED,
    ): "test_review__the_inbox_shows_both_versions_and_a_review_corrects_the_decision",
    (
        Status.SUCCEEDED,
        Status.FAILED,
    ): "test_review__an_executors_own_result_stands_and_unflagged_calls_are_refused",
}


def test_transitions__the_api_covers_exactly_the_table():
    from tests.integration import test_proof

    covered = {(old, target) for target, olds, _ in ACTIONS.values() for old in olds}
    assert covered | set(ELSEWHERE) == {pair for pair in TRANSITIONS if pair[0] is not None}
    assert all(hasattr(test_proof, name) for name in ELSEWHERE.values())


@pytest.fixture(params=["default", "generic"])
def either_store(request, db_url):
    """The ledger as configured (Postgres: PostgresStore; a SQLite file: SqliteStore) and with
    the generic store: the matrix holds for both."""
    led = Ledger(db_url, fast_path=request.param == "default")
    yield led
    led.close()


@pytest.mark.parametrize("start", list(Status), ids=str)
@pytest.mark.parametrize("action", list(ACTIONS))
def test_transitions__every_pair_allowed_or_refused(either_store, scope, start, action):
    ledger = either_store
    target, sources, run = ACTIONS[action]
    ctx = _in_state(ledger, scope, start)
    before = snapshot(ledger, scope)
    if start in sources:
        result = run(ledger, scope, ctx)
        assert result is not None
        assert ledger.get(scope, "c1").operation.status is target
        assert len(snapshot(ledger, scope)["events"]) == len(before["events"]) + 1
    else:
        try:
            result = run(ledger, scope, ctx)
        except (StateError, NotFound):
            result = None
        assert result is None  # refused: an error, or (claim) no claim
        assert snapshot(ledger, scope) == before


def test_transitions__status_outside_the_vocabulary_refused_before_any_write(ledger, scope):
    ctx = _in_state(ledger, scope, Status.UNKNOWN)
    before = snapshot(ledger, scope)
    for bad in (Status.RUNNING, Status.APPROVED, Status.UNKNOWN, Status.REJECTED):
        with pytest.raises(InvalidTransition):
            ledger.resolve(_execution_id(ledger, scope), bad, by="h", evidence="e")
    with pytest.raises(InvalidTransition):
        ledger.finish(ctx["claim"].execution_id, ctx["claim"].lease_token, Status.UNKNOWN, {})
    assert snapshot(ledger, scope) == before


def test_transitions__stale_fence_changes_nothing(ledger, scope):
    key = approved(ledger, scope)
    claim = ledger.claim(scope, key, 1, worker_id="w1")
    before = snapshot(ledger, scope)
    with pytest.raises(StaleFence):
        ledger.finish(claim.execution_id, "f" * 32, Status.SUCCEEDED, {"forged": True})
    with pytest.raises(StaleFence):
        ledger.mark_unknown(claim.execution_id, reason="x", actor="x", lease_token="f" * 32)
    assert not ledger.renew_lease(claim.execution_id, "f" * 32)
    assert snapshot(ledger, scope) == before


def test_transitions__zombie_terminal_write_after_unknown_changes_nothing(ledger, scope):
    # Given a running execution declared unknown (its executor presumed gone)
    key = approved(ledger, scope)
    claim = ledger.claim(scope, key, 1, worker_id="zombie")
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    before = snapshot(ledger, scope)
    # When the original executor wakes up and writes its result with its (valid) token
    with pytest.raises(StaleFence):
        ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"late": True})
    assert not ledger.renew_lease(claim.execution_id, claim.lease_token)
    # Then nothing changed; it may only add evidence
    assert snapshot(ledger, scope) == before
    ledger.record_evidence(claim.execution_id, {"late_result": {"late": True}}, actor="zombie")
    assert [e.kind for e in ledger.events(scope, "c1")][-1] == "evidence"
    assert ledger.get(scope, "c1").operation.status is Status.UNKNOWN


# ---------------------------------------------------------------------------- leases


def _db_now(ledger: Ledger) -> Any:
    with ledger.engine.connect() as conn:
        return conn.execute(sa.select(db_now())).scalar_one()


def test_lease__set_and_renewed_by_the_database_clock(ledger, scope):
    key = approved(ledger, scope)
    claim = ledger.claim(scope, key, 1, worker_id="w", lease_seconds=30)
    assert abs((claim.lease_expires_at - _db_now(ledger)).total_seconds() - 30) < 2
    assert ledger.renew_lease(claim.execution_id, claim.lease_token, 300)
    row = ledger.execution(claim.execution_id)
    assert abs((row.lease_expires_at - _db_now(ledger)).total_seconds() - 300) < 2
    assert row.heartbeat_at is not None


def test_lease__renewed_together_only_where_still_ours(ledger, scope):
    """One statement renews a process's claims; a row revoked meanwhile, or a token that is
    not the row's, is left alone and reported as not ours."""
    alive, revoked, forged = (
        ledger.claim(scope, approved(ledger, scope, f"c{i}"), 1, worker_id="w", lease_seconds=30)
        for i in range(3)
    )
    ledger.mark_unknown(revoked.execution_id, reason="lease expired", actor="sweep")
    before = {c.execution_id: ledger.execution(c.execution_id) for c in (revoked, forged)}
    held = [(c.execution_id, c.lease_token) for c in (alive, revoked)]
    held.append((forged.execution_id, "f" * 32))
    assert ledger.renew_leases(held, 300) == {alive.execution_id}
    assert ledger.renew_leases([], 300) == set()
    row = ledger.execution(alive.execution_id)
    assert abs((row.lease_expires_at - _db_now(ledger)).total_seconds() - 300) < 2
    for eid, was in before.items():  # untouched: status, lease and heartbeat as they were
        now = ledger.execution(eid)
        assert (now.status, now.lease_expires_at, now.heartbeat_at) == (
            was.status,
            was.lease_expires_at,
            was.heartbeat_at,
        )


def test_lease__expired_marked_unknown_only_past_the_grace(ledger, scope):
    key = approved(ledger, scope)
    claim = ledger.claim(scope, key, 1, worker_id="w", lease_seconds=0.2)
    time.sleep(0.5)
    assert claim.execution_id not in {e.execution_id for e in ledger.mark_expired(grace_seconds=60)}
    assert ledger.execution(claim.execution_id).status is Status.RUNNING
    marked = ledger.mark_expired(grace_seconds=0)
    assert claim.execution_id in {e.execution_id for e in marked}
    assert ledger.execution(claim.execution_id).status is Status.UNKNOWN
    unknown = ledger.events(scope, "c1")[-1]
    assert unknown.kind == "unknown" and unknown.detail["reason"] == "lease expired"
    assert unknown.detail["last_heartbeat_at"] is not None


def test_lease__alive_lease_is_never_marked(ledger, scope):
    key = approved(ledger, scope)
    claim = ledger.claim(scope, key, 1, worker_id="w", lease_seconds=60)
    assert claim.execution_id not in {e.execution_id for e in ledger.mark_expired(grace_seconds=0)}


# ---------------------------------------------------------------------------- current state


def test_unknown__read_from_current_state_not_history(ledger, scope):
    # exec_1: running -> unknown; exec_2: running -> unknown -> succeeded
    k1 = approved(ledger, scope, "c1")
    k2 = approved(ledger, scope, "c2", args={"path": "b", "content": "b"})
    e1 = ledger.claim(scope, k1, 1, worker_id="w")
    e2 = ledger.claim(scope, k2, 1, worker_id="w")
    ledger.mark_unknown(e1.execution_id, reason="t", actor="t")
    ledger.mark_unknown(e2.execution_id, reason="t", actor="t")
    ledger.reconcile(e2.execution_id, Status.SUCCEEDED, {"ok": True}, evidence={"k": 1}, actor="t")
    # The history has "unknown" for both ...
    assert "unknown" in [e.kind for e in ledger.events(scope, "c2")]
    # ... but only exec_1 is unknown now.
    listed = ledger.list_calls(status=Status.UNKNOWN, scope=scope)
    assert [c.execution_id for c in listed] == [e1.execution_id]
    unknown = [ex.execution_id for ex, _op in ledger.unknown_executions() if ex.scope == scope]
    assert unknown == [e1.execution_id]
    reconciled = ledger.get(scope, "c2").current
    assert reconciled.execution_id == e2.execution_id and reconciled.reconciled


# ---------------------------------------------------------------------------- receipts


def test_receipt__rejected(ledger, scope):
    ledger.submit(scope, "c1", "write_file", ARGS)
    ledger.reject(scope, "c1", by="bob", reason="not in prod")
    assert ledger.receipt(scope, "c1").content == {"status": "rejected", "reason": "not in prod"}


@pytest.mark.parametrize("status", [Status.SUCCEEDED, Status.FAILED])
def test_receipt__exactly_the_saved_result(ledger, scope, status):
    key = approved(ledger, scope)
    claim = ledger.claim(scope, key, 1, worker_id="w")
    saved = {"z": 1, "a": {"診断": "é", "list": [3, 1, 2]}, "m": None}
    ledger.finish(claim.execution_id, claim.lease_token, status, saved)
    receipt = ledger.receipt(scope, "c1")
    assert receipt.content == saved and list(receipt.content) == list(saved)
    assert receipt.execution_id == claim.execution_id
    # asked by call, it is that call's: its messages carried no id (a cold review)
    assert (receipt.scope, receipt.tool_call_id, receipt.reconciled) == (scope, "c1", False)
    assert receipt.to_openai()["tool_call_id"] == "c1"
    assert receipt.to_anthropic()["tool_use_id"] == "c1"


def test_receipt__not_yet_for_pending_approved_running(ledger, scope):
    ledger.submit(scope, "c1", "write_file", ARGS)
    with pytest.raises(NoReceipt):
        ledger.receipt(scope, "c1")
    ledger.approve(scope, "c1", by="b")
    with pytest.raises(NoReceipt):
        ledger.receipt(scope, "c1")
    ledger.claim(scope, "write_file:c1", 1, worker_id="w")
    with pytest.raises(NoReceipt):
        ledger.receipt(scope, "c1")


def test_receipt__missing_call(ledger, scope):
    with pytest.raises(NotFound):
        ledger.receipt(scope, "nope")


def test_receipt__unknown(ledger, scope):
    key = approved(ledger, scope)
    claim = ledger.claim(scope, key, 1, worker_id="w")
    ledger.mark_unknown(claim.execution_id, reason="t", actor="t")
    content = ledger.receipt(scope, "c1").content
    assert content["status"] == "unknown" and content["execution_id"] == claim.execution_id
    assert content["message"]


def test_retry__new_attempt_same_key_new_execution_id(ledger, scope):
    key = approved(ledger, scope)
    first = ledger.claim(scope, key, 1, worker_id="w")
    ledger.mark_unknown(first.execution_id, reason="t", actor="t")
    op = ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=False)
    assert op.authorized_attempts == 2 and op.status is Status.APPROVED
    assert ledger.claim(scope, key, 1, worker_id="w") is None  # the old attempt stays done
    second = ledger.claim(scope, key, 2, worker_id="w")
    assert second.execution_id != first.execution_id
    ledger.finish(second.execution_id, second.lease_token, Status.SUCCEEDED, {"ok": 2})
    view = ledger.get(scope, "c1")
    assert [(e.attempt, e.status) for e in view.executions] == [
        (1, Status.UNKNOWN),
        (2, Status.SUCCEEDED),
    ]
    assert ledger.receipt(scope, "c1").content == {"ok": 2}
    retry = [e for e in ledger.events(scope, "c1") if e.kind == "approved"][-1]
    assert retry.actor == "carol" and retry.detail["attempt"] == 2


def test_receipt__a_resolved_result_says_it_was_established_after_the_fact(ledger, scope):
    key = approved(ledger, scope)
    claim = ledger.claim(scope, key, 1, worker_id="w")
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    ledger.resolve(claim.execution_id, Status.SUCCEEDED, by="dana", evidence="saw the file")
    receipt = ledger.receipt(scope, "c1")
    assert (receipt.status, receipt.reconciled, receipt.tool_call_id) == (
        Status.SUCCEEDED, True, "c1"
    )  # fmt: skip
