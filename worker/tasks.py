"""The Celery tasks. A message carries (scope, idempotency_key, attempt) only: the broker
carries pointers, the ledger carries truth — arguments are read from the ledger."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task

from toolledger.config import Settings
from toolledger.worker.runtime import default_worker_id, runtime

log = logging.getLogger("toolledger.worker")

#: The task that runs one call; its messages carry (scope, idempotency_key, attempt).
EXECUTE = "toolledger.execute"


def register_tasks(app: Celery, settings: Settings) -> None:
    @app.task(name=EXECUTE, bind=True, shared=False)  # type: ignore[untyped-decorator]
    def execute(task: Task, scope: str, idempotency_key: str, attempt: int) -> str:
        worker_id = default_worker_id(task.request.hostname or "")
        outcome = runtime(settings).executor(worker_id).execute(scope, idempotency_key, attempt)
        if outcome.state == "lost":
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
        return outcome.state

    _ = execute


def publish(
    app: Celery, settings: Settings, scope: str, key: str, attempt: int, **options: Any
) -> None:
    """Send one job; a few quick retries, then the error goes to the caller (the outbox)."""
    app.send_task(
        EXECUTE,
        args=(scope, key, attempt),
        queue=settings.queue,
        retry=True,
        retry_policy={
            "max_retries": 2,
            "interval_start": 0,
            "interval_step": 0.2,
            "interval_max": 0.5,
        },
        **options,
    )
