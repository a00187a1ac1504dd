"""The ledger: operations, tool calls, executions and the append-only event history.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

from toolledger.ledger.types import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

STATUSES = "'approved', 'failed', 'pending_approval', 'rejected', 'running', 'succeeded', 'unknown'"
WAITING = "'pending_approval', 'running', 'unknown'"
EXECUTION_STATUSES = "'failed', 'running', 'succeeded', 'unknown'"
KINDS = (
    "'approved', 'evidence', 'failed', 'linked', 'pending_approval', 'rejected', "
    "'running', 'submitted', 'succeeded', 'unknown'"
)

PG_APPEND_ONLY = """
CREATE FUNCTION execution_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'execution_events is append-only: % refused', TG_OP
        USING ERRCODE = 'integrity_constraint_violation';
END $$;
CREATE TRIGGER execution_events_append_only BEFORE UPDATE OR DELETE ON execution_events
    FOR EACH ROW EXECUTE FUNCTION execution_events_append_only();
CREATE TRIGGER execution_events_no_truncate BEFORE TRUNCATE ON execution_events
    FOR EACH STATEMENT EXECUTE FUNCTION execution_events_append_only();
"""
SQLITE_APPEND_ONLY = [
    """CREATE TRIGGER execution_events_no_update BEFORE UPDATE ON execution_events
       BEGIN SELECT RAISE(ABORT, 'execution_events is append-only: UPDATE refused'); END""",
    """CREATE TRIGGER execution_events_no_delete BEFORE DELETE ON execution_events
       BEGIN SELECT RAISE(ABORT, 'execution_events is append-only: DELETE refused'); END""",
]


def _partial(name: str, table: str, columns: list[str], where: str) -> None:
    clause = sa.text(where)
    op.create_index(op.f(name), table, columns, postgresql_where=clause, sqlite_where=clause)


def upgrade() -> None:
    op.create_table(
        "operations",
        sa.Column("scope", sa.String(128), nullable=False),
        sa.Column("idempotency_key", sa.String(512), nullable=False),
        sa.Column("tool", sa.String(64), nullable=False),
        sa.Column("args", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("args_sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("authorized_attempts", sa.Integer(), nullable=False),
        sa.Column("decided_by", sa.String(256), nullable=True),
        sa.Column("decided_at", UTCDateTime(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("enqueued_at", UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("scope", "idempotency_key", name=op.f("pk_operations")),
        sa.CheckConstraint(f"status IN ({STATUSES})", name=op.f("ck_operations_status")),
        sa.CheckConstraint(
            "authorized_attempts >= 0", name=op.f("ck_operations_authorized_attempts")
        ),
    )
    _partial(
        "ix_operations_approved_unclaimed", "operations", ["enqueued_at"], "status = 'approved'"
    )
    _partial("ix_operations_waiting", "operations", ["status", "scope"], f"status IN ({WAITING})")

    op.create_table(
        "tool_calls",
        sa.Column("scope", sa.String(128), nullable=False),
        sa.Column("tool_call_id", sa.String(256), nullable=False),
        sa.Column("idempotency_key", sa.String(512), nullable=False),
        sa.Column("args_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "tool_call_id", name=op.f("pk_tool_calls")),
        sa.ForeignKeyConstraint(
            ["scope", "idempotency_key"],
            ["operations.scope", "operations.idempotency_key"],
            name=op.f("fk_tool_calls_operation"),
        ),
    )
    op.create_index(op.f("ix_tool_calls_operation"), "tool_calls", ["scope", "idempotency_key"])

    op.create_table(
        "executions",
        sa.Column("execution_id", sa.String(36), nullable=False),
        sa.Column("scope", sa.String(128), nullable=False),
        sa.Column("idempotency_key", sa.String(512), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("worker_id", sa.String(256), nullable=True),
        sa.Column("lease_token", sa.String(32), nullable=True),
        sa.Column("lease_expires_at", UTCDateTime(), nullable=True),
        sa.Column("heartbeat_at", UTCDateTime(), nullable=True),
        sa.Column("started_at", UTCDateTime(), nullable=False),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("reconciled", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("execution_id", name=op.f("pk_executions")),
        sa.UniqueConstraint(
            "scope", "idempotency_key", "attempt", name=op.f("uq_executions_attempt")
        ),
        sa.ForeignKeyConstraint(
            ["scope", "idempotency_key"],
            ["operations.scope", "operations.idempotency_key"],
            name=op.f("fk_executions_operation"),
        ),
        sa.CheckConstraint(f"status IN ({EXECUTION_STATUSES})", name=op.f("ck_executions_status")),
        sa.CheckConstraint("attempt >= 1", name=op.f("ck_executions_attempt")),
        sa.CheckConstraint(
            "(status IN ('failed', 'succeeded')) = (result IS NOT NULL)",
            name=op.f("ck_executions_terminal_has_result"),
        ),
    )
    _partial(
        "ix_executions_running_lease", "executions", ["lease_expires_at"], "status = 'running'"
    )
    _partial(
        "ix_executions_unknown",
        "executions",
        ["scope", "idempotency_key"],
        "status = 'unknown'",
    )

    op.create_table(
        "execution_events",
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("scope", sa.String(128), nullable=False),
        sa.Column("idempotency_key", sa.String(512), nullable=False),
        sa.Column("execution_id", sa.String(36), nullable=True),
        sa.Column("kind", sa.String(24), nullable=False),
        sa.Column("actor", sa.String(256), nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("detail", sa.JSON(none_as_null=True), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_execution_events")),
        sa.CheckConstraint(f"kind IN ({KINDS})", name=op.f("ck_execution_events_kind")),
    )
    op.create_index(
        op.f("ix_execution_events_operation"),
        "execution_events",
        ["scope", "idempotency_key", "seq"],
    )

    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_APPEND_ONLY)
    else:
        for statement in SQLITE_APPEND_ONLY:
            op.execute(statement)


def downgrade() -> None:
    _refuse_loss()
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER execution_events_no_truncate ON execution_events")
        op.execute("DROP TRIGGER execution_events_append_only ON execution_events")
        op.execute("DROP FUNCTION execution_events_append_only()")
    else:
        op.execute("DROP TRIGGER execution_events_no_update")
        op.execute("DROP TRIGGER execution_events_no_delete")
    op.drop_table("execution_events")
    op.drop_table("executions")
    op.drop_table("tool_calls")
    op.drop_table("operations")


def _refuse_loss() -> None:
    """Going below 0001 drops every table: refused while they hold a call, an execution or
    an event. ``toolledger db downgrade`` (whose default is ``base``) dropped a whole ledger
    and exited 0, and a call that had succeeded then ran again (a cold review). An empty
    ledger's tables may go."""
    from toolledger.ledger.revision import DowngradeRefused

    bind = op.get_bind()
    tables = ("operations", "tool_calls", "executions", "execution_events")
    if bind.dialect.name == "postgresql":  # the count and the drop under one lock
        bind.execute(sa.text(f"LOCK TABLE {', '.join(tables)} IN SHARE ROW EXCLUSIVE MODE"))
    held = {t: bind.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in tables}
    if any(held.values()):
        rows = ", ".join(f"{n} in {t}" for t, n in held.items() if n)
        raise DowngradeRefused(
            f"downgrade to base refused: it would drop the ledger's records ({rows}); nothing "
            "was changed (to start afresh, use a new database)"
        )
