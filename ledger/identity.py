"""Identities: canonical argument hashes, idempotency keys, execution ids, lease tokens.

The idempotency key names the logical action and is never derived from the arguments:
two independent requests with equal arguments are two actions. The hash only detects a
key reused for different content.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
import uuid
from typing import Any

from toolledger.ledger import inputs
from toolledger.ledger.errors import ArgumentsTooLarge, InvalidArguments, InvalidIdentifier

#: Default cap on the canonical JSON of one call's arguments.
MAX_ARGS_BYTES = 1024 * 1024

_SCOPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TOOL = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: How the ledger names a tool the MCP proxy forwards: ``mcp.`` and the upstream's own name.
#: A registered tool's name has no dot, so no proxied call can ever be taken for a registered
#: tool of the same name (by a worker handed it, a reconciler, a retry): they do not know it.
#: The upstream's name may hold the '.' and '/' MCP allows in tool names (SEP-986,
#: ``admin.tools.list``, ``user-profile/update``), and its 1 to 128 characters; a tool name
#: is never a path.
PROXIED_PREFIX = "mcp."
_PROXIED = re.compile(r"mcp\.[A-Za-z0-9_./-]{1,128}")


def canonical_json(value: Any) -> str:
    """Keys sorted, no spaces, non-ASCII kept as is, NaN and Infinity refused."""
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as exc:
        raise InvalidArguments(f"arguments are not valid JSON: {exc}") from exc
    except TypeError as exc:
        raise InvalidArguments(f"arguments are not JSON-serialisable: {exc}") from exc


def args_sha256(args: Any) -> str:
    """SHA-256 hex of the canonical JSON of ``args``."""
    return hashlib.sha256(canonical_json(args).encode("utf-8")).hexdigest()


def check_args(args: Any, max_bytes: int = MAX_ARGS_BYTES) -> str:
    """Refuse anything but a JSON object within the cap; return its args_sha256."""
    if not isinstance(args, dict):
        raise InvalidArguments(f"arguments must be a JSON object, not {type(args).__name__}")
    inputs.check_value(args, "arguments")
    encoded = canonical_json(args).encode("utf-8")
    if len(encoded) > max_bytes:
        raise ArgumentsTooLarge(
            f"arguments are {len(encoded)} bytes of canonical JSON, over the cap of {max_bytes}"
        )
    return hashlib.sha256(encoded).hexdigest()


def check_scope(scope: str) -> str:
    """A scope names a sandbox directory: letters, digits, '.', '_', '-', never '..' or '/'."""
    if not isinstance(scope, str) or not _SCOPE.fullmatch(scope) or ".." in scope:
        raise InvalidIdentifier(
            f"scope {scope!r} is not a safe name: 1-128 of [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..'"
        )
    return scope


def check_tool_name(tool: str) -> str:
    """A name the ledger records: a registered tool's, or a proxied one (``mcp.NAME``)."""
    if not isinstance(tool, str) or not (_TOOL.fullmatch(tool) or _PROXIED.fullmatch(tool)):
        raise InvalidIdentifier(
            f"tool name {tool!r} is not 1-64 of [A-Za-z0-9_-] (nor mcp. and 1-128 of "
            "[A-Za-z0-9_./-], a proxied tool's)"
        )
    return tool


def check_registered_name(tool: str) -> str:
    """A name a registered tool may take: never one of the proxy's."""
    if not isinstance(tool, str) or not _TOOL.fullmatch(tool):
        raise InvalidIdentifier(f"tool name {tool!r} is not 1-64 of [A-Za-z0-9_-]")
    return tool


def check_text_id(value: str, what: str, max_len: int = 512) -> str:
    """Non-empty, at most ``max_len`` characters, no control characters (``inputs``)."""
    return inputs.check_identifier(value, what, max_len)


#: Largest attempt number (the column is a 32-bit integer).
MAX_ATTEMPT = 2**31 - 1


def check_attempt(attempt: object, what: str = "attempt", minimum: int = 1) -> int:
    """An integer that fits the column (``True`` is not one)."""
    if type(attempt) is not int or not minimum <= attempt <= MAX_ATTEMPT:
        raise InvalidArguments(f"{what} must be an integer {minimum}..{MAX_ATTEMPT}")
    return attempt


def check_new_tool_call_id(tool_call_id: str) -> str:
    """A tool_call_id the ledger records anew: never a URL path's dot segment, which HTTP
    clients and browsers remove, so the console could not open such a call nor the API
    name it. Only for new calls: one recorded before is still replayed (a refusal would tell
    the model that a call which took effect had failed)."""
    if tool_call_id in (".", ".."):
        raise InvalidIdentifier(
            f"tool_call_id {tool_call_id!r} is a dot segment: the console and the HTTP API "
            "could not name it in a URL (clients remove it)"
        )
    return tool_call_id


def default_key(tool: str, tool_call_id: str) -> str:
    """``"{tool}:{tool_call_id}"``: one logical action per call the model made."""
    check_tool_name(tool)
    check_text_id(tool_call_id, "tool_call_id", 256)
    return f"{tool}:{tool_call_id}"


def service_key(scope: str, idempotency_key: str) -> str:
    """The key a service outside the ledger deduplicates a call's effect by: ``SCOPE/KEY``.
    An idempotency key is unique within its scope only (two conversations' ``call_1`` share
    ``tool:call_1``), and a service deduplicating by it alone gave one call another's receipt
    (a cold review). A scope holds no ``/``, so the two parts never run together."""
    return f"{scope}/{idempotency_key}"


def new_execution_id() -> str:
    """A UUIDv7 (RFC 9562): unique per attempt and ordered by time, kind to B-tree indexes."""
    unix_ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (unix_ms & 0xFFFF_FFFF_FFFF) << 80 | rand
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return str(uuid.UUID(int=value))


def new_lease_token() -> str:
    """The fence a claim holds: every write by its executor must present it."""
    return secrets.token_hex(16)


def check_call(
    scope: str,
    tool_call_id: str,
    tool: str,
    args: Any,
    key: str | None = None,
    max_bytes: int = MAX_ARGS_BYTES,
) -> tuple[str, str]:
    """Every check on a submission that needs no database; returns (key, args_sha256)."""
    check_scope(scope)
    check_text_id(tool_call_id, "tool_call_id", 256)
    check_tool_name(tool)
    key = default_key(tool, tool_call_id) if key is None else check_text_id(key, "key")
    return key, check_args(args, max_bytes)
