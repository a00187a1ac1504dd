"""The transitions recovery drives: running -> unknown (one, or every expired lease), and
unknown -> succeeded/failed on evidence (a reconciler, a late result, a human)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from ledger.base import LedgerBase, event
from ledger.errors import (
    InvalidArguments,
    InvalidTransition,
    StaleFence,
)
from ledger.identity import (
    check_text_id,
)
from ledger.models import executions
from ledger.records import (
    ExecutionRecord,
)
from ledger.transitions import TERMINAL, Status
from ledger.types import db_now, db_now_plus


class LedgerResolution(LedgerBase):
    def mark_unknown(
        self,
        execution_id: str,
        *,
        reason: str,
        actor: str,
        lease_token: str | None = None,
    ) -> ExecutionRecord:
        """running -> unknown, for an executor known to be gone. The row is kept."""
        where = [executions.c.execution_id == execution_id, executions.c.status == Status.RUNNING]
        if lease_token is not None:
            where.append(executions.c.lease_token == lease_token)
        with self._write() as conn:
            marked = self._mark_unknown(conn, where, reason, actor)
        if not marked:
            raise StaleFence(execution_id, f"execution {execution_id} is not running: unchanged")
        return marked[0]

    def mark_expired(
        self, *, grace_seconds: float = 0.0, limit: int = 1000, actor: str = "sweep"
    ) -> list[ExecutionRecord]:
        """Every ``running`` whose lease expired more than ``grace_seconds`` ago -> unknown.

        The UPDATE re-checks status and lease in its own WHERE, so an executor that renewed
        or finished meanwhile wins; concurrent sweeps skip each other's locked rows and each
        row changes (and gets its event) once.
        """
        deadline = db_now_plus(-grace_seconds)
        expired = (
            sa.select(executions.c.execution_id)
            .where(executions.c.status == Status.RUNNING, executions.c.lease_expires_at < deadline)
            .order_by(executions.c.lease_expires_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
            .scalar_subquery()
        )
        where = [
            executions.c.execution_id.in_(expired),
            executions.c.status == Status.RUNNING,
            executions.c.lease_expires_at < deadline,
        ]
        with self._write() as conn:
            return self._mark_unknown(conn, where, "lease expired", actor)

    def _mark_unknown(
        self,
        conn: sa.Connection,
        where: Sequence[sa.ColumnElement[bool]],
        reason: str,
        actor: str,
    ) -> list[ExecutionRecord]:
        # RETURNING gives the new row; the heartbeat and lease columns are not changed by
        # this UPDATE, so they are the last ones the executor wrote.
        rows = conn.execute(
            executions.update().where(*where).values(status=Status.UNKNOWN).returning(*executions.c)
        ).all()
        marked = [ExecutionRecord.from_row(r) for r in rows]
        events = []
        for ex in marked:
            self._move_operation(
                conn, ex.scope, ex.idempotency_key, ex.attempt, Status.RUNNING, Status.UNKNOWN
            )
            detail = {
                "reason": reason,
                "worker_id": ex.worker_id,
                "last_heartbeat_at": ex.heartbeat_at.isoformat() if ex.heartbeat_at else None,
                "lease_expired_at": ex.lease_expires_at.isoformat()
                if ex.lease_expires_at
                else None,
            }
            events.append(
                event(Status.UNKNOWN, ex.scope, ex.idempotency_key, actor, detail, ex.execution_id)
            )
        if events:
            self._append(conn, *events)
        return marked

    def reconcile(
        self,
        execution_id: str,
        status: Status,
        result: dict[str, Any],
        *,
        evidence: dict[str, Any],
        actor: str,
    ) -> ExecutionRecord:
        """unknown -> succeeded/failed on the same execution, ``reconciled: true``, with the
        evidence that justified it. Zero rows (already resolved) raises StaleFence."""
        if status not in TERMINAL:
            raise InvalidTransition(Status.UNKNOWN, status, "a reconciliation")
        if not isinstance(result, dict):
            raise InvalidArguments("a result must be a JSON object")
        with self._write() as conn:
            row = conn.execute(
                executions.update()
                .where(
                    executions.c.execution_id == execution_id,
                    executions.c.status == Status.UNKNOWN,
                )
                .values(status=status, result=result, reconciled=True, finished_at=db_now())
                .returning(*executions.c)
            ).first()
            if row is None:
                self._require_execution(conn, execution_id)
                raise StaleFence(execution_id, f"execution {execution_id} is not unknown")
            done = ExecutionRecord.from_row(row)
            self._move_operation(
                conn, done.scope, done.idempotency_key, done.attempt, Status.UNKNOWN, status
            )
            detail = {"result": result, "reconciled": True, "evidence": evidence}
            self._append(
                conn, event(status, done.scope, done.idempotency_key, actor, detail, execution_id)
            )
        return done

    def resolve(
        self, execution_id: str, status: Status, *, by: str, evidence: str
    ) -> ExecutionRecord:
        """A human's resolution of an unknown: who decided, and on what evidence."""
        if status not in TERMINAL:
            raise InvalidTransition(Status.UNKNOWN, status, "a human resolution")
        check_text_id(by, "resolver", 256)
        check_text_id(evidence, "evidence", 10_000)
        result = {"status": status.value, "resolved_by": by, "evidence": evidence}
        return self.reconcile(
            execution_id,
            status,
            result,
            evidence={"kind": "human", "by": by, "text": evidence},
            actor=by,
        )
