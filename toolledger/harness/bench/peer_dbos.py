"""DBOS Transact, the same job: ``python -m bench.peer_dbos worker`` (BENCH_PG)."""

from __future__ import annotations

import os
import signal
import sys
import threading

from dbos import DBOS

from toolledger.harness.bench.common import atomic_write

QUEUE = "bench"


@DBOS.step()
def write_step(directory: str, name: str, content: str) -> None:
    atomic_write(directory, name, content.encode())


@DBOS.workflow()
def write_wf(directory: str, name: str, content: str) -> None:
    write_step(directory, name, content)


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    DBOS(
        config={
            "name": "bench",
            "system_database_url": os.environ["BENCH_PG"],
            "executor_id": f"bench-{os.getpid()}",
        }
    )
    DBOS.launch()
    DBOS.register_queue(
        QUEUE,
        worker_concurrency=int(os.environ.get("BENCH_CONCURRENCY", 2)),
        # DBOS's queue is polled (its default: every second). 0.005 s is its best on the
        # 2-core machine, 1,000 calls, 2 x 2 workers (2026-12-05): 0.05 s 68 calls/s, 0.005 s
        # 180-203, 0.002 s 168, 0.001 s 174 (polling faster costs more CPU than it saves).
        polling_interval_sec=float(os.environ.get("BENCH_DBOS_POLL", 0.005)),
    )
    print("bench-peer ready", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    DBOS.destroy()
