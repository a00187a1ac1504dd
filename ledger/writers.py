"""The writers' queue: on SQLite, writers take the write lock in turn instead of by polling.

SQLite lets one connection at a time hold a database's write lock; the others wait in its
busy handler, which sleeps 1, 2, 5, 10, 15 … up to 100 ms between tries. With several
processes committing short transactions (a claim, a terminal write: a few statements and an
fsync, under a millisecond), a waiter mostly sleeps past the moment the lock came free: at
four processes the lock stood idle a third of the time while writers slept (README,
"Performance").

So each of toolledger's write transactions on a database file first takes an exclusive
``flock(2)`` on ``NAME.writers`` beside it, and only then ``BEGIN IMMEDIATE``; the kernel
wakes a waiter the moment the one before it lets go. The queue is an order, not a guard:
SQLite's lock still decides who writes. A writer that is not toolledger's (the ``sqlite3``
shell, a migration), or one that cannot open the file, goes through the busy handler as
before; either way the queue changes how long a writer waits, never what it may do.

``flock`` waits without a timeout. A process frozen (SIGSTOP) in its turn stalls every
writer until it wakes or dies, as a process frozen inside a transaction already did; what
changes is that they wait instead of failing with "database is locked" every 30 s. A process
that dies lets go: the kernel drops its locks with its files.

Each thread has its own open file (flock locks belong to an open file, so two threads of one
process queue like two processes), opened on first use and kept until the thread ends (at most
``KEEP`` of them a thread: a thread that writes to many databases closes its oldest idle ones).
A forked child closes its copies of every open file of its parent's, whose locks it would
otherwise share and keep past its parent's death (``os.register_at_fork``). A turn taken
again by a thread already holding it (a write transaction inside another) is counted, not
re-locked; the lock goes when the count is back to 0, whichever of the turns ends last. The
queue file is named after the database's real path, so two spellings of one file (relative
and absolute, through a symlink) share one queue: two would make a write nested in another
wait on its own thread.

A turn yields how long its writer waited in the queue; ``within_budget`` takes that from
SQLite's busy timeout for the ``BEGIN IMMEDIATE`` that follows, so a queue behind a writer
that is not toolledger's (which holds SQLite's lock, not the queue's) still gives up after
the timeout, rather than each writer spending a whole timeout in turn.

Where ``fcntl`` does not exist (Windows), there is no queue. On a network filesystem that
emulates ``flock`` with POSIX record locks (NFS), locks belong to the process, not the open
file: threads of one process would not queue against each other. SQLite itself advises
against such filesystems for a database written by several processes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

_SUFFIX = ".writers"
#: What flock says on a filesystem that has none (some network filesystems).
_NO_FLOCK = {errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}
#: Open queue files a thread keeps at most (one per database it writes).
KEEP = 8
#: A wait in the queue shorter than this leaves SQLite's busy timeout as it is (a wait under
#: contention is a millisecond or two; changing the timeout costs two statements).
SLOW_WAIT_SECONDS = 0.05


class _QueueFile:
    """A thread's open file on one queue file, and how many turns it holds. Closed when the
    thread ends (its thread-local state goes, and with it this), so threads that come and go
    leave no descriptor behind."""

    __slots__ = ("__weakref__", "depth", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.depth = 0
        _every.add(self)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    __del__ = close


#: Every open queue file of this process, whichever thread holds it (closed in a child).
_every: weakref.WeakSet[_QueueFile] = weakref.WeakSet()


class _Held(threading.local):
    def __init__(self) -> None:
        #: database file -> this thread's open queue file, oldest first
        self.files: dict[str, _QueueFile] = {}


_held = _Held()


def _forget_in_child() -> None:
    """In a forked child: its copies of the parent's open files share the parent's locks, and
    would hold them past the parent's death, so every one of them is closed, the other
    threads' too (those threads do not exist in the child, but their state does); the child
    opens its own."""
    global _held
    for queue in list(_every):
        queue.close()
    _held = _Held()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def queue_file(database: str) -> str:
    """The file whose lock orders a database file's writers: ``NAME.writers`` beside it."""
    return database + _SUFFIX


def database_file(url: Any) -> str | None:
    """The real path of the file a SQLAlchemy SQLite URL names, or None where there is no
    queue to take: an in-memory database (one per connection), a ``file:`` URI, another
    dialect. A relative path is resolved against the working directory of the first call
    for that URL, as SQLite resolves it when it opens the engine's first connection."""
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database
    if database in (None, "", ":memory:") or url.query.get("mode") == "memory":
        return None
    if str(database).startswith("file:"):
        return None
    return _real(str(database))


_real_paths: dict[str, str] = {}


def _real(database: str) -> str:
    real = _real_paths.get(database)
    if real is None:
        real = os.path.realpath(database)
        if len(_real_paths) < 1024:  # a process that opens endless databases resolves anew
            _real_paths[database] = real
    return real


def _open(database: str) -> int:
    """This thread's descriptor on the queue file, or -1 if it cannot be had (no directory,
    no permission): the writer then goes without the queue, and tries again next time.
    Read-only is enough for flock."""
    try:
        return os.open(queue_file(database), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return -1


def _queue(database: str) -> _QueueFile | None:
    files = _held.files
    queue = files.get(database)
    if queue is None:
        fd = _open(database)
        if fd < 0:
            return None
        if len(files) >= KEEP:  # close the oldest idle one
            for name, old in list(files.items()):
                if not old.depth:
                    del files[name]
                    old.close()
                    break
        queue = files[database] = _QueueFile(fd)
    return queue


@contextlib.contextmanager
def turn(database: str | None) -> Iterator[float]:
    """Hold this thread's turn to write ``database`` (a file path; None: no queue) for the
    body: begin, write and commit inside it. Yields the seconds spent waiting for it."""
    queue = None if database is None or fcntl is None else _queue(database)
    if queue is None:
        yield 0.0
        return
    waited = 0.0
    # The count goes up before the lock is taken and down after it is let go, each inside
    # the ``try`` that undoes it: an exception from a signal handler at any point leaves
    # at worst a thread that no longer queues, never a lock that nobody will let go.
    queue.depth += 1
    try:
        if queue.depth == 1:
            started = time.monotonic()
            try:
                fcntl.flock(queue.fd, fcntl.LOCK_EX)
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    raise
                # a filesystem without flock: SQLite's busy handler alone, as before
            waited = time.monotonic() - started
        yield waited
    finally:
        if queue.depth == 1 and queue.fd >= 0:  # fd -1: a forked child's, closed at fork
            with contextlib.suppress(OSError):  # not held (no flock here, or interrupted)
                fcntl.flock(queue.fd, fcntl.LOCK_UN)
        queue.depth -= 1


@contextlib.contextmanager
def within_budget(waited: float, connection: Callable[[], Any]) -> Iterator[None]:
    """Around a ``BEGIN IMMEDIATE``: SQLite's busy timeout on ``connection()`` (a sqlite3
    connection) less the ``waited`` seconds its turn took, then as it was. A wait under
    ``SLOW_WAIT_SECONDS`` changes nothing (and never calls ``connection``)."""
    if waited < SLOW_WAIT_SECONDS:
        yield
        return
    conn = connection()
    (full,) = conn.execute("PRAGMA busy_timeout").fetchone()
    conn.execute(f"PRAGMA busy_timeout = {max(0, int(full) - int(waited * 1000))}")
    try:
        yield
    finally:
        conn.execute(f"PRAGMA busy_timeout = {int(full)}")
