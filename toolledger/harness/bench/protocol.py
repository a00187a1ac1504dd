"""1. The ledger protocol: claim + running, an atomic file write, terminal + result — per job.

toolledger      the execute pipeline as a worker runs it, without Celery (worker.pipeline)
handwritten     the same 2-commit protocol in psycopg (sqlite3 on SQLite): on Postgres the
                ledger's own statements (ledger.fastpath), prepared, autocommit, no framework —
                the limit
insert          a bare INSERT … ON CONFLICT DO NOTHING + commit, no file: the floor of any
                Postgres-backed queue
handwritten_minimal
                Postgres only: the same 2-commit protocol written from scratch, the simplest
                correct statements (a claim and a terminal write, each one statement with its
                event): what the ledger's own SQL costs — its review guard, path locks, lease
                and effect columns — which the handwritten loop, running that SQL, cannot see
handwritten_queued
                SQLite only: the hand-written loop with its two transactions taken in turn
                (ledger.writers), as toolledger's are: what the writers' queue alone is worth,
                so the ratio against the plain loop can be read without it
"""

from __future__ import annotations

import contextlib
import functools
import json
import resource
import secrets
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from toolledger.harness.bench.common import Figures, atomic_write, plain_url
from toolledger.harness.bench.procs import Group
from toolledger.ledger import writers
from toolledger.ledger.db import create_engine
from toolledger.ledger.transitions import Status

IMPLS = ("toolledger", "handwritten", "insert")
QUEUED = "handwritten_queued"
MINIMAL = "handwritten_minimal"


def impls(dialect: str) -> tuple[str, ...]:
    """What the protocol runs on ``dialect``: the writers' queue exists on SQLite only, the
    minimal statements are written for Postgres."""
    return (*IMPLS, QUEUED) if dialect == "sqlite" else (*IMPLS, MINIMAL)


NOW = "strftime('%Y-%m-%d %H:%M:%f','now') || '000'"

_cache: dict[tuple[str, str], Any] = {}


# ---------------------------------------------------------------------------- one job each


def _toolledger_job(url: str, sandbox: str) -> Any:
    from toolledger.ledger.ledger import Ledger
    from toolledger.registry import load_registry
    from toolledger.sandbox import Sandbox
    from toolledger.worker.pipeline import Executor

    executor = Executor(
        Ledger(url), load_registry(), Sandbox(Path(sandbox)), worker_id="bench", lease_seconds=30
    )

    def job(scope: str, key: str) -> None:
        outcome = executor.execute(scope, key, 1)
        # finished *and* succeeded: a failed call is no throughput (a cold review)
        assert outcome.state == "finished" and outcome.status is Status.SUCCEEDED, outcome

    return job


def _handwritten_pg_job(url: str, sandbox: str) -> Any:
    import psycopg

    from toolledger.ledger.fastpath import psycopg_statements

    # the ledger's own statements, run without any framework
    claim_sql, finish_sql, statuses = psycopg_statements()
    conn = psycopg.connect(plain_url(url), autocommit=True)
    conn.execute("SET plan_cache_mode = auto")

    def job(scope: str, key: str) -> None:
        directory = Path(sandbox) / scope
        eid, token = str(uuid.uuid4()), secrets.token_hex(16)
        claim: dict[str, Any] = {
            **statuses, "scope": scope, "key": key, "attempt": 1, "execution_id": eid,
            "worker_id": "bench", "lease_token": token, "lease_seconds": 30.0,
            "detail": '{"attempt":1,"worker_id":"bench","fenced":true}',
        }  # fmt: skip
        row = conn.execute(claim_sql, claim, prepare=True).fetchone()
        assert row is not None
        args = row[2]
        atomic_write(str(directory), args["path"], args["content"].encode())
        result = json.dumps({"path": args["path"], "bytes_written": len(args["content"])})
        finish: dict[str, Any] = {
            **statuses, "execution_id": eid, "lease_token": token, "status": "succeeded",
            "result": result, "error": None, "effects": None, "lock_keys": [],
            "detail": '{"result":' + result + ',"error":null,"reconciled":false}',
        }  # fmt: skip
        assert conn.execute(finish_sql, finish, prepare=True).fetchone() is not None

    return job


