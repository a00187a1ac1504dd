"""The JSON API: the CLI's ``--json`` shapes over HTTP, every action in the token's name.

Bodies are read as bytes through the ledger's input layer (strict UTF-8, no duplicate keys,
bounded depth and size), so the API refuses exactly what the CLI refuses."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, BeforeValidator, Field

from toolledger.ledger import inputs
from toolledger.ledger.errors import InvalidArguments
from toolledger.server.auth import Action, Token
from toolledger.server.deps import (
    ReadsBusy,
    ReadTimedOut,
    api_token,
    desk_of,
    read_body,
    require_suffix,
    suffixed,
)
from toolledger.server.state import Desk

router = APIRouter(prefix="/api")
Who = Annotated[Token, Depends(api_token)]


def _blank_is(default: object) -> BeforeValidator:
    """An empty query value (a form's or a script's empty field) is the parameter's default,
    as an empty ``status``, ``scope`` or ``cursor`` is no filter: ``?review=`` and
    ``?limit=`` were 422 where those were taken as absent (a review)."""
    return BeforeValidator(lambda value: default if value == "" else value)


# The bodies, for the OpenAPI document; parsing itself goes through the input layer.
class SubmitBody(BaseModel):
    scope: str
    tool_call_id: str
    tool: str
    args: dict[str, Any]
    key: str | None = Field(None, description="Idempotency key [default: TOOL:TOOL_CALL_ID].")
    approve: bool = Field(False, description="Approve at once in the token's name.")
    reason: str | None = None


class DecisionBody(BaseModel):
    reason: str | None = None


class RetryBody(BaseModel):
    accept_duplicate: bool = False
    reason: str | None = None


class ResolveBody(BaseModel):
    as_: str = Field(alias="as", description="succeeded or failed")
    evidence: str = Field(description="What you saw that proves it (required).")
    review: bool = Field(
        default=False,
        description="Settle the flag on this execution's call, which you have looked at; "
        "without it, an execution no longer unknown is refused (409).",
    )
    seen: int | None = Field(
        default=None,
        description="With review: the seq of the call's newest event you looked at; 409 if a "
        "flag the review would settle was raised since, or the call changed since.",
    )


def _body(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


def _fields(body: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise InvalidArguments(f"unknown field(s): {', '.join(extra)}")


def _opt_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidArguments(f"{name} must be a string")
    if value is not None:
        inputs.check_text(value, name)
    return value


@router.get("/calls")
def list_calls(
    request: Request,
    who: Who,
    status: str | None = None,
    scope: str | None = None,
    review: Annotated[bool, Query(), _blank_is(False)] = False,
    limit: Annotated[int, Query(), _blank_is(100)] = 100,
    cursor: str | None = None,
) -> dict[str, Any]:
    """Calls from current state, oldest first; ``next_cursor`` fetches the next page."""
    page = desk_of(request).list_calls(
        who, status=status, scope=scope, review=review, limit=limit, cursor=cursor
    )
    return page.to_json()


@router.get("/inbox")
def inbox(request: Request, who: Who) -> dict[str, int]:
    """What waits on a person: pending approvals, unknown calls, calls flagged for review."""
    return desk_of(request).inbox(who)


@router.post("/calls", openapi_extra=_body(SubmitBody))
async def submit(request: Request, who: Who) -> Any:
    """Record a call (the CLI's ``submit``); runs it at once if the tool is read-only."""
    who.require(Action.SUBMIT)  # a role that may not: 403, whatever the body (helper-91)
    body = await read_body(request)
    desk = desk_of(request)
    sub = await _threaded(request, lambda: desk.prepare(who, body))
    if sub.call.read_only:
        return await _read_only(desk, lambda: desk.record(who, sub), sub.call.tool)
    return await _threaded(request, lambda: desk.record(who, sub))


@router.post("/executions/{execution_id}/resolve", openapi_extra=_body(ResolveBody))
async def resolve(request: Request, who: Who, execution_id: str) -> Any:
    """A person's resolution of an unknown execution, with the evidence; ``review``, their
    review of the flag on its call, which they have looked at (409 without it on an
    execution no longer unknown: a stale resolution never settles a flag it never saw);
    ``seen``, the seq of the call's newest event the review was decided on (409 if a flag it
    would settle was raised since, or the call changed)."""
    who.require(Action.RESOLVE)
    body = await read_body(request)
    _fields(body, {"as", "evidence", "review", "seen"})
    as_, evidence = body.get("as"), body.get("evidence")
    if not isinstance(as_, str) or not isinstance(evidence, str):
        raise InvalidArguments("as and evidence are required strings")
    review = body.get("review", False)
    if not isinstance(review, bool):
        raise InvalidArguments("review must be true or false")
    seen = body.get("seen")  # the newest event's seq the review was decided on
    if seen is not None and (type(seen) is not int or not 0 <= seen <= 2**62):
        raise InvalidArguments("seen must be an event's seq")
    if seen is not None and not review:  # as the CLI's --seen without --review
        raise InvalidArguments("seen goes with review: true (it says what the review saw)")
    return await _threaded(
        request,
        lambda: desk_of(request).resolve(
            who, execution_id, as_, evidence, review=review, seen=seen
        ),
    )


# A tool_call_id may hold "/": the routes with a suffix come before the bare one, and each
# checks that its suffix was not the end of an escaped id.
@router.get("/calls/{scope}/{tool_call_id:path}/events")
def events(
    request: Request,
    who: Who,
    scope: str,
    tool_call_id: str,
    after: Annotated[int, Query(ge=0, le=2**62), _blank_is(0)] = 0,
    limit: Annotated[int, Query(ge=0, le=2**62), _blank_is(0)] = 0,
) -> dict[str, Any]:
    """The call's event history, in order (the CLI's ``events``): the events past ``after``
    (a ``seq``), at most ``limit`` (0: all); ``more`` says if some were left."""
    if not suffixed(request, "events"):  # the call "x/events" itself
        return show(request, who, scope, f"{tool_call_id}/events")
    return desk_of(request).events(who, scope, tool_call_id, after=after, limit=limit)


@router.post("/calls/{scope}/{tool_call_id:path}/approve", openapi_extra=_body(DecisionBody))
async def approve(request: Request, who: Who, scope: str, tool_call_id: str) -> Any:
    """Approve a pending call in the token's name, and enqueue it."""
    require_suffix(request, "approve")
    return await _decide(request, who, scope, tool_call_id, approve=True)


@router.post("/calls/{scope}/{tool_call_id:path}/reject", openapi_extra=_body(DecisionBody))
async def reject(request: Request, who: Who, scope: str, tool_call_id: str) -> Any:
    """Reject a pending call in the token's name."""
    require_suffix(request, "reject")
    return await _decide(request, who, scope, tool_call_id, approve=False)


@router.post("/calls/{scope}/{tool_call_id:path}/retry", openapi_extra=_body(RetryBody))
async def retry(request: Request, who: Who, scope: str, tool_call_id: str) -> Any:
    """A new attempt under the same key; ``accept_duplicate`` for a tool that is not
    idempotent; ``attempt``, the call's ``last_attempt`` as the decision saw it
    (409 if there is a later attempt now)."""
    require_suffix(request, "retry")
    who.require(Action.RETRY)
    body = await read_body(request, empty_ok=True)
    _fields(body, {"accept_duplicate", "reason", "attempt"})
    accept = body.get("accept_duplicate", False)
    if not isinstance(accept, bool):
        raise InvalidArguments("accept_duplicate must be true or false")
    reason = _opt_str(body, "reason")
    attempt = body.get("attempt")
    if attempt is not None and (type(attempt) is not int or not 1 <= attempt <= 2**31):
        raise InvalidArguments("attempt must be a positive integer")
    return await _threaded(
        request,
        lambda: desk_of(request).retry(
            who, scope, tool_call_id, accept_duplicate=accept, reason=reason, attempt=attempt
        ),
    )


@router.get("/calls/{scope}/{tool_call_id:path}")
def show(request: Request, who: Who, scope: str, tool_call_id: str) -> dict[str, Any]:
    """One call: its action, every attempt and the receipt (the CLI's ``show``)."""
    return desk_of(request).show(who, scope, tool_call_id)


async def _decide(
    request: Request, who: Token, scope: str, tool_call_id: str, *, approve: bool
) -> Any:
    who.require(Action.DECIDE)
    body = await read_body(request, empty_ok=True)
    _fields(body, {"reason"})
    reason = _opt_str(body, "reason")
    return await _threaded(
        request,
        lambda: desk_of(request).decide(who, scope, tool_call_id, reason, approve=approve),
    )


async def _read_only(desk: Desk, work: Callable[[], Any], tool: str) -> Any:
    """A read-only call's run, apart from the pool (``Desk.reads``), within its time limit.
    On the pool, unbounded, an agent's 45 reads of 20 s left no thread for anyone's request
    (a cold review: a viewer's inbox waited 17.7 s), as ``mcp serve`` bounds them."""
    done = desk.reads.start(work)
    if done is None:
        raise ReadsBusy(
            f"the read-only tool {tool!r} was not started: {desk.reads.at_once} reads still "
            "run on this server; a read is not recorded: ask again shortly"
        )
    limit = desk.read_timeout
    with anyio.move_on_after(limit if limit > 0 else math.inf):
        return await asyncio.shield(done)
    raise ReadTimedOut(
        f"the read-only tool {tool!r} did not finish within {limit:g} s (its time limit, "
        "TOOLLEDGER_TIME_LIMIT); a read is not recorded: ask again"
    )


async def _threaded(request: Request, work: Any) -> Any:
    """The ledger is synchronous: run it on the thread pool, not the event loop."""
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(work)
