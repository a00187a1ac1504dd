"""The storage seam: the statements every call runs — its claim, its terminal write, the
submit of a new call — behind one object.

``Store`` runs them with SQLAlchemy Core inside the ledger's own transactions, on either
dialect. ``PostgresStore`` (``ledger.fastpath``) overrides each with a single data-modifying
statement, ``SqliteStore`` (``ledger.fastpath_sqlite``) with one ``BEGIN IMMEDIATE`` …
``COMMIT`` of prepared statements on a connection each thread keeps;
``tests/integration/test_fastpath.py`` holds them to the same returns, errors, rows, events and
doorbells on every path. Everything else the ledger does (decisions, recovery, reads) is generic
SQL on the facade. Event details are built by the facade and handed in, so both stores write
the same ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from toolledger.ledger.base import event
from toolledger.ledger.errors import StaleFence
from toolledger.ledger.models import execution_events, executions, operations
from toolledger.ledger.reads import op_key
from toolledger.ledger.records import Claim, ExecutionRecord, Finished, OperationRecord
from toolledger.ledger.transitions import Status
from toolledger.ledger.types import db_now, db_now_plus

if TYPE_CHECKING:
    from toolledger.ledger.base import LedgerBase


class Store:
    """The hot statements in SQLAlchemy Core, in the ledger's transactions."""

    #: Whether ``create`` has a shortcut worth building its parameters for.
    creates = False

    def __init__(self, ledger: LedgerBase) -> None:
        self.ledger = ledger

    def claim(
        self,
        scope: str,
        key: str,
        attempt: int,
        worker_id: str,
        lease_seconds: float,
        execution_id: str,
        token: str,
        detail: dict[str, Any],
    ) -> Claim | None:
        """The execution row, the operation's move to running and its event; None if the
        attempt is not approved, not authorised, flagged, or already claimed."""
        with self.ledger._write() as conn:
            op = conn.execute(
                sa.select(operations.c.tool, operations.c.args)
                .where(
                    op_key(scope, key),
                    operations.c.status == Status.APPROVED,
                    operations.c.authorized_attempts == attempt,
                    operations.c.review.is_(None),  # a flagged call waits for its human
                )
                .with_for_update()
            ).first()
            if op is None:
                return None
            won = conn.execute(
                self.ledger._insert(executions)
                .values(
                    execution_id=execution_id,
                    scope=scope,
                    idempotency_key=key,
                    attempt=attempt,
                    status=Status.RUNNING,
                    worker_id=worker_id,
                    lease_token=token,
                    lease_expires_at=db_now_plus(lease_seconds),
                    heartbeat_at=db_now(),
                    started_at=db_now(),
                    reconciled=False,
                    fenced=True,
                )
                .on_conflict_do_nothing(index_elements=["scope", "idempotency_key", "attempt"])
                .returning(executions.c.lease_expires_at)
            ).first()
            if won is None:
                return None
            self.ledger._move_operation(conn, scope, key, attempt, Status.APPROVED, Status.RUNNING)
            self.ledger._append(
                conn, event(Status.RUNNING, scope, key, worker_id, detail, execution_id)
            )
        return Claim(
            execution_id=execution_id,
            scope=scope,
            idempotency_key=key,
            attempt=attempt,
            lease_token=token,
            lease_expires_at=won.lease_expires_at,
            worker_id=worker_id,
            tool=op.tool,
            args=op.args,
        )

    def finish(
        self,
        execution_id: str,
        lease_token: str,
        status: Status,
        result: dict[str, Any],
        error: str | None,
        effects: list[dict[str, Any]] | None,
        lock_keys: list[int],
        detail: dict[str, Any],
    ) -> Finished:
        """The terminal write under the fence; StaleFence if the row is no longer running
        under ``lease_token``."""
        with self.ledger._write() as conn:
            row = conn.execute(
                executions.update()
                .where(
                    executions.c.execution_id == execution_id,
                    executions.c.status == Status.RUNNING,
                    executions.c.lease_token == lease_token,
                )
                .values(
                    status=status,
                    result=result,
                    error=error,
                    effects=effects,
                    finished_at=db_now(),
                )
                .returning(*executions.c)
            ).first()
            if row is None:
                raise StaleFence(execution_id)
            done = ExecutionRecord.from_row(row)
            if self.ledger.dialect == "postgresql":
                for key in lock_keys:
                    conn.execute(sa.select(sa.func.pg_advisory_xact_lock(key)))
            self.ledger._move_operation(
                conn, done.scope, done.idempotency_key, done.attempt, Status.RUNNING, status
            )
            ev = event(
                status,
                done.scope,
                done.idempotency_key,
                done.worker_id or "worker",
                detail,
                execution_id,
            )
            seq = conn.execute(
                execution_events.insert()
                .values(at=db_now(), **ev)
                .returning(execution_events.c.seq)
            ).scalar_one()
        return Finished(done, int(seq))

    def create(self, params: dict[str, Any]) -> OperationRecord | None:
        """A shortcut for a call whose key is new; None: the facade's one transaction decides
        (created, linked, existing or conflict). The generic store has no shortcut."""
        return None

    def close(self) -> None:
        """Give back what the store holds (the generic one holds nothing of its own)."""
