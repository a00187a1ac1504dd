"""One assistant turn through the ledger: its tool calls submitted in order, waited for, and
their results returned in the turn's own format — the very items ``repair`` would insert
for the same ledger (both build them with ``recovery.replay``), with the model's ids.

The message is one assistant message in OpenAI chat form (``tool_calls``) or Anthropic
Messages form (``tool_use`` blocks), or the list of output items of an OpenAI Responses turn
(``function_call`` items). What comes back: OpenAI chat, one ``tool`` message per call;
Responses, one ``function_call_output`` item per call; Anthropic, one ``user`` message holding
every ``tool_result`` block.

A call whose result is among the items given (a Responses turn passed with its outputs) is
answered already: it is neither submitted nor answered again.
Chat or Anthropic items holding two turns whose calls have no result are refused: the
results come back as one list, which goes right after one turn.

Every call of the turn is checked (its arguments, tool, schema and paths) and every approval
asked before the first is submitted: a turn refused for any of its calls records none.

A call that needs a human (``approve`` returned None for it, and nobody decided in time) or
is still running when ``timeout`` ends has no receipt, so there is nothing true to tell the
model yet: the turn answers nothing and raises ``CallsWaiting`` naming those calls (the
application pauses the run, as agent SDKs do with interruptions, and runs the same turn
again later: every call is found in the ledger, none runs twice). So does a call whose
submit or wait the database failed: its status ``unanswered``, the error chained. An
``unknown`` call comes back with the text ``repair`` writes, marked as an error.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from toolledger.ledger import inputs
from toolledger.ledger.errors import InputError, LedgerError
from toolledger.ledger.identity import check_text_id
from toolledger.ledger.records import Receipt
from toolledger.recovery.replay import Call, Format, TranscriptError, detect

if TYPE_CHECKING:
    from toolledger.client import AsyncCallHandle, AsyncClient, CallHandle, Client
    from toolledger.worker.submit import PreparedCall

Approve = Callable[[str, str, dict[str, Any]], Any]


class CallsWaiting(TimeoutError):
    """Calls of the turn still without a receipt when ``timeout`` ended (pending approval,
    approved, running): ``waiting`` maps their tool_call_ids to their statuses, in call order.
    Nothing was answered; the same turn run again later waits for them again."""

    def __init__(
        self, scope: str, waiting: dict[str, str], unanswered: frozenset[str] = frozenset()
    ) -> None:
        named = ", ".join(
            f"{cid!r} ({status}{UNANSWERED_SINCE if _stale(cid, status, unanswered) else ''})"
            for cid, status in waiting.items()
        )
        super().__init__(
            f"{len(waiting)} call(s) of the turn in scope {scope!r} have no receipt yet: "
            f"{named}; run the same turn again once they have one"
        )
        self.scope, self.waiting = scope, waiting
        #: The calls whose status is what the database said last, before it stopped
        #: answering the turn's waits (their submit's, for a call not waited for): it may
        #: have moved on since (said as current: a cold review).
        self.unanswered = unanswered


#: The status of a call whose submit or wait the database failed (``client.UNANSWERED``, not
#: imported: the client imports this module).
UNANSWERED = "unanswered"


UNANSWERED_SINCE = ", when the database last answered: it did not answer the wait"


def _stale(cid: str, status: str, unanswered: frozenset[str]) -> bool:
    # "unanswered" says it by itself: no answer at all
    return cid in unanswered and status != UNANSWERED


def parse_turn(message: dict[str, Any] | list[Any]) -> tuple[Format, list[Call]]:
    """The turn's format and its tool calls still without a result, in order (a call whose
    result is among the items given is answered already: it was answered again, and the
    transcript then held two results for it, a cold review); InputError for anything else."""
    items = list(message) if isinstance(message, list) else [message]
    for i, item in enumerate(items):
        if not isinstance(item, dict):  # an SDK's object: said "holds no tool call" (a review)
            raise TranscriptError(
                f"item {i + 1} is a {type(item).__name__}, not a dict: pass an SDK's message "
                "as its .model_dump()"
            )
    fmt = detect(items)
    if fmt is None:
        raise TranscriptError("the message holds no tool call")
    calls, batches = fmt.calls(items, lambda i: f"item {i + 1}")
    if not calls:
        raise TranscriptError("the message holds no tool call")
    if len(batches) > 1 and fmt.name != "responses":
        # the results come back as one list, to append after the turn: a chat tool message
        # or an Anthropic tool_result goes right after its own turn, so those of an earlier
        # turn were handed back out of place (the transcript then refused by the API; a Responses
        # output goes anywhere after its call)
        raise TranscriptError(
            f"the items hold {len(batches)} turns whose calls have no result "
            f"({', '.join(b.calls[0].at for b in batches)}): run_turn answers one turn, "
            "whose results go right after it; pass one turn, or repair the whole transcript "
            "(toolledger repair)"
        )
    unanswered = {c.id for batch in batches for c in batch.calls}
    return fmt, [c for c in calls if c.id in unanswered]


def call_args(call: Call) -> dict[str, Any]:
    where = f"the arguments of call {call.id!r}"
    if isinstance(call.args, str):
        return inputs.loads_arguments(call.args, where)
    if not isinstance(call.args, dict):
        raise InputError(f"{where}: must be a JSON object")
    return call.args


def _approver(value: Any, call: Call, prepared: PreparedCall) -> str | None:
    """The policy's answer for ``call`` (None: ask a human), checked as the ledger will check
    it, before any call of the turn is submitted: a name the ledger refuses for the second
    call used to leave the first recorded, approved and run. A read-only call is not
    recorded and uses no approver: its answer is passed on unchecked, as ``submit`` takes it."""
    if prepared.read_only:
        return value  # type: ignore[no-any-return]
    return approver_named(value, call.id)


def approver_named(value: Any, call_id: str) -> str | None:
    """An approval policy's answer for the call ``call_id``: None (a person decides), or an
    approver's name as the ledger checks it (``InputError`` for anything else: False, "", 0
    is no pause, and the call was recorded approved by a name nobody gave). Every adapter
    checks its policy's answer here, before anything is submitted."""
    if value is None:
        return None
    return check_text_id(value, f"approver of call {call_id!r}", inputs.MAX_ACTOR)


