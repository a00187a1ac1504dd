"""What every part of the Ledger facade shares: transactions, inserts, events."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from ledger import db
from ledger.models import execution_events, operations
from ledger.reads import LedgerReads, op_key
from ledger.transitions import EventKind, Status
from ledger.types import db_now

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

    @contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        with db.write_transaction(self.engine) as conn:
            yield conn

    def _insert(self, table: sa.Table) -> Any:
        dialect = postgresql if self.dialect == "postgresql" else sqlite
        return dialect.insert(table)

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
        return moved is not None
