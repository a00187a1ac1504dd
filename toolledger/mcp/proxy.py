"""``toolledger mcp proxy -- COMMAND``: another MCP server's tools, each call at most once.

The proxy starts the upstream server as its child (stdio), lists its tools once, and serves
them over its own stdio. A ``tools/call`` goes through the ledger as a worker's job would:

1. **submit**, approved by ``approved_by`` (the MCP host decided before sending it): the
   same call again (same scope and tool_call_id) finds the record, never a second one;
2. **claim** under a lease, by this process (``running`` is committed before anything is
   sent upstream); only the claim's winner forwards, so a call is forwarded at most once
   per authorised attempt, whoever asks and however often;
3. **forward** upstream with the idempotency key in ``_meta["toolledger/idempotency_key"]``
   and ``SCOPE/KEY`` (``identity.service_key``: unique across the ledger's scopes) in
   ``_meta["toolledger/service_key"]``,
   renewing the lease every lease/3 while it runs, for at most ``--time-limit`` seconds
   (an hour unless given: long enough for any upstream call that works, short of for ever,
   and not a worker's 20 s, which would cut calls that used to finish): a forward still
   unanswered then is cancelled upstream
   (``notifications/cancelled``) and recorded ``unknown`` — without a limit, an upstream that
   hangs would keep the call ``running`` forever, its lease renewed, out of the sweep's reach;
4. **finish** with the upstream's ``CallToolResult`` serialised as the result (``succeeded``,
   or ``failed`` when it says ``isError``); an upstream that answers with a protocol error
   or breaks the connection instead leaves the call ``unknown``: whether the tool ran
   cannot be told from here.

SIGTERM (or SIGHUP) stops the proxy at once, as an MCP host does after closing its stdin:
each forward still running is cancelled upstream and recorded ``unknown`` by the proxy itself
(no sweep needed), then the upstream is stopped (its stdin closed, then its process tree
killed), so that no upstream outlives its proxy.

Every answer is the call's receipt, rebuilt from the ledger: the first answer and every
replay are the same. A proxy killed (or frozen) mid-forward leaves its execution ``running``;
once its lease and the sweep's grace (``TOOLLEDGER_SWEEP_GRACE``, as this proxy reads it)
have passed, the sweep marks it ``unknown``, or a proxy asked about the call does (no
reconciler knows an upstream tool, so it stays there for a human: ``toolledger resolve``), and
the same call asked again is answered with that unknown receipt — it is never forwarded again.

Upstream tools are not in the registry, and the ledger records them as ``mcp.NAME``, a name
no registered tool can take (an upstream ``write_file`` is never the built-in one): the ledger
and the sweep need nothing from the registry for them (an unknown tool has no reconciler and
no fence, so its unknown calls wait for a human; ``retry`` refuses them). A worker that is
handed one ends it ``failed`` without running anything: the worker does not know the tool.
Neither the sweep's re-publishing of approved work nobody claimed nor a replayed submit
publishes one: a proxy sends it, the next one asked for the call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Sequence
from functools import partial
from typing import Any, TypeVar, cast

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import jsonschema
import jsonschema.exceptions
import jsonschema.protocols
import jsonschema.validators
import mcp.types as types
import pydantic
import sqlalchemy as sa
from anyio.streams.memory import MemoryObjectSendStream
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from toolledger.client import AsyncClient, ReceiptTimeout
from toolledger.config import ConfigError, Settings
from toolledger.ledger import inputs
from toolledger.ledger.errors import (
    InputError,
    InvalidArguments,
    LedgerError,
    NotFound,
    StaleFence,
)
from toolledger.ledger.identity import (
    PROXIED_PREFIX,
    check_call,
    check_scope,
    check_text_id,
    check_tool_name,
    service_key,
)
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.receipts import DISPUTED_MESSAGE
from toolledger.ledger.records import Claim, OperationRecord, Receipt
from toolledger.ledger.transitions import Status
from toolledger.mcp import DEFAULT_TIMEOUT, META_IDEMPOTENCY_KEY, META_SERVICE_KEY, patterns
from toolledger.mcp.common import (
    UNANSWERED,
    CallIdentity,
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
    receipt_meta,
    receipt_result,
    response_id,
)

log = logging.getLogger("toolledger.mcp")
T = TypeVar("T")

#: How many times a terminal write is tried after a database error, and the first pause.
RECORD_TRIES = 6
RECORD_BACKOFF_SECONDS = 0.2

_TOOL_NAME = "1-128 of [A-Za-z0-9_./-]"

#: The reasons the proxy records a forward ``unknown`` with when it is stopped.
STOPPED_MID_FORWARD = (
    "the proxy was stopped while the upstream ran it: cancelled upstream, whether it ran is unknown"
)
STOPPED_BEFORE_SEND = "not sent upstream: the proxy was stopped between its claim and its send"
NOT_SENT = {"content": [{"type": "text", "text": STOPPED_BEFORE_SEND}], "isError": True}
UNCONFIRMED_BEFORE_SEND = (
    "not sent upstream: its lease could not be confirmed before the send (the database did "
    "not answer)"
)


class UpstreamError(Exception):
    """The upstream server could not be started, initialised or listed."""


def upstream_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the upstream server starts with: the proxy's own, without the
    ``TOOLLEDGER_*`` settings (a ledger URL may hold a password; the upstream needs none)."""
    env = base if base is not None else dict(os.environ)
    return {k: v for k, v in env.items() if not k.startswith("TOOLLEDGER_")}


def refusal(tools: Sequence[types.Tool], idempotent: set[str]) -> str | None:
    """Why the proxy cannot serve these upstream tools (None: it can). A name the ledger
    cannot record is refused, not mapped: a mapped name would differ from the one the model
    was told and the one the upstream's own logs show."""
    names = [t.name for t in tools]
    bad = [n for n in names if not _valid_name(n)]
    if bad:
        return (
            f"upstream tool name {bad[0]!r} is not a toolledger tool name ({_TOOL_NAME})"
            + (f", nor are {len(bad) - 1} more" if len(bad) > 1 else "")
            + ": the proxy cannot record its calls"
        )
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return f"the upstream lists the tool {twice[0]!r} more than once"
    unknown = sorted(idempotent - set(names))
    if unknown:
        return f"--idempotent {unknown[0]!r}: the upstream has no such tool"
    return None


