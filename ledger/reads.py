"""The ledger's reads: current state (never the history) for calls, lists and recovery."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from toolledger.ledger.errors import NotFound
from toolledger.ledger.identity import check_scope, check_text_id
from toolledger.ledger.models import execution_events, executions, operations, tool_calls
from toolledger.ledger.receipts import receipt_for
from toolledger.ledger.records import (
    CallView,
    Claim,
    EventRecord,
    ExecutionRecord,
    ListedCall,
    OperationRecord,
    Receipt,
)
from toolledger.ledger.transitions import EventKind, Flag, Status, fold_flags
from toolledger.ledger.types import db_now_plus

#: Rows ``list`` returns unless told otherwise.
LIST_LIMIT = 1000


def op_key(scope: str, key: str) -> sa.ColumnElement[bool]:
    return sa.and_(operations.c.scope == scope, operations.c.idempotency_key == key)


def last_event_detail(
    conn: sa.Connection,
    scope: str,
    key: str,
    kinds: Collection[str],
    execution_id: str | None = None,
) -> dict[str, Any] | None:
    """The detail of the newest event of one of ``kinds`` in a call's history (of one of its
    executions, if given), through the (scope, key, seq) index; None if there is none. An
    event without a detail reads as ``{}``."""
    where = [
        execution_events.c.scope == scope,
        execution_events.c.idempotency_key == key,
        execution_events.c.kind.in_(list(kinds)),
    ]
    if execution_id is not None:
        where.append(execution_events.c.execution_id == execution_id)
    row = conn.execute(
        sa.select(execution_events.c.detail)
        .where(*where)
        .order_by(execution_events.c.seq.desc())
        .limit(1)
    ).first()
    if row is None:
        return None
    return row.detail if isinstance(row.detail, dict) else {}


def flag_events(conn: sa.Connection, scope: str, key: str) -> list[tuple[str, str, dict[str, Any]]]:
    """A call's flagged and reviewed events, in seq order (for ``fold_flags``)."""
    rows = conn.execute(
        sa.select(
            execution_events.c.kind, execution_events.c.execution_id, execution_events.c.detail
        )
        .where(
            execution_events.c.scope == scope,
            execution_events.c.idempotency_key == key,
            execution_events.c.kind.in_([EventKind.FLAGGED, EventKind.REVIEWED]),
        )
        .order_by(execution_events.c.seq)
    ).all()
    return [(r.kind, r.execution_id, r.detail) for r in rows]


def waiting_flags(conn: sa.Connection, op: OperationRecord) -> tuple[Flag, ...]:
    """The flags still waiting on ``op``'s call; none read for a call not flagged (the hot
    path: ``operations.review`` is set while any flag waits)."""
    if op.review is None:
        return ()
    return tuple(fold_flags(flag_events(conn, op.scope, op.idempotency_key))[0])


