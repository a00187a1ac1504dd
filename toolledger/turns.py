"""One assistant turn through the ledger: its tool calls submitted in order, waited for, and
their results returned in the turn's own format — the very items ``repair`` would insert
for the same ledger (both build them with ``recovery.replay``), with the model's ids.

The message is one assistant message in OpenAI chat form (``tool_calls``) or Anthropic
Messages form (``tool_use`` blocks), or the list of output items of an OpenAI Responses turn
(``function_call`` items). What comes back: OpenAI chat, one ``tool`` message per call;
Responses, one ``function_call_output`` item per call; Anthropic, one ``user`` message holding
every ``tool_result`` block.

A call that needs a human (``approve`` returned None for it, and nobody decided in time) or
is still running when ``timeout`` ends comes back as what it is — ``pending_approval``,
``approved`` or ``running``, with a message that says nothing ran or nothing is known yet —
never as an invented result; an ``unknown`` call comes back with the text ``repair`` writes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from toolledger.ledger import inputs
from toolledger.ledger.errors import InputError
from toolledger.ledger.records import Receipt
from toolledger.ledger.transitions import Status
from toolledger.recovery.replay import Call, Format, TranscriptError, detect

if TYPE_CHECKING:
    from toolledger.client import AsyncClient, Client

#: What a call waiting for a person, or still running, tells the model.
WAITING_MESSAGES = {
    Status.PENDING_APPROVAL: (
        "This tool call is waiting for a human's approval. It has not run. Its result will "
        "come when someone decides."
    ),
    Status.APPROVED: "This tool call is approved and queued. It has not reported a result yet.",
    Status.RUNNING: "This tool call is running. It has not reported a result yet.",
}

Approve = Callable[[str, str, dict[str, Any]], Any]


def parse_turn(message: dict[str, Any] | list[Any]) -> tuple[Format, list[Call]]:
    """The turn's format and its tool calls in order; InputError for anything else."""
    items = list(message) if isinstance(message, list) else [message]
    fmt = detect(items)
    if fmt is None:
        raise TranscriptError("the message holds no tool call")
    calls, _ = fmt.calls(items, lambda i: f"item {i + 1}")
    if not calls:
        raise TranscriptError("the message holds no tool call")
    return fmt, calls


def call_args(call: Call) -> dict[str, Any]:
    where = f"the arguments of call {call.id!r}"
    if isinstance(call.args, str):
        return inputs.loads_object(call.args or "{}", where)
    if not isinstance(call.args, dict):
        raise InputError(f"{where}: must be a JSON object")
    return call.args


def _status_of(exc: TimeoutError) -> str:
    status = getattr(exc, "status", None)
    if status is None:
        raise exc
    return str(status)


def waiting_receipt(status: str) -> Receipt:
    s = Status(status)
    return Receipt(s, {"status": s.value, "message": WAITING_MESSAGES[s]}, None)


def run_turn(
    client: Client,
    scope: str,
    message: dict[str, Any] | list[Any],
    *,
    approve: Approve | None = None,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    fmt, calls = parse_turn(message)
    deadline = None if timeout is None else time.monotonic() + timeout
    handles = []
    for call in calls:  # in order: the model's order is the effects' order
        args = call_args(call)
        approver = approve(call.name, call.id, args) if approve else None
        handles.append((call, client.submit(scope, call.id, call.name, args, approved_by=approver)))
    pairs = []
    for call, handle in handles:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            pairs.append((call, handle.result(timeout=left)))
        except TimeoutError as exc:  # ReceiptTimeout: it says where the call stands
            pairs.append((call, waiting_receipt(_status_of(exc))))
    return fmt.items(pairs)


async def run_turn_async(
    client: AsyncClient,
    scope: str,
    message: dict[str, Any] | list[Any],
    *,
    approve: Approve | None = None,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    fmt, calls = parse_turn(message)
    handles = []
    for call in calls:
        args = call_args(call)
        approver = approve(call.name, call.id, args) if approve else None
        if inspect.isawaitable(approver):
            approver = await approver
        handles.append(
            (call, await client.submit(scope, call.id, call.name, args, approved_by=approver))
        )

    async def one(call: Call, handle: Any) -> tuple[Call, Receipt]:
        try:
            return call, await handle.result(timeout=timeout)
        except TimeoutError as exc:
            return call, waiting_receipt(_status_of(exc))

    pairs = await asyncio.gather(*(one(c, h) for c, h in handles))  # waited together
    return fmt.items(list(pairs))
