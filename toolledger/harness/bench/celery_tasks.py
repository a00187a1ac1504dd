"""The Celery baselines of the end-to-end benchmark: the same app settings as toolledger's
workers (acks_late, reject_on_worker_lost, prefetch 1, one visibility timeout), running a
no-op task and a task that does the same file write with no ledger.
Workers: ``celery -A bench.celery_tasks worker -Q bench``."""

from __future__ import annotations

import os
import time

from celery import Celery

from toolledger.config import Settings
from toolledger.harness.bench.common import atomic_write
from toolledger.worker.app import celery_config

QUEUE = "bench"


def make_app(settings: Settings) -> Celery:
    app = Celery("bench", broker=settings.broker, set_as_current=False)
    app.conf.update(celery_config(settings))
    app.conf.task_default_queue = QUEUE
    return app


app = make_app(Settings.from_env())


def _done(job_id: str) -> None:
    """Completion time, appended to a log (no fsync: the baseline should be cheap)."""
    fd = os.open(os.environ["BENCH_DONE_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{job_id} {time.time()}\n".encode())
    os.close(fd)


@app.task(name="bench.noop", shared=False)  # type: ignore[untyped-decorator]
def noop(job_id: str) -> None:
    _done(job_id)


@app.task(name="bench.write", shared=False)  # type: ignore[untyped-decorator]
def write(job_id: str, directory: str, name: str, content: str) -> None:
    atomic_write(directory, name, content.encode())
    _done(job_id)
