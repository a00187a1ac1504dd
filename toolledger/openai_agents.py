"""The registered tools as OpenAI Agents SDK function tools, every call through the ledger.

    pip install 'toolledger[agents]'          # openai-agents >= 0.20 (tested with 0.24.0)

    from agents import Agent, Runner
    from toolledger import AsyncClient
    from toolledger.openai_agents import ledger_function_tools

    async with AsyncClient() as client:
        tools = ledger_function_tools(client, scope="conversation-42", approve=policy)
        result = await Runner.run(Agent(name="a", tools=tools), "Write the report.")

Each ``FunctionTool.on_invoke_tool`` submits the model's call under the SDK's own tool call id
(``ToolContext.tool_call_id``) in ``scope`` (the conversation or session id: a string, or a
function of the run context), waits for its receipt and hands the model ``receipt.text``.
A call id seen again in its scope finds the call in the ledger: the recorded receipt comes
back and the tool does not run again. The SDK does not give the same ids back after a crash:
it saves nothing of a model response before its tools run and cannot resume a failed run, so
a run again asks the model again, whose new call ids are new calls (the abandoned run's calls
still take effect). Replay needs the call ids kept by the app (the README says how).

Approval is the SDK's human-in-the-loop: a call that ``approve(tool, call_id, args)`` does
not approve (it returns None; with no ``approve`` at all, every call that is not read-only)
is a tool with ``needs_approval``: the run stops with an interruption (any other answer than
None must be an approver's name, or the run stops, nothing recorded), and once
``RunState.approve`` lets it through, the resumed run submits it approved by
``approved_by`` (default ``openai-agents``). A call the SDK rejects is never submitted:
nothing is recorded. A call already in the ledger and decided (a replay) needs no second
approval; one recorded earlier and still waiting for a person pauses the run the same way,
whatever ``approve`` says (as under run_turn, a policy does not decide it), and only the SDK's
approval approves it in the ledger, but its rejection does not reach the ledger
(the SDK answers the model without calling the tool): reject such a call in the ledger too.

The tool waits for its receipt (every approved call ends: its worker finishes it, or the
sweep declares it ``unknown``), so the model is never told anything invented. A ``timeout``,
if given, stops the run with ``CallsWaiting`` (wrapped by the SDK in a ``UserError``:
``calls_waiting(exc)`` finds it), as does any other error once the submit may have committed
(the call's status ``unanswered``: it may be in flight); such a run cannot be resumed: run
again, the model makes new call ids, which are new calls. The SDK's own ``timeout_seconds``
is refused (it stops the wait, not the call, and tells the model the call timed out).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from agents import FunctionTool, RunContextWrapper
from agents.tool_context import ToolContext

from toolledger.client import AsyncCallHandle, AsyncClient, Client, unanswered, waiting_on
from toolledger.ledger import inputs
from toolledger.ledger.errors import InputError, LedgerError, StateError
from toolledger.ledger.identity import check_text_id
from toolledger.ledger.transitions import Status
from toolledger.mcp import META_SCOPE, META_TOOL_CALL_ID
from toolledger.tools import Registry, Tool
from toolledger.turns import CallsWaiting, approver_named, database_failed

Scope = str | Callable[[RunContextWrapper[Any]], str]
#: ``approve(tool, call_id, args)``: the approver's name, or None; or an awaitable of it (an
#: async policy, as AsyncClient.run_turn takes).
Approve = Callable[[str, str, dict[str, Any]], str | Awaitable[str | None] | None]

#: Who a call the SDK's approval let through is recorded as approved by.
SDK_APPROVER = "openai-agents"
#: Policy answers a tool keeps for calls asked about and not run yet (a run the SDK paused
#: for a person, and that nobody resumed, leaves one): at most this many, the oldest forgotten.
POLICY_ANSWERS = 1024


def strict_schema_ok(schema: dict[str, Any]) -> bool:
    """Strict mode only for a flat schema whose every property is required (strict mode
    would otherwise make optional arguments required, or refuse the schema)."""
    props = schema.get("properties", {})
    return (
        schema.get("type") == "object"
        and "$defs" not in schema
        and set(schema.get("required", [])) == set(props)
        and all(isinstance(p, dict) and "default" not in p for p in props.values())
        and schema.get("additionalProperties") in (None, False)
    )


def calls_waiting(exc: BaseException) -> CallsWaiting | None:
    """The CallsWaiting behind an exception the SDK raised from a run (it wraps a tool's
    error in its own), or None if the run stopped for another reason."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, CallsWaiting):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class _Ledger:
    """Both clients behind one awaitable interface."""

    def __init__(self, client: AsyncClient | Client) -> None:
        self.sync = client.sync if isinstance(client, AsyncClient) else client
        self.client = client

    @property
    def registry(self) -> Registry:
        return self.sync._submitter.registry

    async def status(self, scope: str, tool_call_id: str) -> str | None:
        """The call's status in the ledger; None if it is not recorded (or its id is one the
        ledger refuses: submit will say so)."""
        try:
            return await asyncio.to_thread(self.sync.status, scope, tool_call_id)
        except LedgerError:
            return None

    async def call(
        self,
        scope: str,
        tool_call_id: str,
        tool: str,
        args: dict[str, Any],
        *,
        approved_by: str | None,
        sdk_approved: bool,
        timeout: float | None,
    ) -> str:
        """The call's receipt text. ``sdk_approved``: the SDK's own approval let it through,
        which alone decides a call recorded earlier and waiting for a person (a policy's
        answer does not: run_turn leaves such a call to the person too)."""
        sync = self.sync
        by = approved_by
        try:
            handle = await asyncio.to_thread(
                sync.submit, scope, tool_call_id, tool, args, approved_by=by
            )
        except LedgerError as exc:  # refused input, a conflict: nothing recorded
            return " ".join(f"error: {exc}".split())
        except Exception as exc:
            if not database_failed(exc):
                raise
            raise unanswered(scope, tool_call_id) from exc
        # recorded: the database failing now leaves where the call stands unknown, and the
        # model is told nothing; a LedgerError (a record the ledger calls corrupt) or a bug is
        # raised as it is, and ends the run (it was handed to the model as an "error:", a
        # refusal of a call that had been recorded)
        with waiting_on(scope, tool_call_id):
            if handle.status == Status.PENDING_APPROVAL.value and by is not None and sdk_approved:
                # recorded earlier, waiting for a person; this run's approval is that decision
                with contextlib.suppress(StateError):  # decided meanwhile: that stands
                    await asyncio.to_thread(sync.approve, scope, tool_call_id, by=by)
            # woken on the loop, whichever client: no thread held (a Client's wait held one of
            # the loop's default executor for its whole wait, 6 on 2 cores: a turn's parallel
            # calls past that many, and the application's own to_thread work, queued behind
            # the waits; a cold review). A read-only call ran at once, unrecorded: its handle
            # holds its receipt.
            client = self.client
            waiting = AsyncCallHandle(
                client if isinstance(client, AsyncClient) else AsyncClient.of(sync), handle
            )
            receipt = await waiting.result(timeout)
        return receipt.text


