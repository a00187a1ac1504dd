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
    _refuse_loss()
    op.drop_index("ix_ended_sessions_expires_at", table_name="ended_sessions")
    op.drop_table("ended_sessions")


def _refuse_loss() -> None:
    """Refused while a logout is still in force: dropping it would make the copies of those
    sessions' cookies good again until they expire (a cold review); once every cookie
    named here has expired, the table holds nothing anyone relies on."""
    import datetime as dt

    from toolledger.ledger.revision import DowngradeRefused

    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        bind.execute(sa.text("LOCK TABLE ended_sessions IN SHARE ROW EXCLUSIVE MODE"))
    sessions = sa.table("ended_sessions", sa.column("expires_at", UTCDateTime()))
    now = dt.datetime.now(dt.UTC)
    live = bind.execute(
        sa.select(sa.func.count()).select_from(sessions).where(sessions.c.expires_at > now)
    ).scalar_one()
    if live:
        raise DowngradeRefused(
            f"downgrade below 0005 refused: {live} ended console sessions whose cookies have "
            "not expired would be good again; nothing was changed (wait until they expire: "
            "at most the console's session lifetime)"
        )