def _valid_name(name: str) -> bool:
    try:
        check_tool_name(ledger_name(name))
    except InputError:
        return False
    return True


def ledger_name(upstream_name: str) -> str:
    """The name the ledger records an upstream tool's calls under."""
    return PROXIED_PREFIX + upstream_name


def stored_result(result: types.CallToolResult) -> dict[str, Any]:
    """The upstream's result as the ledger keeps it: the ``CallToolResult``'s wire fields
    (``content``, ``structuredContent``, ``isError``, and its ``_meta`` but for keys under
    ``toolledger/``, which are the proxy's to say). A result outside the ledger's input
    rules (a lone surrogate, an integer past 64 bits) is kept as a note saying so."""
    content = [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in result.content]
    stored: dict[str, Any] = {"content": content, "isError": result.is_error}
    if result.structured_content is not None:
        stored["structuredContent"] = result.structured_content
    if theirs := _upstream_meta(result.meta):  # the host's due too: it was dropped (a review)
        stored["_meta"] = theirs
    try:
        inputs.check_value(stored, "upstream result")
    except InputError as exc:
        note = f"the upstream's result could not be recorded as it was: {exc}"
        stored = {"content": [{"type": "text", "text": note}], "isError": result.is_error}
    return stored


def _upstream_meta(meta: Any) -> dict[str, Any]:
    """The upstream result's ``_meta`` keys that are not ``toolledger/``'s: an upstream never
    says how the call stands in the ledger."""
    if not isinstance(meta, dict):
        return {}
    return {k: v for k, v in meta.items() if not str(k).startswith("toolledger/")}


def reply(receipt: Receipt) -> types.CallToolResult:
    """The answer for a receipt: the upstream's own result rebuilt when the receipt holds one,
    else the receipt's text (unknown, rejected, a human's resolution)."""
    content = receipt.content
    if receipt.status in (Status.SUCCEEDED, Status.FAILED) and isinstance(
        content.get("content"), list
    ):
        blocks = list(content["content"])
        if receipt.disputed:
            # the rebuilt result dropped what the receipt says of the dispute: the model read
            # the upstream's "charged $10" alone (a cold review); whether it is disputed is the
            # receipt's to say (``in_doubt``), not the first flag's name
            blocks.append({"type": "text", "text": DISPUTED_MESSAGE})
        try:
            rebuilt = types.CallToolResult.model_validate(
                {
                    "content": blocks,
                    "structuredContent": content.get("structuredContent"),
                    "isError": receipt.is_error,
                    "_meta": {**_upstream_meta(content.get("_meta")), **receipt_meta(receipt)},
                }
            )
        except pydantic.ValidationError:
            pass
        else:
            return rebuilt
    return receipt_result(receipt)


