"""What ``serve`` and ``proxy`` share: which call a request is, and how a receipt is told.

A call's identity comes from the wire, so every part of it goes through the ledger's input
rules (``toolledger.ledger.inputs``) before anything is recorded; a refusal is answered as a
tool error (``isError``, one line), never a crash of the server.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import secrets
import sys
import threading
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import anyio
import anyio.from_thread
import anyio.lowlevel
import mcp.types as types
from anyio.streams.memory import MemoryObjectReceiveStream
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from toolledger.ledger.errors import InvalidIdentifier
from toolledger.ledger.identity import check_scope, check_text_id
from toolledger.ledger.records import Receipt
from toolledger.mcp import (
    META_EXECUTION_ID,
    META_RECONCILED,
    META_REVIEW,
    META_SCOPE,
    META_STATUS,
    META_TOOL_CALL_ID,
)

log = logging.getLogger("toolledger.mcp")

#: Longest tool_call_id accepted (as on the command line).
MAX_TOOL_CALL_ID = 256


def new_session() -> str:
    """A name for this server's one stdio session: the default scope is ``mcp-<session>``."""
    return secrets.token_hex(6)


@dataclass(frozen=True)
class CallIdentity:
    """Where a call is recorded: its scope and its tool_call_id."""

    scope: str
    tool_call_id: str
    #: Whether the host named the call (``_meta``); if not, asking again is a new call.
    named_by_host: bool = True
    #: Whether the scope is this connection's own (``mcp-<session>``: no ``--scope``, none in
    #: ``_meta``): a reconnected host lands in another, so it must send this one to find it.
    session_scope: bool = False


def call_identity(
    meta: Mapping[str, Any] | None,
    request_id: int | str | None,
    *,
    scope: str,
    session: str,
) -> CallIdentity:
    """The call a ``tools/call`` request is: ``_meta["toolledger/tool_call_id"]`` if given,
    else ``rpc-<session>-<request id>`` — JSON-RPC ids are unique only within one connection
    (clients count from 0 again on each), so the session makes them unique across
    connections; ``_meta["toolledger/scope"]`` if given, else ``scope``.

    Raises InputError (nothing recorded) for an id or scope outside the input rules."""
    raw_id = meta.get(META_TOOL_CALL_ID) if meta else None
    named = raw_id is not None
    if raw_id is None:
        if request_id is None:
            raise InvalidIdentifier(f"tool_call_id: no _meta {META_TOOL_CALL_ID!r}, no request id")
        raw_id = f"rpc-{session}-{request_id}"
    tool_call_id = check_text_id(raw_id, "tool_call_id", MAX_TOOL_CALL_ID)
    raw_scope = meta.get(META_SCOPE) if meta else None
    where = check_scope(scope if raw_scope is None else raw_scope)
    return CallIdentity(where, tool_call_id, named, raw_scope is None and where == f"mcp-{session}")


def one_line(message: str) -> str:
    """An error as one printable line, whatever it quotes."""
    text = " ".join(str(message).split())
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_result(message: str) -> types.CallToolResult:
    """A refusal the model can read: nothing was recorded, nothing ran."""
    return types.CallToolResult(
        content=[types.TextContent(text=one_line(message))],
        is_error=True,
    )


def receipt_meta(receipt: Receipt) -> dict[str, Any]:
    """The result's ``_meta``: which call this is and how it stands."""
    return {
        META_SCOPE: receipt.scope,
        META_TOOL_CALL_ID: receipt.tool_call_id,
        META_STATUS: receipt.status.value,
        META_EXECUTION_ID: receipt.execution_id,
        META_RECONCILED: receipt.reconciled,
        META_REVIEW: receipt.review,
    }


def receipt_result(receipt: Receipt) -> types.CallToolResult:
    """A receipt as the tool result: its text, and ``isError`` as the receipt says (failed,
    rejected, and ``unknown``: the effect may or may not have happened, never a success)."""
    return types.CallToolResult(
        content=[types.TextContent(text=receipt.text)],
        structured_content=receipt.content,
        is_error=receipt.is_error,
        _meta=receipt_meta(receipt),
    )


#: The status of a call whose submit or wait the database failed (``client.UNANSWERED``).
UNANSWERED = "unanswered"


