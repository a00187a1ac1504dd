"""Procrastinate, the same job: ``python -m bench.peer_procrastinate worker`` (BENCH_PG)."""

from __future__ import annotations

import os
import sys

import procrastinate

from toolledger.harness.bench.common import atomic_write

TASK = "bench_write"


def make_app(conninfo: str) -> procrastinate.App:
    """An app on ``conninfo`` with the bench's one task. Built per database: a module-level
    app would keep the first database's pool for every later run in the same process."""
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo))

    @app.task(queue="bench", name=TASK)
    def write(directory: str, name: str, content: str) -> None:
        atomic_write(directory, name, content.encode())

    return app


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    app = make_app(os.environ.get("BENCH_PG", ""))
    with app.open():
        print("bench-peer ready", flush=True)
        app.run_worker(queues=["bench"], concurrency=int(os.environ.get("BENCH_CONCURRENCY", 2)))
