"""Celery's prefork pool, with the locks of its shared queues released when their holder dies.

On a transport without asynchronous support (the embedded broker) Celery runs billiard's
plain ``Pool``: one pipe carries every job to the children and one carries their results
back, each behind a process-shared lock (a POSIX semaphore). An idle child blocks in its read
*holding* the job queue's lock, so a child SIGKILLed while it waits for work (an OOM kill, a
chaos run) takes the lock with it: the children that replace it wait on it for ever and the
worker takes no job again, its messages piling up (both children killed: every time; one: when
it was the one reading). The same lock held the main process for ever in its exit when SIGTERM
reached the whole process group (``exit_when_stuck`` in ``worker/app.py`` is its backstop).

Here those locks are POSIX record locks (``fcntl.lockf``) on an unlinked file of their own,
which the kernel releases when the process holding them dies, however it dies. A job or a
result is one pipe message written under ``PIPE_BUF`` in one ``write`` (billiard's
``send_bytes`` joins header and body below 16 KiB), so a writer killed mid-way leaves all of
it or nothing; a reader killed between a message's header and its body (two ``read``\\ s of a
message already there) is a window of microseconds this does not close.

Used for Celery's ``prefork`` pool under the fork start method: the worker swaps it in at
``worker_init`` (``use_robust_prefork``), however the pool was named (``-P prefork``, the
default, the ``worker_pool`` setting). The asynchronous pool (Redis) gives every child pipes
of its own and is left as it is.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
from typing import Any

from billiard.pool import Pool as BilliardPool
from celery.concurrency import get_implementation
from celery.concurrency.prefork import TaskPool as CeleryPreforkPool

#: How often a timed acquire looks again at a lock another process holds (seconds).
_POLL = 0.01


class ProcessLock:
    """A lock between processes that is released when the process holding it dies.

    A POSIX record lock on an unlinked file of its own: exclusive between processes (a
    forked child does not inherit its parent's lock; the descriptor is inherited, the lock is
    the process's), and released by the kernel at the holder's death, a SIGKILL included.
    Record locks are per process, not per thread, so a thread lock in front of it keeps two
    threads of one process apart; a child makes that one anew (it may be copied held).
    Mind POSIX's rule: closing *any* descriptor of the file drops the process's locks; this
    lock's file has the one descriptor it opened.
    """

    def __init__(self) -> None:
        with tempfile.TemporaryFile(prefix="toolledger-pool-lock-") as f:
            self._fd = os.dup(f.fileno())  # unlinked already: nothing left to clean
        self._pid = os.getpid()
        self._threads = threading.Lock()

    def _local(self) -> threading.Lock:
        if self._pid != os.getpid():  # forked: the thread lock may be a held copy
            self._pid, self._threads = os.getpid(), threading.Lock()
        return self._threads

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        local = self._local()
        deadline = None if timeout is None or not block else time.monotonic() + timeout
        if not block:
            took = local.acquire(False)
        elif timeout is None:
            took = local.acquire()
        else:
            took = local.acquire(True, max(timeout, 0.0))
        if not took:
            return False
        try:
            if block and deadline is None:
                fcntl.lockf(self._fd, fcntl.LOCK_EX)
                return True
            while True:
                try:
                    fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except (BlockingIOError, PermissionError):  # held by another process
                    if deadline is None or time.monotonic() >= deadline:
                        local.release()
                        return False
                    time.sleep(_POLL)
        except BaseException:
            local.release()
            raise

    def release(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN)
        self._local().release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __getstate__(self) -> Any:
        raise TypeError("a ProcessLock is shared by fork only")


class RobustPool(BilliardPool):  # type: ignore[misc]
    """billiard's blocking pool, its queues' locks ProcessLocks (under the fork start method:
    a spawned child gets its queues by pickling, which only billiard's own locks survive)."""

    def _setup_queues(self) -> None:
        super()._setup_queues()
        if self._ctx.get_start_method() != "fork":
            return
        for queue in (self._inqueue, self._outqueue):
            queue._rlock = ProcessLock()
            if queue._wlock is not None:
                queue._wlock = ProcessLock()


class TaskPool(CeleryPreforkPool):  # type: ignore[misc]
    """Celery's prefork pool, running RobustPool where Celery would run billiard's Pool."""

    BlockingPool = RobustPool


def use_robust_prefork(worker: Any) -> None:
    """At ``worker_init``: if the worker is to run Celery's own prefork pool, run ours."""
    if get_implementation(worker.pool_cls) is CeleryPreforkPool:
        worker.pool_cls = TaskPool
