"""kombu's Redis transport, with one client per channel instead of one per command, and
an item on a queue that is not a kombu message dropped, never a worker stopped.

kombu's ``Channel.conn_or_acquire`` builds a new ``redis.Redis`` (a ``PrefixedStrictRedis``
under a key prefix) for every publish, ack and restore it makes without a client in hand.
redis-py's constructor fills a table of some 170 response callbacks each time: 0.13 ms here,
paid twice per call end to end (the producer's publish, the worker's ack), about a tenth of
the Python CPU of each. A client is only a view on the channel's connection pool, and it is
thread-safe (every command and every pipeline checks out a connection of its own), so one per
channel serves them all; it is made again if the channel's pool was replaced (a reconnect).

Chosen for ``redis://`` brokers by ``worker.app`` (Celery's own ``broker_transport``
setting); ``rediss://`` and Sentinel keep kombu's transports as they are, and so does a
failover list (``redis://a;redis://b``) once it fails over: kombu reads the scheme again.

An item on a queue that is no kombu message (a raw ``LPUSH``) is dropped with one line
(``worker.envelope``), never a worker stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from queue import Empty
from typing import Any

from kombu.transport import redis as kombu_redis

from toolledger.worker.envelope import UNREADABLE, DropsForeignItems, dropped

#: Celery's ``broker_transport`` value that selects this transport.
NAME = "toolledger.worker.redis_transport:Transport"


class Channel(kombu_redis.Channel):
    _shared_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        shared = self._shared_client
        if shared is None or shared.connection_pool is not self.pool:
            shared = self._shared_client = self._create_client()  # type: ignore[no-untyped-call]
        yield shared

    def _brpop_read(self, **options: Any) -> bool:
        try:
            return bool(super()._brpop_read(**options))  # type: ignore[no-untyped-call]
        except UNREADABLE as exc:  # popped, undecodable: gone from the queue, dropped
            dropped(None, type(exc).__name__)
            return True

    def _get(self, queue: str, timeout: Any = None) -> Any:
        try:
            return super()._get(queue)  # type: ignore[no-untyped-call]
        except UNREADABLE as exc:
            dropped(queue, type(exc).__name__)
            raise Empty() from None


class Transport(DropsForeignItems, kombu_redis.Transport):
    Channel = Channel
