"""What only a human may decide: resolving an unknown, and authorising a new attempt."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from toolledger.ledger.errors import InvalidTransition, NotFound, StaleAttempt, StateError
from toolledger.ledger.identity import PROXIED_PREFIX
from toolledger.ledger.ledger import Ledger, flagged_retry
from toolledger.ledger.transitions import RETRYABLE, Status
from toolledger.observability import tracing
from toolledger.recovery.reconcile import NOT_APPLIED
from toolledger.tools import Registry, UnknownTool

#: Publishes an authorised attempt: ``(scope, idempotency_key, attempt) -> what happened``
#: (the worker's ``Submitter.enqueue``; an enqueue error is reported, the sweep re-publishes).
Enqueue = Callable[[str, str, int], dict[str, Any]]


class DuplicateNotAccepted(StateError):
    """A retry of a tool that is not idempotent must accept a duplicate effect explicitly."""


def _about(
    ledger: Ledger,
    *,
    scope: str | None = None,
    tool_call_id: str | None = None,
    execution_id: str | None = None,
) -> tuple[dict[str, Any], dict[str, str] | None]:
    """The attributes of a person's span about a call, and the trace context the call was
    submitted under, for the span to link to. Read only when this process traces; a call
    not found (the decision says so itself) or a ledger that does not answer: no link."""
    attrs: dict[str, Any] = {
        "toolledger.scope": scope,
        "gen_ai.tool.call.id": tool_call_id,
        "toolledger.execution_id": execution_id,
    }
    if not tracing.active():
        return attrs, None
    try:
        if execution_id is not None:
            ex = ledger.execution(execution_id)
            scope, key = ex.scope, ex.idempotency_key
            attrs.update({"toolledger.scope": scope, "toolledger.attempt": ex.attempt})
        else:
            assert scope is not None and tool_call_id is not None
            key = ledger.key_for(scope, tool_call_id)
        attrs["toolledger.idempotency_key"] = key
        attrs["gen_ai.tool.name"] = ledger.operation(scope, key).tool
        return attrs, ledger.call_traces([(scope, key)]).get((scope, key))
    except (NotFound, sa.exc.SQLAlchemyError):
        return attrs, None


def retry(
    ledger: Ledger,
    registry: Registry,
    enqueue: Enqueue,
    scope: str,
    tool_call_id: str,
    *,
    by: str,
    accept_duplicate: bool = False,
    reason: str | None = None,
    attempt: int | None = None,
) -> dict[str, Any]:
    """A new attempt under the same key, authorised by ``by``, then enqueued.

    The first attempt may have taken effect (unknown) or partly taken effect (failed): for a
    tool that is not idempotent, a retry can apply the effect twice, and the person must say
    that they accept it. ``attempt``: the last attempt the person saw when they decided (the
    console's page, ``show``'s ``last_attempt``); refused if there is a later one now
    (helper-91: a page showing attempt 1 authorised attempt 3, accepting a duplicate of an
    attempt 2 nobody had seen).

    Its span, ``retry_tool {tool}``, links to the call's submit span, and so does the
    execution it publishes (its child): a retry made hours later, from the CLI or the
    console, is found from the call's trace.
    """
    asked = RetryAsked(scope, tool_call_id, by, accept_duplicate, reason, attempt)
    try:
        return _retry(ledger, registry, enqueue, asked)
    except InvalidTransition:
        again = _retry_given_again(ledger, enqueue, asked)
        if again is None:
            raise
        return again


@dataclass(frozen=True)
class RetryAsked:
    """A retry as a person asked for it (``retry``'s arguments)."""

    scope: str
    tool_call_id: str
    by: str
    accept_duplicate: bool
    reason: str | None
    attempt: int | None


def _retry_given_again(
    ledger: Ledger, enqueue: Enqueue, asked: RetryAsked
) -> dict[str, Any] | None:
    """The answer to a retry the ledger refused that is one it took already: the call's last
    attempt was authorised by this very retry (this person, this reason, this acceptance of a
    duplicate, and, when the retry names the ``attempt`` it saw, the attempt after it), as a
    script whose answer was lost sends it again. None for any other refusal. Until
    2026-12-07 it was refused (exit 5 / 409, "it is attempt 2 now; look again"), as anyone
    else's retry, and the script could not tell its own retry stood. Nothing is written; a
    retry whose publish never happened (its process killed after the commit: never stamped)
    is published, as a replayed submit would."""
    scope, tool_call_id, by, attempt = asked.scope, asked.tool_call_id, asked.by, asked.attempt
    accept_duplicate, reason = asked.accept_duplicate, asked.reason
    view = ledger.get(scope, tool_call_id)
    op, last = view.operation, view.last_attempt
    if attempt is not None and attempt + 1 != last:
        return None
    mine = {"retry": True, "accept_duplicate": accept_duplicate, "reason": reason}
    given = [
        ev
        for ev in ledger.events(scope, tool_call_id)
        if ev.kind == Status.APPROVED.value and ev.detail.get("attempt") == last
    ]
    if not given or given[-1].actor != by:
        return None
    if {k: given[-1].detail.get(k) for k in mine} != mine:
        return None
    out: dict[str, Any] = {
        "scope": scope,
        "tool_call_id": tool_call_id,
        "idempotency_key": op.idempotency_key,
        "tool": op.tool,
        "status": op.status.value,
        "attempt": last,
        "authorized_by": by,
        "duplicate_effect_accepted": accept_duplicate,
        "outcome": "existing",
    }
    workers = op.review is None and not op.tool.startswith(PROXIED_PREFIX)
    if workers and op.status is Status.APPROVED and op.enqueued_at is None:
        out.update(enqueue(scope, op.idempotency_key, op.authorized_attempts))
    return out


def _retry(
    ledger: Ledger, registry: Registry, enqueue: Enqueue, asked: RetryAsked
) -> dict[str, Any]:
    scope, tool_call_id, by, attempt = asked.scope, asked.tool_call_id, asked.by, asked.attempt
    accept_duplicate, reason = asked.accept_duplicate, asked.reason
    attrs, trace = _about(ledger, scope=scope, tool_call_id=tool_call_id)
    name = f"retry_tool {attrs.get('gen_ai.tool.name') or ''}".rstrip()
    with (
        tracing.span(name, attrs, links=tracing.links_to(trace)) as span,
        tracing.for_call(trace),
    ):
        view = ledger.get(scope, tool_call_id)
        op = view.operation
        # against the last attempt, which a withdrawal does not lower (``CallView.last_attempt``):
        # against ``authorized_attempts``, a page read before attempts 2 and 3 existed was taken
        # as current once a withdrawal made attempt 1 current again (a cold review)
        if attempt is not None and attempt != view.last_attempt:
            raise StaleAttempt(
                op.status,
                f"a retry of {tool_call_id!r} decided on attempt {attempt}: it is attempt "
                f"{view.last_attempt} ({op.status}) now; look again (toolledger show)",
            )
        if op.tool.startswith(PROXIED_PREFIX):
            raise UnknownTool(
                f"unknown tool {op.tool!r}: an upstream tool the MCP proxy forwards, which no "
                "worker runs; resolve the call once you know what the upstream did"
            )
        if op.status not in RETRYABLE:  # before any advice on duplicates: none would help
            raise InvalidTransition(
                op.status, Status.APPROVED, f"a retry of {tool_call_id!r} (only unknown or failed)"
            )
        if op.review is not None:  # before any advice on duplicates: a person reviews it first
            flagged = flagged_retry(tool_call_id, op.review)
            raise InvalidTransition(op.status, Status.APPROVED, flagged)
        tool = registry.get(op.tool)
        # No duplicate when every attempt before is proven to have left nothing: a sandboxed
        # tool's that did not succeed by their own commit (the fence), and any the sweep proved
        # not applied (its reconciler's word, an executor that never started the tool). Only
        # the fence counted: a person had to accept a duplicate of an attempt proven never to
        # have run, and the log said they did (a cold review).
        nothing_landed = all(
            (tool.sandboxed and e.fenced and not e.own_success)
            or (e.status is Status.FAILED and e.reconciled and e.result == NOT_APPLIED)
            for e in view.executions
        )
        if not (tool.idempotent or nothing_landed or accept_duplicate):
            raise DuplicateNotAccepted(
                f"{op.tool} is not idempotent: the {op.status} attempt may already have taken "
                "effect, so a retry may apply it a second time; accept a duplicate effect "
                "explicitly (--accept-duplicate; accept_duplicate in the API and the Python "
                "client)"
            )
        retried = ledger.authorize_retry(
            scope, tool_call_id, by=by, accept_duplicate=accept_duplicate, reason=reason, seen=op
        )  # refused if another attempt came meanwhile: the duplicate check was about these
        out: dict[str, Any] = {
            "scope": scope,
            "tool_call_id": tool_call_id,
            "idempotency_key": retried.idempotency_key,
            "tool": retried.tool,
            "status": retried.status.value,
            "attempt": retried.authorized_attempts,
            "authorized_by": by,
            "duplicate_effect_accepted": accept_duplicate,
            "outcome": "decided",
        }
        if not (tool.idempotent or nothing_landed):
            out["warning"] = f"{by} accepted that {op.tool} may take effect twice"
        out.update(enqueue(scope, retried.idempotency_key, retried.authorized_attempts))
        tracing.annotate(
            span,
            {
                "gen_ai.tool.name": out["tool"],
                "toolledger.idempotency_key": out["idempotency_key"],
                "toolledger.attempt": out["attempt"],
                "toolledger.status": out["status"],
            },
            name=f"retry_tool {out['tool']}",
        )
        return out


def resolve(
    ledger: Ledger,
    execution_id: str,
    status: Status,
    *,
    by: str,
    evidence: str,
    review: bool = False,
    seen: int | None = None,
) -> dict[str, Any]:
    """unknown -> succeeded/failed on a human's word, with the evidence they give; or, with
    ``review`` (the person saw the flag), the review of a call flagged for a human (which
    clears the flag). Without it, a flag is never settled by a resolution decided before it
    was raised: StaleFence (``Ledger.resolve``). ``seen``: the ``seq`` of the call's newest
    event the person looked at; the review is refused if a flag it would settle was raised
    since, or the call changed (``Ledger.review``).

    Its span, ``resolve_tool {tool}`` (``review_tool {tool}`` for a review), links to the
    call's submit span.
    """
    attrs, trace = _about(ledger, execution_id=execution_id)
    what = "review_tool" if review else "resolve_tool"
    name = f"{what} {attrs.get('gen_ai.tool.name') or ''}".rstrip()
    with tracing.span(name, attrs, links=tracing.links_to(trace)) as span:
        done = ledger.resolve(
            execution_id, status, by=by, evidence=evidence, review=review, seen=seen
        )
        out = {
            "execution_id": execution_id,
            "scope": done.scope,
            "idempotency_key": done.idempotency_key,
            "status": done.status.value,
            "result": done.result,
            "reconciled": done.reconciled,
            "resolved_by": by,
        }
        tracing.annotate(span, {"toolledger.status": out["status"]})
        return out
