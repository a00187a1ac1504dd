"""Console sessions end at logout, not only when their cookie expires.

A session cookie is signed and self-contained: before this, logging out deleted the cookie in
the browser, and a copy of it (taken from the machine, a proxy's log, a shared profile) stayed
good until its expiry, eight hours at most. Each cookie now names a random session id; logging
out records it here, and every server process refuses it from then on. A row is useless once
its cookie would have expired: each logout deletes those.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

from toolledger.ledger.types import UTCDateTime

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ended_sessions",
        sa.Column("session_id", sa.String(32), nullable=False),
        sa.Column("token", sa.String(256), nullable=False),
        sa.Column("ended_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", name="pk_ended_sessions"),
    )
    op.create_index("ix_ended_sessions_expires_at", "ended_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_ended_sessions_expires_at", table_name="ended_sessions")
    op.drop_table("ended_sessions")
