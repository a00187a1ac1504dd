"""The Celery tasks. A message carries (scope, idempotency_key, attempt) only: the broker
carries pointers, the ledger carries truth — arguments are read from the ledger."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from celery import Celery, Task

from toolledger.config import Settings
from toolledger.ledger.errors import InputError, InvalidArguments
from toolledger.ledger.identity import check_attempt, check_scope, check_text_id
from toolledger.observability import tracing
from toolledger.observability.tracing import CALL_TRACEPARENT
from toolledger.worker.runtime import default_worker_id, runtime

if TYPE_CHECKING:
    from toolledger.worker.pipeline import Outcome

log = logging.getLogger("toolledger.worker")

#: The task that runs one call; its messages carry (scope, idempotency_key, attempt).
EXECUTE = "toolledger.execute"


_FIELDS = ("scope", "idempotency_key", "attempt")
#: Message headers (never arguments): when it was published (Unix time, for the
#: schedule-to-start histogram) and the tool_call_id the submitter knew (for the span); the
#: W3C ``traceparent``/``tracestate`` headers carry the submitter's trace context, and
#: ``CALL_TRACEPARENT`` the call's own where another published it (the sweep, a retry).
PUBLISHED_AT = "toolledger_published_at"
TOOL_CALL_ID = "toolledger_tool_call_id"
#: The call's tool, as its producer knew it: a worker that does not load it leaves the call
#: for one that does without a read (Executor._leaves). A label: the claim reads the tool.
TOOL = "toolledger_tool"


def message_headers(request: Any) -> dict[str, Any]:
    """The custom headers of the message being run (Celery merges them into the request)."""
    headers = dict(getattr(request, "headers", None) or {})
    for name in (PUBLISHED_AT, TOOL_CALL_ID, TOOL, "traceparent", "tracestate", CALL_TRACEPARENT):
        if name not in headers and (value := getattr(request, name, None)) is not None:
            headers[name] = value
    return headers


def parse_message(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, str, int]:
    """(scope, idempotency_key, attempt) from a job's arguments, or InputError naming the
    field: checked before anything else, so that a forged or garbled message costs one log
    line and no database work (never a retry loop, never its contents in a log)."""
    unknown = sorted(set(kwargs) - set(_FIELDS))
    if unknown:
        raise InvalidArguments(f"message: unknown field {unknown[0]!r}")
    if len(args) > len(_FIELDS):
        raise InvalidArguments(f"message: {len(args)} arguments, expected {len(_FIELDS)}")
    values = dict(zip(_FIELDS, args, strict=False))
    for name, value in kwargs.items():
        if name in values:
            raise InvalidArguments(f"message: {name} given twice")
        values[name] = value
    missing = [f for f in _FIELDS if f not in values]
    if missing:
        raise InvalidArguments(f"message: {missing[0]} is missing")
    scope, key, attempt = (values[f] for f in _FIELDS)
    check_scope(scope)
    check_text_id(key, "message: idempotency_key")
    return scope, key, check_attempt(attempt, "message: attempt")


class GuardedTask(Task):  # type: ignore[misc]
    """The base of this app's tasks (the sweep's too): a malformed message is refused."""

    Strategy = "toolledger.worker.consumer:guarded_strategy"


def register_tasks(app: Celery, settings: Settings) -> None:
    @app.task(name=EXECUTE, bind=True, shared=False)  # type: ignore[untyped-decorator]
    def execute(task: Task, *args: Any, **kwargs: Any) -> str:
        try:
            scope, idempotency_key, attempt = parse_message(args, kwargs)
        except InputError as exc:
            # acked and dropped: a malformed message can never become valid by a retry
            log.error("%s %s: rejected: %s", EXECUTE, task.request.id, exc)
            return "rejected"
        worker_id = default_worker_id(task.request.hostname or "")
        headers = message_headers(task.request)
        call_id = headers.get(TOOL_CALL_ID)  # a label only, never trusted: a bounded string
        if not isinstance(call_id, str) or not 0 < len(call_id) <= 256:
            call_id = None
        tool = headers.get(TOOL)  # the same
        if not isinstance(tool, str) or not 0 < len(tool) <= 256:
            tool = None

        def report(outcome: Outcome) -> None:  # inside the span: the line carries its ids
            if outcome.state == "left":
                log.info(
                    "%s %s/%s#%s: not claimed (a tool this worker does not load): nothing ran",
                    EXECUTE,
                    scope,
                    idempotency_key,
                    attempt,
                )
            elif outcome.state == "lost":
                log.info(
                    "%s %s/%s#%s: not claimed (not approved, or already claimed): nothing ran",
                    EXECUTE,
                    scope,
                    idempotency_key,
                    attempt,
                )
            else:
                log.info(
                    "%s %s/%s#%s: %s %s (%s)",
                    EXECUTE,
                    scope,
                    idempotency_key,
                    attempt,
                    outcome.state,
                    outcome.status,
                    outcome.execution_id,
                )

        outcome = (
            runtime(settings)
            .executor(worker_id)
            .execute(
                scope,
                idempotency_key,
                attempt,
                tool_call_id=call_id,
                published_at=headers.get(PUBLISHED_AT),
                parent=tracing.extract(headers),
                links=tracing.call_links(headers),
                report=report,
                tool=tool,
            )
        )
        return outcome.state

    _ = execute


def _plain(text: str) -> bool:
    """Printable ASCII with no quote or backslash: ``repr`` writes it as ``saferepr`` does."""
    return text.isascii() and text.isprintable() and "'" not in text and "\\" not in text


def _argsrepr(args: tuple[str, str, int]) -> str | None:
    """How Celery would show the message's arguments in logs and monitors, made here where
    that is a plain ``repr`` (Celery's ``saferepr`` cost 5 % of a submit's CPU): two short
    plain strings and an int. None (Celery makes it) for anything else, where the two
    differ: ``saferepr`` quotes and escapes its own way, writes numbers with ``str`` and
    shortens past 1,024 characters."""
    scope, key, attempt = args
    if type(attempt) is int and len(scope) + len(key) < 800 and _plain(scope) and _plain(key):
        return repr(args)
    return None


def publish(
    app: Celery,
    settings: Settings,
    scope: str,
    key: str,
    attempt: int,
    *,
    tool_call_id: str | None = None,
    tool: str | None = None,
    **options: Any,
) -> None:
    """Send one job; a few quick retries, then the error goes to the caller (the outbox)."""
    headers: dict[str, Any] = {PUBLISHED_AT: time.time()}
    if tool_call_id is not None:
        headers[TOOL_CALL_ID] = tool_call_id
    if tool is not None:
        headers[TOOL] = tool
    tracing.inject(headers)
    args = (scope, key, attempt)
    app.send_task(
        EXECUTE,
        args=args,
        argsrepr=_argsrepr(args),
        kwargsrepr="{}",
        queue=settings.queue,
        retry=True,
        retry_policy={
            "max_retries": 2,
            "interval_start": 0,
            "interval_step": 0.2,
            "interval_max": 0.5,
        },
        headers=headers,
        **options,
    )
