"""What every part of the Ledger facade shares: transactions, inserts, events."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from toolledger.ledger import db
from toolledger.ledger.errors import NotFound
from toolledger.ledger.models import execution_events, executions, operations
from toolledger.ledger.reads import LedgerReads, op_key
from toolledger.ledger.records import ExecutionRecord, OperationRecord
from toolledger.ledger.transitions import RECEIPT_STATUSES, EventKind, Review, Status
from toolledger.ledger.types import db_now

if TYPE_CHECKING:
    from toolledger.ledger.store import Store

Event = dict[str, Any]


def event(
    kind: EventKind | Status,
    scope: str,
    key: str,
    actor: str,
    detail: dict[str, Any],
    execution_id: str | None = None,
) -> Event:
    return {
        "scope": scope,
        "idempotency_key": key,
        "execution_id": execution_id,
        "kind": str(kind),
        "actor": actor,
        "detail": detail,
    }


class LedgerBase(LedgerReads):
    """Transactions and the event helper; the facade's parts build on it."""

    engine: sa.Engine
    dialect: str
    #: The hot statements: generic, or one statement each on Postgres (ledger.store).
    store: Store
    #: Seconds a statement may take (``Ledger``'s ``timeout``); None: the driver's defaults.
    timeout: float | None = None

    @contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        with db.write_transaction(self.engine) as conn:
            yield conn

    def _insert(self, table: sa.Table) -> Any:
        """``INSERT`` with this dialect's ``ON CONFLICT``, its module imported here, where it
        is used. (Both dialect packages are still loaded by ``models``: SQLAlchemy imports
        one to check a partial index's ``postgresql_where`` / ``sqlite_where``.)"""
        if self.dialect == "postgresql":
            from sqlalchemy.dialects import postgresql

            return postgresql.insert(table)
        from sqlalchemy.dialects import sqlite

        return sqlite.insert(table)

    @staticmethod
    def _append(conn: sa.Connection, *events: Event) -> None:
        conn.execute(execution_events.insert().values(at=db_now()), list(events))

    @staticmethod
    def _move_operation(
        conn: sa.Connection, scope: str, key: str, attempt: int, old: Status, new: Status
    ) -> bool:
        """Follow an execution's change on its operation, if it is the current attempt."""
        moved = conn.execute(
            operations.update()
            .where(
                op_key(scope, key),
                operations.c.status == old,
                operations.c.authorized_attempts == attempt,
            )
            .values(status=new)
            .returning(operations.c.status)
        ).first()
        if moved is not None and new in RECEIPT_STATUSES:
            db.receipt_written(conn, scope, key)
        return moved is not None

    def _authorize_next(
        self, conn: sa.Connection, op: OperationRecord, by: str, detail: dict[str, Any]
    ) -> OperationRecord | None:
        """unknown/failed -> approved with the next attempt, a compare-and-set on the status
        and attempt the caller read; None if either changed meanwhile.

        The next attempt is numbered past every attempt ever claimed, not only past the
        current one: a withdrawal makes an earlier, proven attempt current again while a later
        one was claimed (``_proof_beats_permission``), and the number after the current one
        was that claimed attempt's: every claim of it lost on the row already there, and the
        call stayed approved for good, re-published every pass, with no way out (a cold
        review)."""
        claimed = conn.execute(
            sa.select(sa.func.max(executions.c.attempt)).where(
                executions.c.scope == op.scope, executions.c.idempotency_key == op.idempotency_key
            )
        ).scalar_one()
        attempt = max(op.authorized_attempts, claimed or 0) + 1
        row = conn.execute(
            operations.update()
            .where(
                op_key(op.scope, op.idempotency_key),
                operations.c.status == op.status,
                operations.c.authorized_attempts == op.authorized_attempts,
            )
            .values(status=Status.APPROVED, authorized_attempts=attempt, enqueued_at=None)
            .returning(*operations.c)
        ).first()
        if row is None:
            return None
        ev = event(
            Status.APPROVED, op.scope, op.idempotency_key, by, {"attempt": attempt, **detail}
        )
        self._append(conn, ev)
        return OperationRecord.from_row(row)

    def _flag(
        self,
        conn: sa.Connection,
        ex: ExecutionRecord,
        reason: Review,
        detail: dict[str, Any],
        actor: str,
    ) -> None:
        """Put the call back in the humans' inbox: ``review`` set, both versions in the event.
        A call already flagged keeps its first reason; the new facts are still recorded, and
        what the model is told follows every flag still waiting (``receipts.in_doubt``), not
        this column."""
        conn.execute(
            operations.update()
            .where(op_key(ex.scope, ex.idempotency_key), operations.c.review.is_(None))
            .values(review=reason.value)
        )
        ev = event(
            EventKind.FLAGGED,
            ex.scope,
            ex.idempotency_key,
            actor,
            {"reason": reason.value, **detail},
            ex.execution_id,
        )
        self._append(conn, ev)

    def _evidence(
        self, conn: sa.Connection, execution_id: str, detail: dict[str, Any], actor: str
    ) -> int:
        seq = conn.execute(
            execution_events.insert()
            .from_select(
                ["scope", "idempotency_key", "execution_id", "kind", "actor", "at", "detail"],
                sa.select(
                    executions.c.scope,
                    executions.c.idempotency_key,
                    executions.c.execution_id,
                    sa.literal(EventKind.EVIDENCE.value),
                    sa.literal(actor),
                    db_now(),
                    sa.literal(detail, execution_events.c.detail.type),
                ).where(executions.c.execution_id == execution_id),
            )
            .returning(execution_events.c.seq)
        ).scalar_one_or_none()
        if seq is None:
            raise NotFound(f"no execution {execution_id!r}")
        return int(seq)
