"""The Postgres store (one statement per hot step) writes exactly what the generic store writes."""

from __future__ import annotations

import re
from typing import Any

import sqlalchemy as sa

from toolledger.ledger.fastpath import PostgresStore
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.models import execution_events, executions, operations
from toolledger.ledger.store import Store
from toolledger.ledger.transitions import Status

VOLATILE = {
    "execution_id",
    "lease_token",
    "lease_expires_at",
    "heartbeat_at",
    "started_at",
    "finished_at",
    "created_at",
    "decided_at",
    "at",
    "seq",
    "scope",
    "enqueued_at",
}


def _flow(ledger: Ledger, scope: str) -> None:
    for cid, status in (("a", Status.SUCCEEDED), ("b", Status.FAILED), ("c", None)):
        ledger.submit(scope, cid, "write_file", {"path": cid, "content": "é"}, approved_by="al")
        claim = ledger.claim(scope, f"write_file:{cid}", 1, worker_id="w1")
        assert ledger.claim(scope, f"write_file:{cid}", 1, worker_id="w2") is None
        if status:
            ledger.finish(
                claim.execution_id,
                claim.lease_token,
                status,
                {"r": cid, "ü": [1]},
                error=None if status is Status.SUCCEEDED else "boom",
            )


#: Times an event's detail carries (when the lease was last renewed, when it expired).
DETAIL_VOLATILE = {"last_heartbeat_at", "lease_expired_at"}


def _stable(column: str, value: Any) -> Any:
    if column == "detail" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in DETAIL_VOLATILE}
    return value


def _state(ledger: Ledger, scope: str) -> dict[str, Any]:
    with ledger.engine.connect() as conn:

        def rows(table: sa.Table, *order: Any) -> list[dict[str, Any]]:
            q = sa.select(table).where(table.c.scope == scope).order_by(*order)
            return [
                {k: _stable(k, v) for k, v in r._mapping.items() if k not in VOLATILE}
                for r in conn.execute(q)
            ]

        return {
            "operations": rows(operations, operations.c.idempotency_key),
            "executions": rows(executions, executions.c.idempotency_key),
            "events": rows(execution_events, execution_events.c.seq),
        }


def test_fastpath__same_rows_and_events_as_the_generic_path(pg_url):
    fast, generic = Ledger(pg_url, fast_path=True), Ledger(pg_url, fast_path=False)
    assert type(fast.store) is PostgresStore and type(generic.store) is Store
    _flow(fast, "fast")
    _flow(generic, "generic")
    assert _state(fast, "fast") == _state(generic, "generic")
    assert fast.verify().ok
    fast.close()
    generic.close()


def _outcome(fn: Any) -> Any:
    """What a step returned (its comparable part) or which error it raised."""
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - the error class is the outcome
        return ("raised", type(exc).__name__)
    if out is None:
        return None
    if hasattr(out, "outcome"):  # Submitted
        return ("submitted", out.outcome, out.operation.status.value)
    if hasattr(out, "lease_token"):  # Claim
        return ("claimed", out.attempt, out.tool, out.args)
    if hasattr(out, "record"):  # Finished
        return ("finished", out.record.status.value, out.record.result)
    return ("other", type(out).__name__)