def pending_result(ident: CallIdentity, status: str) -> types.CallToolResult:
    """No receipt yet: the call's status, never an invented result. Not an error: the call
    goes on, and the same tool_call_id later gets its receipt. Only the host can ask with that
    id: the text is the model's, and a model told to "call the tool again with the same
    toolledger/tool_call_id" can only make a new tool call, under a new id; with a host that
    names calls by the model's ids (``mcp_call_meta``) that is a new call, and the tool ran a
    second time (a cold review). So the text never invites a new call, named or not.
    ``UNANSWERED``: the database failed the submit or the wait, and whether the call was
    recorded is not known."""
    if ident.named_by_host:
        again = (
            "Do not make a new call of the tool for it: a new tool call is a new action and "
            f"runs again. Asked with this call's own toolledger/tool_call_id "
            f"({ident.tool_call_id!r}) again, the server answers its result: it will not run "
            "again."
        )
        if ident.session_scope:  # a promise only this connection keeps
            again += (
                f" After a reconnect, also send _meta {META_SCOPE!r} = {ident.scope!r}: this "
                "connection's calls are kept in that scope, and a new connection has a scope "
                "of its own (where the same id would be a new call)."
            )
    else:
        again = (
            f"Do not call the tool again for it: without a toolledger/tool_call_id of yours "
            f"a second call is a new call and runs again. Its result will be recorded as "
            f"{ident.tool_call_id!r} in scope {ident.scope!r} (toolledger wait)."
        )
    if status == UNANSWERED:  # the database failed once the submit may have committed
        said = (
            "The ledger's database did not answer about this tool call: it may have been "
            "recorded, and then it runs. No result is available now."
        )
    else:
        said = f"This tool call has not finished yet: it is {status}. No result is available now."
    content = {"status": status, "finished": False, "message": f"{said} {again}"}
    return types.CallToolResult(
        content=[types.TextContent(text=json.dumps(content, ensure_ascii=False))],
        structured_content=content,
        is_error=False,
        _meta={
            META_SCOPE: ident.scope,
            META_TOOL_CALL_ID: ident.tool_call_id,
            META_STATUS: status,
        },
    )


def log_to_stderr(level: int = logging.WARNING) -> None:
    """stdout is the protocol's: every log line goes to stderr (the host's log)."""
    logging.basicConfig(
        stream=sys.stderr, level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )


