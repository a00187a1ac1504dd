"""The embedded broker: kombu's SQLAlchemy transport on a SQLite file, tuned for a laptop.

Chosen by test (tests/acceptance/test_embedded.py, 2 prefork workers x 200 jobs): kombu's
filesystem transport lost 4 of 200 messages when consumers polled every 50 ms — its ``_get``
moves a message file while the producer may still be writing it — while the SQLAlchemy
transport lost none, because it takes the SQLite write lock (BEGIN IMMEDIATE) to fetch.

The stock transport polls every second and hands every transport option to create_engine;
with prefetch 1 that caps a worker near one job a second. This subclass polls every 50 ms,
puts the broker file in WAL mode with a busy timeout, and is registered as ``embedded``:
``TOOLLEDGER_BROKER=embedded+sqlite:///.toolledger/broker.db``. Like every virtual
transport it keeps unacked messages in the worker's memory: a SIGKILLed worker main process
loses what it held, which the sweep's outbox re-publishes.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import sqlalchemy as kombu_sqla

ALIAS = "embedded"
POLL_SECONDS = 0.05


@contextlib.contextmanager
def _process_lock(database: str) -> Iterator[None]:
    """kombu's own mutex is per process; workers starting together need one per file."""
    with open(f"{database}.init-lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Channel(kombu_sqla.Channel):
    def _open(self) -> Any:
        database = sa.make_url(self.connection.client.hostname).database or "broker.db"
        with _process_lock(database):  # kombu creates its tables here
            return super()._open()  # type: ignore[no-untyped-call]

    def _get_or_create(self, queue: str) -> Any:
        try:
            return super()._get_or_create(queue)  # type: ignore[no-untyped-call]
        except sa.exc.IntegrityError:  # another process created the queue row first
            self.session.rollback()
            return super()._get_or_create(queue)  # type: ignore[no-untyped-call]

    def _engine_from_config(self) -> sa.Engine:
        engine = sa.create_engine(self.connection.client.hostname, connect_args={"timeout": 30})

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA busy_timeout = 30000")
            cursor.close()

        return engine


class Transport(kombu_sqla.Transport):
    Channel = Channel
    polling_interval = POLL_SECONDS


def register() -> None:
    TRANSPORT_ALIASES.setdefault(ALIAS, f"{__name__}:Transport")


register()