class Proxy:
    """The handlers of the proxy's own server, and the forwards it runs."""

    def __init__(
        self,
        client: AsyncClient,
        ledger: Ledger,
        upstream: ClientSession,
        tools: Sequence[types.Tool],
        forwards: anyio.abc.TaskGroup,
        gone: anyio.Event,
        *,
        scope: str,
        session: str,
        approved_by: str,
        idempotent: set[str],
        lease: float,
        timeout: float,
        time_limit: float,
        grace: float = 5.0,
        tool_wait: float = 900.0,
    ) -> None:
        self.client, self.ledger, self.upstream = client, ledger, upstream
        self.grace = grace  # past its lease, a forward's row is unknown after this (the sweep's)
        self.tool_wait = tool_wait  # a never-sent call of a tool no more listed: failed after
        self.forwards, self.gone = forwards, gone
        self.scope, self.session, self.approved_by = scope, session, approved_by
        self.idempotent, self.lease, self.timeout = idempotent, lease, timeout
        self.time_limit = time_limit
        self.tools = {t.name: self._relisted(t) for t in tools}
        self.validators = {t.name: _validator(t) for t in tools}
        self.worker_id = f"mcp-proxy@{socket.gethostname()}:{os.getpid()}"
        self.in_flight = InFlight()  # calls being answered (answered at the input's end)

    def _relisted(self, tool: types.Tool) -> types.Tool:
        """The upstream tool as the proxy lists it: idempotent only if ``--idempotent`` says
        so (the upstream's hints are hints)."""
        hints = tool.annotations or types.ToolAnnotations()
        idempotent = tool.name in self.idempotent
        # No outputSchema: the proxy's own answers (not finished yet, unknown, a human's
        # resolution) carry structured content of their own, which a host's SDK checked
        # against the upstream's schema and turned into an error (a cold review)
        # Its _meta without keys under toolledger/, as a result's: a host may send a tool's
        # _meta with each of its calls (the OpenAI Agents SDK does, over its own keys), and an
        # upstream's "toolledger/tool_call_id" there named every call alike, the second
        # answered the first's result, never run (a cold review)
        return tool.model_copy(
            update={
                "annotations": hints.model_copy(update={"idempotent_hint": idempotent}),
                "output_schema": None,
                "meta": _upstream_meta(tool.meta) or None,
            }
        )

    def server(self) -> Server[Any]:
        return Server(
            "toolledger-proxy",
            version=_version(),
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
        )

    async def _db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs))

    # ------------------------------------------------------------------ handlers

    async def list_tools(
        self, _ctx: ServerRequestContext[Any], _params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=list(self.tools.values()))

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        with self.in_flight.one():
            return await self._call_tool(ctx, params)

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if params.name not in self.tools:
            return await self._replay_unlisted(ctx, params)
        if self.gone.is_set():  # nothing more is sent: a recorded call gets its receipt (an
            # error in its place, "nothing was sent", told a call that had run it had not)
            return await self._replay_unlisted(ctx, params, _upstream_gone())
        try:
            ident = call_identity(
                params.meta, ctx.request_id, scope=self.scope, session=self.session
            )
            args = inputs.check_value(params.arguments or {}, "arguments")
            await self._check_new(params.name, args, ident)
        except LedgerError as exc:  # input refused: nothing recorded
            return error_result(str(exc))
        # From the submit to the forward's start, a host's cancellation (or stdin closing)
        # waits: cut in between, the call stayed approved and never sent, and the sweep's
        # re-publishing then had a worker fail it "unknown tool", its id spent (a cold review)
        with anyio.CancelScope(shield=True):
            try:
                submitted = await self._db(
                    self.ledger.submit,
                    ident.scope,
                    ident.tool_call_id,
                    ledger_name(params.name),
                    args,
                    approved_by=self.approved_by,
                    actor="mcp-proxy",
                )
            except LedgerError as exc:  # input refused, a conflict: nothing recorded
                return error_result(str(exc))
            except sa.exc.SQLAlchemyError as exc:  # it may or may not be recorded: ask again
                raise MCPError(types.INTERNAL_ERROR, _db_error(exc)) from None
            op = submitted.operation
            try:
                if op.status is Status.RUNNING:
                    await self._expire(op)
                if op.status is Status.APPROVED:
                    self._check_upstream()  # recorded, not claimed: the next proxy sends it
                    claim = await self._claim(op)
                    if claim is not None:  # ours: forwarded once, in the background, so that
                        self.forwards.start_soon(self._forward, claim)  # a timeout stops no one
            except sa.exc.SQLAlchemyError as exc:
                raise MCPError(types.INTERNAL_ERROR, _db_error(exc)) from None
        return await self._answer(ident)

    async def _claim(self, op: OperationRecord) -> Claim | None:
        """The call's authorised attempt, claimed by this proxy (None: another took it)."""
        return await self._db(
            self.ledger.claim,
            op.scope,
            op.idempotency_key,
            op.authorized_attempts,
            worker_id=self.worker_id,
            lease_seconds=self.lease,
        )

    async def _answer(self, ident: CallIdentity) -> types.CallToolResult:
        """The call's receipt, once it is there (within ``timeout``), else where it stands."""
        receipt = None
        try:
            with self.in_flight.waiting():  # cut at the input's end, once the drain's time is up
                receipt = await self.client.wait(
                    ident.scope, ident.tool_call_id, timeout=self.timeout
                )
            if receipt is None:  # cut: where it stands (its receipt, if it came meanwhile)
                receipt = await self.client.wait(ident.scope, ident.tool_call_id, timeout=0)
        except ReceiptTimeout as exc:  # the database not answering it: where it is unknown
            return pending_result(ident, UNANSWERED if exc.unanswered else exc.status)
        except sa.exc.SQLAlchemyError as exc:
            # recorded, and perhaps forwarded already: an error the model reads invites
            # another call, under a new request id where the host names none, forwarded
            # again (a cold review of the day's diff, as serve's). Before the claim an error
            # stays an error: a call recorded but never claimed is never forwarded by itself
            log.warning("%s/%s: %s", ident.scope, ident.tool_call_id, _db_error(exc))
            return pending_result(ident, UNANSWERED)
        return reply(receipt)

    async def _replay_unlisted(
        self,
        ctx: ServerRequestContext[Any],
        params: types.CallToolRequestParams,
        refused: MCPError | None = None,
    ) -> types.CallToolResult:
        """A tool the upstream does not list (no more, since an upgrade): the call is answered
        from the ledger if it is recorded (same id, key and arguments), as ``mcp serve``
        answers one of a tool gone from its registry; refused "unknown tool" before, a call
        that ran read as one that never did (a cold review). Only a new call is refused
        (``refused``, else "unknown tool"). Nothing is sent upstream, nor claimed: the
        upstream has no such tool to send it to (or has exited)."""
        unknown = refused or MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}")
        try:
            ident = call_identity(
                params.meta, ctx.request_id, scope=self.scope, session=self.session
            )
            args = inputs.check_value(params.arguments or {}, "arguments")
            op = await self._db(self._recorded_call, ident, params.name, args)
        except LedgerError:  # not a call the ledger could hold
            raise unknown from None
        except sa.exc.SQLAlchemyError as exc:
            raise MCPError(types.INTERNAL_ERROR, _db_error(exc)) from None
        if op is None:
            raise unknown
        if op.status is Status.RUNNING:
            await self._expire(op)
        if op.status is Status.APPROVED and refused is None:
            await self._never_sent(op, params.name)
        return await self._answer(ident)

    async def _never_sent(self, op: OperationRecord, name: str) -> None:
        """A call recorded and never claimed (its proxy killed between the two), of a tool the
        upstream no longer lists: it was never sent (a proxy sends only what it claimed), and
        it can be sent nowhere now. Past ``tool_wait`` (``TOOLLEDGER_TOOL_WAIT``, as a worker
        that does not load a call's tool waits for one that does) from its approval, it is
        claimed and failed, not sent: it stayed approved for ever, answered "not finished"
        each time it was asked, out of the sweep's reach (it publishes no proxy's call) and
        of a person's (a cold review). Sooner, the upstream may list the tool again (a
        restart): left approved, sent by the proxy it is asked of then. Housekeeping: a
        database failure is logged, and the answer goes on."""
        try:
            if self.tool_wait > 0 and await self._db(
                self.ledger.authorised_within, op.scope, op.idempotency_key, self.tool_wait
            ):
                return
            claim = await self._claim(op)
        except sa.exc.SQLAlchemyError as exc:
            log.warning("%s/%s: not failed: %s", op.scope, op.idempotency_key, _db_error(exc))
            return
        if claim is None:  # another proxy took it meanwhile: its record answers
            return
        said = (
            f"not sent upstream: the upstream server no longer lists the tool {name!r}, and "
            f"the call was never sent (its proxy stopped between recording it and sending it)"
        )
        log.warning("%s: %s", claim.execution_id, said)
        with anyio.CancelScope(shield=True):  # claimed: on record before anything else
            await self._record(
                claim,
                Status.FAILED,
                {"content": [{"type": "text", "text": said}], "isError": True},
                said,
            )

    def _recorded_call(
        self, ident: CallIdentity, name: str, args: dict[str, Any]
    ) -> OperationRecord | None:
        """The operation recorded for this very call (its id, key and arguments), else None."""
        key, sha = check_call(ident.scope, ident.tool_call_id, ledger_name(name), args)
        try:
            recorded = self.ledger.key_for(ident.scope, ident.tool_call_id)
        except NotFound:
            return None
        op = self.ledger.operation(ident.scope, recorded) if recorded == key else None
        return op if op is not None and op.args_sha256 == sha else None

    async def _expire(self, op: OperationRecord) -> None:
        """A running call's forwarding proxy may be dead (killed mid-forward): past its lease
        and the sweep's grace (the database's clock), its row is unknown now, as the sweep
        would mark it. A proxy alone has no sweep: the host was told "not finished yet" for
        good (a cold review). Housekeeping: a failure is logged, and the answer goes on."""
        try:
            await self._db(
                self.ledger.mark_expired,
                grace_seconds=self.grace,
                limit=10,
                actor="mcp-proxy",
                call=(op.scope, op.idempotency_key),
            )
        except sa.exc.SQLAlchemyError as exc:
            log.warning("%s/%s: expired leases not marked: %s", op.scope, op.idempotency_key,
                        type(exc).__name__)  # fmt: skip

    async def _check_new(self, name: str, args: dict[str, Any], ident: CallIdentity) -> None:
        """Refuse arguments the upstream's ``inputSchema`` refuses, for a call not recorded
        yet: one already recorded is answered from the ledger (its replay, or a conflict),
        whatever the upstream's schema says now (refused after an upgrade of the upstream, a
        call that ran read as one that never did). Checked in a thread, within
        ``SCHEMA_CHECK_SECONDS``: never on the loop that renews the leases. The thread stops
        itself at the same deadline, which is cut short when the wait ends early (SIGTERM):
        abandoned, a recursive schema's check burnt a core for hours and held the proxy's
        exit (a cold review)."""
        validator = self.validators[name]
        if validator is None:
            return
        limit = patterns.Deadline(SCHEMA_CHECK_SECONDS)
        try:
            with anyio.fail_after(SCHEMA_CHECK_SECONDS):
                await anyio.to_thread.run_sync(
                    partial(_check_arguments, name, validator, args, limit),
                    abandon_on_cancel=True,
                )
        except (InvalidArguments, TimeoutError) as exc:
            if await self._db(self._recorded, ident):
                return
            if isinstance(exc, TimeoutError):
                raise _unchecked(name) from None
            raise
        finally:
            limit.cut()  # whatever the thread still does, it stops at its next step

    def _recorded(self, ident: CallIdentity) -> bool:
        try:
            self.ledger.get(ident.scope, ident.tool_call_id)
        except NotFound:
            return False
        return True

    def _check_upstream(self) -> None:
        if self.gone.is_set():
            raise _upstream_gone()

    # ------------------------------------------------------------------ the forward

    async def _forward(self, claim: Claim) -> None:
        """Send the claimed call upstream once and record what came back."""
        request = types.CallToolRequest(
            params=types.CallToolRequestParams(
                name=claim.tool.removeprefix(PROXIED_PREFIX),
                arguments=claim.args,
                _meta={
                    # the key as it always went (an upstream deduplicating by it keeps its
                    # history across the upgrade), and the one unique across scopes
                    META_IDEMPOTENCY_KEY: claim.idempotency_key,
                    META_SERVICE_KEY: service_key(claim.scope, claim.idempotency_key),
                },
            )
        )
        try:
            if not await self._still_ours(claim):
                return
        except anyio.get_cancelled_exc_class():  # the proxy stops: claimed, never sent
            with anyio.CancelScope(shield=True):
                await self._record(claim, Status.FAILED, NOT_SENT, STOPPED_BEFORE_SEND)
            raise
        result: types.CallToolResult | None = None
        failure = STOPPED_MID_FORWARD
        logged: str | None = None  # the failure as the log says it, where it differs
        try:
            async with anyio.create_task_group() as leases:
                leases.start_soon(self._keep_lease, claim)
                try:
                    with anyio.fail_after(self.time_limit):  # the write and the wait, both
                        result = await self.upstream.send_request(request, types.CallToolResult)
                except TimeoutError:  # cancelled upstream by the SDK as the scope unwound
                    failure = (
                        f"upstream gave no result: no answer within the time limit of "
                        f"{self.time_limit:g} s (--time-limit): cancelled upstream"
                    )
                except Exception as exc:  # noqa: BLE001 - no result: whether it ran is unknown
                    failure = "upstream gave no result: " + _no_contents(exc)
                    if isinstance(exc, MCPError):  # its message is the upstream's: recorded,
                        logged = failure  # for the person who decides; never logged (a review)
                        failure += f": {one_line(exc.message)[:1000]}"
                leases.cancel_scope.cancel()
        except anyio.get_cancelled_exc_class():
            # the proxy stops (SIGTERM): mid-forward, or with the answer in hand while the
            # lease keeper was being stopped. Either way it is recorded before the proxy goes.
            if result is None:
                log.warning("%s: the proxy stops mid-forward: unknown", claim.execution_id)
            with anyio.CancelScope(shield=True):
                await self._outcome(claim, result, failure, logged)
            raise
        with anyio.CancelScope(shield=True):  # a stop meanwhile waits for the record
            await self._outcome(claim, result, failure, logged)

    async def _outcome(
        self,
        claim: Claim,
        result: types.CallToolResult | None,
        failure: str,
        logged: str | None = None,
    ) -> None:
        """Record what the forward came back with: the upstream's result, else unknown
        (``failure`` recorded; ``logged``, else ``failure``, logged)."""
        if result is None:
            log.warning("%s: %s: unknown", claim.execution_id, logged or failure)
            await self._record(claim, Status.UNKNOWN, None, failure)
        else:
            status = Status.FAILED if result.is_error else Status.SUCCEEDED
            error = "the upstream tool reported an error" if result.is_error else None
            await self._record(claim, status, stored_result(result), error)

    async def _still_ours(self, claim: Claim) -> bool:
        """Confirm the lease right before the request goes out: a proxy frozen between its
        claim and its send, whose call the sweep revoked meanwhile, sends nothing — and says
        so, which proves the call not applied (the next sweep reconciles it ``failed``).
        What no lease can close is a freeze between this commit and the send itself: the
        upstream gets the idempotency key in ``_meta`` to refuse a second effect with."""
        try:
            if await self._db(
                self.ledger.renew_lease, claim.execution_id, claim.lease_token, self.lease
            ):
                return True
        except sa.exc.SQLAlchemyError as exc:  # cannot confirm: do not send
            log.warning(
                "%s not sent: the lease could not be confirmed (%s)",
                claim.execution_id,
                _db_error(exc),
            )
            # and on record as never sent, as when stopped before the send: left running, the
            # sweep made it unknown, "possibly applied", for a person (helper-93)
            said = {"content": [{"type": "text", "text": UNCONFIRMED_BEFORE_SEND}], "isError": True}
            await self._record(claim, Status.FAILED, said, UNCONFIRMED_BEFORE_SEND)
            return False
        log.warning("%s not sent: revoked before its forward", claim.execution_id)
        not_sent = {"not_started": True, "absent": True, "worker_id": self.worker_id}
        try:
            await self._db(
                self.ledger.record_late_result,
                claim.execution_id,
                not_sent,
                actor=self.worker_id,
                outcome=None,
            )
        except sa.exc.SQLAlchemyError as exc:
            log.error("%s: 'not sent' not recorded: %s", claim.execution_id, _db_error(exc))
        return False

    async def _keep_lease(self, claim: Claim) -> None:
        """Renew the claim's lease every lease/3 by the database clock while it runs. A lease
        found lost (the sweep declared the call unknown: this process was frozen or cut off)
        cannot stop a request already sent; its result will be recorded as evidence."""
        while True:
            await anyio.sleep(self.lease / 3)
            try:
                ours = await self._db(
                    self.ledger.renew_lease, claim.execution_id, claim.lease_token, self.lease
                )
            except sa.exc.SQLAlchemyError as exc:
                log.warning("lease renewal of %s failed: %s", claim.execution_id, _db_error(exc))
                continue
            if not ours:
                log.warning("lease of %s lost while its forward runs", claim.execution_id)
                return

    async def _record(
        self, claim: Claim, status: Status, result: dict[str, Any] | None, error: str | None
    ) -> None:
        """The terminal write, fenced by the lease token; after a database error the row is
        read again before another try (a commit may succeed while the client sees it fail).
        Revoked meanwhile: the result is kept as evidence (it reconciles an unknown call)."""
        pause = RECORD_BACKOFF_SECONDS
        ambiguous = False  # a try failed: its commit may have succeeded all the same
        for tries_left in range(RECORD_TRIES - 1, -1, -1):
            try:
                await self._db(self._write, claim, status, result, error)
                return
            except StaleFence:
                if not ambiguous or not tries_left:
                    break  # not running under our token: in doubt, the result is evidence
                # maybe our own earlier commit moved the row: read below before calling it late
            except sa.exc.SQLAlchemyError as exc:
                ambiguous = True
                log.warning("terminal write of %s failed: %s", claim.execution_id, _db_error(exc))
            if not tries_left:
                log.error(  # (never the result's contents in a log line: README "Logs")
                    "could not record %s of %s, nor read whether an earlier try did: if it is "
                    "still running, the sweep marks it unknown",
                    status.value,
                    claim.execution_id,
                )
                return
            await anyio.sleep(pause)
            pause *= 2
            try:
                state = await self._db(self.ledger.effect_states, [claim.execution_id])
            except sa.exc.SQLAlchemyError:
                continue
            found = state.get(claim.execution_id)
            if found is not None and found.status is not Status.RUNNING:
                if found.holds_own_write(status):
                    return  # the earlier try committed
                break
        await self._late(claim, status, result, error)

    def _write(
        self, claim: Claim, status: Status, result: dict[str, Any] | None, error: str | None
    ) -> None:
        if status is Status.UNKNOWN:
            self.ledger.mark_unknown(
                claim.execution_id,
                reason=error or "outcome unknown",
                actor=self.worker_id,
                lease_token=claim.lease_token,
            )
            return
        assert result is not None
        self.ledger.finish(claim.execution_id, claim.lease_token, status, result, error=error)

    async def _late(
        self, claim: Claim, status: Status, result: dict[str, Any] | None, error: str | None
    ) -> None:
        proves = status if status is not Status.UNKNOWN else None
        detail: dict[str, Any] = {
            "late_result": result,
            "status": status.value,
            "error": error,
            "worker_id": self.worker_id,
            "attempt": claim.attempt,
            "staged": [],
            "landed": False,
            "proves": proves.value if proves else None,
            "idempotent": claim.tool.removeprefix(PROXIED_PREFIX) in self.idempotent,
        }
        log.warning("%s was revoked: its result is kept as evidence", claim.execution_id)
        try:
            await self._db(
                self.ledger.record_late_result,
                claim.execution_id,
                detail,
                actor=self.worker_id,
                outcome=proves,
                idempotent=claim.tool.removeprefix(PROXIED_PREFIX) in self.idempotent,
            )
        except sa.exc.SQLAlchemyError as exc:
            log.error(  # (never the result's contents in a log line: README "Logs")
                "late result of %s not recorded (%s)", claim.execution_id, _db_error(exc)
            )


