"""The embedded broker: kombu's SQLAlchemy transport on a SQLite file, tuned for a laptop.

Chosen by test (tests/acceptance/test_embedded.py, 2 prefork workers x 200 jobs): kombu's
filesystem transport lost 4 of 200 messages when consumers polled every 50 ms — its ``_get``
moves a message file while the producer may still be writing it — while the SQLAlchemy
transport lost none, because it takes the SQLite write lock (BEGIN IMMEDIATE) to fetch.

The stock transport polls every second and hands every transport option to create_engine;
with prefetch 1 that caps a worker near one job a second. This subclass puts the broker file
in WAL mode with a busy timeout, and waits for messages on a doorbell (``ledger.doorbell``):
a producer rings the broker file's bell directory after its commit, so an idle worker takes
a new job at once instead of at its next poll; while it holds unacknowledged messages (a job
of its own finishing frees a slot without anyone ringing) it polls every 50 ms as before,
and an idle one re-reads every second in case a ring never came. It is registered as
``embedded``:
``TOOLLEDGER_BROKER=embedded+sqlite:///.toolledger/broker.db``. Like every virtual
transport it keeps unacked messages in the worker's memory: a SIGKILLed worker main process
loses what it held, which the sweep's outbox re-publishes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from queue import Empty
from typing import Any

import sqlalchemy as sa
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import sqlalchemy as kombu_sqla

from toolledger.ledger import doorbell
from toolledger.worker.envelope import UNREADABLE, DropsForeignItems, dropped

ALIAS = "embedded"
#: Poll interval while the worker has jobs in hand (a finished one frees a slot silently).
POLL_SECONDS = 0.05
#: Longest wait for a ring while idle (a lost ring costs at most this).
IDLE_WAIT_SECONDS = 1.0
#: The transport option (seconds) bounding a wait for the broker file's write lock; the app
#: sets it to TOOLLEDGER_DB_TIMEOUT, as the ledger's own wait.
BUSY_TIMEOUT_OPTION = "busy_timeout"
DEFAULT_BUSY_TIMEOUT_SECONDS = 30.0


@contextlib.contextmanager
def _process_lock(database: str) -> Iterator[None]:
    """kombu's own mutex is per process; workers starting together need one per file."""
    with open(f"{database}.init-lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _database(client: Any) -> str:
    return sa.make_url(client.hostname).database or "broker.db"


class Channel(kombu_sqla.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        super()._put(queue, payload, **kwargs)  # type: ignore[no-untyped-call]
        doorbell.ring(doorbell.bell_dir(_database(self.connection.client)))  # after the commit

    def _open(self) -> Any:
        database = _database(self.connection.client)
        with _process_lock(database):  # kombu creates its tables here
            return super()._open()  # type: ignore[no-untyped-call]

    def _get(self, queue: str) -> Any:  # type: ignore[override]
        try:
            return super()._get(queue)  # type: ignore[no-untyped-call]
        except UNREADABLE as exc:  # its row is marked taken already: dropped
            dropped(queue, type(exc).__name__)
            raise Empty() from None

    def _get_or_create(self, queue: str) -> Any:
        try:
            return super()._get_or_create(queue)  # type: ignore[no-untyped-call]
        except sa.exc.IntegrityError:  # another process created the queue row first
            self.session.rollback()
            return super()._get_or_create(queue)  # type: ignore[no-untyped-call]

    def _engine_from_config(self) -> sa.Engine:
        options = self.connection.client.transport_options
        busy = float(options.get(BUSY_TIMEOUT_OPTION, DEFAULT_BUSY_TIMEOUT_SECONDS))
        engine = sa.create_engine(self.connection.client.hostname, connect_args={"timeout": busy})

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute(f"PRAGMA busy_timeout = {max(1, int(busy * 1000))}")
            cursor.close()

        return engine


def _worker_stopping() -> bool:
    """A worker asked to stop (SIGTERM, SIGQUIT): Celery's loop sees it only when a drain
    returns, and its loop drains once more after it has seen it (``synloop`` runs a cycle in
    a ``finally``), each drain up to 2 s — 2 to 4 s of an idle worker's warm shutdown spent
    waiting for the doorbell (measured: 6.2 s to stop an idle worker, 4 s of it here)."""
    state = sys.modules.get("celery.worker.state")
    if state is None:  # a producer: no worker in this process
        return False
    flags = (state.should_stop, state.should_terminate)  # an exit code, 0 included
    return any(flag is not None and flag is not False for flag in flags)


class Transport(DropsForeignItems, kombu_sqla.Transport):
    Channel = Channel
    polling_interval = POLL_SECONDS

    _bell: tuple[int, doorbell.Doorbell] | None = None

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:  # type: ignore[override]
        """kombu's loop, with its sleep replaced by a wait on the doorbell while idle."""
        started = time.monotonic()
        while True:
            if _worker_stopping():  # no new job, and back to Celery's loop, which stops
                raise TimeoutError()
            try:
                self.cycle.get(self._deliver, timeout=timeout)  # type: ignore[union-attr]
                return
            except Empty:
                elapsed = time.monotonic() - started
                if timeout is not None and elapsed >= timeout:
                    raise TimeoutError() from None
                wait = self.polling_interval if self._busy() else IDLE_WAIT_SECONDS
                if timeout is not None:
                    wait = min(wait, timeout - elapsed)
                bell = self._doorbell(connection)
                if bell is None:
                    time.sleep(wait)
                else:
                    bell.wait(wait)

    def _busy(self) -> bool:
        """Jobs in hand: a slot may free without a ring, so keep polling quickly."""
        return any(getattr(ch, "_qos", None) and ch._qos._delivered for ch in self.channels)

    def _doorbell(self, connection: Any) -> doorbell.Doorbell | None:
        """This process's bell on the broker file (a forked child binds its own)."""
        if self._bell is None or self._bell[0] != os.getpid():
            try:
                bell = doorbell.Doorbell(doorbell.bell_dir(_database(connection.client)))
            except OSError:
                return None
            self._bell = (os.getpid(), bell)
        return self._bell[1]


def register() -> None:
    TRANSPORT_ALIASES.setdefault(ALIAS, f"{__name__}:Transport")


register()
