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

A raw item pushed onto a queue (``LPUSH toolledger garbage``) that is not a kombu message
is dropped here with one line: kombu decoded it inside the worker's event loop, and a
``JSONDecodeError`` (or a ``KeyError`` for an envelope without ``properties``) stopped the
worker ("Unrecoverable error"); each such item stopped one more worker of the fleet (a
review, 2026-12-07). A job's message is only a pointer: a call it named is still approved
in the ledger, re-published by the sweep's outbox.
"""

from __future__ import annotations

import binascii
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Empty
from typing import Any

from kombu.transport import redis as kombu_redis

log = logging.getLogger("toolledger.worker")

#: What decoding an item that is not a kombu message raises (deep nesting: RecursionError).
_UNREADABLE = (json.JSONDecodeError, UnicodeDecodeError, RecursionError)


def envelope_fault(payload: Any, channel: Any) -> str | None:
    """What keeps a decoded item from being a kombu message a virtual channel can deliver,
    or None: a mapping with ``properties`` holding a text ``delivery_tag`` and a
    ``delivery_info`` mapping, headers a mapping or none, a body kombu can decode."""
    if not isinstance(payload, dict):
        return "not a mapping"
    properties = payload.get("properties")
    if not isinstance(properties, dict) or not isinstance(properties.get("delivery_tag"), str):
        return "no properties with a delivery tag"
    if not isinstance(properties.get("delivery_info", {}), dict):
        return "its delivery info is not a mapping"
    if not isinstance(payload.get("headers") or {}, dict):
        return "its headers are not a mapping"
    body, encoding = payload.get("body"), properties.get("body_encoding")
    if body is not None and not isinstance(body, str):
        return "its body is not text"
    if encoding is not None and not isinstance(encoding, str):
        return "its body encoding is not text"
    if body and encoding and encoding.lower() != "utf-8" and channel is not None:
        if encoding not in channel.codecs:
            return "its body encoding is unknown"
        try:
            channel.decode_body(body, encoding)
        except (binascii.Error, ValueError, TypeError):
            return "its body does not decode"
    return None


def dropped(queue: str | None, why: str) -> None:
    """One line for an item dropped from a queue (never its contents)."""
    where = f"queue {queue}" if queue else "a queue"
    log.error("dropped an item on %s that is not a kombu message: %s", where, why)


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
        except _UNREADABLE as exc:  # popped, undecodable: gone from the queue, dropped
            dropped(None, type(exc).__name__)
            return True

    def _get(self, queue: str, timeout: Any = None) -> Any:
        try:
            return super()._get(queue)  # type: ignore[no-untyped-call]
        except _UNREADABLE as exc:
            dropped(queue, type(exc).__name__)
            raise Empty() from None


class Transport(kombu_redis.Transport):
    Channel = Channel

    def _deliver(self, message: Any, queue: str) -> None:
        why = envelope_fault(message, self.channels[0] if self.channels else None)
        if why is not None:
            dropped(queue, why)
            return
        super()._deliver(message, queue)  # type: ignore[no-untyped-call]
