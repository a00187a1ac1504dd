"""The executor's path through the ledger: claim, renew, finish, and late results.

Each write is a compare-and-set. The claim is an ``INSERT … ON CONFLICT DO NOTHING
RETURNING`` on the unique (scope, idempotency_key, attempt), taken while the operation row
is locked (``FOR UPDATE`` on Postgres; SQLite's BEGIN IMMEDIATE serialises every writer), so
that a withdrawal of the attempt and its claim can never both happen. The claim's and the
terminal write's statements are the store's (``ledger.store``); this module checks their
inputs and builds their events' details.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from toolledger.ledger import metrics
from toolledger.ledger.base import LedgerBase
from toolledger.ledger.errors import InvalidArguments, InvalidTransition
from toolledger.ledger.identity import check_attempt, new_execution_id, new_lease_token
from toolledger.ledger.models import execution_events, executions, operations
from toolledger.ledger.records import Claim, EffectState, Finished
from toolledger.ledger.transitions import TERMINAL, EventKind, Review, Status, fold_flags
from toolledger.ledger.types import db_now, db_now_plus

#: How long a claim holds before it must be renewed; renewed every LEASE_SECONDS / 3.
LEASE_SECONDS = 30.0


class LedgerExecution(LedgerBase):
    def claim(
        self,
        scope: str,
        key: str,
        attempt: int,
        *,
        worker_id: str,
        lease_seconds: float = LEASE_SECONDS,
        execution_id: str | None = None,
        lease_token: str | None = None,
    ) -> Claim | None:
        """Win the right to run ``attempt``, or None: not approved, not authorised, or lost.

        ``running`` and its event are committed before this returns (invariant 1): a crash
        after it leaves evidence that the effect may have started. A caller that picks the
        ``execution_id`` and ``lease_token`` itself can, after an error around the commit,
        find out with ``claimed()`` whether the claim is its own.
        """
        # a forged attempt is refused here, not retried as a database error; 0 (nothing
        # authorised yet) is a claim that simply loses
        check_attempt(attempt, minimum=0)
        execution_id = execution_id or new_execution_id()
        token = lease_token or new_lease_token()
        detail = {
            "attempt": attempt,
            "worker_id": worker_id,
            "fenced": True,
        }  # both stores write it
        claim = self.store.claim(
            scope, key, attempt, worker_id, lease_seconds, execution_id, token, detail
        )
        if claim is not None:
            metrics.transition(claim.tool, Status.RUNNING)
        return claim

    def claimed(self, execution_id: str, lease_token: str) -> Claim | None:
        """The claim ``execution_id`` if it exists under ``lease_token`` (after an ambiguous
        commit: the server may have committed what the client saw fail)."""
        with self._read() as conn:
            row = conn.execute(
                sa.select(executions, operations.c.tool, operations.c.args)
                .join(
                    operations,
                    sa.and_(
                        operations.c.scope == executions.c.scope,
                        operations.c.idempotency_key == executions.c.idempotency_key,
                    ),
                )
                .where(
                    executions.c.execution_id == execution_id,
                    executions.c.lease_token == lease_token,
                )
            ).first()
        if row is None:
            return None
        return Claim(
            execution_id=execution_id,
            scope=row.scope,
            idempotency_key=row.idempotency_key,
            attempt=row.attempt,
            lease_token=lease_token,
            lease_expires_at=row.lease_expires_at,
            worker_id=row.worker_id,
            tool=row.tool,
            args=row.args,
        )

    def renew_lease(
        self, execution_id: str, lease_token: str, lease_seconds: float = LEASE_SECONDS
    ) -> bool:
        """Extend the lease by the database clock; False when the row is no longer ours."""
        with self._write() as conn:
            renewed = conn.execute(
                executions.update()
                .where(
                    executions.c.execution_id == execution_id,
                    executions.c.status == Status.RUNNING,
                    executions.c.lease_token == lease_token,
                )
                .values(lease_expires_at=db_now_plus(lease_seconds), heartbeat_at=db_now())
                .returning(executions.c.execution_id)
            ).first()
        return renewed is not None

    def renew_leases(
        self, held: list[tuple[str, str]], lease_seconds: float = LEASE_SECONDS
    ) -> set[str]:
        """``renew_lease`` for every (execution_id, lease_token) of ``held`` in one statement:
        a process's lease keeper renews all its claims at once, so a slow database costs a
        round one statement, not one per thread. The ids whose rows were still ours."""
        if not held:
            return set()
        ours = sa.or_(
            *(
                sa.and_(executions.c.execution_id == eid, executions.c.lease_token == token)
                for eid, token in held
            )
        )
        with self._write() as conn:
            rows = conn.execute(
                executions.update()
                .where(ours, executions.c.status == Status.RUNNING)
                .values(lease_expires_at=db_now_plus(lease_seconds), heartbeat_at=db_now())
                .returning(executions.c.execution_id)
            ).all()
        return {row.execution_id for row in rows}

    def finish(
        self,
        execution_id: str,
        lease_token: str,
        status: Status,
        result: dict[str, Any],
        *,
        error: str | None = None,
        effects: list[dict[str, Any]] | None = None,
        lock_keys: list[int] | None = None,
    ) -> Finished:
        """running -> succeeded/failed with its result, one transaction (invariant 2).

        ``effects``: the sandbox effects this commit makes official (published after it, in
        the order of the returned ``seq``). ``lock_keys``: one per path they touch; the
        commit takes them (Postgres advisory locks, to its end) before its event draws its
        ``seq``, so two commits on one path get their seqs in the order they commit — the
        order their bytes land in. (SQLite serialises every commit anyway.)

        Raises StaleFence when the row is no longer running under this token: the execution
        was revoked, its effects must never land, and the caller records its result as
        evidence instead.
        """
        if status not in TERMINAL:
            raise InvalidTransition(Status.RUNNING, status, "a terminal write")
        if not isinstance(result, dict):
            raise InvalidArguments("a result must be a JSON object")
        if status is not Status.SUCCEEDED:
            effects = None  # a failed execution's staged effects are discarded, never published
        keys = sorted(set(lock_keys or ())) if effects else []
        detail: dict[str, Any] = {"result": result, "error": error, "reconciled": False}
        if effects is not None:
            detail["effects"] = effects
        return self.store.finish(
            execution_id, lease_token, status, result, error, effects, keys, detail
        )

    def record_evidence(self, execution_id: str, detail: dict[str, Any], *, actor: str) -> int:
        """Append a fact about an execution that changes no state (e.g. a late result)."""
        with self._write() as conn:
            return self._evidence(conn, execution_id, detail, actor)

    def reviewed_not_landed(self, execution_ids: list[str]) -> set[str]:
        """Where the bytes of these executions' effects that could not land are kept (as the
        flags recorded them, relative to the sandbox), once a human has reviewed each: those
        may go. Bytes set aside with no flag recorded are never among them."""
        if not execution_ids:
            return set()
        with self._read() as conn:
            calls = conn.execute(
                sa.select(executions.c.scope, executions.c.idempotency_key)
                .where(executions.c.execution_id.in_(execution_ids))
                .distinct()
            ).all()
            pair = sa.tuple_(execution_events.c.scope, execution_events.c.idempotency_key)
            rows = (
                conn.execute(
                    sa.select(
                        execution_events.c.scope,
                        execution_events.c.idempotency_key,
                        execution_events.c.kind,
                        execution_events.c.execution_id,
                        execution_events.c.detail,
                    )
                    .where(
                        pair.in_(sorted((c.scope, c.idempotency_key) for c in calls)),
                        execution_events.c.kind.in_([EventKind.FLAGGED, EventKind.REVIEWED]),
                    )
                    .order_by(execution_events.c.seq)
                ).all()
                if calls
                else []
            )
        per_call: dict[tuple[str, str], list[tuple[str, str, dict[str, Any]]]] = {}
        for r in rows:
            per_call.setdefault((r.scope, r.idempotency_key), []).append(
                (r.kind, r.execution_id, r.detail)
            )
        wanted = set(execution_ids)
        return {
            f.kept
            for events in per_call.values()
            for f in fold_flags(events)[1]
            if f.reason == Review.NOT_LANDED and f.kept and f.execution_id in wanted
        }

    def effect_states(self, execution_ids: list[str]) -> dict[str, EffectState]:
        """What the ledger says about executions whose staged effects wait in a sandbox: one
        query for the rows, one for the sequence numbers of their own successes."""
        if not execution_ids:
            return {}
        with self._read() as conn:
            rows = conn.execute(
                sa.select(executions).where(executions.c.execution_id.in_(execution_ids))
            ).all()
            done = [r for r in rows if r.status == Status.SUCCEEDED and not r.reconciled]
            seqs: dict[str, int] = {}
            if done:
                pair = sa.tuple_(execution_events.c.scope, execution_events.c.idempotency_key)
                seqs = dict(
                    conn.execute(
                        sa.select(
                            execution_events.c.execution_id, sa.func.min(execution_events.c.seq)
                        )
                        .where(
                            pair.in_(sorted({(r.scope, r.idempotency_key) for r in done})),
                            execution_events.c.execution_id.in_([r.execution_id for r in done]),
                            execution_events.c.kind == EventKind.SUCCEEDED,
                        )
                        .group_by(execution_events.c.execution_id)
                    ).all()
                )
        return {
            r.execution_id: EffectState(
                execution_id=r.execution_id,
                scope=r.scope,
                idempotency_key=r.idempotency_key,
                attempt=r.attempt,
                status=Status(r.status),
                reconciled=r.reconciled,
                lease_token=r.lease_token,
                effects=tuple(r.effects or ()),
                seq=int(seqs.get(r.execution_id, 0)),
            )
            for r in rows
        }
