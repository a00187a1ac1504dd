"""The schema: SQLAlchemy 2.x typed models. Alembic migrations mirror them exactly.

operations       one row per logical action (scope, idempotency_key): what, approval, status
tool_calls       each tool_call_id the model gave -> the action it names
executions       one row per real attempt; inserting (scope, key, attempt) IS the claim
execution_events the append-only history; current state can be rebuilt from it alone
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar, cast

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from toolledger.ledger.transitions import EXECUTION_STATUSES, EventKind, Status
from toolledger.ledger.types import JSONType, UTCDateTime

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _in(column: str, values: Iterable[StrEnum]) -> str:
    names = sorted(v.value for v in values)
    return f"{column} IN ({', '.join(repr(n) for n in names)})"


def _partial(name: str, *columns: str, where: str) -> sa.Index:
    """A partial index, the same on both dialects: the sweep's cost follows its rows."""
    clause = sa.text(where)
    return sa.Index(name, *columns, postgresql_where=clause, sqlite_where=clause)


WAITING = (Status.PENDING_APPROVAL, Status.RUNNING, Status.UNKNOWN)


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSONType,
        list[dict[str, Any]]: JSONType,
    }


class Operation(Base):
    """A logical action that must take effect at most once."""

    __tablename__ = "operations"

    scope: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(sa.String(512), primary_key=True)
    tool: Mapped[str] = mapped_column(sa.String(64))
    args: Mapped[dict[str, Any]]
    args_sha256: Mapped[str] = mapped_column(sa.String(64))
    # The status of the latest authorised attempt (or of the approval): the hot queries'
    # partial indexes are on it, so it moves in the same transaction as its execution.
    status: Mapped[str] = mapped_column(sa.String(16))
    authorized_attempts: Mapped[int] = mapped_column(sa.Integer)
    decided_by: Mapped[str | None] = mapped_column(sa.String(256))
    decided_at: Mapped[datetime | None]
    reason: Mapped[str | None] = mapped_column(sa.Text)
    created_at: Mapped[datetime]
    # Outbox: when a message for the authorised attempt was last published; NULL = never.
    enqueued_at: Mapped[datetime | None]
    # Why the call waits for a human although it has a status (ledger.transitions.Review).
    review: Mapped[str | None] = mapped_column(sa.String(32))

    __table_args__ = (
        sa.CheckConstraint(_in("status", Status), name="status"),
        sa.CheckConstraint("authorized_attempts >= 0", name="authorized_attempts"),
        _partial("ix_operations_approved_unclaimed", "enqueued_at", where="status = 'approved'"),
        # What waits on someone (a human, a worker, evidence); approved has its own index.
        _partial("ix_operations_waiting", "status", "scope", where=_in("status", WAITING)),
        _partial("ix_operations_review", "scope", where="review IS NOT NULL"),
    )


class ToolCall(Base):
    """A tool_call_id the model gave, bound to the action it asks for."""

    __tablename__ = "tool_calls"

    scope: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    tool_call_id: Mapped[str] = mapped_column(sa.String(256), primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(sa.String(512))
    args_sha256: Mapped[str] = mapped_column(sa.String(64))
    created_at: Mapped[datetime]

    __table_args__ = (
        sa.ForeignKeyConstraint(
            ["scope", "idempotency_key"],
            ["operations.scope", "operations.idempotency_key"],
            name="fk_tool_calls_operation",
        ),
        sa.Index("ix_tool_calls_operation", "scope", "idempotency_key"),
    )


class Execution(Base):
    """One real attempt. Its unique (scope, idempotency_key, attempt) is the claim."""

    __tablename__ = "executions"

    execution_id: Mapped[str] = mapped_column(sa.String(36), primary_key=True)
    scope: Mapped[str] = mapped_column(sa.String(128))
    idempotency_key: Mapped[str] = mapped_column(sa.String(512))
    attempt: Mapped[int] = mapped_column(sa.Integer)
    status: Mapped[str] = mapped_column(sa.String(16))
    worker_id: Mapped[str | None] = mapped_column(sa.String(256))
    lease_token: Mapped[str | None] = mapped_column(sa.String(32))
    lease_expires_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    result: Mapped[dict[str, Any] | None]
    reconciled: Mapped[bool] = mapped_column(sa.Boolean)
    error: Mapped[str | None] = mapped_column(sa.Text)
    # Ran under the staged-effect protocol: its sandbox effects land only after its own
    # terminal commit, so a revoked execution provably left none (older rows: false).
    fenced: Mapped[bool] = mapped_column(sa.Boolean, server_default=sa.false())
    # The sandbox effects its own commit made official: [{n, kind, path, size, sha256}].
    effects: Mapped[list[dict[str, Any]] | None]

    __table_args__ = (
        sa.UniqueConstraint("scope", "idempotency_key", "attempt", name="uq_executions_attempt"),
        sa.ForeignKeyConstraint(
            ["scope", "idempotency_key"],
            ["operations.scope", "operations.idempotency_key"],
            name="fk_executions_operation",
        ),
        sa.CheckConstraint(_in("status", EXECUTION_STATUSES), name="status"),
        sa.CheckConstraint("attempt >= 1", name="attempt"),
        # Invariant 2: succeeded/failed without a result never exists, and nothing else has one.
        sa.CheckConstraint(
            "(status IN ('failed', 'succeeded')) = (result IS NOT NULL)",
            name="terminal_has_result",
        ),
        _partial("ix_executions_running_lease", "lease_expires_at", where="status = 'running'"),
        _partial("ix_executions_unknown", "scope", "idempotency_key", where="status = 'unknown'"),
    )


class ExecutionEvent(Base):
    """One entry of the append-only history (a trigger refuses UPDATE and DELETE)."""

    __tablename__ = "execution_events"

    seq: Mapped[int] = mapped_column(
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True
    )
    scope: Mapped[str] = mapped_column(sa.String(128))
    idempotency_key: Mapped[str] = mapped_column(sa.String(512))
    execution_id: Mapped[str | None] = mapped_column(sa.String(36))
    kind: Mapped[str] = mapped_column(sa.String(24))
    actor: Mapped[str] = mapped_column(sa.String(256))
    at: Mapped[datetime]
    detail: Mapped[dict[str, Any]]

    __table_args__ = (
        sa.CheckConstraint(_in("kind", EventKind), name="kind"),
        sa.Index("ix_execution_events_operation", "scope", "idempotency_key", "seq"),
    )


operations = cast(sa.Table, Operation.__table__)
tool_calls = cast(sa.Table, ToolCall.__table__)
executions = cast(sa.Table, Execution.__table__)
execution_events = cast(sa.Table, ExecutionEvent.__table__)
