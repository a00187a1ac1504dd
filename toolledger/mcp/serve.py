"""``toolledger mcp serve``: the registered tools as a stdio MCP server, every call through the
ledger.

A ``tools/call`` is submitted approved by the server's ``approved_by`` (the MCP host decides
whether a call may run — its own approval prompt, its policy — before it sends it; this
server records who let it through), executed by the workers like any other call, and
answered with its receipt: the same receipt every time the same call is asked for, so a
host that retries after a crash or a timeout gets the result back instead of a second
effect. A call still running when ``timeout`` runs out is answered with its status, not an
error and not an invented result; it goes on, and asking again gets its receipt.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import mcp.types as types
import sqlalchemy as sa
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

from toolledger.client import AsyncCallHandle, AsyncClient, ReceiptTimeout
from toolledger.config import Settings
from toolledger.ledger import inputs
from toolledger.ledger.errors import LedgerError
from toolledger.ledger.identity import check_scope, check_text_id
from toolledger.mcp import DEFAULT_TIMEOUT, META_SCOPE, META_TOOL_CALL_ID
from toolledger.mcp.common import (
    UNANSWERED,
    InFlight,
    StdinLines,
    StdoutLines,
    answering_malformed,
    call_identity,
    error_result,
    log_to_stderr,
    new_session,
    one_line,
    pending_result,
    receipt_result,
)

if TYPE_CHECKING:
    from anyio import AsyncFile
from toolledger.registry import load_registry
from toolledger.tools import Registry, Tool, UnknownTool
from toolledger.worker import reads

log = logging.getLogger("toolledger.mcp")
T = TypeVar("T")

INSTRUCTIONS = (
    "Every tool call runs at most once through the toolledger ledger. Send "
    f"_meta[{META_TOOL_CALL_ID!r}] with the model's tool call id (and optionally "
    f"_meta[{META_SCOPE!r}]): calling again with the same id returns the same result instead "
    "of running the tool again. A result that says it has not finished is not a failure, "
    "and the call goes on: the host asks again with the same id for its result; a new tool "
    "call (a new id) would run the tool again. Unless the server was started with a scope, "
    "a call sent "
    f"without _meta[{META_SCOPE!r}] is kept in this connection's own scope: after a "
    "reconnect, send the scope its result named (_meta) with the same id."
)


def hints(tool: Tool) -> types.ToolAnnotations:
    """The tool's contract as MCP hints: read-only, idempotent, and destructive when it is
    neither; a sandboxed tool touches nothing outside its scope's sandbox (a closed world)."""
    return types.ToolAnnotations(
        read_only_hint=tool.read_only,
        idempotent_hint=tool.idempotent,
        destructive_hint=not tool.read_only and not tool.idempotent,
        open_world_hint=False if tool.sandboxed else None,
    )


def mcp_tool(tool: Tool) -> types.Tool:
    """A registered tool as ``tools/list`` lists it: its pydantic schema, its contract."""
    return types.Tool(
        name=tool.name,
        description=tool.description,
        input_schema=tool.json_schema(),
        annotations=hints(tool),
    )


def _read_only(registry: Registry, name: str) -> bool:
    try:
        return registry.get(name).read_only
    except UnknownTool:
        return False  # the submit says so (or answers a call the ledger holds)


#: Read-only runs a server keeps at once, given-up ones included (each a thread and, in the
#: read, a pooled connection): past it a call is answered "busy, ask again", never queued.
READS_AT_ONCE = reads.READS_AT_ONCE
_reads = reads.ReadSlots(READS_AT_ONCE)


async def _read_apart(
    timeout: float, in_flight: InFlight, fn: Callable[..., T], *args: Any, **kwargs: Any
) -> tuple[T | None, str]:
    """``fn(...)`` (a read-only tool's run, in the submit) in a daemon thread of its own
    (``ReadSlots``), given up (None, and why) after ``timeout`` (0: not bounded by it, a
    read's result being in hand or nowhere: helper-94, every read answered "did not finish
    within 0 s") or when the input ends and the drain's time is up. A
    read-only tool ran inline, past ``--timeout``, and kept the server from exiting after
    stdin closed for as long as it ran (helper-93: 40 s); a thread of a pool would hold the
    exit too (asyncio's and anyio's are joined). Given up, it runs on unseen: a read changes
    nothing and is not recorded. At most ``READS_AT_ONCE`` run: given-up reads asked again
    and again started a thread each, a connection each, without end (helper-94, suspected)."""
    slots = _reads
    done = slots.start(fn, *args, **kwargs)
    if done is None:
        return None, f"was not started: {slots.at_once} reads still run on this server"
    with anyio.move_on_after(timeout if timeout > 0 else math.inf) as bound:
        with in_flight.waiting():
            return await asyncio.shield(done), ""
    if bound.cancelled_caught:
        return None, f"did not finish within {timeout:g} s (--timeout)"
    return None, "did not finish before the input ended"


