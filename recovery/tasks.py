"""The sweep as a Celery task, registered from here on any app that includes this module
(the worker's does: ``toolledger.worker.app.INCLUDE``); the beat schedules it by name."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any, cast

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

_parts: tuple[int, Ledger, Registry, Sandbox] | None = None


def parts(settings: Settings) -> tuple[Ledger, Registry, Sandbox]:
    """This process's ledger, registry and sandbox for sweeping (again after a fork)."""
    global _parts
    if _parts is None or _parts[0] != os.getpid():
        ledger = Ledger(settings.db, timeout=settings.db_timeout)
        sandbox = Sandbox.configured(settings)
        _parts = (os.getpid(), ledger, load_registry(settings.tools), sandbox)
    return _parts[1], _parts[2], _parts[3]


@shared_task(name=SWEEP, bind=True)  # type: ignore[untyped-decorator]
def sweep(task: Task) -> dict[str, Any]:
    """One recovery pass, with the settings and the publisher of the app that runs it."""
    settings = cast(Settings, task.app.toolledger_settings)
    publish = cast(Publish, task.app.toolledger_publish)
    ledger, registry, sandbox = parts(settings)
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
    )
    log.info("%s: %s", SWEEP, json.dumps(summary.to_json()))
    return summary.to_json()