log = logging.getLogger("toolledger.client")


def _said(scope: str, call: Call, submitted: dict[str, Any]) -> None:
    """The submit's warning, said: an approver's answer for a call already waiting for a
    person is not applied (it is the person's to decide), and run_turn waited its timeout
    out in silence (a cold review)."""
    if warning := submitted.get("warning"):
        log.warning("%s/%s: %s", scope, call.id, warning)


def database_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is the database (or the network to it) failing, where the call may or
    may not have been recorded: SQLAlchemy's errors, an ``OSError``. A ``LedgerError`` is the
    ledger's answer (a refusal, a record it calls corrupt), and anything else a bug: each is
    raised as it is. Said "unanswered", a record the ledger called corrupt was reported as a
    database that did not answer, for ever (a cold review of the day's diff)."""
    import sqlalchemy as sa

    if isinstance(exc, LedgerError):
        return False
    return isinstance(exc, sa.exc.SQLAlchemyError | OSError)


def _submit_failed(
    scope: str, call: Call, submitted: list[tuple[Call, str]], exc: Exception
) -> None:
    """A submit that failed, past the turn's checks: a refusal (``LedgerError``) or a bug is
    raised as it is; the database failing (``database_failed``), perhaps once the submit had
    committed, leaves the call unanswered, and the turn's calls submitted before it waiting:
    CallsWaiting, chained to the error. It reached the application as the database's own
    error, which an agent loop could hand to the model, who called again under a new id (a
    cold review of the integrations: the effect twice). The calls after it were not sent:
    the same turn run again sends them."""
    if isinstance(exc, LedgerError) or not database_failed(exc):
        raise exc
    waiting = {c.id: status for c, status in submitted} | {call.id: UNANSWERED}
    raise CallsWaiting(scope, waiting, frozenset({call.id})) from exc


def _replayed_unpublished(handle: CallHandle) -> bool:
    """A call the turn found recorded, approved, and that its replay did not publish again."""
    out = getattr(handle, "submitted", None)  # (a handle-like of a test has none)
    return (
        isinstance(out, dict)
        and out.get("outcome") not in (None, "created", "read_only")
        and out.get("status") == "approved"
        and not out.get("enqueued")
    )


def _first_wait(handle: CallHandle, left: float | None) -> float | None:
    """How long a call is waited for before its submit is replayed again (None: never).

    A replay publishes a call approved and unclaimed only once its stamp is older than
    ``REPUBLISH_AFTER`` (its message may still be on its way), and a wait never publishes: an
    agent SIGKILLed between a call's commit and its publish and restarted at once waited out
    its whole timeout (the sweep re-publishes after ``requeue_after``, 120 s) while a worker
    stood idle. The turn's own submit, replayed once past that age, publishes it: one more
    message at most, the claim deciding which one runs."""
    from toolledger.worker.submit import REPUBLISH_AFTER

    if not _replayed_unpublished(handle):
        return None
    first = REPUBLISH_AFTER + 0.5
    return None if left is not None and left <= first else first


def _publish_if_lost(resubmit: Callable[[], Any], exc: TimeoutError) -> bool:
    """After a first wait that timed out: the submit replayed if the call is still approved,
    said as the database answered it (True: it was)."""
    if getattr(exc, "unanswered", False) or getattr(exc, "status", None) != "approved":
        return False
    try:
        resubmit()
    except Exception as failed:  # a nudge: the wait goes on, as it would have
        if not database_failed(failed):
            raise
        log.warning("a replayed call's publish again failed: %s", failed)
    return True


def receipt_replaying(
    handle: CallHandle, resubmit: Callable[[], Any], left: float | None
) -> Receipt:
    """The call's receipt within ``left`` seconds (``_first_wait``)."""
    first = _first_wait(handle, left)
    if first is None:
        return handle.result(timeout=left)
    started = time.monotonic()
    try:
        return handle.result(timeout=first)
    except TimeoutError as exc:
        if not _publish_if_lost(resubmit, exc):
            raise
    rest = None if left is None else max(0.0, left - (time.monotonic() - started))
    return handle.result(timeout=rest)


async def receipt_replaying_async(
    handle: AsyncCallHandle, resubmit: Callable[[], Any], left: float | None
) -> Receipt:
    """``receipt_replaying`` on the event loop (``resubmit`` in a thread)."""
    first = _first_wait(handle.handle, left)
    if first is None:
        return await handle.result(timeout=left)
    started = time.monotonic()
    try:
        return await handle.result(timeout=first)
    except TimeoutError as exc:
        if not await asyncio.to_thread(_publish_if_lost, resubmit, exc):
            raise
    rest = None if left is None else max(0.0, left - (time.monotonic() - started))
    return await handle.result(timeout=rest)


def _status_of(exc: TimeoutError) -> str:
    status = getattr(exc, "status", None)
    if status is None:
        raise exc
    return str(status)


def checked_calls(
    client: Client, scope: str, message: Any
) -> tuple[Format, list[Call], list[PreparedCall]]:
    """The turn's format, its calls and each one checked as ``submit`` would check it, once
    (its arguments are the checked call's): a turn refused for one call records none."""
    fmt, calls = parse_turn(message)
    checked = [client.check(scope, call.id, call.name, call_args(call)) for call in calls]
    return fmt, calls, checked


def answered(
    scope: str,
    fmt: Format,
    outcomes: list[tuple[Call, Receipt | str]],
    unanswered: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """The turn's items, or CallsWaiting if any call has a status but no receipt
    (``unanswered``: the calls whose status the database did not confirm at the end)."""
    if not outcomes:  # every call of the items given had its result among them
        return []
    waiting = {c.id: r for c, r in outcomes if isinstance(r, str)}
    if waiting:
        raise CallsWaiting(scope, waiting, unanswered & waiting.keys())
    return fmt.items([(c, r) for c, r in outcomes if isinstance(r, Receipt)])


def run_turn(
    client: Client,
    scope: str,
    message: dict[str, Any] | list[Any],
    *,
    approve: Approve | None = None,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    timeout = inputs.wait_seconds(timeout)  # before anything is submitted
    fmt, calls, checked = checked_calls(client, scope, message)
    asked = zip(calls, checked, strict=True)  # each policy gets its own copy: what it does
    approvers = [
        _approver(approve(c.name, c.id, copy.deepcopy(p.args)) if approve else None, c, p)
        for c, p in asked
    ]
    deadline = None if timeout is None else time.monotonic() + timeout
    if any(a is not None for a in approvers):
        # what the first publish imports (Celery, the broker's transport: 0.4-0.5 s), imported
        # before the first commit: imported between a call's commit and its publish, an agent
        # SIGKILLed there left the call approved and never published, for the sweep to find
        # 120 s later (repair meanwhile: "approved: no receipt yet")
        client.warm()
    handles: list[tuple[Call, Any]] = []
    again: dict[str, Callable[[], Any]] = {}  # each call's submit, to replay (_first_wait)
    for call, prepared, approver in zip(calls, checked, approvers, strict=True):
        # submitted in the model's order (workers may run them concurrently)
        again[call.id] = functools.partial(client.submit_checked, prepared, approved_by=approver)
        try:
            handles.append((call, again[call.id]()))
        except Exception as exc:  # noqa: BLE001 - raised again by _submit_failed, or as it is
            _submit_failed(scope, call, [(c, h.status) for c, h in handles], exc)
    for call, handle in handles:
        _said(scope, call, handle.submitted)
    outcomes: list[tuple[Call, Receipt | str]] = []
    unanswered: set[str] = set()  # a wait given up on a database that did not answer
    failed: dict[str, Exception] = {}  # a wait the database failed at once: see below
    for call, handle in handles:
        if unanswered and handle.receipt_in_hand is None:
            # the database did not answer this turn's last wait, which took the reads' whole
            # grace past the turn's timeout; each later call's wait took it again (a cold
            # review: 4 calls, timeout 1 s, 9 s): where it stood at its submit is all we know
            outcomes.append((call, handle.status))
            unanswered.add(call.id)
            continue
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            outcomes.append((call, receipt_replaying(handle, again[call.id], left)))
        except TimeoutError as exc:  # ReceiptTimeout: it says where the call stands
            outcomes.append((call, _status_of(exc)))
            if getattr(exc, "unanswered", False):
                unanswered.add(call.id)
        except Exception as exc:
            if not database_failed(exc):  # a bug, a record the ledger calls corrupt: as is
                raise
            # the next call's wait is still made: a failure at once (refused connections)
            # costs no grace, and the database may be back
            outcomes.append((call, UNANSWERED))
            failed[call.id] = exc
    try:
        return answered(scope, fmt, outcomes, frozenset(unanswered | failed.keys()))
    except CallsWaiting as waiting:
        raise waiting from next(iter(failed.values()), None)


async def run_turn_async(
    client: AsyncClient,
    scope: str,
    message: dict[str, Any] | list[Any],
    *,
    approve: Approve | None = None,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    timeout = inputs.wait_seconds(timeout)  # before anything is submitted
    fmt, calls, checked = checked_calls(client.sync, scope, message)
    approvers = []
    for call, prepared in zip(calls, checked, strict=True):
        approver = approve(call.name, call.id, copy.deepcopy(prepared.args)) if approve else None
        answer = await approver if inspect.isawaitable(approver) else approver
        approvers.append(_approver(answer, call, prepared))
    if any(a is not None for a in approvers):
        await client.warm()  # as in run_turn
    handles: list[tuple[Call, Any]] = []
    again: dict[str, Callable[[], Any]] = {}  # as in run_turn
    for call, prepared, approver in zip(calls, checked, approvers, strict=True):
        again[call.id] = functools.partial(
            client.sync.submit_checked, prepared, approved_by=approver
        )
        try:
            handles.append((call, await client.submit_checked(prepared, approved_by=approver)))
        except Exception as exc:  # noqa: BLE001 - raised again by _submit_failed, or as it is
            _submit_failed(scope, call, [(c, h.handle.status) for c, h in handles], exc)
    for call, handle in handles:
        _said(scope, call, handle.handle.submitted)

    unanswered: set[str] = set()
    failed: list[Exception] = []

    async def one(call: Call, handle: Any) -> tuple[Call, Receipt | str]:
        try:
            return call, await receipt_replaying_async(handle, again[call.id], timeout)
        except TimeoutError as exc:
            if getattr(exc, "unanswered", False):
                unanswered.add(call.id)
            return call, _status_of(exc)
        except Exception as exc:
            if not database_failed(exc):  # see run_turn
                raise
            unanswered.add(call.id)
            failed.append(exc)
            return call, UNANSWERED

    outcomes = await asyncio.gather(*(one(c, h) for c, h in handles))  # waited together
    try:
        return answered(scope, fmt, list(outcomes), frozenset(unanswered))
    except CallsWaiting as waiting:
        raise waiting from (failed[0] if failed else None)