def mcp_call_meta(scope: Scope | None = None) -> Callable[[Any], dict[str, str]]:
    """A ``tool_meta_resolver`` for the SDK's own MCP client in front of ``toolledger mcp
    serve`` or ``mcp proxy`` (``MCPServerStdio(..., tool_meta_resolver=mcp_call_meta())``):
    each call carries the SDK's tool call id in ``_meta["toolledger/tool_call_id"]`` (and
    ``scope``, a string or a function of the run context, in ``_meta["toolledger/scope"]``
    if given). The SDK retries a call that timed out (``max_retry_attempts``; its
    ``client_session_timeout_seconds`` is 5 s by default) as a new JSON-RPC request: without
    the id, a new call, and the tool ran twice (a cold review); with it, the same call,
    answered from the ledger. Give ``scope`` or run the server with ``--scope``: without
    either, a call is kept in its connection's own scope, which a restarted server does not
    share."""

    def resolve(context: Any) -> dict[str, str]:
        run_context = context.run_context
        call_id = getattr(run_context, "tool_call_id", None)
        if not isinstance(call_id, str) or not call_id:
            raise TypeError(
                f"mcp_call_meta: the run context of {context.tool_name!r} has no tool call "
                "id to name the call by"
            )
        meta = {META_TOOL_CALL_ID: call_id}
        if scope is not None:
            meta[META_SCOPE] = scope if isinstance(scope, str) else scope(run_context)
        return meta

    return resolve


def ledger_function_tools(
    client: AsyncClient | Client,
    *,
    scope: Scope,
    tools: Iterable[Tool] | Iterable[str] | None = None,
    approve: Approve | None = None,
    timeout: float | None = None,
    approved_by: str = SDK_APPROVER,
) -> list[FunctionTool]:
    """One ``FunctionTool`` per registered tool (``tools``: a subset, as Tools or names).

    ``scope``: the conversation or session id, or a function of the run context giving it.
    ``approve(tool, call_id, args)``: who approves a call (None: the SDK's approval decides,
    the run pauses). ``timeout``: seconds to wait for a receipt (default: until there is one;
    an approved call always ends, by its worker or as ``unknown`` by the sweep); past it the
    tool raises CallsWaiting and the run stops, and it cannot be resumed: a new run asks the
    model again, whose new call ids are new calls."""
    # refused before any call: at the wait, nan was refused once the call had been recorded
    # and approved, and the run stopped with a plain error while its worker ran it (a review)
    timeout = inputs.wait_seconds(timeout)
    # and the SDK's approver: refused at the submit, the model was told a call a person had
    # approved in the SDK was refused ("error: approver: must not be empty")
    check_text_id(approved_by, "approved_by", inputs.MAX_ACTOR)
    ledger = _Ledger(client)
    registry = ledger.registry
    chosen = (
        list(registry)
        if tools is None
        else [t if isinstance(t, Tool) else registry.get(t) for t in tools]
    )
    return [_function_tool(ledger, t, scope, approve, timeout, approved_by) for t in chosen]


