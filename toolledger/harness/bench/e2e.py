"""2 & 3. End to end, 2 worker processes x concurrency 2, the same job (an atomic file write):
calls/s from the first submit to the last completion, and p50/p99 latency submit -> done.

toolledger     submit (ledger + outbox) -> Redis -> Celery worker -> claim, write, terminal
toolledger_threads  the same on Celery's threads pool (one process per worker, 2 threads)
toolledger_production  the README's production configuration: 2 workers on the threads pool at
               8 threads, consuming the job queue alone, a prefork sweeper on the sweep queue
               and a beat beside them (every one of their processes in the CPU measured)
celery_noop    the same Celery app settings, a task that does nothing
celery_write   the same Celery app settings, the file write with no ledger
procrastinate  defer -> Postgres queue -> procrastinate worker -> the file write
dbos           DBOSClient.enqueue -> DBOS queue -> workflow with one step -> the file write
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from toolledger.config import Settings
from toolledger.harness.bench.common import (
    CpuMeter,
    Figures,
    percentile,
    plain_url,
    scratch_postgres,
    wait_for,
)
from toolledger.harness.processes import (
    ManagedProcess,
    beat_process,
    service_env,
    stop_all,
    worker_process,
)
from toolledger.ledger.db import create_engine

VARIANTS = (
    "toolledger",
    "toolledger_threads",
    "toolledger_production",
    "celery_noop",
    "celery_write",
    "procrastinate",
    "dbos",
)


@dataclass
class Result:
    throughput: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_call: float  # busy CPU of the whole machine, first submit to last done
    cpu_parts: dict[str, float]  # the same, split into CPU_PARTS


def _result(submitted: dict[str, float], done: dict[str, float], cpu: CpuMeter) -> Result:
    latencies = [(done[k] - submitted[k]) * 1000 for k in submitted if k in done]
    span = max(done.values()) - min(submitted.values())
    return Result(
        len(done) / span,
        percentile(latencies, 0.5),
        percentile(latencies, 0.99),
        cpu.ms_per(len(done)),
        cpu.parts_ms_per(len(done)),
    )


class E2E:
    def __init__(
        self, pg_server: str, redis: str, root: Path, jobs: int, progress: Callable[[str], Any]
    ) -> None:
        self.pg_server, self.redis, self.root, self.jobs = pg_server, redis, root, jobs
        self.progress = progress
        self.missing: dict[str, str] = {}

    def _procs(self, make: Callable[[int], ManagedProcess]) -> list[ManagedProcess]:
        procs = [make(i) for i in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(120)
        return procs

    def _sandbox(self, label: str) -> Path:
        path = self.root / "sandbox" / label
        path.mkdir(parents=True, exist_ok=True)
        return path

    # ------------------------------------------------------------------ toolledger

    def toolledger(self, db: str, pool: str = "prefork", *, production: bool = False) -> Result:
        """toolledger's 2 workers of 2 (``pool``); ``production``: the README's production
        configuration instead (threads at 8 on the job queue alone, a sweeper, a beat)."""
        from toolledger.worker.submit import Submitter

        prefix, scope = f"bench-{uuid.uuid4().hex[:8]}:", f"e2e-{uuid.uuid4().hex[:6]}"
        env = {
            "db": db,
            "broker": self.redis,
            "broker_prefix": prefix,
            "sandbox": str(self.root / "sandbox"),
            "home": str(self.root / "home"),
        }
        logs = self.root / "logs"
        if production:
            jobs = ("--queues", "toolledger")
            procs = self._procs(
                lambda i: worker_process(
                    f"bench-tp{i}", service_env(None, **env), logs, pool="threads",
                    concurrency=8, extra=jobs,
                )
            )  # fmt: skip
            sweeper = worker_process(
                "bench-tp-sweeper", service_env(None, **env), logs, concurrency=1,
                extra=("--queues", "toolledger.sweep"),
            )  # fmt: skip
            beat = beat_process("bench-tp-beat", service_env(None, **env), logs)
            procs += [sweeper.start(), beat.start()]
            try:
                sweeper.wait_ready(120)
                beat.wait_ready(120)  # a beat that did not start is no configuration measured
            except BaseException:
                stop_all(procs)
                raise
        else:
            procs = self._procs(
                lambda i: worker_process(f"bench-tl{i}", service_env(None, **env), logs, pool=pool)
            )
        try:
            sub = Submitter(
                Settings.from_env({f"TOOLLEDGER_{k.upper()}": v for k, v in env.items()})
            )
            submitted: dict[str, float] = {}
            cpu = CpuMeter([p.pid for p in procs])
            cpu.start()
            for i in range(self.jobs):
                cid = f"c{i}"
                submitted[f"write_file:{cid}"] = time.time()
                sub.submit(
                    sub.prepare(scope, cid, "write_file", {"path": f"f{i}", "content": "done"}),
                    approved_by="b",
                )
            engine = create_engine(db)
            query = sa.text(
                "SELECT idempotency_key, finished_at FROM executions "
                "WHERE scope = :s AND status = 'succeeded'"
            )

            count = sa.text(
                "SELECT count(*) FROM executions WHERE scope = :s AND status = 'succeeded'"
            )

            def finished() -> dict[str, float]:
                with engine.connect() as conn:
                    return {k: t.timestamp() for k, t in conn.execute(query, {"s": scope})}

            def counted() -> int:  # polled: a count, not the rows, to cost the machine little
                with engine.connect() as conn:
                    return int(conn.execute(count, {"s": scope}).scalar_one())

            wait_for(lambda: counted() == self.jobs, 300, "toolledger's jobs")
            cpu.stop()
            done = finished()
            engine.dispose()
            sub.close()
        finally:
            stop_all(procs)
        return _result(submitted, done, cpu)

    # ------------------------------------------------------------------ plain Celery

    def celery(self, task: str) -> Result:
        from toolledger.harness.bench.celery_tasks import make_app

        prefix = f"bench-{uuid.uuid4().hex[:8]}:"
        done_log = self.root / f"done-{uuid.uuid4().hex[:6]}.log"
        env = service_env(None, broker=self.redis, broker_prefix=prefix)
        env["BENCH_DONE_LOG"] = str(done_log)
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "toolledger.harness.bench.celery_tasks",
            "worker",
            "--pool",
            "prefork",
            "--concurrency",
            "2",
            "-Q",
            "bench",
            "--without-gossip",
            "--without-mingle",
            "--loglevel",
            "INFO",
        ]
        procs = self._procs(
            lambda i: ManagedProcess(
                f"bench-c{i}",
                "worker",
                [*argv, "--hostname", f"bench-c{i}@%h"],
                env,
                self.root / "logs" / f"bench-c{i}.log",
            )
        )
        directory = self._sandbox(f"celery-{uuid.uuid4().hex[:6]}")
        app = make_app(Settings(broker=self.redis, broker_prefix=prefix))
        try:
            submitted: dict[str, float] = {}
            cpu = CpuMeter([p.pid for p in procs])
            cpu.start()
            with app.producer_or_acquire() as producer:
                for i in range(self.jobs):
                    job = f"j{i}"
                    submitted[job] = time.time()
                    args = (job,) if task == "noop" else (job, str(directory), f"f{i}", "done")
                    app.send_task(f"bench.{task}", args=args, queue="bench", producer=producer)

            def done() -> dict[str, float]:
                if not done_log.exists():
                    return {}
                pairs = (line.split() for line in done_log.read_text().splitlines())
                return {k: float(t) for k, t in pairs}

            def counted() -> int:
                return done_log.read_bytes().count(b"\n") if done_log.exists() else 0

            wait_for(lambda: counted() >= self.jobs, 300, f"celery {task} jobs")
            cpu.stop()
            finished = done()
        finally:
            app.close()
            stop_all(procs)
        return _result(submitted, finished, cpu)

    # ------------------------------------------------------------------ peers

    def _peer(self, module: str, db: str) -> list[ManagedProcess]:
        env = service_env(None)
        env.update(BENCH_PG=plain_url(db), BENCH_CONCURRENCY="2")
        return self._procs(
            lambda i: ManagedProcess(
                f"{module}-{i}",
                "peer",
                [sys.executable, "-m", f"toolledger.harness.bench.{module}", "worker"],
                env,
                self.root / "logs" / f"{module}-{i}.log",
            )
        )

    def procrastinate(self, db: str) -> Result:
        from toolledger.harness.bench import peer_procrastinate as peer

        directory = self._sandbox(f"proc-{uuid.uuid4().hex[:6]}")
        procs = self._peer("peer_procrastinate", db)
        app = peer.make_app(plain_url(db))
        try:
            submitted: dict[str, float] = {}
            cpu = CpuMeter([p.pid for p in procs])
            cpu.start()
            with app.open():
                task = app.tasks[peer.TASK]
                for i in range(self.jobs):
                    submitted[f"f{i}"] = time.time()
                    task.defer(directory=str(directory), name=f"f{i}", content="done")
            engine = create_engine(db)
            query = sa.text(
                "SELECT j.args->>'name', e.at FROM procrastinate_jobs j JOIN "
                "procrastinate_events e ON e.job_id = j.id "
                "WHERE e.type = 'succeeded' AND j.args->>'directory' = :d"
            )

            count = sa.text(
                "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded' "
                "AND args->>'directory' = :d"
            )

            def done() -> dict[str, float]:
                with engine.connect() as conn:
                    return {n: t.timestamp() for n, t in conn.execute(query, {"d": str(directory)})}

            def counted() -> int:
                with engine.connect() as conn:
                    return int(conn.execute(count, {"d": str(directory)}).scalar_one())

            wait_for(lambda: counted() == self.jobs, 300, "procrastinate's jobs")
            cpu.stop()
            finished = done()
            engine.dispose()
        finally:
            stop_all(procs)
        return _result(submitted, finished, cpu)

    def dbos(self, db: str) -> Result:
        from dbos import DBOSClient

        directory = self._sandbox(f"dbos-{uuid.uuid4().hex[:6]}")
        procs = self._peer("peer_dbos", db)
        client = DBOSClient(system_database_url=plain_url(db))
        try:
            began_ms = time.time() * 1000
            submitted: dict[str, float] = {}
            cpu = CpuMeter([p.pid for p in procs])
            cpu.start()
            for i in range(self.jobs):
                submitted[f"f{i}"] = time.time()
                client.enqueue(
                    {"queue_name": "bench", "workflow_name": "write_wf"},
                    str(directory),
                    f"f{i}",
                    "done",
                )
            engine = create_engine(db)
            # DBOS serialises inputs its own way: this database holds only this benchmark's
            # workflows, so the ones created since this measurement began are ours.
            query = sa.text(
                "SELECT workflow_uuid, created_at, updated_at FROM "
                "dbos.workflow_status WHERE status = 'SUCCESS' AND created_at >= :t"
            )

            count = sa.text(
                "SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS' "
                "AND created_at >= :t"
            )

            def done() -> list[tuple[str, int, int]]:
                with engine.connect() as conn:
                    return [tuple(r) for r in conn.execute(query, {"t": began_ms})]

            def counted() -> int:
                with engine.connect() as conn:
                    return int(conn.execute(count, {"t": began_ms}).scalar_one())

            wait_for(lambda: counted() == self.jobs, 600, "DBOS's workflows")
            cpu.stop()
            rows = done()
            engine.dispose()
        finally:
            client.destroy()
            stop_all(procs)
        latencies = [updated - created for _, created, updated in rows]
        span = max(updated for _, _, updated in rows) / 1000 - min(submitted.values())
        return Result(
            len(rows) / span,
            percentile(latencies, 0.5),
            percentile(latencies, 0.99),
            cpu.ms_per(len(rows)),
            cpu.parts_ms_per(len(rows)),
        )

    # ------------------------------------------------------------------ a round

    def round(self, figures: Figures, dbs: dict[str, str]) -> None:
        runs: dict[str, Callable[[], Result]] = {
            "toolledger": lambda: self.toolledger(dbs["toolledger"]),
            "toolledger_threads": lambda: self.toolledger(dbs["toolledger"], "threads"),
            "toolledger_production": lambda: self.toolledger(dbs["toolledger"], production=True),
            "celery_noop": lambda: self.celery("noop"),
            "celery_write": lambda: self.celery("write"),
            "procrastinate": lambda: self.procrastinate(dbs["procrastinate"]),
            "dbos": lambda: self.dbos(dbs["dbos"]),
        }
        for name, run in runs.items():
            if name in self.missing:
                continue
            try:
                result = run()
            except ImportError as exc:
                self.missing[name] = f"not installed ({exc.name}): pip install -e '.[bench]'"
                continue
            figures.add(f"e2e/{name}/throughput", result.throughput)
            figures.add(f"e2e/{name}/p50_ms", result.p50_ms)
            figures.add(f"e2e/{name}/p99_ms", result.p99_ms)
            figures.add(f"e2e/{name}/cpu_ms_per_call", result.cpu_ms_per_call)
            for part, ms in result.cpu_parts.items():
                figures.add(f"e2e/{name}/cpu_{part}", ms)
            self.progress(
                f"  {name}: {result.throughput:.0f} calls/s, p50 {result.p50_ms:.0f} "
                f"ms, p99 {result.p99_ms:.0f} ms, {result.cpu_ms_per_call:.2f} ms CPU/call"
            )


def peer_databases(pg_server: str) -> Any:
    """Scratch databases: the ledger's (migrated), procrastinate's (its schema), DBOS's."""
    from contextlib import ExitStack

    stack = ExitStack()
    dbs = {"toolledger": stack.enter_context(scratch_postgres(pg_server, "e2e"))}
    dbs["procrastinate"] = stack.enter_context(scratch_postgres(pg_server, "proc", migrate=False))
    dbs["dbos"] = stack.enter_context(scratch_postgres(pg_server, "dbos", migrate=False))
    try:
        from toolledger.harness.bench import peer_procrastinate

        app = peer_procrastinate.make_app(plain_url(dbs["procrastinate"]))
        with app.open():
            app.schema_manager.apply_schema()
    except ImportError:
        pass
    return stack, dbs