# The protocol written from scratch (not the ledger's statements): claim + running event in one
# statement, terminal + result + event in another, autocommit.
MINIMAL_CLAIM = """
WITH op AS (
    SELECT args FROM operations WHERE scope = %(scope)s AND idempotency_key = %(key)s
      AND status = 'approved' AND authorized_attempts = 1
), claimed AS (
    INSERT INTO executions (execution_id, scope, idempotency_key, attempt, status, worker_id,
                            lease_token, lease_expires_at, heartbeat_at, started_at, reconciled)
    SELECT %(eid)s, %(scope)s, %(key)s, 1, 'running', 'bench', %(token)s,
           now() + interval '30 seconds', now(), now(), false FROM op
    ON CONFLICT (scope, idempotency_key, attempt) DO NOTHING RETURNING execution_id
), moved AS (
    UPDATE operations SET status = 'running' WHERE scope = %(scope)s
      AND idempotency_key = %(key)s AND status = 'approved' AND EXISTS (SELECT FROM claimed)
), logged AS (
    INSERT INTO execution_events (scope, idempotency_key, execution_id, kind, actor, at, detail)
    SELECT %(scope)s, %(key)s, %(eid)s, 'running', 'bench', now(), '{"attempt":1}' FROM claimed
)
SELECT op.args FROM claimed, op
"""
MINIMAL_FINISH = """
WITH done AS (
    UPDATE executions SET status = 'succeeded', result = %(result)s::json, finished_at = now()
    WHERE execution_id = %(eid)s AND status = 'running' AND lease_token = %(token)s
    RETURNING scope, idempotency_key, attempt
), moved AS (
    UPDATE operations o SET status = 'succeeded' FROM done WHERE o.scope = done.scope
      AND o.idempotency_key = done.idempotency_key AND o.status = 'running'
      AND o.authorized_attempts = done.attempt
), logged AS (
    INSERT INTO execution_events (scope, idempotency_key, execution_id, kind, actor, at, detail)
    SELECT scope, idempotency_key, %(eid)s, 'succeeded', 'bench', now(), %(detail)s::json
    FROM done
)
SELECT count(*) FROM done
"""


def _minimal_pg_job(url: str, sandbox: str) -> Any:
    import psycopg

    conn = psycopg.connect(plain_url(url), autocommit=True)

    def job(scope: str, key: str) -> None:
        eid, token = str(uuid.uuid4()), secrets.token_hex(16)
        params = {"scope": scope, "key": key, "eid": eid, "token": token}
        row = conn.execute(MINIMAL_CLAIM, params, prepare=True).fetchone()
        assert row is not None
        args = row[0]
        atomic_write(str(Path(sandbox) / scope), args["path"], args["content"].encode())
        result = json.dumps({"path": args["path"], "bytes_written": len(args["content"])})
        detail = '{"result":' + result + ',"error":null,"reconciled":false}'
        finish = {**params, "result": result, "detail": detail}
        assert conn.execute(MINIMAL_FINISH, finish, prepare=True).fetchone() == (1,)

    return job


def _sqlite_connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    for pragma in (
        "journal_mode = WAL",
        "synchronous = FULL",
        "foreign_keys = ON",
        "busy_timeout = 30000",
    ):
        conn.execute(f"PRAGMA {pragma}")
    return conn


def _handwritten_sqlite_job(url: str, sandbox: str, queued: bool = False) -> Any:
    database = sa.make_url(url).database or ""
    conn = _sqlite_connect(database)
    # nullcontext, not turn(None): the plain loop stays exactly the loop it was
    hold: Any = functools.partial(writers.turn, database) if queued else contextlib.nullcontext

    def job(scope: str, key: str) -> None:
        directory = Path(sandbox) / scope
        eid, token = str(uuid.uuid4()), secrets.token_hex(16)
        with hold():
            conn.execute("BEGIN IMMEDIATE")
            (args,) = conn.execute(
                "SELECT args FROM operations WHERE scope=? AND idempotency_key=? "
                "AND status='approved' AND authorized_attempts=1",
                (scope, key),
            ).fetchone()
            conn.execute(
                "INSERT INTO executions (execution_id, scope, idempotency_key, attempt, status, "
                "worker_id, lease_token, lease_expires_at, heartbeat_at, started_at, reconciled) "
                f"VALUES (?, ?, ?, 1, 'running', 'bench', ?, {NOW}, {NOW}, {NOW}, 0) "
                "ON CONFLICT DO NOTHING",
                (eid, scope, key, token),
            )
            conn.execute(
                "UPDATE operations SET status='running' WHERE scope=? AND idempotency_key=?"
                " AND status='approved'",
                (scope, key),
            )
            conn.execute(
                "INSERT INTO execution_events (scope, idempotency_key, execution_id, kind, "
                f"actor, at, detail) VALUES (?, ?, ?, 'running', 'bench', {NOW}, "
                "'{\"attempt\":1}')",
                (scope, key, eid),
            )
            conn.execute("COMMIT")
        data = json.loads(args)
        atomic_write(str(directory), data["path"], data["content"].encode())
        result = json.dumps({"path": data["path"], "bytes_written": len(data["content"])})
        with hold():
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(
                f"UPDATE executions SET status='succeeded', result=?, finished_at={NOW} "
                "WHERE execution_id=? AND status='running' AND lease_token=?",
                (result, eid, token),
            )
            conn.execute(
                "UPDATE operations SET status='succeeded' WHERE scope=? AND "
                "idempotency_key=? AND status='running'",
                (scope, key),
            )
            conn.execute(
                "INSERT INTO execution_events (scope, idempotency_key, execution_id, kind, "
                f"actor, at, detail) VALUES (?, ?, ?, 'succeeded', 'bench', {NOW}, ?)",
                (scope, key, eid, '{"result":' + result + "}"),
            )
            conn.execute("COMMIT")

    return job


