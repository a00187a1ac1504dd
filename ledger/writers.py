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

``flock`` waits without a timeout, and a process frozen (SIGSTOP, a Ctrl-Z) in its turn would
stall every writer until it wakes or dies. So a wait in the queue is bounded by the writer's
busy timeout, unless its process said it would rather wait (``set_blocking``: the worker,
whose lock keeper and executions write all day, and for whom a wait taken in order is worth
more than an error): a turn that cannot be had at once is waited for by a thread of its own,
blocked in ``flock`` on an open file of its own, while the writer waits for it at most the
busy timeout. Past that, the writer goes around the queue to SQLite's lock, with no time left
on its busy timeout (``within_budget``): it writes if the frozen process held only the queue,
and fails with "database is locked" if it held SQLite's lock too, as before the queue — a
CLI command, the HTTP API, an agent's client never hang behind a stopped worker. The waiting
thread, when it gets the lock after its writer left, lets go at once; while it still waits,
the process's other writers go around the queue without waiting in it (one thread left
waiting behind a frozen turn, not one a write). A process that dies lets go of everything:
the kernel drops its locks with its files.

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
the timeout, rather than each writer spending a whole timeout in turn, and a writer that went
around the queue tries SQLite's lock once.

Where ``fcntl`` does not exist (Windows), there is no queue. On a network filesystem that
emulates ``flock`` with POSIX record locks (NFS), locks belong to the process, not the open
file: threads of one process would not queue against each other. SQLite itself advises
against such filesystems for a database written by several processes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
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

log = logging.getLogger("toolledger.ledger")

_SUFFIX = ".writers"
#: What flock says on a filesystem that has none (some network filesystems).
_NO_FLOCK = {errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}
#: Open queue files a thread keeps at most (one per database it writes).
KEEP = 8
#: A wait in the queue shorter than this leaves SQLite's busy timeout as it is (a wait under
#: contention is a millisecond or two; changing the timeout costs two statements).
SLOW_WAIT_SECONDS = 0.05
#: How long a writer waits for its turn when it has no connection to ask (SQLite's busy
#: timeout is the bound otherwise): the ledger's own default.
DEFAULT_PATIENCE_SECONDS = 30.0

#: Whether this process's writers wait for their turn without a timeout (``set_blocking``).
_blocking = False


def set_blocking(blocking: bool = True) -> None:
    """Make this process's writers wait for their turn as long as it takes (the worker: a
    wait in order beats an error, and costs no thread), or again at most their busy timeout
    (every process's default)."""
    global _blocking
    _blocking = blocking


def blocking() -> bool:
    """Whether this process's writers wait for their turn without a timeout."""
    return _blocking


class _QueueFile:
    """A thread's open file on one queue file, and how many turns it holds. Closed when the
    thread ends (its thread-local state goes, and with it this), so threads that come and go
    leave no descriptor behind."""

    __slots__ = ("__weakref__", "depth", "fd", "via")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.depth = 0
        #: another open file of the queue whose lock holds this thread's turn (a bounded
        #: wait's), or None: the lock is this file's
        self.via: _QueueFile | None = None
        _every.add(self)

    def close(self) -> None:
        # A child forked by another thread just as this closes keeps a copy nobody closes;
        # harmless: a file is never closed while locked but by ``release`` (which unlocks
        # first, for every copy), nor locked again once closed.
        fd, self.fd = getattr(self, "fd", -1), -1  # -1: a signal came inside __init__
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def release(self) -> None:
        """Let go of this open file's lock, then close it. The unlock comes first: it lets go
        for every copy of the open file, and a child forked while this closes (another
        thread's fork, between the closing and ``_every``'s knowing it) has one. Never from
        ``close``: in a child, closing its copies must not let go of the parent's turns."""
        fd = self.fd
        if fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
        self.close()

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
    global _held, _opening, _stuck, _stuck_guard
    for queue in list(_every):
        queue.close()
    _held = _Held()
    _opening = threading.Lock()  # held by the parent's forking thread (``before``)
    # no thread of the parent's waits here (nor may a lock another thread held be taken)
    _stuck, _stuck_guard = {}, threading.Lock()


#: Held while a queue file is opened and made known to ``_every``, and by a thread that forks.
_opening = threading.Lock()


def _before_fork() -> None:
    _opening.acquire()


def _after_fork_in_parent() -> None:
    _opening.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_forget_in_child
    )


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


