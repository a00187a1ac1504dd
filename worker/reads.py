"""Read-only runs apart: the bound that ``mcp serve`` and ``toolledger serve`` share.

A read-only tool runs at once, where it is asked (nothing is recorded, no worker takes it).
Run on an event loop's pool of threads, reads that do not end held the threads every other
request waits for (a cold review: 45 reads of 20 s posted by an agent token kept a viewer's
inbox waiting 17.7 s). Each runs in a daemon thread of its own instead, at most so many at
once, given-up ones included (each a thread and, in its read, a pooled connection): past
them a read is refused at once, never queued. A thread cannot be stopped: a waiter that gives
up leaves it running unseen (a read changes nothing) until it ends and gives its place back.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Read-only runs a server keeps at once, given-up ones included.
READS_AT_ONCE = 16


class ReadSlots:
    """At most ``at_once`` read-only runs at once, each in a daemon thread of its own (not in
    a pool: the interpreter's exit and an event loop's end would wait for a pool's threads)."""

    def __init__(self, at_once: int = READS_AT_ONCE) -> None:
        self.at_once = at_once
        self._slots = threading.BoundedSemaphore(at_once)

    def start(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T] | None:
        """``fn(...)`` started in a thread of its own, its result (or exception) the future's,
        on the running loop; None, and nothing started, if ``at_once`` runs are running."""
        if not self._slots.acquire(blocking=False):
            return None
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        # an exception nobody waits for any more (given up) is not logged as never retrieved
        done.add_done_callback(lambda f: f.cancelled() or f.exception())

        def deliver(ok: bool, value: Any) -> None:
            if done.done():  # cancelled: a waiter gone, nobody reads it
                return
            if ok:
                done.set_result(value)
            else:
                done.set_exception(value)

        def run() -> None:
            try:
                outcome: tuple[bool, Any] = (True, fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                outcome = (False, exc)
            finally:
                self._slots.release()
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(deliver, *outcome)

        try:
            threading.Thread(target=run, name="toolledger-read", daemon=True).start()
        except BaseException:
            self._slots.release()  # no thread: nothing holds it
            raise
        return done