#: What a screened line that broke the input rules is replaced with, then its reason: no JSON
#: (the SDK's parse fails on the NUL), told to the host by ``answering_malformed``.
_REFUSED = "\x00toolledger-refused: "
#: The same, for JSON that is no request: answered -32600, "Invalid Request".
_INVALID = "\x00toolledger-invalid: "
#: The same, for a batch (a JSON array), then the ids of its requests as a JSON array: MCP
#: dropped JSON-RPC batches (2025-06-18) and the SDK reads none, so each request of one is
#: refused -32600 under its own id (it was one error, id null: the host never heard about its
#: requests, and waited on each of them for ever).
_BATCH = "\x00toolledger-batch: "


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def screened(raw: bytes) -> str:
    """A line from the host as the SDK will parse it, if it keeps the input rules
    (``toolledger.ledger.inputs``) the SDK does not: strict UTF-8 (the SDK's reader put U+FFFD
    for a bad byte, in a path, a content, a call id) and no key twice in one object (the SDK
    keeps the last: ``"name"`` twice ran the second tool, ``_meta``'s scope twice recorded the
    call in the second). Else a line the SDK cannot parse, carrying why."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"{_REFUSED}not UTF-8 (byte {exc.start} of the line)\n"
    try:
        message = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        return f"{_REFUSED}duplicate key {one_line(str(exc.args[0]))[:200]!r} in one object\n"
    except (ValueError, RecursionError):
        return text  # not JSON: the SDK says so
    if isinstance(message, list) and message:  # ``[]`` is the SDK's -32600, id null
        ids = [m["id"] for m in message if _a_request(m)]
        return f"{_BATCH}{json.dumps(ids)}\n"
    request = isinstance(message, dict) and "method" in message  # not a response of the host's
    if request and "id" in message and not _an_id(message["id"]):
        # the SDK read it as a notification and nobody answered: the host waited for ever
        kind = type(message["id"]).__name__
        return f"{_INVALID}an id is a string or an integer, not {kind}\n"
    return text


def _a_request(message: Any) -> bool:
    """Whether ``message`` (parsed JSON) is a request a host waits on: a method, an id."""
    return isinstance(message, dict) and "method" in message and _an_id(message.get("id"))


def _a_response(message: Any) -> bool:
    """Whether ``message`` (parsed JSON) answers a request: an id, a result or an error."""
    return (
        isinstance(message, dict)
        and "method" not in message
        and ("result" in message or "error" in message)
        and _an_id(message.get("id"))
    )


def _refused_line(errors: list[Any]) -> Any:
    """The line the SDK refused, as parsed JSON where it can be read: the text it could not
    parse, else the object nearest the top (a string or an object within its params or its
    result is no line: its id would name another request). Read on this path only."""
    for error in sorted(errors, key=lambda e: len(e.get("loc", ()))):
        line = error.get("input")
        if error.get("type") == "json_invalid" and isinstance(line, str):
            with contextlib.suppress(ValueError, RecursionError):
                line = json.loads(line)
        if isinstance(line, dict) and "id" in line:
            return line
    return None


def _request_id(errors: list[Any]) -> types.RequestId | None:
    """The id of the request the SDK refused, if the line it read is one (JSON-RPC 2.0 §5:
    null only when the id cannot be read): a request with an escaped lone surrogate, nested
    past the SDK's depth, or with a member of the wrong type was answered id null, and the
    host never heard about its own id (a cold review)."""
    line = _refused_line(errors)
    return line["id"] if _a_request(line) else None


def response_id(errors: list[Any]) -> types.RequestId | None:
    """The id of the request an answer the SDK refused (from an upstream: a ``result`` that
    is null or no object, an escaped lone surrogate) was meant for, else None."""
    line = _refused_line(errors)
    return line["id"] if _a_response(line) else None


def _an_id(value: Any) -> bool:
    """An id MCP allows: a string, or an integer (not a boolean, a float, null)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


class InFlight:
    """The calls being answered. At the input's end ``StdinLines`` gives them up to
    ``DRAIN_SECONDS`` to be answered, then ``cut``s their waits: each answers with where its
    call stands (not finished yet: asking again gets its receipt), never "Connection closed"
    and never a wait as long as ``--timeout`` (unbounded) before the server exits."""

    def __init__(self) -> None:
        self.count = 0
        self.cutting = False
        self._waits: set[anyio.CancelScope] = set()

    def __call__(self) -> int:
        return self.count

    @contextlib.contextmanager
    def one(self) -> Iterator[None]:
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1

    @contextlib.contextmanager
    def waiting(self) -> Iterator[anyio.CancelScope]:
        """A wait for a receipt that ``cut`` ends (``cancelled_caught`` then says so)."""
        scope = anyio.CancelScope()
        if self.cutting:
            scope.cancel()
        self._waits.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._waits.discard(scope)

    def cut(self) -> None:
        self.cutting = True
        for scope in list(self._waits):
            scope.cancel()


#: How long no call must be in flight, at the input's end, before the session ends.
_SETTLE = 0.2
#: At the input's end: how long the calls in flight are waited for, then how long their
#: answers (their statuses, once their waits are cut) may take.
DRAIN_SECONDS = 10.0
CUT_GRACE = 5.0


