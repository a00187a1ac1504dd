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
process queue like two processes), opened on first use and kept until the thread ends; a child
process closes its copies of its parent's (``os.register_at_fork``), whose locks it would
otherwise share. A turn taken again by a thread already holding it (a write transaction inside
another) is counted, not re-locked.
Where ``fcntl`` does not exist (Windows), there is no queue.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterator
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

_SUFFIX = ".writers"
#: What flock says on a filesystem that has none (some network filesystems).
_NO_FLOCK = {errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


class _QueueFile:
    """A thread's open file on one queue file, and how many turns it holds. Closed when the
    thread ends (its thread-local state goes, and with it this), so threads that come and go
    leave no descriptor behind."""

    __slots__ = ("depth", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.depth = 0

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    __del__ = close


class _Held(threading.local):
    def __init__(self) -> None:
        #: database file -> this thread's open queue file
        self.files: dict[str, _QueueFile] = {}


_held = _Held()


def _forget_in_child() -> None:
    """In a forked child: its copies of the parent's open files share the parent's locks, so
    they are closed (the parent's stay held) and the child opens its own."""
    global _held
    for queue in _held.files.values():
        queue.close()
    _held = _Held()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def queue_file(database: str) -> str:
    """The file whose lock orders a database file's writers: ``NAME.writers`` beside it."""
    return database + _SUFFIX


def database_file(url: Any) -> str | None:
    """The file a SQLAlchemy SQLite URL names, or None where there is no queue to take: an
    in-memory database (one per connection), a ``file:`` URI, another dialect."""
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database
    if database in (None, "", ":memory:") or url.query.get("mode") == "memory":
        return None
    if str(database).startswith("file:"):
        return None
    return str(database)


def _open(database: str) -> int:
    """This thread's descriptor on the queue file, or -1 if it cannot be had (no directory,
    no permission): the writer then goes without the queue, and tries again next time.
    Read-only is enough for flock."""
    try:
        return os.open(queue_file(database), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return -1


@contextlib.contextmanager
def turn(database: str | None) -> Iterator[None]:
    """Hold this thread's turn to write ``database`` (a file path; None: no queue) for the
    body: begin, write and commit inside it."""
    if database is None or fcntl is None:
        yield
        return
    queue = _held.files.get(database)
    if queue is None:
        fd = _open(database)
        if fd < 0:
            yield
            return
        queue = _held.files[database] = _QueueFile(fd)
    if queue.depth:
        queue.depth += 1
        try:
            yield
        finally:
            queue.depth -= 1
        return
    try:
        fcntl.flock(queue.fd, fcntl.LOCK_EX)
    except OSError as exc:
        if exc.errno not in _NO_FLOCK:
            raise
        yield  # a filesystem without flock: SQLite's busy handler alone, as before
        return
    queue.depth = 1
    try:
        yield
    finally:
        queue.depth = 0
        fcntl.flock(queue.fd, fcntl.LOCK_UN)
