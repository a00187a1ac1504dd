"""The transitions recovery drives: running -> unknown (one, or every expired lease),
unknown -> succeeded/failed on evidence (a reconciler, a late result, the fence, a human),
what that proof does to a later attempt, and a human's review of a flagged call."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from itertools import chain
from typing import Any

import sqlalchemy as sa

from toolledger.ledger import db, inputs
from toolledger.ledger.base import LedgerBase, event
from toolledger.ledger.errors import InvalidArguments, InvalidTransition, StaleFence
from toolledger.ledger.identity import check_text_id
from toolledger.ledger.models import execution_events, executions, operations, tool_calls
from toolledger.ledger.reads import flag_events, last_event_detail, op_key
from toolledger.ledger.records import ExecutionRecord, OperationRecord
from toolledger.ledger.transitions import (
    TERMINAL,
    EventKind,
    Flag,
    Review,
    Status,
    check_transition,
    fold_flags,
)
from toolledger.ledger.types import db_now, db_now_plus, in_batch, materialized


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
        self,
        *,
        grace_seconds: float = 0.0,
        limit: int = 1000,
        actor: str = "sweep",
        call: tuple[str, str] | None = None,
    ) -> list[ExecutionRecord]:
        """Every ``running`` whose lease expired more than ``grace_seconds`` ago -> unknown
        (``call``: only the executions of that ``(scope, idempotency_key)``).

        The UPDATE re-checks status and lease in its own WHERE, so an executor that renewed
        or finished meanwhile wins; concurrent sweeps skip each other's locked rows and each
        row changes (and gets its event) once.
        """
        deadline = db_now_plus(-grace_seconds)
        of_call = () if call is None else (executions.c.scope == call[0],
                                           executions.c.idempotency_key == call[1])  # fmt: skip
        expired = (
            sa.select(executions.c.execution_id)
            .where(
                executions.c.status == Status.RUNNING,
                executions.c.lease_expires_at < deadline,
                *of_call,
            )
            .order_by(executions.c.lease_expires_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
            .cte("expired")
        )
        expired = materialized(expired)
        where = [
            in_batch(self.engine.dialect.name, [executions.c.execution_id], expired),
            executions.c.status == Status.RUNNING,
            executions.c.lease_expires_at < deadline,
        ]
        with self._write() as conn:
            return self._mark_unknown(conn, where, "lease expired", actor, expired)

    def _mark_unknown(
        self,
        conn: sa.Connection,
        where: Sequence[sa.ColumnElement[bool]],
        reason: str,
        actor: str,
        cte: sa.CTE | None = None,
    ) -> list[ExecutionRecord]:
        # RETURNING gives the new row; the heartbeat and lease columns are not changed by
        # this UPDATE, so they are the last ones the executor wrote.
        update = executions.update()
        if cte is not None:  # the rows ``where`` reads them from (mark_expired's batch)
            update = update.add_cte(cte)
        rows = conn.execute(
            update.where(*where).values(status=Status.UNKNOWN).returning(*executions.c)
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
        retry: bool = False,
        flag_both_ran: bool = True,
    ) -> ExecutionRecord:
        """unknown -> succeeded/failed on the same execution, ``reconciled: true``, with the
        evidence that justified it. Zero rows (already resolved) raises StaleFence.

        Proof beats permission: when this proves an earlier attempt succeeded while a later
        one is authorised, the later one is withdrawn if nobody claimed it yet (the call ends
        succeeded with the proven result), or, if it was claimed, both stay and — unless the
        caller knows the tool is idempotent (``flag_both_ran=False``: twice is once) — the
        call is flagged ``both_ran`` for a human.

        ``retry``: the evidence proves the effect absent and the tool's contract allows an
        automatic retry: the next attempt is authorised in the same transaction (only if
        this is the call's current attempt).
        """
        if status not in TERMINAL:
            raise InvalidTransition(Status.UNKNOWN, status, "a reconciliation")
        if not isinstance(result, dict):
            raise InvalidArguments("a result must be a JSON object")
        with self._write() as conn:
            done = self._reconcile_in(
                conn, execution_id, status, result, evidence, actor, retry, flag_both_ran
            )
            if done is None:
                self._require_execution(conn, execution_id)
                raise StaleFence(execution_id, f"execution {execution_id} is not unknown")
        return done

    def _reconcile_in(
        self,
        conn: sa.Connection,
        execution_id: str,
        status: Status,
        result: dict[str, Any],
        evidence: dict[str, Any],
        actor: str,
        retry: bool,
        flag_both_ran: bool,
    ) -> ExecutionRecord | None:
        call = conn.execute(
            sa.select(executions.c.scope, executions.c.idempotency_key).where(
                executions.c.execution_id == execution_id
            )
        ).first()
        if call is None:
            return None
        # The call's row first, before the event draws its seq: a retry authorised while this
        # waited for it drew a later seq than this reconciliation it came before, and verify's
        # replay of the call then failed (helper-97). Held, every change to the call's state
        # is before this one or after it, in seq order as in fact.
        op = self._locked_operation(conn, call.scope, call.idempotency_key)
        row = conn.execute(
            executions.update()
            .where(executions.c.execution_id == execution_id, executions.c.status == Status.UNKNOWN)
            .values(status=status, result=result, reconciled=True, finished_at=db_now())
            .returning(*executions.c)
        ).first()
        if row is None:
            return None
        done = ExecutionRecord.from_row(row)
        detail = {"result": result, "reconciled": True, "evidence": evidence}
        self._append(
            conn, event(status, done.scope, done.idempotency_key, actor, detail, execution_id)
        )
        if op.authorized_attempts == done.attempt:
            self._move_operation(
                conn, done.scope, done.idempotency_key, done.attempt, Status.UNKNOWN, status
            )
            # never past a flag: a person reviews the call first (an automatic attempt
            # authorised on a call flagged both_ran ran once a review confirmed the earlier
            # attempt's success, a second charge nobody authorised: a cold review)
            if retry and status is Status.FAILED and op.review is None:
                failed = self._operation(conn, done.scope, done.idempotency_key)
                auto = {"retry": True, "automatic": True, "after": execution_id}
                self._authorize_next(conn, failed, actor, {**auto, "evidence": evidence})
        elif status is Status.SUCCEEDED:
            self._proof_beats_permission(conn, op, done, evidence, actor, flag_both_ran)
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
        """The result a fenced-out executor still holds, kept as evidence.

        ``outcome``: what the late result proves happened in the world (None: nothing, e.g.
        every effect was refused by the sandbox fence). Proof counts at once, not at the
        next sweep: an unknown execution is reconciled from it in the same transaction, so a
        later attempt authorised meanwhile is withdrawn before anyone can claim it. If a
        human already resolved the execution the other way, or a reconciler decided it
        ``failed`` and this proves it succeeded, the call goes back to the humans' inbox,
        flagged ``contradicted``, with both versions in the flag's event (a flagged call's
        next attempt cannot be claimed until a human has reviewed it). A reconciler's
        ``failed`` was kept against the executor's own success as evidence only: no flag, the
        call failed, its receipt a plain failure, a retry allowed (a cold review). Its
        ``succeeded`` stands against the executor's ``failed`` or "not applied": a reconciler
        proves the target state holds, not who wrote it (DESIGN §6).
        """
        return self._late_result(execution_id, detail, actor, outcome, idempotent)[0]

    def _late_result(
        self,
        execution_id: str,
        detail: dict[str, Any],
        actor: str,
        outcome: Status | None,
        idempotent: bool,
    ) -> tuple[int, ExecutionRecord | None]:
        """``record_late_result``: the evidence's seq, and the execution if it reconciled it."""
        late = detail.get("late_result")
        # its staged sandbox effects were refused at its fenced-out commit: they never landed
        refused = bool(detail.get("staged")) and not detail.get("landed")
        # its executor never started the tool (the lease was lost first): nothing applied
        not_started = bool(detail.get("not_started")) and bool(detail.get("absent"))
        with self._write() as conn:
            # the call's row first, then what to judge by, read once it is ours: a person's
            # resolution committed between a first read (unknown) and the reconciliation below
            # made it lose its compare-and-set, and the late result that contradicts the person
            # was kept as evidence only, never flagged (helper-97); and the evidence, numbered
            # under it, was listed before a decision that never saw it (helper-98)
            ex = self._lock_call_of(conn, execution_id)
            seq = self._evidence(conn, execution_id, detail, actor)
            human = self._human_decider(conn, ex)
            if (refused or not_started) and human and ex.status is Status.SUCCEEDED:
                # a human said it happened; its executor proves it did not (what it staged
                # never landed, or it never started the tool: that went unflagged, a review)
                late_version: dict[str, Any] = {"status": "not_applied"}
                late_version.update(
                    {"staged": detail.get("staged")} if refused else {"not_started": True}
                )
                decided = self._human_version(ex, human)
                self._contradicted(conn, ex, decided, late_version, seq, actor)
                return seq, None
            if outcome is None or outcome not in TERMINAL or not isinstance(late, dict):
                return seq, None
            if ex.status is Status.UNKNOWN:
                proof = {"kind": "late_result", "event_seq": seq, "worker_id": actor}
                done = self._reconcile_in(
                    conn, execution_id, outcome, late, proof, actor, False, not idempotent
                )
                return seq, done
            if ex.status not in TERMINAL or ex.status is outcome:
                return seq, None
            if human:
                decided = self._human_version(ex, human)
            elif outcome is Status.SUCCEEDED and ex.status is Status.FAILED:
                # a reconciler's "failed" (or the fence's "not applied") against its executor's
                # own word that it took effect: proof beats it, as it beats a person's
                found = self._reconciler_decision(conn, ex)
                if found is None:
                    return seq, None
                decided = {"reconciler": {**found, "status": ex.status.value, "result": ex.result}}
            else:
                return seq, None
            late_version = {"status": outcome.value, "result": late}
            self._contradicted(conn, ex, decided, late_version, seq, actor)
        return seq, None

    def record_finding_after_decision(
        self,
        execution_id: str,
        status: Status,
        result: dict[str, Any],
        *,
        evidence: dict[str, Any],
        actor: str,
    ) -> bool:
        """What the sweep found out about an execution that was decided while it looked (the
        reconciler's answer, the fence's proof), which ``reconcile`` refused as stale: if a
        human decided it the other way, the call goes back to the humans' inbox flagged
        ``contradicted``, both versions in the flag's event, as a late result's does (its
        next attempt, a retry the human authorised, cannot be claimed until reviewed). It was
        dropped without a word, and the retry ran (a cold review). Nothing is recorded when
        the decision agrees, or was not a human's (another sweep's, a late result's): one
        answer each. True if the call was flagged."""
        with self._write() as conn:
            # judged against the decision as it stands once the call's row is ours: a review
            # that corrected it meanwhile was flagged "contradicted" against the decision it
            # had replaced (helper-98)
            ex = self._lock_call_of(conn, execution_id)
            human = self._human_decider(conn, ex)
            if not human or ex.status not in TERMINAL or ex.status is status:
                return False
            finding = {"status": status.value, "result": result, "evidence": evidence}
            seq = self._evidence(conn, execution_id, {"finding": finding}, actor)
            waiting, _ = fold_flags(self._flag_events(conn, ex.scope, ex.idempotency_key))
            if any(
                f.execution_id == execution_id and f.reason == Review.CONTRADICTED for f in waiting
            ):  # its executor's own word said so first: one flag for one fact
                return False
            late_version = {"status": status.value, "result": result, "evidence": evidence}
            decided = self._human_version(ex, human)
            self._contradicted(conn, ex, decided, late_version, seq, actor)
            return True

    @staticmethod
    def _human_decider(conn: sa.Connection, ex: ExecutionRecord) -> str | None:
        """Who decided ``ex``'s terminal status, if a person did (a resolution or a review's
        correction): read from the event that decided it. A tool's own result holding a
        ``resolved_by`` key was taken for a person's decision (a cold review)."""
        if not ex.reconciled or ex.status not in TERMINAL:
            return None
        detail = last_event_detail(
            conn,
            ex.scope,
            ex.idempotency_key,
            [Status.SUCCEEDED.value, Status.FAILED.value],
            ex.execution_id,
        )
        proof = (detail or {}).get("evidence")
        if isinstance(proof, dict) and proof.get("kind") == "human":
            by = proof.get("by")
            return by if isinstance(by, str) else None
        return None

    #: Evidence kinds that are the executor's own word (its late result, its "never started"),
    #: not a decision a later report of that executor could contradict.
    OWN_WORD = frozenset({"late_result", "not_started"})

    @classmethod
    def _reconciler_decision(
        cls, conn: sa.Connection, ex: ExecutionRecord
    ) -> dict[str, Any] | None:
        """The evidence ``ex``'s terminal status was decided on, if that was a reconciler's
        (the sweep's, the fence's, any ``reconcile`` caller's): not a person's, and not its
        executor's own word."""
        if not ex.reconciled or ex.status not in TERMINAL:
            return None
        detail = last_event_detail(
            conn,
            ex.scope,
            ex.idempotency_key,
            [Status.SUCCEEDED.value, Status.FAILED.value],
            ex.execution_id,
        )
        proof = (detail or {}).get("evidence")
        if not isinstance(proof, dict) or proof.get("kind") == "human":
            return None
        if proof.get("kind") in cls.OWN_WORD:
            return None
        return {"evidence": proof}

    @staticmethod
    def _human_version(ex: ExecutionRecord, human: str) -> dict[str, Any]:
        return {"human": {"status": ex.status.value, "result": ex.result, "by": human}}

    def _contradicted(
        self,
        conn: sa.Connection,
        ex: ExecutionRecord,
        decided: dict[str, Any],
        late: dict[str, Any],
        seq: int,
        actor: str,
    ) -> None:
        """Back to the humans' inbox, with both versions in the flag's event: ``decided``
        (``{"human": …}`` or ``{"reconciler": …}``) and ``late``. A late success raises no
        ``both_ran`` here although a later attempt ran: which version of this execution is
        true is the person's to say first; the review that finds it succeeded flags
        ``both_ran`` (``_after_correction``), and until then the receipt of a later attempt
        that failed is said disputed by this flag (``receipts.in_doubt``)."""
        versions = {**decided, "late": late, "evidence_seq": seq}
        self._flag(conn, ex, Review.CONTRADICTED, versions, actor)

    def record_not_landed(self, execution_id: str, detail: dict[str, Any]) -> None:
        """A committed effect that cannot land (its target became a directory, or a path
        through a symlink): on record, and the call flagged for a human. Told once: a refusal
        told again (a crash after the flag left the bytes where they were, and the next settle
        refused them anew) names bytes a flag already names, waiting or reviewed, and records
        nothing more."""
        with self._write() as conn:
            # the call's row locked: two settles refusing it tell it once; and a flag raised
            # while a review of the call's other flag was on its way was numbered before the
            # review, which then settled it in the history (the review never saw it)
            ex = self._lock_call_of(conn, execution_id)
            if "kept" in detail:
                flags = fold_flags(self._flag_events(conn, ex.scope, ex.idempotency_key))
                if Flag(execution_id, Review.NOT_LANDED.value, detail["kept"]) in chain(*flags):
                    return
            seq = self._evidence(conn, execution_id, {"not_landed": detail}, "sandbox")
            flagged = {"effect": detail, "evidence_seq": seq}
            self._flag(conn, ex, Review.NOT_LANDED, flagged, "sandbox")

    def _lock_call_of(self, conn: sa.Connection, execution_id: str) -> ExecutionRecord:
        """The execution, read once its call's row is locked (every decision about a call
        takes that lock before it reads or numbers anything: its events follow the facts)."""
        ex = self._require_execution(conn, execution_id)
        self._locked_operation(conn, ex.scope, ex.idempotency_key)
        return self._require_execution(conn, execution_id)

    def _locked_operation(self, conn: sa.Connection, scope: str, key: str) -> OperationRecord:
        """The operation, its row locked until commit (a concurrent claim waits for us)."""
        row = conn.execute(sa.select(operations).where(op_key(scope, key)).with_for_update()).one()
        return OperationRecord.from_row(row)

    def _proof_beats_permission(
        self,
        conn: sa.Connection,
        op: OperationRecord,
        proven: ExecutionRecord,
        evidence: dict[str, Any],
        actor: str,
        flag_both_ran: bool,
    ) -> None:
        later = conn.execute(
            sa.select(executions).where(
                executions.c.scope == op.scope,
                executions.c.idempotency_key == op.idempotency_key,
                executions.c.attempt == op.authorized_attempts,
            )
        ).first()
        if later is not None:
            self._both_ran(conn, proven, later, evidence, actor, flag_both_ran)
            return
        if op.status is not Status.APPROVED:
            return
        # The authorised attempt was not claimed, but one between the proven attempt and it
        # may have been (attempts 1 and 2 unknown, 3 authorised, 1 proven): that one may have
        # taken effect too. Only the authorised attempt was looked at, and the withdrawal made
        # the call succeeded with nobody asked (a cold review).
        between = conn.execute(
            sa.select(executions)
            .where(
                executions.c.scope == op.scope,
                executions.c.idempotency_key == op.idempotency_key,
                executions.c.attempt > proven.attempt,
            )
            .order_by(executions.c.attempt.desc())
            .limit(1)
        ).first()
        if between is not None and flag_both_ran:
            # an idempotent tool's: the withdrawal below makes the call succeeded, which
            # hides nothing (its flag asked a human about nothing: a cold review)
            self._both_ran(conn, proven, between, evidence, actor, flag_both_ran)
        # and the unclaimed attempt is withdrawn all the same: proof beats permission
        self._withdraw(conn, op, Status.APPROVED, proven, evidence, actor)

    def _withdraw(
        self,
        conn: sa.Connection,
        op: OperationRecord,
        current: Status,
        proven: ExecutionRecord,
        evidence: dict[str, Any],
        actor: str,
    ) -> None:
        """The call made ``succeeded`` with ``proven``'s result, its current attempt (the
        call ``current``: an unclaimed ``approved`` one, or, at a review, a claimed one that
        ended ``failed``, said ``set_aside``) withdrawn: one compare-and-set on the call's row,
        its ``withdrawn`` event and the receipt's notification, in the caller's transaction."""
        check_transition(current, Status.SUCCEEDED)
        withdrawn = conn.execute(
            operations.update()
            .where(
                op_key(op.scope, op.idempotency_key),
                operations.c.status == current,
                operations.c.authorized_attempts == op.authorized_attempts,
            )
            .values(status=Status.SUCCEEDED, authorized_attempts=proven.attempt, enqueued_at=None)
            .returning(operations.c.scope)
        ).first()
        if withdrawn is None:
            return
        db.receipt_written(conn, op.scope, op.idempotency_key)
        detail: dict[str, Any] = {
            "attempt": op.authorized_attempts,
            "proven_attempt": proven.attempt,
            "status": Status.SUCCEEDED.value,
        }
        if current is Status.FAILED:  # a claimed attempt that failed, not an unclaimed one
            detail["set_aside"] = Status.FAILED.value
        detail["evidence"] = evidence
        ev = event(
            EventKind.WITHDRAWN, op.scope, op.idempotency_key, actor, detail, proven.execution_id
        )
        self._append(conn, ev)

    def _both_ran(
        self,
        conn: sa.Connection,
        proven: ExecutionRecord,
        claimed: sa.Row[Any],
        evidence: dict[str, Any],
        actor: str,
        flag_both_ran: bool,
    ) -> None:
        """An attempt after the proven one was claimed: a human must know, but for an
        idempotent tool's that ran to the same end (``flag_both_ran`` false)."""
        other = ExecutionRecord.from_row(claimed)
        if not flag_both_ran and other.status is Status.SUCCEEDED:
            return  # an idempotent tool ran twice to the same end: nothing to tell
        # else a human must know: a non-idempotent tool's two effects, or an idempotent
        # one's call whose own status (the later attempt's failed, unknown, or running
        # yet) would hide the effect this proof shows
        both = {
            "proven": {"execution_id": proven.execution_id, "attempt": proven.attempt},
            "later": {
                "execution_id": other.execution_id,
                "attempt": other.attempt,
                "status": other.status.value,
            },
            "evidence": evidence,
        }
        self._flag(conn, proven, Review.BOTH_RAN, both, actor)

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
        """A human's resolution of an unknown execution, or, with ``review``, their review of
        its flagged call (``review()``). ``review`` says the person saw the flag: a resolution
        decided on the unknown execution and sent after a flag was raised was taken as that
        flag's review, settled by someone who never saw it (a cold review: a contradicted
        call's blocked retry then ran, a second charge). Without it, an execution no longer
        unknown gets this same resolution's replay, or StaleFence saying what happened.
        ``seen``: the review's (``review()``)."""
        if status not in TERMINAL:
            raise InvalidTransition(Status.UNKNOWN, status, "a human resolution")
        check_text_id(execution_id, "execution_id", 64)
        check_text_id(by, "resolver", inputs.MAX_ACTOR)
        if not inputs.check_text(evidence, "evidence", 10_000) or not evidence.strip():
            raise InvalidArguments("evidence: must not be empty")
        result = {"status": status.value, "resolved_by": by, "evidence": evidence}
        try:
            return self.reconcile(
                execution_id,
                status,
                result,
                evidence={"kind": "human", "by": by, "text": evidence},
                actor=by,
            )
        except StaleFence:
            with self._read() as conn:
                current = self._require_execution(conn, execution_id)
                decider = self._human_decider(conn, current)
                flag = self._operation(conn, current.scope, current.idempotency_key).review
                call_id = conn.execute(
                    sa.select(tool_calls.c.tool_call_id)
                    .where(
                        tool_calls.c.scope == current.scope,
                        tool_calls.c.idempotency_key == current.idempotency_key,
                    )
                    .order_by(tool_calls.c.created_at, tool_calls.c.tool_call_id)
                    .limit(1)
                ).scalar()
            show = (
                f"toolledger show --scope {shlex.quote(current.scope)} "
                f"--tool-call-id {shlex.quote(call_id)}"
                if call_id is not None
                else "toolledger show"
            )
            said = current.result or {}
            if current.status is status and decider == by and said.get("evidence") == evidence:
                # this very resolution again (a script retried, a form sent twice): its
                # replay, never a review of a flag raised since, unseen (a cold review); a
                # review says something new. A flag waiting is said, not passed over.
                if flag is not None:
                    raise StaleFence(
                        execution_id,
                        f"execution {execution_id} is already resolved {status} by {by} "
                        f"with this evidence, and its call has been flagged {flag} since: "
                        f"look at it ({show}) and resolve again with --review saying what "
                        "you conclude (in the console, the flagged execution's form on the page "
                        "reloaded)",
                    ) from None
                return current
            if review:
                return self.review(execution_id, status, by=by, evidence=evidence, seen=seen)
            if flag is None or current.status not in TERMINAL:
                # review()'s own answer, without asking it to settle anything
                stale = _nothing_to_resolve(execution_id, current.status)
                raise StaleFence(execution_id, stale) from None
            if decider is not None:
                was = f"was resolved {current.status} by {decider}"
            elif current.reconciled:
                was = f"was settled {current.status} by a reconciler"
            else:
                was = f"is its executor's own {current.status}"
            raise StaleFence(
                execution_id,
                f"execution {execution_id} {was}, and its call has been flagged {flag} since: "
                f"look at it ({show}) and, to settle the flag, resolve again as its review "
                '(--review; the API\'s "review": true; in the console, the flagged '
                "execution's form on the page reloaded); nothing changed",
            ) from None

    def review(
        self,
        execution_id: str,
        status: Status,
        *,
        by: str,
        evidence: str,
        seen: int | None = None,
    ) -> ExecutionRecord:
        """A human settles a flagged call: confirms ``status`` or corrects a decision that a
        human or a reconciler made (an executor's own result is a fact and stands), and
        settles the flags raised on this execution; the call stays flagged for any raised on
        another (recorded as ``review_after``). A ``not_landed`` flag is about the effect, not
        the status: the executor's own status is confirmed (once the human landed the kept
        bytes by hand or chose to leave them; the sweep then removes them). A review that
        finds the execution succeeded while a later current attempt failed makes the call
        succeeded with it (``_proof_beats_failure``). StaleFence unless a flag waits on this
        execution and it is so decided.

        ``seen``: the ``seq`` of the call's newest event the reviewer looked at. A review
        settles every flag waiting on the execution, and one raised after the person looked
        (a late result's ``contradicted``, the ``both_ran`` another reviewer's correction
        raised) was settled by a decision that never saw it (a cold review): with ``seen``,
        StaleFence ("look again") if a flag it would settle was raised since, or the call's
        state changed since (a status, an attempt, another review). Without it, every flag
        waiting on the execution is settled, as before."""
        if status not in TERMINAL:
            raise InvalidTransition(None, status, "a review")
        if seen is not None and (type(seen) is not int or not 0 <= seen <= 2**62):
            raise InvalidArguments("seen: the seq of the newest event you looked at")
        check_text_id(by, "reviewer", 256)
        # free text, as a resolution's (a two-line note was refused here: a cold review)
        if not inputs.check_text(evidence, "evidence", 10_000) or not evidence.strip():
            raise InvalidArguments("evidence: must not be empty")
        with self._write() as conn:
            # the call's row first, then the execution read under it: read before, a correction
            # committed while this waited for the lock was not seen, and this review "confirmed"
            # a status the row no longer held and settled the flag that correction raised (a
            # cold review)
            ex = self._lock_call_of(conn, execution_id)
            op = self._locked_operation(conn, ex.scope, ex.idempotency_key)
            if op.review is None or ex.status not in TERMINAL:
                raise StaleFence(execution_id, _nothing_to_resolve(execution_id, ex.status))
            waiting, _ = fold_flags(self._flag_events(conn, ex.scope, ex.idempotency_key))
            mine = [f for f in waiting if f.execution_id == execution_id]
            not_landed = any(f.reason == Review.NOT_LANDED for f in mine)
            if not ex.reconciled and not (not_landed and status is ex.status):
                also = (
                    f" (its effect did not land: --as {ex.status} once you landed it by hand or "
                    "chose to leave it)"
                    if not_landed
                    else ""
                )
                raise StaleFence(
                    execution_id,
                    f"execution {execution_id} is its executor's own {ex.status}: that stands; "
                    f"a review corrects only what a human or a reconciler decided{also}",
                )
            if not mine:
                flagged = ", ".join(sorted({f"{f.reason} on {f.execution_id}" for f in waiting}))
                raise StaleFence(
                    execution_id,
                    f"execution {execution_id} is not the one its call is flagged for "
                    f"({flagged or op.review}): review that one",
                )
            if seen is not None:
                self._unchanged_since(conn, ex, seen)
            self._later_ended(conn, ex)  # any review, confirming or correcting, to any status
            proof = (
                self._correct(conn, ex, status, by, evidence) if status is not ex.status else None
            )
            # what else the call is flagged for, raised on other executions, still waits
            left = [f for f in waiting if f.execution_id != execution_id]
            after = left[0].reason if left else None
            conn.execute(
                operations.update().where(op_key(ex.scope, ex.idempotency_key)).values(review=after)
            )
            detail = {
                "reason": mine[0].reason,
                "status": status.value,
                "by": by,
                "text": evidence,
                "review_after": after,
            }
            self._append(
                conn,
                event(EventKind.REVIEWED, ex.scope, ex.idempotency_key, by, detail, execution_id),
            )
            if proof is not None:  # after the review: a flag it raises is not settled by it
                self._after_correction(conn, ex, status, proof, by)
            if status is Status.SUCCEEDED:
                decided = {"kind": "human", "by": by, "text": evidence, "review": True}
                if proof is None:  # a confirmation is proof as a correction is: it beats
                    # a later attempt's permission (attempt 3 authorised on the flagged call
                    # stayed approved once the review confirmed attempt 1: a second charge)
                    self._confirmation_beats_permission(conn, ex, decided, by)
                self._proof_beats_failure(conn, ex, decided, by)
            return self._require_execution(conn, execution_id)

    def _confirmation_beats_permission(
        self, conn: sa.Connection, ex: ExecutionRecord, decided: dict[str, Any], by: str
    ) -> None:
        """A review confirming ``ex`` succeeded while a later attempt is authorised and not
        claimed: that attempt is withdrawn, the call ``succeeded`` with ``ex``'s result (proof
        beats permission, DESIGN §2 #11), as the proof that first said so would have done."""
        op = self._locked_operation(conn, ex.scope, ex.idempotency_key)
        if op.status is not Status.APPROVED or op.authorized_attempts <= ex.attempt:
            return
        claimed = conn.execute(
            sa.select(executions.c.execution_id).where(
                executions.c.scope == ex.scope,
                executions.c.idempotency_key == ex.idempotency_key,
                executions.c.attempt == op.authorized_attempts,
            )
        ).first()
        if claimed is None:
            self._withdraw(conn, op, Status.APPROVED, ex, decided, by)

    @staticmethod
    def _unchanged_since(conn: sa.Connection, ex: ExecutionRecord, seen: int) -> None:
        """StaleFence if, after the event ``seen``, a flag was raised on ``ex`` (one this
        review would settle) or the call's state changed: the review was decided on a page
        that no longer says how the call stands. A ``seen`` past the call's newest event is
        no seq a page showed (a count, a typo, 2**62): it guarded nothing, every later flag
        passing unseen, and is refused (a cold review of the HTTP surface)."""
        newest = conn.execute(
            sa.select(sa.func.max(execution_events.c.seq)).where(
                execution_events.c.scope == ex.scope,
                execution_events.c.idempotency_key == ex.idempotency_key,
            )
        ).scalar()
        if newest is None or seen > newest:
            raise InvalidArguments(
                f"seen {seen} is past the call's newest event ({newest}): give the seq of the "
                "newest event you looked at (show's last_seq); nothing changed"
            )
        since = conn.execute(
            sa.select(
                execution_events.c.seq,
                execution_events.c.kind,
                execution_events.c.execution_id,
                execution_events.c.detail,
            )
            .where(
                execution_events.c.scope == ex.scope,
                execution_events.c.idempotency_key == ex.idempotency_key,
                execution_events.c.seq > seen,
                execution_events.c.kind.in_(CHANGES),
            )
            .order_by(execution_events.c.seq)
        ).all()
        for row in since:
            if row.kind == EventKind.FLAGGED and row.execution_id != ex.execution_id:
                continue  # a flag on another execution: this review does not settle it
            if row.kind == EventKind.FLAGGED:
                what = f"it was flagged {(row.detail or {}).get('reason')} since (event {row.seq})"
            else:
                what = f"the call changed since ({row.kind}, event {row.seq})"
            raise StaleFence(
                ex.execution_id,
                f"a review of {ex.execution_id} decided on the call as of event {seen}: {what}; "
                "look again (show, events) and review what it says now; nothing changed",
            )

    @staticmethod
    def _later_ended(conn: sa.Connection, ex: ExecutionRecord) -> None:
        """StaleFence while a later attempt of ``ex``'s call has not ended (running or
        unknown): how it ends decides which receipt is the call's, so every review of ``ex``
        waits for it, confirming or correcting, to either status. A review confirming attempt
        1 succeeded while attempt 2 still ran settled the flag (``both_ran``); attempt 2 then
        failed, and the call was ``failed`` with no flag left to say attempt 1 had charged;
        and a review correcting attempt 1 to failed, made current again by a withdrawal while
        attempt 2 was unknown, left the call ``failed`` at attempt 1, attempt 2 unknown in no
        list and no inbox (cold reviews). Resolving the later attempt is never refused for
        this (``resolve`` of an unknown execution asks no review), nor is a running one's end:
        the refusal says which to wait for."""
        later = conn.execute(
            sa.select(executions.c.execution_id, executions.c.attempt, executions.c.status)
            .where(
                executions.c.scope == ex.scope,
                executions.c.idempotency_key == ex.idempotency_key,
                executions.c.attempt > ex.attempt,
                executions.c.status.in_([Status.RUNNING, Status.UNKNOWN]),
            )
            .order_by(executions.c.attempt)
            .limit(1)
        ).first()
        if later is None:
            return
        what = (
            "resolve it, then review this one"
            if later.status == Status.UNKNOWN
            else "review this one once it has ended"
        )
        raise StaleFence(
            ex.execution_id,
            f"attempt {later.attempt} ({later.execution_id}) is {Status(later.status)}: {what}; "
            "how it ends decides which receipt is the call's; nothing changed",
        )

    @staticmethod
    def _flag_events(
        conn: sa.Connection, scope: str, key: str
    ) -> list[tuple[str, str, dict[str, Any]]]:
        """A call's flagged and reviewed events, in seq order (for ``fold_flags``)."""
        return flag_events(conn, scope, key)

    def _correct(
        self, conn: sa.Connection, ex: ExecutionRecord, status: Status, by: str, evidence: str
    ) -> dict[str, Any]:
        check_transition(ex.status, status)
        result: dict[str, Any] = {"status": status.value, "resolved_by": by, "evidence": evidence}
        result["corrects"] = ex.result
        changed = conn.execute(
            executions.update()
            .where(executions.c.execution_id == ex.execution_id, executions.c.status == ex.status)
            .values(status=status, result=result, finished_at=db_now())
            .returning(executions.c.execution_id)
        ).first()
        if changed is None:
            raise StaleFence(ex.execution_id)
        self._move_operation(conn, ex.scope, ex.idempotency_key, ex.attempt, ex.status, status)
        proof = {"kind": "human", "by": by, "text": evidence, "review": True}
        detail = {"result": result, "reconciled": True, "evidence": proof}
        self._append(conn, event(status, ex.scope, ex.idempotency_key, by, detail, ex.execution_id))
        return proof

    def _after_correction(
        self,
        conn: sa.Connection,
        ex: ExecutionRecord,
        status: Status,
        proof: dict[str, Any],
        by: str,
    ) -> None:
        """A correction to succeeded is proof: it beats a later attempt's permission, or
        flags that both ran."""
        op = self._locked_operation(conn, ex.scope, ex.idempotency_key)
        if status is Status.SUCCEEDED and op.authorized_attempts > ex.attempt:
            corrected = self._require_execution(conn, ex.execution_id)
            self._proof_beats_permission(conn, op, corrected, proof, by, True)

    def _proof_beats_failure(
        self, conn: sa.Connection, ex: ExecutionRecord, evidence: dict[str, Any], by: str
    ) -> None:
        """A review that finds ``ex`` succeeded (confirms a late result's proof, or corrects a
        decision) while the call's current attempt, a later one, ended ``failed``: the call is
        ``succeeded`` with ``ex``'s result, the failed attempt set aside (a ``withdrawn``
        event naming it, as an unclaimed attempt is withdrawn by proof). The action took
        effect; a receipt that says it failed invites the model to do it again. The call
        stayed ``failed`` for good after a reviewer confirmed attempt 1 had charged (a cold
        review). Only at a review: the later attempt's own ``failed`` is a fact, and both
        ran (``both_ran``): a person says which receipt is the call's."""
        op = self._locked_operation(conn, ex.scope, ex.idempotency_key)
        if op.status is not Status.FAILED or op.authorized_attempts <= ex.attempt:
            return
        self._withdraw(conn, op, Status.FAILED, ex, evidence, by)


#: The events that change what a review decides on: a flag, a status, an attempt, a review.
CHANGES = tuple(
    k.value
    for k in (
        EventKind.FLAGGED,
        EventKind.APPROVED,
        EventKind.REJECTED,
        EventKind.RUNNING,
        EventKind.SUCCEEDED,
        EventKind.FAILED,
        EventKind.UNKNOWN,
        EventKind.WITHDRAWN,
        EventKind.REVIEWED,
    )
)


def _nothing_to_resolve(execution_id: str, status: Status) -> str:
    """What a resolution or a review of an execution no longer unknown, on a call not
    flagged, is told (one text for both: resolve answers it without calling review)."""
    return (
        f"execution {execution_id} is {status}, not unknown, and its call is not flagged for "
        "review: nothing to resolve"
    )