def _every_path(ledger: Ledger, scope: str) -> list[Any]:
    """Each path the fast statements take or hand over to the generic code: submit created /
    linked / existing / conflict (other args, and a call id bound to another key); claim won /
    lost / not approved / attempt not authorised / after a retry; finish succeeded / failed /
    stale token / after revocation, with effects and path locks."""
    args = {"path": "p", "content": "x"}
    steps: list[Any] = []
    out = steps.append
    out(
        _outcome(lambda: ledger.submit(scope, "c1", "write_file", args, key="k1", approved_by="al"))
    )
    out(_outcome(lambda: ledger.submit(scope, "c2", "write_file", args, key="k1")))  # linked
    out(_outcome(lambda: ledger.submit(scope, "c1", "write_file", args, key="k1")))  # existing
    other = {"path": "p", "content": "y"}
    out(_outcome(lambda: ledger.submit(scope, "c3", "write_file", other, key="k1")))  # conflict
    out(_outcome(lambda: ledger.submit(scope, "c1", "write_file", args, key="k9")))  # rebound
    out(_outcome(lambda: ledger.submit(scope, "p1", "write_file", args, key="k2")))  # pending
    out(_outcome(lambda: ledger.claim(scope, "k2", 1, worker_id="w")))  # not approved
    out(_outcome(lambda: ledger.claim(scope, "k1", 2, worker_id="w")))  # not authorised
    claim = ledger.claim(scope, "k1", 1, worker_id="w")
    assert claim is not None
    out(_outcome(lambda: claim))
    out(_outcome(lambda: ledger.claim(scope, "k1", 1, worker_id="w2")))  # lost
    out(_outcome(lambda: ledger.finish(claim.execution_id, "not-the-token", Status.SUCCEEDED, {})))
    effects = [{"path": "p", "kind": "write", "sha256": "0" * 64, "bytes": 1}]
    out(_outcome(lambda: ledger.finish(
        claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"ok": True},
        effects=effects, lock_keys=[7, 3],
    )))  # fmt: skip
    out(_outcome(lambda: ledger.finish(claim.execution_id, claim.lease_token, Status.FAILED, {})))
    # failed, then a human's retry: attempt 2 is claimed and revoked before it finishes
    out(
        _outcome(
            lambda: ledger.submit(scope, "c4", "append_file", args, key="k3", approved_by="al")
        )
    )
    c4 = ledger.claim(scope, "k3", 1, worker_id="w")
    assert c4 is not None
    out(
        _outcome(
            lambda: ledger.finish(c4.execution_id, c4.lease_token, Status.FAILED, {}, error="e")
        )
    )
    out(_outcome(lambda: ledger.authorize_retry(scope, "c4", by="bo", accept_duplicate=True)))
    c4b = ledger.claim(scope, "k3", 2, worker_id="w")
    assert c4b is not None
    out(_outcome(lambda: c4b))
    ledger.mark_unknown(c4b.execution_id, reason="lease expired", actor="sweep")
    out(_outcome(lambda: ledger.finish(c4b.execution_id, c4b.lease_token, Status.SUCCEEDED, {})))
    return steps


def test_fastpath__every_path_ends_as_the_generic_one(pg_url):
    """Same outcomes (returns and errors) and the same rows and events, path by path."""
    fast, generic = Ledger(pg_url, fast_path=True), Ledger(pg_url, fast_path=False)
    try:
        got_fast = _every_path(fast, "fast-all")
        got_generic = _every_path(generic, "generic-all")
        assert got_fast == got_generic
        assert ("raised", "ConflictError") in got_fast and ("raised", "StaleFence") in got_fast
        assert _state(fast, "fast-all") == _state(generic, "generic-all")
        assert fast.verify().ok
    finally:
        fast.close()
        generic.close()


def test_fastpath__the_comparison_sees_a_difference(pg_url):
    """The state comparison is not blind: one differing event detail is found."""
    ledger = Ledger(pg_url, fast_path=False)
    try:
        _every_path(ledger, "same-a")
        _every_path(ledger, "same-b")
        assert _state(ledger, "same-a") == _state(ledger, "same-b")
        with ledger.engine.begin() as conn:
            conn.execute(
                sa.update(operations)
                .where(operations.c.scope == "same-b", operations.c.idempotency_key == "k2")
                .values(reason="tampered")
            )
        assert _state(ledger, "same-a") != _state(ledger, "same-b")
    finally:
        ledger.close()


def test_fastpath__plans_cannot_flip_to_a_partial_index(pg_url):
    """Engine connections plan every statement with its values; the fast path keeps generic
    plans, safe because its statuses are bound parameters (a partial index can only serve a
    predicate proven at plan time)."""
    from toolledger.ledger.fastpath import _CLAIM, _FINISH, _psycopg_sql

    ledger = Ledger(pg_url)
    with ledger.engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW plan_cache_mode").scalar() == "force_custom_plan"
    assert isinstance(ledger.store, PostgresStore)
    fast = ledger.store.connection().dbapi_connection
    assert fast.execute("SHOW plan_cache_mode").fetchone() == ("auto",)
    for statement in (_CLAIM, _FINISH):
        sql = _psycopg_sql(statement)
        assert not re.search(r"(WHERE|AND)\s+(\w+\.)?status = '", sql)  # no literal predicate
        assert re.search(r"(WHERE|AND)\s+(\w+\.)?status = %\(", sql)
    ledger.close()
