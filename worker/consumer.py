"""The worker's consumer side of Celery, hardened against messages it cannot read.

Celery's consumer turns some malformed messages into an exception out of its loop: a task
name that is not text (``TypeError: unhashable``) or a body it cannot make a request of (a
``"x"`` or ``[1, 2]`` body: ``ValueError``) stopped the worker ("Unrecoverable error"); no
task id (``KeyError``) restarted its consumer once a second, for ever. Either way the message,
unacked, was restored to the queue and did the same to the next worker that took it: one
publish stopped a whole fleet, every approved call left waiting (a review, 2026-12-07).
Here such a message is refused (logged, acked, dropped): a job's message is only a pointer,
and a call it may have named is still approved in the ledger, re-published by the sweep's
outbox. Imported by the worker only (Celery's ``worker_consumer`` setting and the tasks'
``Strategy``, both by name), never by a producer.
"""

from __future__ import annotations

import math
from typing import Any

from celery import Celery, Task
from celery.exceptions import InvalidTaskError
from celery.worker.consumer import Consumer as CeleryConsumer
from celery.worker.strategy import default
from kombu.exceptions import ContentDisallowed, DecodeError


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer, refusing a message whose task name is not text before Celery
    looks it up (an unhashable name raised out of its loop)."""

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().create_task_handler(*args, **kwargs)

        def on_task_received(message: Any) -> Any:
            if not _name_is_text(message):
                return self.on_unknown_message(None, message)
            return handle(message)

        return on_task_received


def _name_is_text(message: Any) -> bool:
    """False if the message names its task by anything but text (a list, a mapping)."""
    headers = message.headers
    if isinstance(headers, dict) and "task" in headers:  # protocol 2
        name = headers["task"]
    else:  # protocol 1: the name is in the body (one that does not decode is Celery's)
        try:
            payload = message.payload
        except Exception:  # noqa: BLE001 - Celery reports it as it always did
            return True
        if not isinstance(payload, dict) or "task" not in payload:
            return True  # Celery's own "unknown message"
        name = payload["task"]
    return name is None or isinstance(name, str)


def malformed(message: Any) -> str | None:
    """What makes a message no task of any version could be built from, or None: a task
    id that is not text, time limits Celery cannot apply, a protocol 2 body that is not
    ``[args, kwargs, embed]``. A body that does not decode is Celery's to report (it raises
    ``DecodeError``)."""
    headers = message.headers
    if isinstance(headers, dict) and "task" in headers:  # protocol 2 (1 keeps all in the body)
        if not isinstance(headers.get("id"), str):
            return "its task id is missing or not text"
        if not _time_limits(headers.get("timelimit")):
            # a prefork pool read ["a", "b"] only once a child had the job: a ValueError
            # out of the worker's loop ("Unrecoverable error")
            return "its time limits are not [seconds or null, seconds or null]"
        payload = message.payload
        if isinstance(payload, dict):  # a hybrid body ({"args": …}): Celery's to read
            return None
        if not isinstance(payload, list | tuple) or len(payload) != 3:
            return "its body is not [args, kwargs, embed]"
        args, kwargs, embed = payload
        if not isinstance(args, list | tuple) or not isinstance(kwargs, dict):
            return "its body is not [args, kwargs, embed]"
        if embed is not None and not isinstance(embed, dict):
            return "its body is not [args, kwargs, embed]"
    return None


def _time_limits(value: Any) -> bool:
    """Whether a message's ``timelimit`` header is one Celery can apply: null, or a pair of
    null or finite non-negative seconds (a task sent from a finalized app carries the app's
    own limits: the sweep's re-publications do)."""
    if value is None:
        return True
    if not isinstance(value, list | tuple) or len(value) != 2:
        return False
    return all(
        v is None or (type(v) in (int, float) and math.isfinite(v) and v >= 0) for v in value
    )


#: What a job message may say that the worker decides for itself (set to null on receipt).
WORKER_S_OWN = ("timelimit", "eta", "expires")


def worker_s_own(message: Any, body: Any) -> None:
    """The worker's own time limits and schedule for every message, never the message's.

    - ``timelimit``: the worker's settings (checked at start: soft < hard < lease). A forged
      ``[0.5, 1]`` had a prefork child killed half a second into an approved call, leaving it
      running until its lease expired, then unknown; a sweep's re-publication carried the
      limits of the app that sent it (the beat's settings), not the worker's (a review,
      2026-12-07).
    - ``eta`` and ``expires``: toolledger sends neither (a job runs when delivered, and the
      ledger, not the message, says whether it may). A forged far-future ``eta`` was held
      unacked in the worker's memory (on Redis, delivered again to the next worker each
      visibility timeout, held there too), and a past ``expires`` had Celery drop an
      approved call's job as revoked: the call waited for the sweep's re-publication.
    """
    headers = message.headers
    for name in WORKER_S_OWN:
        if isinstance(headers, dict) and name in headers:
            headers[name] = None
        if isinstance(body, dict) and name in body:  # protocol 1, a hybrid body
            body[name] = None


def guarded_strategy(task: Task, app: Celery, consumer: Any, **options: Any) -> Any:
    """Celery's default strategy, refusing a message it cannot make a request of (a body
    not ``[args, kwargs, embed]``, no task id) as an invalid task: logged, acked, dropped."""
    handle = default(task, app, consumer, **options)

    def on_message(
        message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any
    ) -> Any:
        why = malformed(message)
        if why is None:
            worker_s_own(message, body)
            try:
                return handle(message, body, ack, reject, callbacks, **kw)
            except (InvalidTaskError, DecodeError, ContentDisallowed):
                raise  # Celery's consumer reports and drops these itself
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                why = f"{type(exc).__name__}: {exc}"
        raise InvalidTaskError(f"malformed {task.name} message: {why}")

    return on_message
