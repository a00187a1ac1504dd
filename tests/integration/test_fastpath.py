"""The Postgres fast path writes exactly what the generic path writes."""

from __future__ import annotations

import re
from typing import Any

import sqlalchemy as sa

from toolledger.ledger.ledger import Ledger
from toolledger.ledger.models import execution_events, executions, operations
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


def _state(ledger: Ledger, scope: str) -> dict[str, Any]:
    with ledger.engine.connect() as conn:

        def rows(table: sa.Table, *order: Any) -> list[dict[str, Any]]:
            q = sa.select(table).where(table.c.scope == scope).order_by(*order)
            return [
                {k: v for k, v in r._mapping.items() if k not in VOLATILE} for r in conn.execute(q)
            ]

        return {
            "operations": rows(operations, operations.c.idempotency_key),
            "executions": rows(executions, executions.c.idempotency_key),
            "events": rows(execution_events, execution_events.c.seq),
        }


def test_fastpath__same_rows_and_events_as_the_generic_path(pg_url):
    fast, generic = Ledger(pg_url, fast_path=True), Ledger(pg_url, fast_path=False)
    assert fast._fast is not None and generic._fast is None
    _flow(fast, "fast")
    _flow(generic, "generic")
    assert _state(fast, "fast") == _state(generic, "generic")
    assert fast.verify().ok
    fast.close()
    generic.close()


def test_fastpath__plans_cannot_flip_to_a_partial_index(pg_url):
    """Engine connections plan every statement with its values; the fast path keeps generic
    plans, safe because its statuses are bound parameters (a partial index can only serve a
    predicate proven at plan time)."""
    from toolledger.ledger.fastpath import _CLAIM, _FINISH, _psycopg_sql

    ledger = Ledger(pg_url)
    with ledger.engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW plan_cache_mode").scalar() == "force_custom_plan"
    fast = ledger._fast._connection().dbapi_connection
    assert fast.execute("SHOW plan_cache_mode").fetchone() == ("auto",)
    for statement in (_CLAIM, _FINISH):
        sql = _psycopg_sql(statement)
        assert not re.search(r"(WHERE|AND)\s+(\w+\.)?status = '", sql)  # no literal predicate
        assert re.search(r"(WHERE|AND)\s+(\w+\.)?status = %\(", sql)
    ledger.close()