class StdinLines:
    """The host's stdin as ``stdio_server`` reads it (``async for line``), each line
    ``screened``, read by a daemon thread. The SDK's own reader blocks one of anyio's worker
    threads (not a daemon, and not abandoned when cancelled) in ``read`` until the host closes
    stdin, so a proxy told to stop by SIGTERM could neither unwind (its upstream never
    stopped) nor exit."""

    def __init__(self, in_flight: InFlight | None = None, drain: float = DRAIN_SECONDS) -> None:
        """``in_flight``: the calls being answered; at the input's end they are given up to
        ``drain`` seconds to be answered, then their waits are cut and they answer with their
        statuses, before the session ends (the MCP host's way to stop a stdio server is to
        close its stdin, then to wait for it to exit: it was cancelled at once, and every call
        in flight answered "Connection closed", one that had succeeded included)."""
        self._send, self._receive = anyio.create_memory_object_stream[str](16)
        self._in_flight, self._drain, self._ended_here = in_flight, drain, False
        # the thread's for the process's life (a private dup)
        binary = open(os.dup(sys.stdin.fileno()), "rb")  # noqa: SIM115
        token = anyio.lowlevel.current_token()
        threading.Thread(
            target=self._pump, args=(binary, token), name="toolledger-stdin", daemon=True
        ).start()

    def _pump(self, binary: BinaryIO, token: anyio.lowlevel.EventLoopToken) -> None:
        # the loop ended, or stdin broke: the end of the input either way
        with contextlib.suppress(Exception):
            for raw in iter(binary.readline, b""):
                anyio.from_thread.run(self._send.send, screened(raw), token=token)
        with contextlib.suppress(Exception):
            anyio.from_thread.run_sync(self._send.close, token=token)

    def end(self) -> None:
        """End the input here, as if the host had closed stdin (the thread's next line, if
        one comes, goes nowhere): the session then ends as it does at EOF, at once."""
        self._ended_here = True
        self._send.close()

    def __aiter__(self) -> StdinLines:
        return self

    async def __anext__(self) -> str:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            if self._in_flight is not None and not self._ended_here:
                await self._answered(self._in_flight)
            raise StopAsyncIteration from None

    async def _answered(self, in_flight: InFlight) -> None:
        """Wait (at most ``drain`` seconds) until no call is being answered; then cut their
        waits and give their answers ``CUT_GRACE`` more. The last lines read may still be on
        their way to their handlers: none is counted until it starts, so the count is read
        only after it has stayed at zero for ``_SETTLE`` seconds."""

        async def idle() -> None:
            idle_since = anyio.current_time()
            while anyio.current_time() - idle_since < _SETTLE:
                await anyio.sleep(0.02)
                if in_flight():
                    idle_since = anyio.current_time()

        with anyio.move_on_after(self._drain) as draining:
            await idle()
        if draining.cancelled_caught:
            in_flight.cut()
            with anyio.move_on_after(CUT_GRACE):
                await idle()


class StdoutLines:
    """The host's stdout as ``stdio_server`` writes it (``await write(line)``, then
    ``flush()``), each line written by a daemon thread while its writer awaits it on the loop,
    where a stop can cancel the wait. The SDK's own writer blocks one of anyio's worker threads
    (not a daemon, and not abandoned when cancelled) in ``write`` while the host reads nothing:
    SIGTERM then stopped neither the proxy nor its upstream until the host read again (a cold
    review). A write cut off so is abandoned with its thread, as ``StdinLines``'s read is.

    fd 1 points at stderr until the ``with`` block ends, as the SDK's writer has it: a stray
    ``print`` misses the wire."""

    def __init__(self) -> None:
        self._lines: queue.SimpleQueue[tuple[bytes, anyio.Event]] = queue.SimpleQueue()
        self._broken: OSError | None = None  # the host closed its end: raised as the SDK's was
        # the thread's for the process's life (a private dup, never closed under it)
        self._wire = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
        os.dup2(2, 1)
        token = anyio.lowlevel.current_token()
        threading.Thread(
            target=self._pump, args=(token,), name="toolledger-stdout", daemon=True
        ).start()

    def _pump(self, token: anyio.lowlevel.EventLoopToken) -> None:
        with contextlib.suppress(Exception):  # the loop ended: nobody waits for a line
            while True:
                data, written = self._lines.get()
                try:
                    while data and self._broken is None:
                        data = data[os.write(self._wire, data) :]
                except OSError as exc:
                    self._broken = exc
                anyio.from_thread.run_sync(written.set, token=token)

    async def write(self, text: str) -> int:
        """Return once the line is in the pipe (a full pipe holds the writer, as the SDK's
        ``write`` then ``flush`` did)."""
        written = anyio.Event()
        self._lines.put((text.encode("utf-8"), written))
        await written.wait()
        if self._broken is not None:
            raise self._broken
        return len(text)

    async def flush(self) -> None:
        """Nothing to do: ``write`` returned once its line was written."""

    def __enter__(self) -> StdoutLines:
        return self

    def __exit__(self, *_exc: object) -> None:
        """Point fd 1 at the wire again (a write still blocked goes on, on its own dup)."""
        with contextlib.suppress(OSError):
            os.dup2(self._wire, 1)