class _Invoke:
    """A tool's ``on_invoke_tool``: ``run`` once the SDK's own ``timeout_seconds`` is found
    unset on the FunctionTool that calls it, which the SDK binds it to (its
    ``__agents_bind_function_tool__`` hook, at construction, ``dataclasses.replace`` and copy;
    on an SDK without the hook, the tool made here): read at the call, as one may be set after.
    The SDK's timeout stops waiting, not the call: it told the model "timed out" while the call
    went on and ran, and the model called again under a new id (a cold review)."""

    def __init__(
        self,
        run: Callable[[ToolContext[Any], str], Awaitable[str]],
        function_tool: FunctionTool | None = None,
    ) -> None:
        self.run, self.function_tool = run, function_tool

    def __agents_bind_function_tool__(self, function_tool: FunctionTool) -> _Invoke:
        return _Invoke(self.run, function_tool)

    async def __call__(self, ctx: ToolContext[Any], args_json: str) -> str:
        made = self.function_tool
        if made is not None and made.timeout_seconds is not None:  # before any submit
            raise ValueError(
                f"{made.name}: the SDK's timeout_seconds tells the model a call timed out while "
                "it goes on and runs; leave it unset and give ledger_function_tools(timeout=…)"
            )
        return await self.run(ctx, args_json)


def _function_tool(
    ledger: _Ledger,
    tool: Tool,
    scope: Scope,
    approve: Approve | None,
    timeout: float | None,
    sdk_approver: str,
) -> FunctionTool:
    def scope_of(ctx: RunContextWrapper[Any]) -> str:
        return scope if isinstance(scope, str) else scope(ctx)

    # The policy's answer for a call, given when the SDK asked whether it needs approval and
    # taken when it runs: the policy is asked once a call (it was asked again at the run, and
    # that second answer decided who the ledger said approved it: a policy that approved once
    # and then said None recorded the SDK's approval, which nobody gave; a cold review).
    answers: OrderedDict[tuple[str, str], str | None] = OrderedDict()

    async def policy(call_id: str, args: dict[str, Any]) -> str | None:
        if tool.read_only or approve is None:
            return None  # read-only: runs at once, never recorded, nothing to approve
        # its own copy: the arguments recorded and run are the model's, whatever it does
        answer = approve(tool.name, call_id, copy.deepcopy(args))
        # an async policy is awaited: its coroutine was taken for the approver's name, and the
        # model read "approver: must be a string, not coroutine" (a cold review)
        said = await answer if inspect.isawaitable(answer) else answer
        # checked as run_turn checks it, before anything is submitted: a falsy answer (False,
        # "") meant no pause, and the call was then recorded approved by the SDK's approver,
        # which nobody gave, and ran (a cold review)
        return approver_named(said, call_id)

    def asked(key: tuple[str, str], answer: str | None) -> str | None:
        answers[key] = answer
        while len(answers) > POLICY_ANSWERS:  # calls the SDK paused and never ran
            answers.popitem(last=False)
        return answer

    async def needs_approval(
        ctx: RunContextWrapper[Any], args: dict[str, Any], call_id: str
    ) -> bool:
        if tool.read_only:
            return False
        key = (scope_of(ctx), call_id)
        answer = await policy(call_id, args)
        status = await ledger.status(*key)
        if status == Status.PENDING_APPROVAL.value:
            # recorded earlier and waiting for a person: the SDK's pause decides, whatever the
            # policy says (its approval was taken as that person's: a cold review; run_turn
            # leaves such a call to the person too)
            asked(key, None)
            return True
        # new and not approved by the policy: the SDK's pause decides; any other status was
        # decided before (a replay waits for, or returns, its receipt)
        return asked(key, answer) is None and status is None

    async def invoke(ctx: ToolContext[Any], args_json: str) -> str:
        try:
            # the input rules run_turn and repair read a call's arguments by: plain json.loads
            # took a key given twice (the last won), and repair then refused the transcript
            # holding the call that ran (a cold review)
            args = inputs.loads_arguments(args_json, "arguments")
        except InputError as exc:
            return f"error: {exc}"
        call_id = ctx.tool_call_id
        key = (scope_of(ctx), call_id)
        answer = answers.pop(key) if key in answers else await policy(call_id, args)
        # reached without a policy approver: the SDK's approval let it through (or a replay)
        by = None if tool.read_only else (answer or sdk_approver)
        return await ledger.call(
            scope_of(ctx),
            call_id,
            tool.name,
            args,
            approved_by=by,
            sdk_approved=answer is None,
            timeout=timeout,
        )

    schema = tool.json_schema()
    approval: bool | Callable[[RunContextWrapper[Any], dict[str, Any], str], Awaitable[bool]]
    approval = False if tool.read_only else needs_approval
    made = FunctionTool(
        name=tool.name,
        description=tool.description,
        params_json_schema=schema,
        on_invoke_tool=_Invoke(invoke),
        strict_json_schema=strict_schema_ok(schema),
        needs_approval=approval,
    )
    bound = made.on_invoke_tool
    if isinstance(bound, _Invoke) and bound.function_tool is None:  # an SDK without the hook
        bound.function_tool = made
    return made