def _insert_job(url: str, sandbox: str) -> Any:
    if url.startswith("sqlite"):
        conn: Any = _sqlite_connect(sa.make_url(url).database or "")
        sql = "INSERT INTO bench_claims (key) VALUES (?) ON CONFLICT DO NOTHING"
    else:
        import psycopg

        conn = psycopg.connect(plain_url(url), autocommit=True)
        sql = "INSERT INTO bench_claims (key) VALUES (%s) ON CONFLICT DO NOTHING"

    def job(scope: str, key: str) -> None:
        conn.execute(sql, (f"{scope}/{key}",))

    return job


def run_share(
    impl: str, url: str, scope: str, keys: list[str], start_at: float, sandbox: str
) -> tuple[float, float, float]:
    """In a group process: build the job (once: connections live as long as the process; no
    call is made before the measure, so round 1 carries each side's first-call costs, more
    of them toolledger's), wait for the start, run the share. Its seconds, and the user and
    system CPU seconds this process spent on it."""
    factories: dict[str, Callable[[str, str], Any]] = {
        "toolledger": _toolledger_job,
        "insert": _insert_job,
        "handwritten": _handwritten_sqlite_job if url.startswith("sqlite") else _handwritten_pg_job,
        QUEUED: functools.partial(_handwritten_sqlite_job, queued=True),
        MINIMAL: _minimal_pg_job,
    }
    factory = factories[impl]
    writers.set_blocking()  # a group process runs the worker's path, as the worker does
    if (impl, url) not in _cache:  # connections live as long as the process
        _cache[(impl, url)] = factory(url, sandbox)
    job = _cache[(impl, url)]
    while time.time() < start_at:
        time.sleep(0.0005)
    before, began = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for key in keys:
        job(scope, key)
    elapsed, after = time.perf_counter() - began, resource.getrusage(resource.RUSAGE_SELF)
    return elapsed, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


# ---------------------------------------------------------------------------- set-up


def seed(url: str, scope: str, count: int) -> list[str]:
    """``count`` approved write_file operations, inserted in bulk (not measured)."""
    keys = [f"write_file:{scope}-{i}" for i in range(count)]
    rows = [
        {"scope": scope, "key": k, "args": json.dumps({"path": f"f{i}", "content": "done"})}
        for i, k in enumerate(keys)
    ]
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO operations (scope, idempotency_key, tool, args, args_sha256, status, "
                "authorized_attempts, created_at) VALUES (:scope, :key, 'write_file', :args, "
                "'0', 'approved', 1, CURRENT_TIMESTAMP)"
            ),
            rows,
        )
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS bench_claims (key TEXT PRIMARY KEY)")
    engine.dispose()
    return keys


def measure(
    group: Group, impl: str, url: str, processes: int, jobs: int, sandbox: Path, label: str
) -> tuple[float, float, float]:
    """Jobs per second of ``impl`` with ``processes`` processes sharing ``jobs`` jobs, and
    the user and system CPU milliseconds a job cost in those processes (on SQLite the
    database's work is among it; on Postgres the server's is not)."""
    scope = f"{label}-{impl}-{processes}-{uuid.uuid4().hex[:6]}"
    keys = seed(url, scope, jobs)
    (sandbox / scope).mkdir(parents=True, exist_ok=True)
    shares = [
        (impl, url, scope, keys[i::processes], time.time() + 1.5, str(sandbox))
        for i in range(processes)
    ]
    shares_done = group.run(run_share, shares)
    elapsed = max(share[0] for share in shares_done)
    user, system = (sum(share[i] for share in shares_done) * 1000 / jobs for i in (1, 2))
    return float(jobs / elapsed), user, system


def run_protocol(
    group: Group,
    figures: Figures,
    urls: dict[str, str],
    process_counts: tuple[int, ...],
    jobs: int,
    sandbox: Path,
    progress: Any,
) -> None:
    """One round: every dialect, every process count, every implementation, interleaved."""
    for dialect, url in urls.items():
        for n in process_counts:
            for impl in impls(dialect):
                rate, user, system = measure(group, impl, url, n, jobs, sandbox, f"p{dialect[:2]}")
                figures.add(f"{dialect}/{impl}/{n}", rate)
                figures.add(f"cpu/{dialect}/{impl}/{n}/user", user)
                figures.add(f"cpu/{dialect}/{impl}/{n}/sys", system)
            progress(
                f"  {dialect} x{n}: "
                + ", ".join(
                    f"{impl} {figures[f'{dialect}/{impl}/{n}'].values[-1]:.0f}/s"
                    for impl in impls(dialect)
                )
            )
