"""Fenced effects: the staged-effect protocol, proof beats permission, the review inbox.

- ``executions.fenced``: the execution ran under the staged-effect protocol (its sandbox
  effects land only after its own terminal commit). Older rows keep ``false``: for them the
  fence proves nothing.
- ``executions.effects``: the sandbox effects an execution's own commit made official.
- ``operations.review``: why a call waits for a human although it has a status.
- event kinds ``withdrawn``, ``flagged``, ``reviewed``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

OLD_KINDS = (
    "'approved', 'evidence', 'failed', 'linked', 'pending_approval', 'rejected', "
    "'running', 'submitted', 'succeeded', 'unknown'"
)
NEW_KINDS = (
    "'approved', 'evidence', 'failed', 'flagged', 'linked', 'pending_approval', 'rejected', "
    "'reviewed', 'running', 'submitted', 'succeeded', 'unknown', 'withdrawn'"
)
SQLITE_TRIGGERS = {
    "execution_events_no_update": """CREATE TRIGGER execution_events_no_update BEFORE UPDATE
       ON execution_events
       BEGIN SELECT RAISE(ABORT, 'execution_events is append-only: UPDATE refused'); END""",
    "execution_events_no_delete": """CREATE TRIGGER execution_events_no_delete BEFORE DELETE
       ON execution_events
       BEGIN SELECT RAISE(ABORT, 'execution_events is append-only: DELETE refused'); END""",
}


def _event_kinds(kinds: str) -> None:
    name = op.f("ck_execution_events_kind")
    if op.get_bind().dialect.name == "postgresql":
        op.drop_constraint(name, "execution_events", type_="check")
        op.create_check_constraint(name, "execution_events", f"kind IN ({kinds})")
        return
    # SQLite cannot alter a CHECK: the table is rebuilt (its rows copied, never updated);
    # the append-only triggers go with the old table and are created again.
    for trigger in SQLITE_TRIGGERS:
        op.execute(f"DROP TRIGGER {trigger}")
    with op.batch_alter_table("execution_events", recreate="always") as batch:
        batch.drop_constraint(name, type_="check")
        batch.create_check_constraint(name, f"kind IN ({kinds})")
    for statement in SQLITE_TRIGGERS.values():
        op.execute(statement)


def upgrade() -> None:
    with op.batch_alter_table("executions") as batch:
        batch.add_column(
            sa.Column("fenced", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(sa.Column("effects", sa.JSON(none_as_null=True), nullable=True))
    with op.batch_alter_table("operations") as batch:
        batch.add_column(sa.Column("review", sa.String(32), nullable=True))
    clause = sa.text("review IS NOT NULL")
    op.create_index(
        op.f("ix_operations_review"),
        "operations",
        ["scope"],
        postgresql_where=clause,
        sqlite_where=clause,
    )
    _event_kinds(NEW_KINDS)


#: What only this revision holds, each counted before a downgrade drops it.
HELD_HERE = {
    "executions that ran fenced": "SELECT count(*) FROM executions WHERE fenced",
    "executions with landed effects": "SELECT count(*) FROM executions WHERE effects IS NOT NULL",
    "calls waiting for a review": "SELECT count(*) FROM operations WHERE review IS NOT NULL",
    "events of kinds 0001 does not know": (
        "SELECT count(*) FROM execution_events WHERE kind IN ('flagged', 'reviewed', 'withdrawn')"
    ),
}


def _refuse_loss() -> None:
    """A downgrade never drops what the ledger relies on: an upgrade after it would find the
    executions unfenced and their effects gone (``verify`` would differ ever after, the sweep
    would treat fenced executions as unfenced), and 0001's CHECK refuses the newer event kinds."""
    from toolledger.ledger.revision import DowngradeRefused

    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        # the count and the drop under one lock (the migration's transaction): a claim or a
        # finish committed between them would be dropped uncounted
        bind.execute(
            sa.text(
                "LOCK TABLE operations, executions, execution_events IN SHARE ROW EXCLUSIVE MODE"
            )
        )
    held = {what: bind.execute(sa.text(query)).scalar_one() for what, query in HELD_HERE.items()}
    lost = ", ".join(f"{n} {what}" for what, n in held.items() if n)
    if lost:
        raise DowngradeRefused(
            f"downgrade below 0002 refused: it would drop what only 0002 holds ({lost}); "
            "nothing was changed (to go back, restore a copy of the ledger taken before it "
            "was upgraded)"
        )


def downgrade() -> None:
    _refuse_loss()
    _event_kinds(OLD_KINDS)
    op.drop_index(op.f("ix_operations_review"), table_name="operations")
    for table, column in (
        ("operations", "review"),
        ("executions", "effects"),
        ("executions", "fenced"),
    ):
        _drop_column(table, column)


def _drop_column(table: str, column: str) -> None:
    """On SQLite, ALTER TABLE DROP COLUMN (3.35+) where a batch would rebuild the table: the
    rebuild drops ``operations`` while ``tool_calls`` and ``executions`` refer to it, which
    the foreign keys refuse on any ledger holding a call."""
    import sqlite3

    if op.get_bind().dialect.name == "sqlite" and sqlite3.sqlite_version_info >= (3, 35):
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        return
    with op.batch_alter_table(table) as batch:
        batch.drop_column(column)
