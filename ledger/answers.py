"""A client-side bound on the wait for a statement's answer (Postgres's hot statements).

The server bounds a statement (``statement_timeout``) and the kernel notices a peer that stops
acknowledging (``tcp_user_timeout``, keepalives). Neither notices a peer that acknowledges
every packet and never answers: a PgBouncer or a proxy hung once it had forwarded the
statement, its kernel still answering keepalive probes. The statement may have committed,
its answer never comes, and psycopg waits for ever: a threads worker's thread (no time limit
cuts it) hung on a claim or a terminal write for good, the call's committed bytes never
landing, and with every thread so caught the worker took no job again (a review, 12-07).

Past its deadline the wait's socket is shut down: psycopg's wait ends in an
``OperationalError``, which the executor already reads as a commit that may have landed
(re-read by execution id and lease token). One thread a process keeps the deadlines.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import os
import socket
import threading
import time
from collections.abc import Iterator


class _Wait:
    __slots__ = ("cut", "done", "fd")

    def __init__(self, fd: int) -> None:
        self.fd, self.done, self.cut = fd, False, False


class AnswerWatch:
    """Cuts the connections whose statements wait past their deadlines (``bounded``)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cv = threading.Condition()
        self._due: list[tuple[float, int, _Wait]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._wakes_at = math.inf

    @contextlib.contextmanager
    def bounded(self, fd: int, seconds: float) -> Iterator[_Wait]:
        """Shut the socket ``fd`` down if the block has not ended ``seconds`` from now; the
        wait's ``cut`` then says so."""
        wait = _Wait(fd)
        self._add(time.monotonic() + seconds, wait)
        try:
            yield wait
        finally:
            with self._cv:  # under the lock: never cut once the block has ended
                wait.done = True
                while self._due and self._due[0][2].done:  # ended in order, most often
                    heapq.heappop(self._due)

    def _add(self, deadline: float, wait: _Wait) -> None:
        if self._pid != os.getpid():  # forked: the thread is the parent's, the lock may be held
            self._reset()
        with self._cv:
            heapq.heappush(self._due, (deadline, next(self._order), wait))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="toolledger-answer-watch", daemon=True
                )
                self._thread.start()
            elif deadline < self._wakes_at:
                self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while True:
                while self._due and self._due[0][2].done:
                    heapq.heappop(self._due)
                now = time.monotonic()
                if self._due and self._due[0][0] <= now:
                    _cut(heapq.heappop(self._due)[2])
                    continue
                self._wakes_at = self._due[0][0] if self._due else math.inf
                self._cv.wait(None if not self._due else self._wakes_at - now)
                self._wakes_at = math.inf


def _cut(wait: _Wait) -> None:
    """Shut the waiting connection's socket down (a duplicate descriptor, closed after: the
    connection's own stays its owner's to close)."""
    wait.cut = True
    with (
        contextlib.suppress(OSError),
        socket.fromfd(wait.fd, socket.AF_INET, socket.SOCK_STREAM) as dup,
    ):
        dup.shutdown(socket.SHUT_RDWR)


#: This process's watch.
WATCH = AnswerWatch()


def answer_wait(timeout: float | None) -> float | None:
    """How long a statement's answer is waited for under the ledger's ``timeout``: past the
    server's own bound (which cancels it, and answers) by as much again, at least a second
    (a commit's flush is outside ``statement_timeout``). None: for ever, as before."""
    return None if timeout is None else timeout + max(timeout, 1.0)