def _no_contents(exc: Exception) -> str:
    """What went wrong, in one line that quotes nothing of the upstream's answer: pydantic's
    message for a malformed result quotes it (``input_value=…``), and it reached the log at
    WARNING, where no call's contents go (a cold review)."""
    if isinstance(exc, pydantic.ValidationError):
        first = exc.errors(include_input=False, include_url=False)[:1]
        where = ".".join(str(p) for p in first[0]["loc"]) if first else "?"
        said = one_line(first[0]["msg"]) if first else "invalid"
        return f"a malformed result ({exc.error_count()} errors; at {where}: {said})"
    if isinstance(exc, MCPError):  # the upstream's own error: its message is its words
        return f"MCPError (code {exc.code})"
    return one_line(f"{type(exc).__name__}: {exc}")


def _canonical(value: Any) -> Any:
    """A hashable stand-in for a JSON value, equal where JSON Schema's equality says equal
    (1 and 1.0 alike, true and 1 not; objects regardless of key order)."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", value)
    if isinstance(value, str):
        return ("s", value)
    if value is None:
        return ("z",)
    if isinstance(value, list):
        return ("l", tuple(_canonical(v) for v in value))
    if isinstance(value, dict):
        return ("d", frozenset((k, _canonical(v)) for k, v in value.items()))
    return ("o", repr(value))


def _unique_items(
    validator: Any, unique: Any, instance: Any, _schema: Any
) -> Iterator[jsonschema.ValidationError]:
    """``uniqueItems`` in linear time: jsonschema's own compares unhashable items pairwise
    (a cold review: 8,000 small objects, 103 KB, took 84 s on the proxy's loop)."""
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[Any] = set()
    for item in instance:
        key = _canonical(item)
        if key in seen:
            yield jsonschema.ValidationError("has non-unique elements")
            return
        seen.add(key)


def _validator(tool: types.Tool) -> jsonschema.protocols.Validator | None:
    """A validator of the upstream tool's ``inputSchema`` (its ``$schema``, else JSON Schema
    2020-12, as MCP says); None, with a warning, for a schema that is not one: its calls are
    then forwarded unchecked, as the upstream would take them.

    Each of its keywords first looks at the check's deadline (``patterns.stepping_keyword``): a
    validation's work is keywords applied, each a bounded step but for the subschemas it
    applies (the next steps), so past the deadline the check ends within a step, however many
    its schema would take (an ``anyOf`` of two over a ``$ref`` cycle, and an argument 30
    levels deep: 2^30 of them, hours)."""
    patterns.install()
    schema = tool.input_schema
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    keywords = {**cls.VALIDATORS, "uniqueItems": _unique_items}
    checker: type[jsonschema.protocols.Validator] = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
        cls, {k: patterns.stepping_keyword(fn) for k, fn in keywords.items()}
    )
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        log.warning(
            "upstream tool %r: its inputSchema is not a JSON Schema (%s): its arguments are "
            "not checked",
            tool.name,
            one_line(exc.message),
        )
        return None
    return checker(schema)


