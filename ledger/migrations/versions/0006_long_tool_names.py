"""A tool name of up to 132 characters: ``mcp.`` and the 1 to 128 an MCP tool's name may have.

MCP allows tool names of 1 to 128 characters (SEP-986); the ledger's column held 64, so the
proxy refused to start on an upstream with a name of 61 characters or more (``mcp.`` takes
four). Widening a ``varchar`` rewrites nothing on Postgres (a catalog change). SQLite holds
any length whatever a column declares, and its declaration stays as it was (the models say
so): no rebuild of the ledger's largest table.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column(
            "operations", "tool", type_=sa.String(132), existing_type=sa.String(64),
            existing_nullable=False,
        )  # fmt: skip


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    from toolledger.ledger.revision import DowngradeRefused

    # the count and the change under one lock (the migration's transaction): a submit
    # committed between them would fail the change half-way
    bind.execute(sa.text("LOCK TABLE operations IN SHARE ROW EXCLUSIVE MODE"))
    longer = bind.execute(
        sa.text("SELECT count(*) FROM operations WHERE length(tool) > 64")
    ).scalar_one()
    if longer:
        raise DowngradeRefused(
            f"downgrade below 0006 refused: {longer} calls name a tool of more than 64 "
            "characters, which 0005's column cannot hold; nothing was changed (to go back, "
            "restore a copy of the ledger taken before it was upgraded)"
        )
    op.alter_column(
        "operations", "tool", type_=sa.String(64), existing_type=sa.String(132),
        existing_nullable=False,
    )  # fmt: skip
