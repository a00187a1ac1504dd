"""The outbox: when a job's message was last published, and what is due to publish again."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from toolledger.ledger.base import LedgerBase
from toolledger.ledger.identity import PROXIED_PREFIX
from toolledger.ledger.models import operations
from toolledger.ledger.reads import op_key
from toolledger.ledger.transitions import Status
from toolledger.ledger.types import db_now, db_now_plus, in_batch, materialized


class LedgerOutbox(LedgerBase):
    def mark_enqueued(self, scope: str, key: str, attempt: int) -> bool:
        """Record that a message for ``attempt`` was published (after it was)."""
        with self._write() as conn:
            row = conn.execute(
                operations.update()
                .where(
                    op_key(scope, key),
                    operations.c.status == Status.APPROVED,
                    operations.c.authorized_attempts == attempt,
                )
                .values(enqueued_at=db_now())
                .returning(operations.c.scope)
            ).first()
        return row is not None

    def clear_enqueued(self, scope: str, key: str, attempt: int) -> None:
        """The publish stamped at commit failed: leave it visibly unpublished."""
        self.clear_enqueued_all([(scope, key, attempt)])

    def clear_enqueued_all(self, jobs: Sequence[tuple[str, str, int]]) -> None:
        """``clear_enqueued`` for each ``(scope, key, attempt)``, in one transaction (what a
        sweep stamped and could not publish: due again at the next pass)."""
        with self._write() as conn:
            for scope, key, attempt in jobs:
                conn.execute(
                    operations.update()
                    .where(
                        op_key(scope, key),
                        operations.c.status == Status.APPROVED,
                        operations.c.authorized_attempts == attempt,
                    )
                    .values(enqueued_at=None)
                )

    def take_due_for_enqueue(
        self, *, older_than_seconds: float, limit: int = 1000
    ) -> list[tuple[str, str, int]]:
        """Approved, unclaimed work whose last publication is older than the threshold (or
        never happened). Stamps each as enqueued now, so concurrent sweeps take it once."""
        deadline = db_now_plus(-older_than_seconds)
        last = sa.func.coalesce(operations.c.enqueued_at, operations.c.decided_at)
        not_flagged = operations.c.review.is_(None)
        # an upstream's tool recorded by the MCP proxy is sent by a proxy (the next one asked
        # for the call): no worker runs it, and one handed it failed it "unknown tool"
        not_proxied = operations.c.tool.not_like(f"{PROXIED_PREFIX}%")
        due = (
            sa.select(operations.c.scope, operations.c.idempotency_key)
            # a flagged call's next attempt cannot be claimed until a human has reviewed it:
            # published every requeue_after before, each refused by the claim; once reviewed
            # (flag cleared) it is due at the next pass
            .where(operations.c.status == Status.APPROVED, last < deadline, not_flagged)
            .where(not_proxied)
            # due longest first: a call never published (no stamp) before one published long
            # ago, and what this pass stamped last. By enqueued_at alone, Postgres put the
            # never published after the rest (NULLS LAST), and a pass under a threshold
            # shorter than itself never reached them (sweep --requeue-after 0)
            .order_by(last, operations.c.scope, operations.c.idempotency_key)
            .limit(limit)
            .with_for_update(skip_locked=True)
            .cte("due")
        )
        due = materialized(due)
        key = (operations.c.scope, operations.c.idempotency_key)
        with self._write() as conn:
            rows = conn.execute(
                operations.update()
                .add_cte(due)
                .where(
                    in_batch(self.engine.dialect.name, key, due),
                    operations.c.status == Status.APPROVED,
                    last < deadline,
                    not_flagged,
                    not_proxied,
                )
                .values(enqueued_at=db_now())
                .returning(
                    operations.c.scope,
                    operations.c.idempotency_key,
                    operations.c.authorized_attempts,
                )
            ).all()
        return [(r.scope, r.idempotency_key, r.authorized_attempts) for r in rows]
