"""Round trip through the agent's API, one call at a time on an idle stack: submit -> receipt.

client    ``Client.submit(...).result()``: the waiter is woken by the database (LISTEN/NOTIFY
          on Postgres, the ledger's doorbell on the embedded default);
polling   the baseline a loop had before the client: ``Submitter.submit`` then
          ``Ledger.receipt`` every 1 ms until there is one.

The two alternate call by call against the same worker (one process, concurrency 2), so that
they share the machine's noise. Then ``idle_waiters``: the CPU (all threads of this process)
that 100 ``AsyncClient`` waiters on calls nobody approves cost over a quiet window, as a
percentage of one core.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolledger.config import Settings
from toolledger.harness.bench.common import Figures, percentile
from toolledger.harness.processes import service_env, worker_process

POLL_SECONDS = 0.001


def run_roundtrip(
    figures: Figures,
    label: str,
    env: dict[str, str],
    root: Path,
    calls: int,
    progress: Callable[[str], Any],
    idle_seconds: float = 10.0,
) -> None:
    from toolledger.client import Client
    from toolledger.ledger.errors import StateError
    from toolledger.worker.submit import Submitter

    settings = Settings.from_env({f"TOOLLEDGER_{k.upper()}": v for k, v in env.items()})
    worker = worker_process(f"rt-{label}", service_env(None, **env), root / "logs", concurrency=2)
    worker.start().wait_ready(120)
    scope = f"rt-{uuid.uuid4().hex[:8]}"
    client, submitter = Client(settings), Submitter(settings)
    try:
        client.notifier.start()
        lat: dict[str, list[float]] = {"client": [], "polling": []}
        for i in range(calls + 5):  # the first five warm both paths and are not counted
            for way in ("client", "polling") if i % 2 else ("polling", "client"):
                args = {"path": f"{way}/{i}.txt", "content": "x"}
                t0 = time.perf_counter()
                if way == "client":
                    client.submit(scope, f"{way}-{i}", "write_file", args, approved_by="b").result(
                        60
                    )
                else:
                    call = submitter.prepare(scope, f"{way}-{i}", "write_file", args)
                    submitter.submit(call, approved_by="b")
                    while True:
                        try:
                            submitter.ledger.receipt(scope, f"{way}-{i}")
                            break
                        except StateError:
                            time.sleep(POLL_SECONDS)
                if i >= 5:
                    lat[way].append((time.perf_counter() - t0) * 1000)
        for way, values in lat.items():
            figures.add(f"roundtrip/{label}/{way}/p50_ms", percentile(values, 0.5))
            figures.add(f"roundtrip/{label}/{way}/p99_ms", percentile(values, 0.99))
        figures.add(f"roundtrip/{label}/found_by_poll", client.stats.found_by_poll)
        progress(
            f"  round trip on {label}: client p50 {percentile(lat['client'], 0.5):.1f} ms, "
            f"polling p50 {percentile(lat['polling'], 0.5):.1f} ms"
        )
        figures.add(f"roundtrip/{label}/idle_100_waiters_cpu_pct", _idle(settings, idle_seconds))
    finally:
        client.close()
        submitter.close()
        worker.stop()


def _idle(settings: Settings, seconds: float) -> float:
    """CPU of this process while 100 async waiters wait on calls nobody approves."""
    from toolledger.client import AsyncClient

    async def go() -> float:
        scope = f"idle-{uuid.uuid4().hex[:8]}"
        async with AsyncClient(settings) as client:
            handles = [
                await client.submit(
                    scope, f"c{i}", "write_file", {"path": f"{i}.txt", "content": "x"}
                )
                for i in range(100)
            ]
            waits = [asyncio.create_task(h.result(timeout=seconds + 30)) for h in handles]
            await asyncio.sleep(1.0)  # every waiter registered and quiet
            cpu0, t0 = time.process_time(), time.monotonic()
            await asyncio.sleep(seconds)
            share = (time.process_time() - cpu0) / (time.monotonic() - t0) * 100
            for i in range(100):
                await client.reject(scope, f"c{i}", by="bench")
            await asyncio.gather(*waits)
            return share

    return asyncio.run(go())
