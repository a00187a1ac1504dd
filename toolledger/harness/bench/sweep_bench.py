"""4. The sweep's cost follows the rows it touches, not the ledger: mark and reconcile the same
1,000 stale rows in a ledger of 10k finished calls and in one of 1M. And claim contention:
8 processes racing over the same keys.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from toolledger.harness.bench.common import Figures
from toolledger.harness.bench.procs import Group
from toolledger.ledger.db import create_engine
from toolledger.ledger.ledger import Ledger
from toolledger.recovery.reconcile import reconcile_unknown
from toolledger.registry import load_registry
from toolledger.sandbox import Sandbox

STALE_SCOPE = "stale"


def populate(url: str, finished: int, stale: int, sandbox: Sandbox) -> None:
    """``finished`` calls done long ago, ``stale`` running ones whose files were written."""
    engine = create_engine(url)
    with engine.begin() as conn:
        for sql in (
            "INSERT INTO operations (scope, idempotency_key, tool, args, args_sha256, status, "
            "authorized_attempts, created_at) SELECT 'done-' || (g % 100), 'k' || g, "
            '\'write_file\', \'{"path": "p", "content": "c"}\', md5(g::text), \'succeeded\', '
            "1, now() FROM generate_series(1, :n) g",
            "INSERT INTO executions (execution_id, scope, idempotency_key, attempt, status, "
            "started_at, finished_at, result, reconciled) SELECT gen_random_uuid()::text, "
            "'done-' || (g % 100), 'k' || g, 1, 'succeeded', now(), now(), '{\"ok\": true}', "
            "false FROM generate_series(1, :n) g",
            "INSERT INTO execution_events (scope, idempotency_key, kind, actor, at, detail) "
            "SELECT 'done-' || (g % 100), 'k' || g, 'succeeded', 'w', now(), '{}' "
            "FROM generate_series(1, :n) g",
        ):
            conn.execute(sa.text(sql), {"n": finished})
    engine.dispose()
    ledger = Ledger(url)
    for i in range(stale):
        args = {"path": f"s{i}.txt", "content": f"stale {i}"}
        ledger.submit(STALE_SCOPE, f"c{i}", "write_file", args, approved_by="bench")
        ledger.claim(STALE_SCOPE, f"write_file:c{i}", 1, worker_id="gone", lease_seconds=1)
        target = sandbox.scope_dir(STALE_SCOPE) / args["path"]  # as if it had landed
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(args["content"].encode())
    with ledger.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM ANALYZE")
    ledger.close()


def reset(ledger: Ledger) -> None:
    """The stale rows back to running with an expired lease (the history keeps growing)."""
    with ledger.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE executions SET status = 'running', result = NULL, reconciled = false, "
            f"finished_at = NULL, lease_expires_at = now() - interval '1 hour' "
            f"WHERE scope = '{STALE_SCOPE}'"
        )
        conn.exec_driver_sql(
            f"UPDATE operations SET status = 'running' WHERE scope = '{STALE_SCOPE}'"
        )


def time_sweep(url: str, sandbox: Sandbox, stale: int) -> tuple[float, float]:
    """Seconds to mark the stale rows unknown, and to reconcile them (both must be all)."""
    ledger = Ledger(url)
    reset(ledger)
    began = time.perf_counter()
    marked = 0
    while batch := ledger.mark_expired(grace_seconds=0, limit=1000):
        marked += len(batch)
    mark_s = time.perf_counter() - began
    began = time.perf_counter()
    tally = reconcile_unknown(ledger, load_registry(), sandbox, page_size=1000)
    reconcile_s = time.perf_counter() - began
    ledger.close()
    if (marked, tally.reconciled) != (stale, stale):
        raise RuntimeError(
            f"sweep bench: marked {marked}, reconciled {tally.reconciled} of {stale}"
        )
    return mark_s, reconcile_s


def run_sweep_round(
    figures: Figures,
    urls: dict[str, str],
    sandboxes: dict[str, Sandbox],
    stale: int,
    progress: Callable[[str], Any],
) -> None:
    for size, url in urls.items():
        mark_s, reconcile_s = time_sweep(url, sandboxes[size], stale)
        figures.add(f"sweep/{size}/seconds", mark_s + reconcile_s)
        figures.add(f"sweep/{size}/mark_rows_per_s", stale / mark_s)
        figures.add(f"sweep/{size}/reconcile_rows_per_s", stale / reconcile_s)
        progress(
            f"  sweep over {size}: mark {stale / mark_s:.0f} rows/s, reconcile "
            f"{stale / reconcile_s:.0f} rows/s, {mark_s + reconcile_s:.2f} s"
        )


# ---------------------------------------------------------------------------- contention


def claim_share(
    url: str, scope: str, keys: list[str], start_at: float, seed: int
) -> tuple[int, int, float]:
    ledger = Ledger(url)
    ledger.claimed("00000000-0000-7000-8000-000000000000", "warm")  # connect before the start
    keys = keys[:]
    random.Random(seed).shuffle(keys)
    while time.time() < start_at:
        time.sleep(0.0005)
    won = lost = 0
    began = time.perf_counter()
    for key in keys:
        if ledger.claim(scope, key, 1, worker_id=f"race{seed}"):
            won += 1
        else:
            lost += 1
    elapsed = time.perf_counter() - began
    ledger.close()
    return won, lost, elapsed


def run_contention(
    group: Group, figures: Figures, url: str, keys_count: int, processes: int = 8
) -> None:
    from toolledger.harness.bench.protocol import seed

    scope = f"race-{uuid.uuid4().hex[:6]}"
    keys = seed(url, scope, keys_count)
    results = group.run(
        claim_share, [(url, scope, keys, time.time() + 2.0, i) for i in range(processes)]
    )
    wins = sum(r[0] for r in results)
    if wins != keys_count or sum(r[1] for r in results) != keys_count * (processes - 1):
        raise RuntimeError(f"claim race: {wins} wins for {keys_count} keys")
    figures.add("contention/attempts_per_s", keys_count * processes / max(r[2] for r in results))


def sandboxes_for(root: Path, sizes: list[str]) -> dict[str, Sandbox]:
    return {size: Sandbox(root / f"sweep-{size}").prepare() for size in sizes}
