"""Procrastinate, the same job: ``python -m bench.peer_procrastinate worker`` (BENCH_PG)."""

from __future__ import annotations

import os
import sys

import procrastinate

from toolledger.harness.bench.common import atomic_write

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=os.environ.get("BENCH_PG", ""))
)


@app.task(queue="bench", name="bench_write")
def write(directory: str, name: str, content: str) -> None:
    atomic_write(directory, name, content.encode())


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    with app.open():
        print("bench-peer ready", flush=True)
        app.run_worker(queues=["bench"], concurrency=int(os.environ.get("BENCH_CONCURRENCY", 2)))
