"""The sweep as a Celery task, registered from here on any app that includes this module
(the worker's does: ``toolledger.worker.app.INCLUDE``); the beat schedules it by name."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any, cast

import sqlalchemy as sa
from celery import Task, shared_task

from toolledger.config import Settings
from toolledger.ledger.ledger import Ledger
from toolledger.recovery.sweep import sweep as run_sweep
from toolledger.registry import load_registry
from toolledger.sandbox import Sandbox
from toolledger.tools import Registry

log = logging.getLogger("toolledger.recovery")

#: The sweep's task name (the beat schedule of ``toolledger.worker.app`` names it).
SWEEP = "toolledger.sweep"

Publish = Callable[[str, str, int], None]


class SweepFailed(Exception):
    """A pass the database stopped (out of reach, busy, or refusing a statement), told in one
    line: Celery logged the driver's error through SQLAlchemy with its traceback, about 120
    lines every interval for as long as the database was down (a cold review). Celery still
    records the task failed (``throws``: at INFO, without a traceback); a bug keeps its own."""


_parts: tuple[int, Ledger, Registry, Sandbox] | None = None


def parts(settings: Settings) -> tuple[Ledger, Registry, Sandbox]:
    """This process's ledger, registry and sandbox for sweeping (again after a fork)."""
    global _parts
    if _parts is None or _parts[0] != os.getpid():
        ledger = Ledger(settings.db, timeout=settings.db_timeout)
        sandbox = Sandbox.configured(settings)
        _parts = (os.getpid(), ledger, load_registry(settings.tools), sandbox)
    return _parts[1], _parts[2], _parts[3]


@shared_task(name=SWEEP, bind=True, throws=(SweepFailed,))  # type: ignore[untyped-decorator]
def sweep(task: Task) -> dict[str, Any]:
    """One recovery pass, with the settings and the publisher of the app that runs it."""
    settings = cast(Settings, task.app.toolledger_settings)
    publish = cast(Publish, task.app.toolledger_publish)
    ledger, registry, sandbox = parts(settings)
    try:
        summary = run_sweep(
            ledger,
            registry,
            sandbox,
            grace_seconds=settings.sweep_grace,
            requeue_after=settings.requeue_after,
            publish=publish,
            max_auto_retries=settings.max_auto_retries,
            # under the soft time limit the worker's app sets for every task: half of it for
            # reconcilers, which may each wait on a service; the next pass goes on after them
            reconcile_budget=settings.soft_time_limit / 2,
            # a reconciler past the hard limit kills this child, and where it stood with it:
            # every pass was killed at that row, the rows after it never reconciled
            resume_file=settings.home / "sweep-resume.json",
        )
    except (sa.exc.DBAPIError, sa.exc.TimeoutError) as exc:
        said = _database_said(exc)
        log.error("%s: this pass stopped, %s; the next pass tries again", SWEEP, said)
        raise SweepFailed(said) from None
    log.info("%s: %s", SWEEP, json.dumps(summary.to_json()))
    return summary.to_json()


def _database_said(exc: sa.exc.DBAPIError | sa.exc.TimeoutError) -> str:
    """What stopped a pass, in one line, with the driver's own words (never a statement: they
    show no parameters, and no URL's password is in a driver's message)."""
    from toolledger.ledger.db import busy, unreachable

    orig = getattr(exc, "orig", None)
    words = " ".join(str(orig if orig is not None else exc).split())
    if isinstance(exc, sa.exc.TimeoutError):
        return f"the ledger out of reach (no free connection in the pool): {words}"
    if unreachable(orig):
        return f"the ledger out of reach: {words}"
    if busy(orig):
        return f"the ledger busy: {words}"
    return f"the ledger refused it: {type(orig).__name__}: {words}"