def _unchecked(name: str) -> InvalidArguments:
    return InvalidArguments(
        f"arguments could not be checked against {name!r}'s inputSchema within "
        f"{SCHEMA_CHECK_SECONDS:g} s: refused"
    )


def _check_arguments(
    name: str,
    validator: jsonschema.protocols.Validator | None,
    args: dict[str, Any],
    limit: patterns.Deadline | None = None,
) -> None:
    """Refuse (InputError: nothing recorded, nothing sent) arguments the upstream's own
    ``inputSchema`` refuses: recorded and forwarded, such a call would end ``unknown`` or
    ``failed`` with its key spent on a call that could never run. Past ``limit`` (else
    ``SCHEMA_CHECK_SECONDS`` from now), refused as unchecked."""
    if validator is None:
        return
    try:
        with patterns.deadline(limit or patterns.Deadline(SCHEMA_CHECK_SECONDS)):
            error = jsonschema.exceptions.best_match(validator.iter_errors(args))
    except TimeoutError:  # a pattern's search or a step, past the deadline (patterns)
        raise _unchecked(name) from None
    except Exception as exc:  # noqa: BLE001 - a $ref it cannot resolve, say: cannot check
        log.warning(
            "upstream tool %r: its inputSchema cannot be applied (%s): arguments not checked",
            name,
            one_line(f"{type(exc).__name__}: {exc}")[:300],
        )
        return
    if error is None:
        return
    where = "/".join(str(p) for p in error.absolute_path)
    said = one_line(error.message)  # it quotes the value: a long one is cut
    raise InvalidArguments(
        f"arguments refused by {name!r}'s inputSchema"
        + (f" at {where[:100]!r}" if where else "")
        + f": {said[:300]}{'…' if len(said) > 300 else ''}"
    )