class LedgerReads:
    """Read methods of the Ledger facade."""

    engine: sa.Engine

    @contextmanager
    def _read(self) -> Iterator[sa.Connection]:
        """A connection whose reads see one snapshot: SQLite's read transaction, Postgres's
        repeatable read (under read committed, ``get`` read the operation and its executions
        at two moments, and a receipt could be built from two states: a review's correction
        made it ``succeeded`` with the corrected ``failed`` content; a cold review)."""
        with self.engine.connect() as conn:
            if self.engine.dialect.name == "postgresql":
                conn = conn.execution_options(isolation_level="REPEATABLE READ")
            yield conn

    @staticmethod
    def _key_for(conn: sa.Connection, scope: str, tool_call_id: str) -> str:
        check_scope(scope)  # a NUL or a surrogate must be refused here, not by the driver
        check_text_id(tool_call_id, "tool_call_id", 256)
        key: str | None = conn.execute(
            sa.select(tool_calls.c.idempotency_key).where(
                tool_calls.c.scope == scope, tool_calls.c.tool_call_id == tool_call_id
            )
        ).scalar_one_or_none()
        if key is None:
            raise NotFound(f"no call {tool_call_id!r} in scope {scope!r}")
        return key

    @staticmethod
    def _operation(conn: sa.Connection, scope: str, key: str) -> OperationRecord:
        row = conn.execute(sa.select(operations).where(op_key(scope, key))).first()
        if row is None:
            raise NotFound(f"no operation {key!r} in scope {scope!r}")
        return OperationRecord.from_row(row)

    def key_for(self, scope: str, tool_call_id: str) -> str:
        with self._read() as conn:
            return self._key_for(conn, scope, tool_call_id)

    def operation(self, scope: str, key: str) -> OperationRecord:
        with self._read() as conn:
            return self._operation(conn, scope, key)

    def execution(self, execution_id: str) -> ExecutionRecord:
        with self._read() as conn:
            return self._require_execution(conn, execution_id)

    @staticmethod
    def _require_execution(conn: sa.Connection, execution_id: str) -> ExecutionRecord:
        row = conn.execute(
            sa.select(executions).where(executions.c.execution_id == execution_id)
        ).first()
        if row is None:
            raise NotFound(f"no execution {execution_id!r}")
        return ExecutionRecord.from_row(row)

    def get(self, scope: str, tool_call_id: str) -> CallView:
        """The call, its action and every attempt at it."""
        with self._read() as conn:
            return self._view(conn, scope, tool_call_id, self._key_for(conn, scope, tool_call_id))

    def history(self, scope: str, tool_call_id: str) -> tuple[CallView, list[EventRecord]]:
        """The call and its event history, read on one connection (a console's page)."""
        with self._read() as conn:
            key = self._key_for(conn, scope, tool_call_id)
            return self._view(conn, scope, tool_call_id, key), self._events(conn, scope, key)

    def events(
        self, scope: str, tool_call_id: str, *, after: int = 0, limit: int = 0
    ) -> list[EventRecord]:
        """The history of the call's action, in order: the events past ``after`` (a
        ``seq``), at most ``limit`` of them (0: all)."""
        with self._read() as conn:
            key = self._key_for(conn, scope, tool_call_id)
            return self._events(conn, scope, key, after=after, limit=limit)

    @classmethod
    def _view(cls, conn: sa.Connection, scope: str, tool_call_id: str, key: str) -> CallView:
        op = cls._operation(conn, scope, key)
        rows = conn.execute(
            sa.select(executions)
            .where(executions.c.scope == scope, executions.c.idempotency_key == key)
            .order_by(executions.c.attempt)
        ).all()
        runs = tuple(ExecutionRecord.from_row(r) for r in rows)
        return CallView(scope, tool_call_id, op, runs, waiting_flags(conn, op))

    @staticmethod
    def _events(
        conn: sa.Connection, scope: str, key: str, *, after: int = 0, limit: int = 0
    ) -> list[EventRecord]:
        query = (
            sa.select(execution_events)
            .where(execution_events.c.scope == scope, execution_events.c.idempotency_key == key)
            .order_by(execution_events.c.seq)
        )
        if after:
            query = query.where(execution_events.c.seq > after)
        if limit:
            query = query.limit(limit)
        return [EventRecord.from_row(r) for r in conn.execute(query).all()]

    def receipt(self, scope: str, tool_call_id: str) -> Receipt:
        """The result to hand the model, by the replay rules; never runs anything. Asked by
        call, it carries the call's ids (its ``to_openai()`` answered ``tool_call_id: None``:
        a cold review) and whether its result was established after the fact, as the
        client's receipts do."""
        view = self.get(scope, tool_call_id)
        r = receipt_for(view.operation, view.current, flags=view.flags)
        current = view.current
        reconciled = bool(current and current.reconciled and r.execution_id == current.execution_id)
        return dataclasses.replace(
            r, scope=view.scope, tool_call_id=view.tool_call_id, reconciled=reconciled
        )

    def list_calls(
        self,
        *,
        status: Status | None = None,
        scope: str | None = None,
        limit: int = LIST_LIMIT,
        review: bool = False,
        scopes: Collection[str] | None = None,
        after: tuple[datetime, str, str] | None = None,
    ) -> list[ListedCall]:
        """Calls from current state (never from the history), oldest first.

        ``review``: only calls flagged for a human (``operations.review``), whatever their
        status; with ``status=unknown`` as well, this is the humans' whole inbox.
        ``scopes``: only calls in one of these scopes (a token limited to them).
        ``after``: the page after this row's ``ListedCall.position`` (a keyset cursor)."""
        first_call = (
            sa.select(sa.func.min(tool_calls.c.tool_call_id))
            .where(
                tool_calls.c.scope == operations.c.scope,
                tool_calls.c.idempotency_key == operations.c.idempotency_key,
            )
            .scalar_subquery()
        )
        current = sa.and_(
            executions.c.scope == operations.c.scope,
            executions.c.idempotency_key == operations.c.idempotency_key,
            executions.c.attempt == operations.c.authorized_attempts,
        )
        query = sa.select(
            operations.c.scope,
            operations.c.idempotency_key,
            operations.c.tool,
            operations.c.status,
            operations.c.authorized_attempts,
            operations.c.created_at,
            operations.c.review,
            executions.c.execution_id,
            executions.c.reconciled,
            first_call.label("tool_call_id"),
        ).select_from(operations.outerjoin(executions, current))
        if status is not None:
            query = query.where(operations.c.status == status)
        if review:
            query = query.where(operations.c.review.is_not(None))
        if scope is not None:
            query = query.where(operations.c.scope == scope)
        if scopes is not None:
            query = query.where(operations.c.scope.in_(sorted(scopes)))
        order = (operations.c.created_at, operations.c.scope, operations.c.idempotency_key)
        if after is not None:
            bound = [sa.literal(v, type_=c.type) for v, c in zip(after, order, strict=True)]
            query = query.where(sa.tuple_(*order) > sa.tuple_(*bound))
        query = query.order_by(*order)
        if limit:
            query = query.limit(limit)
        with self._read() as conn:
            return [ListedCall.from_row(r) for r in conn.execute(query)]

    def inbox_counts(self, scopes: Collection[str] | None = None) -> dict[str, int]:
        """What waits on a person, counted: pending approval, unknown, flagged for review.

        Served by the partial indexes on waiting and flagged rows: its cost follows them."""
        waiting = sa.select(operations.c.status, sa.func.count()).where(
            operations.c.status.in_([Status.PENDING_APPROVAL, Status.UNKNOWN])
        )
        flagged = sa.select(sa.func.count()).where(operations.c.review.is_not(None))
        if scopes is not None:
            waiting = waiting.where(operations.c.scope.in_(sorted(scopes)))
            flagged = flagged.where(operations.c.scope.in_(sorted(scopes)))
        with self._read() as conn:
            grouped = conn.execute(waiting.group_by(operations.c.status)).all()
            counts: dict[str, int] = {str(k): int(v) for k, v in grouped}
            review = conn.execute(flagged).scalar_one()
        return {
            "pending_approval": int(counts.get(Status.PENDING_APPROVAL, 0)),
            "unknown": int(counts.get(Status.UNKNOWN, 0)),
            "review": int(review),
        }

    def unknown_executions(
        self,
        limit: int = 1000,
        after: tuple[str, str, str] | None = None,
        until: tuple[str, str, str] | None = None,
    ) -> list[tuple[ExecutionRecord, OperationRecord]]:
        """Executions unknown now, with their operations, in (scope, key, id) pages: after
        ``after``, up to ``until`` included, both compared by the database (its collation,
        not Python's code points, orders the pages).

        Served by the partial index on unknown rows: its cost follows the unknown rows."""
        order = (executions.c.scope, executions.c.idempotency_key, executions.c.execution_id)
        query = (
            sa.select(executions, *[c.label(f"op_{c.name}") for c in operations.c])
            .join(
                operations,
                sa.and_(
                    operations.c.scope == executions.c.scope,
                    operations.c.idempotency_key == executions.c.idempotency_key,
                ),
            )
            .where(executions.c.status == Status.UNKNOWN)
            .order_by(*order)
            .limit(limit)
        )
        if after is not None:
            query = query.where(sa.tuple_(*order) > sa.tuple_(*after))
        if until is not None:
            query = query.where(sa.tuple_(*order) <= sa.tuple_(*until))
        with self._read() as conn:
            rows = conn.execute(query).all()
        out = []
        for row in rows:
            m = row._mapping
            op = {c.name: m[f"op_{c.name}"] for c in operations.c}
            out.append((ExecutionRecord.from_row(row), OperationRecord.from_row(op)))
        return out

    def retried_automatically(self, claim: Claim) -> bool:
        """Whether ``claim``'s attempt was authorised by the sweep on proof of absence."""
        with self._read() as conn:
            detail = last_event_detail(
                conn, claim.scope, claim.idempotency_key, [EventKind.APPROVED.value]
            )
        return (
            detail is not None
            and bool(detail.get("automatic"))
            and detail.get("attempt") == claim.attempt
        )

    def authorised_within(self, scope: str, key: str, seconds: float) -> bool:
        """Whether the call's newest authorisation (its approval, or a retry's) is at most
        ``seconds`` old by the database's clock: through the (scope, key, seq) index."""
        newest = (
            sa.select(execution_events.c.at)
            .where(
                execution_events.c.scope == scope,
                execution_events.c.idempotency_key == key,
                execution_events.c.kind == EventKind.APPROVED.value,
            )
            .order_by(execution_events.c.seq.desc())
            .limit(1)
            .subquery()
        )
        with self._read() as conn:
            recent = conn.execute(
                sa.select(sa.func.count()).where(newest.c.at >= db_now_plus(-seconds))
            ).scalar_one()
        return bool(recent)

    def evidence_of(self, execution_id: str) -> list[EventRecord]:
        """The evidence events of one execution, oldest first."""
        return self.evidence_for([self.execution(execution_id)]).get(execution_id, [])

    def call_traces(
        self, calls: Collection[tuple[str, str]]
    ) -> dict[tuple[str, str], dict[str, str]]:
        """The W3C trace context each of these calls (scope, key) was submitted under
        (``Ledger.submit``'s ``trace``), for the spans made about them later to link to: one
        query, through the (scope, key, seq) index. A call submitted without tracing (or
        before 2026-12-07) is absent; a detail that is not a context is read as none."""
        pairs = sorted(set(calls))
        if not pairs:
            return {}
        e = execution_events.c
        with self._read() as conn:
            rows = conn.execute(
                sa.select(e.scope, e.idempotency_key, e.detail).where(
                    sa.tuple_(e.scope, e.idempotency_key).in_(pairs),
                    e.kind == EventKind.SUBMITTED,
                )
            ).all()
        found: dict[tuple[str, str], dict[str, str]] = {}
        for row in rows:
            kept = row.detail.get("trace") if isinstance(row.detail, dict) else None
            if isinstance(kept, dict) and isinstance(kept.get("traceparent"), str):
                found[row.scope, row.idempotency_key] = {
                    k: v for k, v in kept.items() if isinstance(v, str)
                }
        return found

    def evidence_for(self, keyed: Sequence[ExecutionRecord]) -> dict[str, list[EventRecord]]:
        """Evidence events of these executions by execution id, oldest first: one query,
        through the (scope, key, seq) index."""
        if not keyed:
            return {}
        pairs = sorted({(e.scope, e.idempotency_key) for e in keyed})
        ids = {e.execution_id for e in keyed}
        pair = sa.tuple_(execution_events.c.scope, execution_events.c.idempotency_key)
        with self._read() as conn:
            rows = conn.execute(
                sa.select(execution_events)
                .where(pair.in_(pairs), execution_events.c.kind == EventKind.EVIDENCE)
                .order_by(execution_events.c.seq)
            ).all()
        found: dict[str, list[EventRecord]] = {}
        for row in rows:
            if row.execution_id in ids:
                found.setdefault(row.execution_id, []).append(EventRecord.from_row(row))
        return found