def build_server(
    client: AsyncClient,
    registry: Registry,
    *,
    scope: str,
    session: str,
    approved_by: str,
    timeout: float,
    in_flight: InFlight,
    warmed: anyio.Event | None = None,
) -> Server[Any]:
    """The MCP server: ``tools/list`` from ``registry``, ``tools/call`` through ``client``
    (each counted ``in_flight`` while it is answered; none submitted before ``warmed``)."""
    listed = types.ListToolsResult(tools=[mcp_tool(t) for t in registry])

    async def list_tools(
        _ctx: ServerRequestContext[Any], _params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return listed

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        with in_flight.one():
            if warmed is not None:  # the first publish's imports paid before a commit
                await warmed.wait()
            return await answer(ctx, params)

    async def answer(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        try:
            ident = call_identity(params.meta, ctx.request_id, scope=scope, session=session)
            args = inputs.check_value(params.arguments or {}, "arguments")
            if _read_only(registry, params.name):  # it runs here, now: bounded here
                submitted, cut = await _read_apart(
                    timeout, in_flight, client.sync.submit,
                    ident.scope, ident.tool_call_id, params.name, args, approved_by=approved_by,
                )  # fmt: skip
                if submitted is None:
                    return error_result(
                        f"the read-only tool {params.name!r} {cut}; a read is not recorded: "
                        "ask again"
                    )
                handle = AsyncCallHandle(client, submitted)
            else:
                handle = await client.submit(
                    ident.scope, ident.tool_call_id, params.name, args, approved_by=approved_by
                )
        except UnknownTool:  # neither registered here nor a call the ledger holds (a tool
            # gone from the registry since its call ran is answered with its receipt)
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}") from None
        except LedgerError as exc:  # input refused, a conflict: nothing recorded
            return error_result(str(exc))
        except sa.exc.SQLAlchemyError as exc:  # it may or may not be recorded
            if _read_only(registry, params.name):  # a read changes nothing: ask again
                raise MCPError(types.INTERNAL_ERROR, _db_error(exc)) from None
            # an error the model reads invites another call, under a new request id where
            # the host names none: a second effect (the integrations' cold review)
            log.warning("%s/%s: %s", ident.scope, ident.tool_call_id, _db_error(exc))
            return pending_result(ident, UNANSWERED)
        receipt = None
        try:
            with in_flight.waiting():  # cut at the input's end, once the drain's time is up
                receipt = await handle.result(timeout=timeout)
            if receipt is None:  # cut: where it stands (its receipt, if it came meanwhile)
                receipt = await handle.result(timeout=0)
        except ReceiptTimeout as exc:  # the database not answering it: where it is unknown
            return pending_result(ident, UNANSWERED if exc.unanswered else exc.status)
        except sa.exc.SQLAlchemyError as exc:  # recorded: where it stands is not known
            log.warning("%s/%s: %s", ident.scope, ident.tool_call_id, _db_error(exc))
            return pending_result(ident, UNANSWERED)
        return receipt_result(receipt)

    return Server(
        "toolledger",
        version=version("toolledger"),
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


def _db_error(exc: sa.exc.SQLAlchemyError) -> str:
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return one_line(f"ledger unavailable: {detail[0] if detail else type(exc).__name__}")


async def serve(
    settings: Settings,
    *,
    scope: str | None = None,
    approved_by: str = "mcp",
    timeout: float = DEFAULT_TIMEOUT,
) -> None:
    """Serve the registered tools over stdio until the host closes stdin.

    ``scope``: where calls without ``_meta["toolledger/scope"]`` go (None: ``mcp-<session>``,
    one scope per server process, i.e. per host connection)."""
    log_to_stderr()
    registry = load_registry(settings.tools)  # a tool module that does not load: exit 2
    check_text_id(approved_by, "approver", inputs.MAX_ACTOR)
    session = new_session()
    default_scope = check_scope(scope if scope is not None else f"mcp-{session}")
    client = AsyncClient(settings)
    in_flight = InFlight()
    warmed = anyio.Event()

    async def warm() -> None:
        """``Client.warm`` while the host starts the session, calls waiting on it: the first
        call's publish imported Celery and the broker's transport between its commit and its
        send (1.2-1.4 s), and a server killed there left the call unpublished, a server
        started again within 5 s waiting out its ``--timeout`` for it (a cold review). Not
        before ``initialize``: a host's 5 s for it (the OpenAI Agents SDK's) is short enough."""
        try:
            await anyio.to_thread.run_sync(client.sync.warm)
        finally:
            warmed.set()

    try:
        server = build_server(
            client,
            registry,
            scope=default_scope,
            session=session,
            approved_by=approved_by,
            timeout=timeout,
            in_flight=in_flight,
            warmed=warmed,
        )
        # at the input's end, the calls in flight are answered before the session ends
        lines = StdinLines(in_flight)
        stdin = cast("AsyncFile[str]", lines)
        # a SIGINT while the host reads nothing stops serve all the same (StdoutLines): the
        # SDK's writer, stuck in a full pipe, held the unwinding for as long as nobody read
        with StdoutLines() as out:
            stdout = cast("AsyncFile[str]", out)
            async with (
                stdio_server(stdin, stdout) as (raw, write),
                answering_malformed(raw, write) as read,
                anyio.create_task_group() as warming,
            ):
                warming.start_soon(warm)
                await server.run(read, write, server.create_initialization_options())
    finally:
        await client.close()