def _db_error(exc: sa.exc.SQLAlchemyError) -> str:
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return one_line(f"ledger unavailable: {detail[0] if detail else type(exc).__name__}")


def _upstream_gone() -> MCPError:
    return MCPError(types.INTERNAL_ERROR, "the upstream server has exited: nothing was sent to it")


def _version() -> str:
    from importlib.metadata import version

    return version("toolledger")


#: Seconds a forward may wait for the upstream's answer unless ``--time-limit`` says.
DEFAULT_TIME_LIMIT = 3600.0

#: Seconds a call's arguments may take to be checked against the upstream's schema.
SCHEMA_CHECK_SECONDS = 5.0

#: Seconds the upstream may take to start, initialise and list its tools (``npx -y`` may
#: download its package first).
START_TIMEOUT = 120.0
#: Once the upstream exited: the most the calls in flight take beyond ``--timeout`` to be
#: answered, then the session's own end after the input is ended (``_serve``).
GONE_GRACE = 5.0

#: Pages of ``tools/list`` read at most: an upstream that always says "more" (a cold review's
#: did) stopped the proxy's start for ever.
MAX_TOOL_PAGES = 100


async def _list_all(upstream: ClientSession) -> list[types.Tool]:
    tools: list[types.Tool] = []
    cursor: str | None = None
    seen: set[str] = set()
    for _ in range(MAX_TOOL_PAGES):
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await upstream.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools
        if cursor in seen:
            raise UpstreamError(f"the upstream's tools/list gave the cursor {cursor[:80]!r} twice")
        seen.add(cursor)
    raise UpstreamError(f"the upstream's tools/list has more than {MAX_TOOL_PAGES} pages")


