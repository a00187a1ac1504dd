"""A virtual transport's item that is no kombu message (a raw Redis ``LPUSH``, a row written
into the embedded broker's table): what is wrong with it, and its one log line. kombu
decoded such an item inside the worker's event loop and the error stopped the worker
("Unrecoverable error"), one worker per item (a review, 2026-12-07); the transports of
``worker.redis_transport`` and ``worker.broker`` drop it instead. A job's message is only a
pointer: a call it named is still approved in the ledger, re-published by the sweep's outbox.
"""

from __future__ import annotations

import binascii
import json
import logging
from typing import Any

log = logging.getLogger("toolledger.worker")

#: What decoding an item that is not a kombu message raises (deep nesting: RecursionError).
UNREADABLE = (json.JSONDecodeError, UnicodeDecodeError, RecursionError)


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


class DropsForeignItems:
    """A virtual transport's ``_deliver`` that drops an item ``envelope_fault`` finds no
    kombu message, one line, before kombu's own (mixed in before kombu's Transport)."""

    channels: list[Any]

    def _deliver(self, message: Any, queue: str) -> None:
        why = envelope_fault(message, self.channels[0] if self.channels else None)
        if why is not None:
            dropped(queue, why)
            return
        super()._deliver(message, queue)  # type: ignore[misc]
