"""The schema: SQLAlchemy Core tables. Alembic migrations mirror them exactly.

operations       one row per logical action (scope, idempotency_key): what, approval, status
tool_calls       each tool_call_id the model gave -> the action it names
executions       one row per real attempt; inserting (scope, key, attempt) IS the claim
execution_events the append-only history; current state can be rebuilt from it alone
ended_sessions   console sessions logged out before their cookie expired (not the ledger's
                 state: the server's, kept where all its processes read)

Core, not the ORM: nothing maps rows to objects (records.py builds frozen dataclasses from
rows), and ``sqlalchemy.orm`` would add a third to every command's start.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any

import sqlalchemy as sa

from toolledger.ledger.transitions import EXECUTION_STATUSES, EventKind, Status
from toolledger.ledger.types import JSONType, UTCDateTime

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class Base:
    """``Base.metadata``: what Alembic's env and the migration test compare with."""

    metadata = metadata


def _in(column: str, values: Iterable[StrEnum]) -> str:
    names = sorted(v.value for v in values)
    return f"{column} IN ({', '.join(repr(n) for n in names)})"


def _partial(name: str, *columns: str, where: str) -> sa.Index:
    """A partial index, the same on both dialects: the sweep's cost follows its rows."""
    clause = sa.text(where)
    return sa.Index(name, *columns, postgresql_where=clause, sqlite_where=clause)


def _column(name: str, type_: Any, *, null: bool = False, **kw: Any) -> sa.Column[Any]:
    """A column, NOT NULL unless ``null``: the models' ``Mapped[X]`` / ``Mapped[X | None]``."""
    return sa.Column(name, type_, nullable=null, **kw)


def _when(name: str, *, null: bool = False) -> sa.Column[Any]:
    """A timezone-aware UTC timestamp column (types.UTCDateTime)."""
    return _column(name, UTCDateTime(), null=null)


WAITING = (Status.PENDING_APPROVAL, Status.RUNNING, Status.UNKNOWN)

#: A logical action that must take effect at most once.
operations = sa.Table(
    "operations",
    metadata,
    _column("scope", sa.String(128), primary_key=True),
    _column("idempotency_key", sa.String(512), primary_key=True),
    # mcp. and the 1 to 128 characters of an upstream's name (migration 0006). SQLite holds any
    # length whatever a column declares: its declaration stays as 0001 made it (no rebuild).
    _column("tool", sa.String(132).with_variant(sa.String(64), "sqlite")),
    _column("args", JSONType),
    _column("args_sha256", sa.String(64)),
    # The status of the latest authorised attempt (or of the approval): the hot queries'
    # partial indexes are on it, so it moves in the same transaction as its execution.
    _column("status", sa.String(16)),
    _column("authorized_attempts", sa.Integer()),
    _column("decided_by", sa.String(256), null=True),
    _when("decided_at", null=True),
    _column("reason", sa.Text(), null=True),
    _when("created_at"),
    # Outbox: when a message for the authorised attempt was last published; NULL = never.
    _when("enqueued_at", null=True),
    # Why the call waits for a human although it has a status (ledger.transitions.Review).
    _column("review", sa.String(32), null=True),
    sa.CheckConstraint(_in("status", Status), name="status"),
    sa.CheckConstraint("authorized_attempts >= 0", name="authorized_attempts"),
    _partial("ix_operations_approved_unclaimed", "enqueued_at", where="status = 'approved'"),
    # What waits on someone (a human, a worker, evidence); approved has its own index.
    _partial("ix_operations_waiting", "status", "scope", where=_in("status", WAITING)),
    _partial("ix_operations_review", "scope", where="review IS NOT NULL"),
    # What waits on a person, oldest first: the inbox's order (migration 0004).
    _partial(
        "ix_operations_attention",
        "status",
        "created_at",
        where=_in("status", (Status.PENDING_APPROVAL, Status.UNKNOWN)),
    ),
)

#: A tool_call_id the model gave, bound to the action it asks for.
tool_calls = sa.Table(
    "tool_calls",
    metadata,
    _column("scope", sa.String(128), primary_key=True),
    _column("tool_call_id", sa.String(256), primary_key=True),
    _column("idempotency_key", sa.String(512)),
    _column("args_sha256", sa.String(64)),
    _when("created_at"),
    sa.ForeignKeyConstraint(
        ["scope", "idempotency_key"],
        ["operations.scope", "operations.idempotency_key"],
        name="fk_tool_calls_operation",
    ),
    sa.Index("ix_tool_calls_operation", "scope", "idempotency_key"),
)

#: One real attempt. Its unique (scope, idempotency_key, attempt) is the claim.
executions = sa.Table(
    "executions",
    metadata,
    _column("execution_id", sa.String(36), primary_key=True),
    _column("scope", sa.String(128)),
    _column("idempotency_key", sa.String(512)),
    _column("attempt", sa.Integer()),
    _column("status", sa.String(16)),
    _column("worker_id", sa.String(256), null=True),
    _column("lease_token", sa.String(32), null=True),
    _when("lease_expires_at", null=True),
    _when("heartbeat_at", null=True),
    _when("started_at"),
    _when("finished_at", null=True),
    _column("result", JSONType, null=True),
    _column("reconciled", sa.Boolean()),
    _column("error", sa.Text(), null=True),
    # Ran under the staged-effect protocol: its sandbox effects land only after its own
    # terminal commit, so a revoked execution provably left none (older rows: false).
    _column("fenced", sa.Boolean(), server_default=sa.false()),
    # The sandbox effects its own commit made official: [{n, kind, path, size, sha256}].
    _column("effects", JSONType, null=True),
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

#: One entry of the append-only history (a trigger refuses UPDATE and DELETE).
execution_events = sa.Table(
    "execution_events",
    metadata,
    _column(
        "seq",
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    _column("scope", sa.String(128)),
    _column("idempotency_key", sa.String(512)),
    _column("execution_id", sa.String(36), null=True),
    _column("kind", sa.String(24)),
    _column("actor", sa.String(256)),
    _when("at"),
    _column("detail", JSONType),
    sa.CheckConstraint(_in("kind", EventKind), name="kind"),
    sa.Index("ix_execution_events_operation", "scope", "idempotency_key", "seq"),
)

#: A console session logged out before its cookie expired: refused from then on, in every
#: server process. A row outlives its cookie by nothing; logouts prune the expired ones.
ended_sessions = sa.Table(
    "ended_sessions",
    metadata,
    _column("session_id", sa.String(32), primary_key=True),
    _column("token", sa.String(256)),
    _when("ended_at"),
    _when("expires_at"),
    sa.Index("ix_ended_sessions_expires_at", "expires_at"),
)