def _only(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def _relay(
    source: AsyncIterable[SessionMessage | Exception],
    sink: MemoryObjectSendStream[SessionMessage | Exception],
    gone: anyio.Event,
    cut: anyio.CancelScope,
) -> None:
    """Pass the upstream's messages on to its session; set ``gone`` when its stdout ends (it
    exited) or ``cut`` is cancelled (``_watch_exit``): from then on the proxy sends it nothing
    (see ``Proxy.call_tool``), and the session's requests in flight end "Connection closed"
    (their forwards record unknown)."""
    try:
        with cut:
            async with sink:
                async for item in source:
                    await sink.send(_unreadable_answer(item))
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
        pass
    finally:
        gone.set()


def _unreadable_answer(item: SessionMessage | Exception) -> SessionMessage | Exception:
    """An answer of the upstream's that the SDK could not read (a ``result`` that is null or
    no object, an escaped lone surrogate) as an error for the request it names: the SDK's
    session dropped it, and the forward waited for ``--time-limit`` (an hour by default),
    its lease renewed, before it was recorded unknown (a cold review). The forward records
    it unknown at once: the upstream answered, whether it ran is not known."""
    if not isinstance(item, ValidationError):
        return item
    request_id = response_id(item.errors())
    if request_id is None:  # no answer of ours to be found in it: the SDK logged it
        return item
    log.warning("the upstream's answer to request %s could not be read", request_id)
    error = types.ErrorData(
        code=types.INTERNAL_ERROR,
        message="the upstream's answer could not be read: no JSON-RPC result or error of MCP's",
    )
    return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error))


#: How often the upstream's process is looked at, and how long its stdout is still read once
#: it has exited: what it wrote before its exit is in the pipe, read at once.
EXIT_POLL_SECONDS = 0.1
EXITED_DRAIN_SECONDS = 1.0


async def _watch_exit(
    spawned: list[anyio.abc.Process], gone: anyio.Event, relay: anyio.CancelScope
) -> None:
    """Take the upstream as gone when its process exits, not only at its stdout's EOF: a child
    it left (a wrapper's background job, npx's grandchild) holds that stdout open, and its
    calls stayed running, leases renewed, its proxy alive until the orphan exited (a cold
    review). ``returncode`` is polled as the SDK's own shutdown does: ``wait()`` also waits
    for the pipes' EOF."""
    if not spawned:
        return
    process = spawned[0]
    while process.returncode is None:
        await anyio.sleep(EXIT_POLL_SECONDS)
    gone.set()  # nothing more is sent; the answers it wrote before it died are still read
    await anyio.sleep(EXITED_DRAIN_SECONDS)
    relay.cancel()


@contextlib.asynccontextmanager
async def _spawned(into: list[anyio.abc.Process]) -> AsyncIterator[None]:
    """The upstream's process, as the SDK's ``stdio_client`` starts it, appended to ``into``:
    the SDK hands it to no one, and only its exit says the upstream is gone when an orphan
    holds its stdout. An SDK without the hook: the exit is not watched (EOF still is)."""
    import mcp.client.stdio as sdk_stdio

    spawn = getattr(sdk_stdio, "_create_platform_compatible_process", None)
    if spawn is None:
        log.warning("this mcp SDK starts its servers unseen: the upstream's exit is not watched")
        yield
        return

    async def spawn_and_keep(*args: Any, **kwargs: Any) -> Any:
        process = await spawn(*args, **kwargs)
        into.append(process)
        return process

    sdk_stdio._create_platform_compatible_process = spawn_and_keep
    try:
        yield
    finally:
        sdk_stdio._create_platform_compatible_process = spawn


def _stop_left_behind(spawned: list[anyio.abc.Process]) -> None:
    """The upstream exited by itself, so the SDK killed none of its process group (its own
    session): what it left running there is stopped with the proxy, as the upstream would
    have been (no upstream outlives its proxy)."""
    if spawned and spawned[0].returncode is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(spawned[0].pid, signal.SIGKILL)