class _Sends(Protocol):
    async def send(self, item: SessionMessage, /) -> None: ...


@contextlib.asynccontextmanager
async def answering_malformed(
    read: AsyncIterable[SessionMessage | Exception], write: _Sends
) -> AsyncIterator[MemoryObjectReceiveStream[SessionMessage | Exception]]:
    """The host's messages, each line that is no JSON-RPC message answered as JSON-RPC 2.0
    asks — an error with id null: -32700 for text that is not JSON, -32600 for JSON that is no
    message — where the SDK's server drops it without a word (a host waiting on a reply to a
    request it mangled waited forever); and a second ``initialize`` once a tool was called
    refused (``_initialized_already``)."""
    send, receive = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    # a tools/call was passed on in a session: its id is spent on this connection (one sent
    # before any handshake, refused by the SDK, spends nothing)
    initialized = called = False

    async def pump() -> None:
        nonlocal initialized, called
        async with send:
            async for item in read:
                if not isinstance(item, Exception):
                    request = item.message
                    if isinstance(request, types.JSONRPCRequest):
                        if request.method == "initialize" and called:
                            await write.send(_initialized_already(request.id))
                            continue
                        called = called or (initialized and request.method == "tools/call")
                        initialized = initialized or request.method == "initialize"
                    await send.send(item)
                    continue
                errors = item.errors() if isinstance(item, ValidationError) else []
                not_json = any(e["type"] == "json_invalid" for e in errors)
                code, text = (
                    (types.PARSE_ERROR, "Parse error")
                    if not_json
                    else (types.INVALID_REQUEST, "Invalid Request")
                )
                line = errors[0].get("input") if errors else None
                if isinstance(line, str) and line.startswith(_BATCH):
                    ids = json.loads(line.removeprefix(_BATCH))
                    log.warning("a batch from the host refused: %d requests", len(ids))
                    for refused in ids or [None]:  # its notifications alone: once, id null
                        await write.send(_batch_refused(refused))
                    continue
                if isinstance(line, str) and line.startswith(_REFUSED):
                    text = f"{text}: {line.removeprefix(_REFUSED).strip()}"
                elif isinstance(line, str) and line.startswith(_INVALID):
                    code = types.INVALID_REQUEST
                    text = f"Invalid Request: {line.removeprefix(_INVALID).strip()}"
                log.warning("a line from the host is no JSON-RPC message: %s", text)
                error = types.ErrorData(code=code, message=text)
                refused = _request_id(errors)
                await write.send(
                    SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=refused, error=error))
                )

    async with anyio.create_task_group() as pumping:
        pumping.start_soon(pump)
        try:
            yield receive
        finally:
            pumping.cancel_scope.cancel()


def _batch_refused(request_id: types.RequestId | None) -> SessionMessage:
    """The answer to each request of a batch: refused, nothing run (none was recorded)."""
    error = types.ErrorData(
        code=types.INVALID_REQUEST,
        message=(
            "Invalid Request: a JSON-RPC batch is not supported (MCP removed batching in "
            "2025-06-18): nothing in it was run; send each message on a line of its own"
        ),
    )
    return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error))


def _initialized_already(request_id: types.RequestId) -> SessionMessage:
    """The answer to an ``initialize`` on a connection whose tools were called already. A
    host's new session counts its request ids again, and a call it does not name
    (``rpc-<session>-<id>``) was taken for the earlier call of that id: the same arguments got
    that call's result, nothing run (the SDK accepted the second handshake; a cold review).
    Refused as the TypeScript SDK refuses one ("Server already initialized"): a new session
    is a new server process."""
    error = types.ErrorData(
        code=types.INVALID_REQUEST,
        message=(
            "Invalid Request: this connection is initialized and has called tools already: a "
            "new session's request ids would name its earlier calls; start a new server "
            "process for a new session"
        ),
    )
    log.warning("a second initialize, after tools were called, refused")
    return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error))
