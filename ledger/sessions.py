"""Console sessions ended before their cookie expired (``ended_sessions``, migration 0005).

The server's state, not the ledger's: no event, no status. It lives in the ledger's database
because that is what every server process (``serve --workers N``, several hosts) shares.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from toolledger.ledger.base import LedgerBase
from toolledger.ledger.models import ended_sessions
from toolledger.ledger.types import db_now


class LedgerSessions(LedgerBase):
    def end_session(self, session_id: str, token: str, expires_at: datetime) -> None:
        """Refuse this session from now on; forget the ended sessions whose cookies have
        expired anyway (judged by ``expires_at``'s clock, the server's, as the cookie is)."""
        with self._write() as conn:
            conn.execute(
                ended_sessions.delete().where(
                    ended_sessions.c.expires_at < datetime.now(expires_at.tzinfo)
                )
            )
            conn.execute(
                self._insert(ended_sessions)
                .values(
                    session_id=session_id, token=token, ended_at=db_now(), expires_at=expires_at
                )
                .on_conflict_do_nothing()
            )

    def session_ended(self, session_id: str) -> bool:
        with self._read() as conn:
            found = conn.execute(
                sa.select(sa.literal(1)).where(ended_sessions.c.session_id == session_id)
            ).first()
        return found is not None
