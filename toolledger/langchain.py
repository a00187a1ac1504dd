"""The registered tools as LangChain tools, every call through the ledger (extra ``langgraph``).

    from langgraph.prebuilt import ToolNode
    from toolledger import Client
    from toolledger.langchain import ledger_tools

    client = Client()
    tools = ledger_tools(client, approve=lambda tool, call_id, args: "policy")
    node = ToolNode(tools)          # in a graph compiled with a checkpointer
    graph.invoke(state, {"configurable": {"thread_id": "run-42"}}, durability="sync")

A call is the model's ``ToolCall``: its ``id`` is the ledger's ``tool_call_id`` and the
LangGraph thread (``config["configurable"]["thread_id"]``) is its scope. The tool submits
it through ``Client.submit`` — approved by ``approve(tool, call_id, args)`` (default
``"langgraph"``; None leaves it for a person) — waits for its receipt and answers with a
``ToolMessage`` whose content is ``receipt.text``, ``status="error"`` when
``receipt.is_error``, and ``artifact`` the receipt as JSON.

A node run again after an interrupt or a crash sends the same ToolCall ids in the same
thread: ``submit`` finds the recorded calls and the receipts come back; nothing runs twice.
That holds only if the model's message was saved before its tools ran: in a graph the tools
refuse to run unless it has a checkpointer and runs with ``durability="sync"``
(``NotDurable``, nothing submitted). LangGraph's default, ``"async"``, saves the message
while the tools node already runs: a crash before the save made the model call again under
new ids, and the effect happened twice (a cold review).
A call without a receipt (waiting for a person, or still running when ``timeout`` ends) has
nothing true to tell the model: the tool raises ``CallsWaiting`` naming it (a ToolNode lets it
through, and the graph run stops at its last checkpoint), as ``Client.run_turn`` does. Once a
person has decided, or the call has finished, invoking the graph again from that checkpoint
sends the same ToolCall ids: the receipts come back, and nothing runs twice.
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Annotated, Any, cast

import pydantic
from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, InjectedToolCallId, ToolException

from toolledger.client import (
    AsyncCallHandle,
    AsyncClient,
    CallHandle,
    Client,
    unanswered,
    waiting_on,
)
from toolledger.ledger.errors import ConflictError, InputError, LedgerError
from toolledger.ledger.identity import args_sha256
from toolledger.ledger.inputs import wait_seconds
from toolledger.ledger.records import Receipt
from toolledger.ledger.transitions import Status
from toolledger.registry import load_registry
from toolledger.tools import Registry, Tool
from toolledger.turns import (
    CallsWaiting,
    approver_named,
    database_failed,
    receipt_replaying,
    receipt_replaying_async,
)

#: ``approve(tool, tool_call_id, args) -> approver | None`` (None: a person decides).
Approve = Callable[[str, str, dict[str, Any]], str | None]

#: The ToolCall's ``args`` as the model sent them, from ``invoke`` to ``_run``.
_MODEL_ARGS: ContextVar[Any] = ContextVar("toolledger_langchain_model_args", default=None)

#: The hidden field LangChain fills with the ToolCall's id (never in the model's schema).
CALL_ID_FIELD = "toolledger_tool_call_id"

DEFAULT_APPROVER = "langgraph"

#: Until then (README: "Until 2026-12-06") the tool recorded LangChain's validated arguments
#: (``5.0`` made ``5``); since, the model's own, as run_turn and repair read them.
VALIDATED_UNTIL = datetime(2026, 12, 6, 1, 47, tzinfo=UTC)


try:  # a ToolNode lets a GraphBubbleUp through whatever its handle_tool_errors says
    from langgraph.errors import GraphBubbleUp
except ImportError:  # LangChain without LangGraph: a plain CallsWaiting

    class GraphBubbleUp(Exception):  # type: ignore[no-redef]
        pass


class ToolCallsWaiting(CallsWaiting, GraphBubbleUp):
    """CallsWaiting raised by a LangChain tool: also a LangGraph ``GraphBubbleUp``, so that a
    ``ToolNode(handle_tool_errors=True)`` does not turn it into an error the model reads."""


class MissingCallIdentity(ValueError):
    """The tool was invoked without a ToolCall id or outside a LangGraph thread."""


class NotDurable(MissingCallIdentity, GraphBubbleUp):
    """The tool was invoked in a graph that would not give its ToolCall ids back after a
    crash: no checkpointer, or a durability other than ``"sync"``. Also a ``GraphBubbleUp``:
    ``ToolNode(handle_tool_errors=True)`` handed it to the model as a tool error, and the
    graph ended normally, its developer never told (a cold review of the day's diff)."""


#: LangGraph's own config keys (``langgraph._internal._constants``): a task of a graph run
#: has the first; the others say how its checkpoints are kept. A test holds them to the
#: installed LangGraph (a renamed key would let every graph through).
_TASK_ID = "__pregel_task_id"
_CHECKPOINTER = "__pregel_checkpointer"
_DURABILITY = "__pregel_durability"


def check_durable(config: RunnableConfig | None) -> None:
    """``NotDurable`` unless the ToolCall ids would come back after a crash: in a graph, a
    checkpointer and ``durability="sync"`` (the model's message saved before its tools run).
    Outside a graph (a ``tool.invoke`` of a ToolCall) the caller keeps its ids, as
    ``run_turn``'s does."""
    configurable = (config or {}).get("configurable") or {}
    if _TASK_ID not in configurable:
        return
    if configurable.get(_CHECKPOINTER) is None:
        raise NotDurable(
            "toolledger tools need a graph compiled with a checkpointer: without one a crash "
            "loses the model's tool calls, and the model calls again under new ids"
        )
    durability = configurable.get(_DURABILITY, "async")
    if durability != "sync":
        raise NotDurable(
            f"toolledger tools need durability='sync' (this graph runs with {durability!r}, "
            "LangGraph's default is 'async'): invoke or stream the graph with "
            "durability='sync', so the model's tool calls are saved before they run; "
            "otherwise a crash makes the model call again under new ids, a second effect"
        )


class PolicyAnswerRefused(InputError, GraphBubbleUp):
    """The approval policy answered neither an approver's name nor None: the run stops,
    nothing recorded, as under run_turn and the SDK's adapter. Also a ``GraphBubbleUp``: a
    ``ToolNode(handle_tool_errors=True)`` does not hand it to the model."""


def _approver(answer: Any, call_id: str) -> str | None:
    """The policy's answer checked before the submit: a falsy one (False, "") was refused by
    the submit, a ``ToolException`` the model read as "toolledger refused the call" (a
    refusal nobody made), where run_turn and the SDK's adapter stop the run."""
    try:
        return approver_named(answer, call_id)
    except InputError as exc:
        raise PolicyAnswerRefused(str(exc)) from None


def default_approve(_tool: str, _call_id: str, _args: dict[str, Any]) -> str | None:
    return DEFAULT_APPROVER


def _schema_with_call_id(tool: Tool) -> type[pydantic.BaseModel]:
    """The tool's args model plus the injected ToolCall id (hidden from the model)."""
    if CALL_ID_FIELD in tool.args_model.model_fields:
        raise ValueError(f"{tool.name}: an argument may not be named {CALL_ID_FIELD!r}")
    model: type[pydantic.BaseModel] = pydantic.create_model(
        tool.args_model.__name__,
        __base__=tool.args_model,
        __doc__=tool.args_model.__doc__,
        **{CALL_ID_FIELD: (Annotated[str, InjectedToolCallId], ...)},  # type: ignore[call-overload]
    )
    return model


def thread_id(config: RunnableConfig | None) -> str:
    """The LangGraph thread the call runs in: the ledger scope."""
    configurable = (config or {}).get("configurable") or {}
    found = configurable.get("thread_id")
    if found is None or str(found) == "":
        raise MissingCallIdentity(
            "toolledger tools need a LangGraph thread id as their scope: invoke the graph with "
            "config={'configurable': {'thread_id': ...}} (and a checkpointer)"
        )
    return str(found)


class LedgerTool(BaseTool):
    """One registered toolledger tool as a LangChain tool: executed by a worker, at most once."""

    client: Client
    ledger_tool: Tool
    approve: Approve = default_approve
    timeout: float = 60.0
    handle_tool_error: bool = True  # a refusal by the ledger is a tool error the model reads

    @pydantic.field_validator("timeout")
    @classmethod
    def _timeout_checked(cls, value: float) -> float:
        """Refused here, before any call: checked at the wait, ``nan`` was refused once the
        call had been recorded and approved, an error the model read (a ToolNode with
        ``handle_tool_errors``) while its worker ran it: called again, a second effect."""
        wait_seconds(value)
        return value

    def invoke(
        self, input: str | dict[str, Any] | Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Any:
        token = _MODEL_ARGS.set(self._check_call(input).get("args"))
        try:
            return super().invoke(input, config, **kwargs)
        finally:
            _MODEL_ARGS.reset(token)

    async def ainvoke(
        self, input: str | dict[str, Any] | Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Any:
        # (_arun's thread, as the executor that runs _run, copies the context)
        token = _MODEL_ARGS.set(self._check_call(input).get("args"))
        try:
            return await super().ainvoke(input, config, **kwargs)
        finally:
            _MODEL_ARGS.reset(token)

    def _check_call(self, value: Any) -> dict[str, Any]:
        is_tool_call = isinstance(value, dict) and value.get("type") == "tool_call"
        if not (is_tool_call and value.get("id")):
            raise MissingCallIdentity(
                f"toolledger tool {self.name!r} must be invoked with a ToolCall that has an id "
                "(the model's tool call id is the ledger's tool_call_id), as a ToolNode does: "
                "{'type': 'tool_call', 'id': ..., 'name': ..., 'args': {...}}"
            )
        return cast("dict[str, Any]", value)

    def _run(self, config: RunnableConfig, **kwargs: Any) -> ToolMessage:
        scope, call_id, handle, again = self._submit(config, kwargs)
        with waiting_on(scope, call_id, ToolCallsWaiting):
            receipt = receipt_replaying(handle, again, self.timeout)
        return self._message(scope, call_id, receipt)

    async def _arun(self, config: RunnableConfig, **kwargs: Any) -> ToolMessage:
        """As ``_run``, its wait on the event loop: a ToolNode's concurrent calls held an
        executor thread each for their whole wait (the loop's default executor has
        min(32, CPUs + 4)), and the calls past that many were not even submitted until an
        earlier one's wait ended."""
        # the checks, the policy (user code, maybe blocking) and the submit in a thread
        # that copies this context (_MODEL_ARGS)
        scope, call_id, handle, again = await asyncio.to_thread(self._submit, config, kwargs)
        waiting = AsyncCallHandle(AsyncClient.of(self.client), handle)
        with waiting_on(scope, call_id, ToolCallsWaiting):
            receipt = await receipt_replaying_async(waiting, again, self.timeout)
        return self._message(scope, call_id, receipt)

    def _submit(
        self, config: RunnableConfig, kwargs: dict[str, Any]
    ) -> tuple[str, str, CallHandle, Callable[[], Any]]:
        """The call checked and submitted: its scope, its id, its handle and its submit to
        replay (``turns.receipt_replaying``) (raises ``ToolCallsWaiting`` if a person decides,
        ``ToolException`` if it is refused)."""
        call_id = str(kwargs.pop(CALL_ID_FIELD))
        kwargs.pop("run_manager", None)
        scope = thread_id(config)
        check_durable(config)
        spec = self.ledger_tool
        # The arguments as the model sent them, which run_turn and repair record and hash for
        # the same call: LangChain's validated ones (5.0 made 5, "5" made 5, unknown keys
        # dropped) were another call to them, a conflict (a cold review). LangChain
        # validated them with the tool's own model; the submit checks them again.
        validated = spec.args_model.model_validate(kwargs).model_dump(
            mode="json", exclude_unset=True
        )
        model_args = _MODEL_ARGS.get()
        args = (
            {k: v for k, v in model_args.items() if k != CALL_ID_FIELD}
            if isinstance(model_args, dict)
            else validated
        )
        # the policy's own copy, as run_turn gives it: what it does to it is not recorded
        # and run (a cold review: a policy that stamped the arguments made the call's
        # replay a conflict, told to the model as a refusal, and repair refuse the transcript)
        approver = _approver(self.approve(spec.name, call_id, copy.deepcopy(args)), call_id)
        if approver is not None:  # the publish's imports before the commit (turns.run_turn)
            self.client.warm()
        try:
            try:
                handle = self.client.submit(scope, call_id, spec.name, args, approved_by=approver)
            except ConflictError:
                if args_sha256(args) == args_sha256(validated):  # (5.0 == 5 in Python)
                    raise
                if not self._recorded_validated(scope, call_id):
                    raise  # the model's own arguments were recorded: others are a conflict
                # recorded by a version that recorded the validated arguments: its replay
                # (the id is taken: nothing new can be recorded under it)
                args = validated
                handle = self.client.submit(scope, call_id, spec.name, args, approved_by=approver)
        except LedgerError as exc:  # refused (arguments, a conflict): nothing recorded
            raise ToolException(f"toolledger refused the call: {exc}") from exc
        except Exception as exc:
            if not database_failed(exc):
                raise
            raise unanswered(scope, call_id, ToolCallsWaiting) from exc
        if handle.status == Status.PENDING_APPROVAL.value:  # a person decides: nobody waits
            raise ToolCallsWaiting(scope, {call_id: handle.status})
        again = functools.partial(
            self.client.submit, scope, call_id, spec.name, args, approved_by=approver
        )
        return scope, call_id, handle, again

    def _recorded_validated(self, scope: str, call_id: str) -> bool:
        """Whether the call was recorded before ``VALIDATED_UNTIL``, when the tool recorded
        LangChain's validated arguments: only such a call is replayed under them. Any call
        was: a replay whose arguments only validated alike (``"5"`` for ``5``, a key the
        model ignores) was answered with the receipt of a call recorded with other arguments,
        which run_turn and repair refuse as a conflict (DESIGN §2.4)."""
        try:
            created = self.client.ledger.get(scope, call_id).operation.created_at
        except LedgerError:
            return False
        if created.tzinfo is None:  # SQLite keeps UTC without its offset
            created = created.replace(tzinfo=UTC)
        return created < VALIDATED_UNTIL

    def _message(self, scope: str, call_id: str, receipt: Receipt) -> ToolMessage:
        return ToolMessage(
            content=receipt.text,
            tool_call_id=call_id,
            name=self.name,
            status="error" if receipt.is_error else "success",
            artifact={**receipt.to_json(), "scope": scope, "tool_call_id": call_id},
        )


def ledger_tool(
    client: Client, tool: Tool, *, approve: Approve | None = None, timeout: float = 60.0
) -> LedgerTool:
    """One registered tool as a LangChain tool (its pydantic schema, its description)."""
    return LedgerTool(
        name=tool.name,
        description=tool.description or tool.name,
        args_schema=_schema_with_call_id(tool),
        client=client,
        ledger_tool=tool,
        approve=approve or default_approve,
        timeout=timeout,
    )


def ledger_tools(
    client: Client,
    *,
    registry: Registry | None = None,
    approve: Approve | None = None,
    timeout: float = 60.0,
    tools: Iterable[str] | None = None,
) -> list[BaseTool]:
    """The registered tools (``registry``, default: the client's settings' registry; only
    those named in ``tools`` if given) as LangChain tools that run through the ledger."""
    reg = registry if registry is not None else load_registry(client.settings.tools)
    chosen = [reg.get(name) for name in tools] if tools is not None else list(reg)
    return [ledger_tool(client, t, approve=approve, timeout=timeout) for t in chosen]