async def proxy(
    settings: Settings,
    command: Sequence[str],
    *,
    scope: str | None = None,
    approved_by: str = "mcp",
    idempotent: Sequence[str] = (),
    lease: float | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    time_limit: float | None = None,
    start_timeout: float = START_TIMEOUT,
) -> None:
    """Start ``command`` as the upstream MCP server and serve its tools over stdio, every call
    through the ledger, until the host closes stdin (in-flight forwards are finished and
    recorded first, each within ``time_limit``), SIGTERM or SIGHUP arrives (in-flight forwards
    are cancelled and recorded unknown, the upstream stopped) or the upstream exits (then
    UpstreamError: a proxy without its upstream stops, so that the host sees it and starts it
    again).

    Raises ConfigError (exit 2) for upstream tools the proxy cannot serve, UpstreamError when
    the upstream does not start, answer, or stay."""
    log_to_stderr()
    if not command:
        raise ConfigError("no upstream command: toolledger mcp proxy -- COMMAND [ARGS...]")
    check_text_id(approved_by, "approver", inputs.MAX_ACTOR)
    lease = settings.lease_seconds if lease is None else lease
    if not lease > 0:
        raise ConfigError(f"--lease must be positive, not {lease}")
    time_limit = DEFAULT_TIME_LIMIT if time_limit is None else time_limit
    if not time_limit > 0:
        raise ConfigError(f"--time-limit must be positive, not {time_limit}")
    session = new_session()
    default_scope = check_scope(scope if scope is not None else f"mcp-{session}")
    params = StdioServerParameters(command=command[0], args=list(command[1:]), env=upstream_env())
    client = AsyncClient(settings)  # waits for receipts
    # the executor's side: every statement, lock wait and connect bounded, as a worker's are,
    # so that a hung connection cannot hold a renewal or a terminal write past the lease
    ledger = Ledger(
        settings.db, max_args_bytes=settings.max_args_bytes, timeout=settings.db_timeout
    )
    problem: str | None = None
    exited = False
    gone = anyio.Event()
    stopped_by: list[str] = []
    spawned: list[anyio.abc.Process] = []
    try:
        async with anyio.create_task_group() as stopping:
            forwards_scopes: list[anyio.CancelScope] = []
            stopping.start_soon(_stop_on_signal, stopping.cancel_scope, stopped_by, forwards_scopes)
            async with (
                _spawned(spawned),
                stdio_client(params) as (up_read, up_write),
                anyio.create_task_group() as pipe,
            ):
                sink, relayed = anyio.create_memory_object_stream[SessionMessage | Exception](0)
                relay = anyio.CancelScope()
                pipe.start_soon(_relay, up_read, sink, gone, relay)
                pipe.start_soon(_watch_exit, spawned, gone, relay)
                async with ClientSession(relayed, up_write) as upstream:
                    try:
                        with anyio.fail_after(start_timeout):
                            await upstream.initialize()
                            tools = await _list_all(upstream)
                    except TimeoutError:
                        raise UpstreamError(
                            f"upstream {command[0]!r} did not answer within {start_timeout:g} s "
                            "(--start-timeout)"
                        ) from None
                    except Exception as exc:  # noqa: BLE001 - reported as the upstream's failure
                        raise UpstreamError(
                            f"upstream {command[0]!r} did not answer: {exc}"
                        ) from None
                    problem = refusal(tools, set(idempotent))
                    if problem is None:
                        async with anyio.create_task_group() as forwards:
                            forwards_scopes.append(forwards.cancel_scope)
                            handlers = Proxy(
                                client,
                                ledger,
                                upstream,
                                tools,
                                forwards,
                                gone,
                                scope=default_scope,
                                session=session,
                                approved_by=approved_by,
                                idempotent=set(idempotent),
                                lease=lease,
                                timeout=timeout,
                                time_limit=time_limit,
                                grace=settings.sweep_grace,
                                tool_wait=settings.tool_wait,
                            )
                            exited = await _serve(handlers, gone)
                pipe.cancel_scope.cancel()
            stopping.cancel_scope.cancel()  # served to the end: no signal to wait for
    except BaseException as exc:  # anyio wraps what its task groups raise
        inner = _only(exc)
        if isinstance(inner, UpstreamError | ConfigError | OSError) and inner is not exc:
            raise inner from None
        raise
    finally:
        _stop_left_behind(spawned)
        await client.close()
        ledger.close()
    if stopped_by:
        log.warning("stopped by %s", stopped_by[0])
        return
    if problem is not None:
        raise ConfigError(problem)
    if exited:
        raise UpstreamError(f"the upstream server {command[0]!r} exited; the proxy stops with it")


#: Seconds the forwards have, once cancelled at a stop, before the whole run is: the SDK's
#: ``notifications/cancelled`` for each must reach the upstream while its writer still runs.
FORWARDS_STOP_GRACE = 1.0


async def _stop_on_signal(
    scope: anyio.CancelScope, stopped_by: list[str], first: list[anyio.CancelScope]
) -> None:
    """Cancel ``scope`` (the proxy's whole run) at SIGTERM or SIGHUP: the forwards first
    (``first``), each recording itself unknown and its request cancelled upstream; then the
    rest, ``stdio_client`` stopping the upstream as it unwinds. Cancelled at once together,
    the upstream's writer stopped before the SDK could write the cancellations, and the
    record's "cancelled upstream" was untrue (helper-93). (SIGINT needs nothing: asyncio
    cancels the main task itself.)"""
    with contextlib.ExitStack() as stack:
        try:
            signals = stack.enter_context(anyio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP))
        except (ValueError, NotImplementedError, RuntimeError):  # not the main thread
            return
        async for signum in signals:
            stopped_by.append(signal.Signals(signum).name)
            if first:
                for forwards in first:
                    forwards.cancel()
                await anyio.sleep(FORWARDS_STOP_GRACE)
            scope.cancel()
            return


async def _serve(handlers: Proxy, gone: anyio.Event) -> bool:
    """Serve over stdio until the host closes stdin (False) or the upstream exits (True).

    When the upstream exits, new calls are refused, the calls in flight are answered from the
    ledger (their forwards record what came back, or unknown), and then the input is ended as
    if the host had closed stdin. The session was cancelled at once before: every call in
    flight was answered "Connection closed", one that had succeeded upstream included (an
    error that invites the model to issue it again), and the SDK's reader went on waiting for
    the host's next line, so a host that kept stdin open had a proxy that neither answered
    nor exited (a cold review)."""
    server = handlers.server()
    lines = StdinLines(handlers.in_flight)
    stdin = cast("anyio.AsyncFile[str]", lines)
    # a SIGTERM while the host reads nothing stops the proxy all the same (StdoutLines)
    with StdoutLines() as out:
        stdout = cast("anyio.AsyncFile[str]", out)
        async with (
            stdio_server(stdin, stdout) as (raw, write),
            answering_malformed(raw, write) as read,
            anyio.create_task_group() as serving,
        ):

            async def stop_when_gone() -> None:
                await gone.wait()
                with anyio.move_on_after(handlers.timeout + GONE_GRACE):
                    while handlers.in_flight():
                        await anyio.sleep(0.05)
                lines.end()
                await anyio.sleep(GONE_GRACE)  # the session ends at the input's end; if not:
                serving.cancel_scope.cancel()

            serving.start_soon(stop_when_gone)
            await server.run(read, write, server.create_initialization_options())
            serving.cancel_scope.cancel()
    return gone.is_set()