def _open(database: str) -> _QueueFile | None:
    """A new open file on the queue file, or None if it cannot be had (no directory, no
    permission): the writer then goes without the queue, and tries again next time.
    Read-only is enough for flock. Opened and made known to ``_every`` under ``_opening``,
    which a fork waits for: a child forked in between would keep a copy nobody closes."""
    with _opening:
        try:
            fd = os.open(queue_file(database), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return None
        return _QueueFile(fd)


def _queue(database: str) -> _QueueFile | None:
    files = _held.files
    queue = files.get(database)
    if queue is None:
        queue = _open(database)
        if queue is None:
            return None
        if len(files) >= KEEP:  # close the oldest idle one
            for name, old in list(files.items()):
                if not old.depth:
                    del files[name]
                    old.close()
                    break
        files[database] = queue
    return queue


@contextlib.contextmanager
def turn(database: str | None, connection: Callable[[], Any] | None = None) -> Iterator[float]:
    """Hold this thread's turn to write ``database`` (a file path; None: no queue) for the
    body: begin, write and commit inside it. Yields the seconds spent waiting for it.

    ``connection()`` (the sqlite3 connection the body will write on) is asked for its busy
    timeout, which bounds the wait unless this process waits without one (``set_blocking``):
    past it the body runs without the turn."""
    queue = None if database is None or fcntl is None else _queue(database)
    if queue is None or database is None:
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
                if _blocking:
                    fcntl.flock(queue.fd, fcntl.LOCK_EX)
                else:
                    _take_within(queue, database, connection)
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    raise
                # a filesystem without flock: SQLite's busy handler alone, as before
            waited = time.monotonic() - started
        yield waited
    finally:
        # The unlock is the first call made here: CPython runs a signal handler only after a
        # call or as a function (or this generator) resumes, so a handler raising as the turn
        # ends (a shutdown, a soft time limit) comes before this block, which then still runs
        # whole, or after the unlock. Unlocking (rather than closing) lets go for every copy
        # of the open file, a child's forked meanwhile by another thread too.
        if queue.depth == 1:
            via = queue.via
            fd = queue.fd if via is None else via.fd
            if fd >= 0:  # -1: a forked child's, closed at fork
                # not ``contextlib.suppress``: its call would come before the unlock
                try:  # noqa: SIM105
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except OSError:  # not held (no flock here, or interrupted)
                    pass
            queue.via = None
            if via is not None:
                via.close()
        queue.depth -= 1


#: database file -> waiting threads of this process whose writers left (their timeout came
#: first): while there is one, the turn is held by a frozen writer, and nobody waits anew.
_stuck: dict[str, int] = {}
_stuck_guard = threading.Lock()


def _unstuck(database: str) -> None:
    with _stuck_guard:
        left = _stuck.get(database, 0) - 1
        if left > 0:
            _stuck[database] = left
        else:
            _stuck.pop(database, None)


def _patience(connection: Callable[[], Any] | None) -> float:
    if connection is not None:
        with contextlib.suppress(Exception):  # a connection that cannot say: the default
            (ms,) = connection().execute("PRAGMA busy_timeout").fetchone()
            return int(ms) / 1000
    return DEFAULT_PATIENCE_SECONDS


def _take_within(queue: _QueueFile, database: str, connection: Callable[[], Any] | None) -> None:
    """Take the turn at once on the thread's own file, or else within the busy timeout
    through an open file of its own, waited on by a thread of its own (``queue.via``, set
    as the lock comes). Past the timeout, returns without the turn."""
    try:
        fcntl.flock(queue.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    with _stuck_guard:
        if _stuck.get(database):
            # A waiting thread of this process already outwaited its writer's timeout and is
            # still in the queue: the turn is held by a frozen writer. Around the queue at once,
            # to SQLite's busy timeout, rather than one more thread and file left waiting for
            # every write as long as the freeze lasts.
            return
    patience = _patience(connection)
    mine = _open(database)
    if mine is None:
        return
    # Its own open file, never the thread's: a lock that comes after its writer left is let
    # go by unlocking and closing this file, which nobody else uses (a descriptor number
    # closed under a blocked flock could be reused by then, and unlocking the thread's own
    # file would end whatever turn it holds by then). In ``_every``: a child closes its copy.
    came, lock = threading.Event(), threading.Lock()
    # plain flags, read under ``lock`` with no call in between (no signal handler between)
    abandoned = running = counted = taken = False

    def wait() -> None:
        nonlocal running, taken
        with lock:
            if abandoned:  # its writer left before this thread ran
                mine.close()
                return
            running = True
        with contextlib.suppress(OSError):  # the writer is told by ``came``, either way
            fcntl.flock(mine.fd, fcntl.LOCK_EX)
        with lock:
            if abandoned:
                mine.release()  # its writer went on without it: let go at once
                if counted:
                    _unstuck(database)
            else:
                queue.via = mine
                taken = True
                came.set()

    try:
        # started inside the ``try``: a signal handler raising in ``start`` (which waits for
        # the thread to run) must abandon the wait too, or the lock, once it came, would be
        # kept for a turn that has ended
        threading.Thread(target=wait, name="toolledger-writers-turn", daemon=True).start()
        came.wait(patience)
    finally:
        with lock:
            if not taken:  # the timeout, or a signal handler raising in the wait
                abandoned = True
                if running:  # blocked in flock: the turn's holder is stuck, say so
                    counted = True
                    with _stuck_guard:
                        _stuck[database] = _stuck.get(database, 0) + 1
    if taken:
        return
    log.warning(
        "the writers' queue of %s was held for %.1f s (a writer frozen in its turn?): "
        "writing without it",
        database,
        patience,
    )


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
