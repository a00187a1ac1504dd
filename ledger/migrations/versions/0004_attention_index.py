"""The humans' inbox in index order: calls waiting on a person, by status then age.

The console's inbox and ``list --status pending_approval|unknown`` read the oldest waiting
calls first. The partial index on waiting rows is keyed by (status, scope) for the sweep, so
the planner sorted every waiting row, or scanned the table (measured on 100,000 calls: a
parallel sequential scan, ~60 ms a page). This index holds only the rows waiting on a person,
so the hot path (approved -> running -> succeeded) never writes to it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

WHERE = "status IN ('pending_approval', 'unknown')"


def upgrade() -> None:
    op.create_index(
        "ix_operations_attention",
        "operations",
        ["status", "created_at"],
        postgresql_where=sa.text(WHERE),
        sqlite_where=sa.text(WHERE),
    )


def downgrade() -> None:
    op.drop_index("ix_operations_attention", table_name="operations")
