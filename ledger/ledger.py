"""The Ledger facade: every state change is a compare-and-set plus its event, one transaction.

Each transition is an ``UPDATE … WHERE <key> AND status = <expected> [AND lease_token
= <fence>] RETURNING …``; zero rows means the caller's view is stale and nothing was
written. The claim is an ``INSERT … ON CONFLICT DO NOTHING RETURNING`` on the unique
(scope, idempotency_key, attempt): the database decides who runs, never a prior read.
This module holds submission and the humans' decisions; the executor's path is in
``ledger.execution``, recovery's transitions in ``ledger.resolution``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from toolledger.ledger import db, inputs, metrics
from toolledger.ledger.base import event
from toolledger.ledger.errors import (
    ConflictError,
    InputError,
    InvalidIdentifier,
    InvalidTransition,
    NotFound,
)
from toolledger.ledger.events import VerifyReport, verify
from toolledger.ledger.execution import LEASE_SECONDS, LedgerExecution
from toolledger.ledger.identity import (
    MAX_ARGS_BYTES,
    check_call,
    check_new_tool_call_id,
    check_text_id,
)
from toolledger.ledger.models import operations, tool_calls
from toolledger.ledger.outbox import LedgerOutbox
from toolledger.ledger.reads import op_key
from toolledger.ledger.records import Decided, ExecutionRecord, OperationRecord, Submitted
from toolledger.ledger.resolution import LedgerResolution
from toolledger.ledger.sessions import LedgerSessions
from toolledger.ledger.store import Store
from toolledger.ledger.transitions import RETRYABLE, EventKind, Status, check_transition
from toolledger.ledger.types import db_now, dumps

__all__ = ["LEASE_SECONDS", "Ledger"]


class Ledger(LedgerExecution, LedgerResolution, LedgerOutbox, LedgerSessions):
    """The execution layer's own record of every side-effecting tool call.

    ``timeout``: seconds any statement, connect, lock wait or idle moment in a transaction may
    take before it fails (None: the driver's defaults). Workers set it, so a hung connection
    cannot stall a lease renewal or a terminal write past the lease; the CLI sets it without
    the statement timeout, so a frozen operator holds no lock for long.
    """

    def __init__(
        self,
        url: str | sa.Engine,
        *,
        max_args_bytes: int = MAX_ARGS_BYTES,
        fast_path: bool = True,
        timeout: float | None = None,
        statement_timeout: bool = True,
    ) -> None:
        self.engine = (
            url
            if isinstance(url, sa.Engine)
            else db.create_engine(url, timeout=timeout, statement_timeout=statement_timeout)
        )
        self.dialect = self.engine.dialect.name
        self.max_args_bytes = max_args_bytes
        self.timeout = None if isinstance(url, sa.Engine) else timeout
        self.store = Store(self)
        if fast_path and self.dialect == "postgresql":
            from toolledger.ledger.fastpath import PostgresStore

            self.store = PostgresStore(self)
        elif fast_path and self.dialect == "sqlite":
            from toolledger.ledger.fastpath_sqlite import SqliteStore

            if SqliteStore.fits(self.engine):
                self.store = SqliteStore(self)

    def close(self) -> None:
        self.store.close()
        self.engine.dispose()

    def upgrade(self) -> None:
        db.upgrade(self.engine)

    # ---------------------------------------------------------------- plumbing

    # ---------------------------------------------------------------- submit / decide

    def submit(
        self,
        scope: str,
        tool_call_id: str,
        tool: str,
        args: dict[str, Any],
        *,
        key: str | None = None,
        approved_by: str | None = None,
        reason: str | None = None,
        actor: str = "agent",
        stamp_enqueued: bool = False,
        trace: Mapping[str, str] | None = None,
    ) -> Submitted:
        """Record a call. Same key and arguments again returns the existing record.

        ``stamp_enqueued``: the caller will publish the job right after this commits, so the
        outbox stamp is written now, in the same transaction (clear_enqueued if it fails).
        ``trace``: the submit span's W3C context (``tracing.carrier``), kept in the detail of
        the call's ``submitted`` event (the same insert: no statement more), for the spans
        recovery makes about the call later to link to (``call_traces``).
        """
        key, sha = check_call(scope, tool_call_id, tool, args, key, self.max_args_bytes)
        try:
            check_new_tool_call_id(tool_call_id)
        except InvalidIdentifier:
            if not self._holds_call(scope, tool_call_id):  # a replay passes (see prepare)
                raise
        if approved_by is not None:
            check_text_id(approved_by, "approver", inputs.MAX_ACTOR)
        inputs.check_text(reason, "reason")
        if reason is not None and approved_by is None:  # it would be dropped in silence
            raise InputError(
                "reason: it says why a call was approved; approve it too (--approved-by, "
                'approved_by, or the API\'s "approve": true)'
            )
        check_text_id(actor, "actor", inputs.MAX_ACTOR)
        status = Status.APPROVED if approved_by else Status.PENDING_APPROVAL
        check_transition(None, status)
        stamp = stamp_enqueued and status is Status.APPROVED
        submitted: dict[str, Any] = {"tool_call_id": tool_call_id, "tool": tool, "args": args}
        if trace:
            submitted["trace"] = dict(trace)
        decision = {"attempt": 1, "reason": reason} if approved_by else {}
        if self.store.creates:  # a shortcut for a new key (the rest: one transaction below)
            with contextlib.suppress(sa.exc.IntegrityError):  # the generic path will explain
                created = self.store.create(
                    {
                        "scope": scope,
                        "key": key,
                        "tool": tool,
                        "args": dumps(args),
                        "sha": sha,
                        "status": status.value,
                        "attempts": 1 if approved_by else 0,
                        "decided_by": approved_by,
                        "approved": approved_by is not None,
                        "reason": reason if approved_by else None,
                        "stamp": stamp,
                        "tool_call_id": tool_call_id,
                        "actor": actor,
                        "submitted": dumps(submitted),
                        "decider": approved_by or actor,
                        "decision": dumps(decision),
                    }
                )
                if created is not None:
                    metrics.transition(tool, status)
                    return Submitted(created, tool_call_id, "created")
        with self._write() as conn:
            created = self._insert_operation(
                conn, scope, key, tool, args, sha, status, approved_by, reason, stamp
            )
            if created is None:
                op = self._operation(conn, scope, key)
                conflict = _action_conflict(op, scope, key, tool, sha)
                if conflict is not None:
                    raise conflict
            else:
                op = created
            if not self._insert_tool_call(conn, scope, tool_call_id, key, sha):
                return Submitted(op, tool_call_id, "existing")
            if created is None:
                # The call's row first: a link's event must draw its seq holding it, as every
                # decision's does, or it may commit after a later seq, and a history paged
                # between the two (``events --after``) never shows it (a cold review)
                self._locked_operation(conn, scope, key)
                self._append(
                    conn,
                    event(EventKind.LINKED, scope, key, actor, {"tool_call_id": tool_call_id}),
                )
                return Submitted(op, tool_call_id, "linked")
            self._append(
                conn,
                event(EventKind.SUBMITTED, scope, key, actor, submitted),
                event(status, scope, key, approved_by or actor, decision),
            )
        metrics.transition(tool, status)
        return Submitted(op, tool_call_id, "created")

    def _holds_call(self, scope: str, tool_call_id: str) -> bool:
        """Whether this tool_call_id is recorded in ``scope``."""
        try:
            self.key_for(scope, tool_call_id)
        except NotFound:
            return False
        return True

    def _insert_operation(
        self,
        conn: sa.Connection,
        scope: str,
        key: str,
        tool: str,
        args: dict[str, Any],
        sha: str,
        status: Status,
        approved_by: str | None,
        reason: str | None,
        stamp: bool,
    ) -> OperationRecord | None:
        row = conn.execute(
            self._insert(operations)
            .values(
                scope=scope,
                idempotency_key=key,
                tool=tool,
                args=args,
                args_sha256=sha,
                status=status,
                authorized_attempts=1 if approved_by else 0,
                decided_by=approved_by,
                decided_at=db_now() if approved_by else None,
                reason=reason if approved_by else None,
                created_at=db_now(),
                enqueued_at=db_now() if stamp else None,
            )
            .on_conflict_do_nothing(index_elements=["scope", "idempotency_key"])
            .returning(*operations.c)
        ).first()
        return OperationRecord.from_row(row) if row else None

    def _insert_tool_call(
        self, conn: sa.Connection, scope: str, tool_call_id: str, key: str, sha: str
    ) -> bool:
        """Bind the call to its key; False if it was bound already (to this same action)."""
        inserted = conn.execute(
            self._insert(tool_calls)
            .values(
                scope=scope,
                tool_call_id=tool_call_id,
                idempotency_key=key,
                args_sha256=sha,
                created_at=db_now(),
            )
            .on_conflict_do_nothing(index_elements=["scope", "tool_call_id"])
            .returning(tool_calls.c.tool_call_id)
        ).first()
        if inserted is not None:
            return True
        conflict = self._binding_conflict(conn, scope, tool_call_id, key, sha)
        if conflict is not None:
            raise conflict
        return False

    @staticmethod
    def _binding_conflict(
        conn: sa.Connection, scope: str, tool_call_id: str, key: str, sha: str
    ) -> ConflictError | None:
        bound = conn.execute(
            sa.select(tool_calls.c.idempotency_key, tool_calls.c.args_sha256).where(
                tool_calls.c.scope == scope, tool_calls.c.tool_call_id == tool_call_id
            )
        ).first()
        if bound is None or (bound.idempotency_key == key and bound.args_sha256 == sha):
            return None
        return ConflictError(
            scope=scope,
            idempotency_key=bound.idempotency_key,
            stored_sha256=bound.args_sha256,
            requested_sha256=sha,
            tool_call_id=tool_call_id,
            requested_key=key,
        )

    def conflict_of(
        self, scope: str, tool_call_id: str, key: str, tool: str, sha: str
    ) -> ConflictError | None:
        """The ConflictError ``submit`` would raise for this call now (its key or its
        tool_call_id already recorded for other arguments or another tool), read only; None
        if it would not (a later writer can still make it conflict)."""
        with self._read() as conn:
            row = conn.execute(sa.select(operations).where(op_key(scope, key))).first()
            if row is not None:
                conflict = _action_conflict(OperationRecord.from_row(row), scope, key, tool, sha)
                if conflict is not None:
                    return conflict
            return self._binding_conflict(conn, scope, tool_call_id, key, sha)

    def approve(
        self,
        scope: str,
        tool_call_id: str,
        *,
        by: str,
        reason: str | None = None,
        stamp_enqueued: bool = False,
    ) -> OperationRecord:
        """pending_approval -> approved: attempt 1 may now run (see submit's stamp_enqueued).
        The same person's approval with the same reason, given again, is answered with the
        call as it stands (``decide``)."""
        return self.decide(
            scope, tool_call_id, Status.APPROVED, by, reason, stamp_enqueued
        ).operation

    def reject(
        self, scope: str, tool_call_id: str, *, by: str, reason: str | None = None
    ) -> OperationRecord:
        """pending_approval -> rejected: nothing will ever run (given again, as ``approve``)."""
        return self.decide(scope, tool_call_id, Status.REJECTED, by, reason).operation

    def decide(
        self,
        scope: str,
        tool_call_id: str,
        new: Status,
        by: str,
        reason: str | None,
        stamp_enqueued: bool = False,
    ) -> Decided:
        """A person's decision on a pending call, ``new`` approved or rejected.

        A call no longer pending is refused (InvalidTransition), unless the decision it
        carries is this one, by this person, for this reason: then nothing is written and the
        outcome is ``existing``. A script whose approval committed and whose answer was lost
        (a timeout, a dropped connection) asks again and learns it stands (until 2026-12-07
        it was refused, exit 5 / 409, the same as someone else's contrary decision)."""
        check_transition(Status.PENDING_APPROVAL, new)
        check_text_id(by, "decider", inputs.MAX_ACTOR)
        inputs.check_text(reason, "reason")
        values: dict[str, Any] = {
            "status": new,
            "decided_by": by,
            "decided_at": db_now(),
            "reason": reason,
        }
        detail: dict[str, Any] = {"reason": reason}
        if new is Status.APPROVED:
            values["authorized_attempts"] = 1
            detail["attempt"] = 1
            if stamp_enqueued:
                values["enqueued_at"] = db_now()
        with self._write() as conn:
            key = self._key_for(conn, scope, tool_call_id)
            row = conn.execute(
                operations.update()
                .where(op_key(scope, key), operations.c.status == Status.PENDING_APPROVAL)
                .values(**values)
                .returning(*operations.c)
            ).first()
            if row is None:
                current = self._operation(conn, scope, key)
                if _decision_of(current) is new and (current.decided_by, current.reason) == (
                    by,
                    reason,
                ):
                    return Decided(current, "existing")
                raise InvalidTransition(current.status, new, f"call {tool_call_id!r}")
            self._append(conn, event(new, scope, key, by, detail))
            if new is Status.REJECTED:
                db.receipt_written(conn, scope, key)
        metrics.transition(row.tool, new)
        return Decided(OperationRecord.from_row(row), "decided")

    def authorize_retry(
        self,
        scope: str,
        tool_call_id: str,
        *,
        by: str,
        accept_duplicate: bool = False,
        reason: str | None = None,
        seen: OperationRecord | None = None,
    ) -> OperationRecord:
        """unknown/failed -> approved: a new attempt under the same key, authorised by ``by``.

        The caller (who knows the tool) decides whether a duplicate effect must be accepted
        explicitly; the ledger records that it was. ``seen``: the call as the caller read it
        to decide that; refused if its status or attempt has changed since (another retry, an
        attempt run meanwhile: the decision was about attempts that are no longer all).
        """
        check_text_id(by, "authoriser", inputs.MAX_ACTOR)
        inputs.check_text(reason, "reason")
        with self._write() as conn:
            key = self._key_for(conn, scope, tool_call_id)
            # the call's row locked before its flag is read: read unlocked, a flag committed
            # while this waited for the row (a late success against a person's "failed") was
            # not seen, the compare-and-set on status and attempt still held, and attempt 2
            # was authorised on a flagged call by someone who never saw the flag (a review)
            op = self._locked_operation(conn, scope, key)
            if op.status not in RETRYABLE:
                raise InvalidTransition(
                    op.status,
                    Status.APPROVED,
                    f"a retry of {tool_call_id!r} (only unknown or failed)",
                )
            if op.review is not None:
                raise InvalidTransition(
                    op.status, Status.APPROVED, flagged_retry(tool_call_id, op.review)
                )
            if seen is not None and (op.status, op.authorized_attempts) != (
                seen.status,
                seen.authorized_attempts,
            ):
                raise InvalidTransition(
                    op.status,
                    Status.APPROVED,
                    f"a retry of {tool_call_id!r} decided on attempt {seen.authorized_attempts} "
                    f"({seen.status}): it is attempt {op.authorized_attempts} ({op.status}) now; "
                    "look again",
                )
            detail = {"retry": True, "accept_duplicate": accept_duplicate, "reason": reason}
            retried = self._authorize_next(conn, op, by, detail)
            if retried is None:
                raise InvalidTransition(op.status, Status.APPROVED, "a concurrent change")
        metrics.transition(op.tool, Status.APPROVED)
        return retried

    def resolve(
        self,
        execution_id: str,
        status: Status,
        *,
        by: str,
        evidence: str,
        review: bool = False,
        seen: int | None = None,
    ) -> ExecutionRecord:
        """A human's resolution (see ``LedgerResolution.resolve``), counted as a transition."""
        done = super().resolve(
            execution_id, status, by=by, evidence=evidence, review=review, seen=seen
        )
        if metrics.active() is not None:  # the tool is on the operation: read it only then
            metrics.transition(self.operation(done.scope, done.idempotency_key).tool, status)
        return done

    def record_late_result(
        self,
        execution_id: str,
        detail: dict[str, Any],
        *,
        actor: str,
        outcome: Status | None,
        idempotent: bool = False,
    ) -> int:
        """``LedgerResolution.record_late_result``; a late result that settles an unknown
        execution is counted as the sweep counts a reconciliation (it was not counted)."""
        seq, done = self._late_result(execution_id, detail, actor, outcome, idempotent)
        if done is not None and metrics.active() is not None:
            metrics.transition(self.operation(done.scope, done.idempotency_key).tool, done.status)
            metrics.reconciled(done.status.value)
        return seq

    def verify(self, page_size: int = 1000) -> VerifyReport:
        """Rebuild current state from the events alone and report every difference."""
        return verify(self.engine, page_size)


def flagged_retry(tool_call_id: str, review: str) -> str:
    """What a retry of a call a flag waits on is told (the person's and the API's alike)."""
    return (
        f"a retry of {tool_call_id!r}: its call is flagged {review}, and a flag waits for a "
        "person's review before any new attempt (an earlier attempt may have taken effect): "
        "review it first (show the call, then resolve --review); nothing changed"
    )


def _decision_of(op: OperationRecord) -> Status | None:
    """The decision a call carries: rejected, approved (every status past the approval: a
    retry keeps the first decision's ``decided_by`` and reason), or None while it waits."""
    if op.status is Status.PENDING_APPROVAL:
        return None
    return Status.REJECTED if op.status is Status.REJECTED else Status.APPROVED


def _action_conflict(
    op: OperationRecord, scope: str, key: str, tool: str, sha: str
) -> ConflictError | None:
    """The key is recorded for other arguments or another tool: a conflict, not the call."""
    if op.args_sha256 == sha and op.tool == tool:
        return None
    return ConflictError(
        scope=scope,
        idempotency_key=key,
        stored_sha256=op.args_sha256,
        requested_sha256=sha,
        stored_tool=op.tool,
        requested_tool=tool,
    )
