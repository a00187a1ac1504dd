"""The chaos harness: real workers on Postgres + Redis, killed and frozen on a seeded schedule.

A run gets a database of its own (created on the configured server, dropped afterwards) and a
Redis key prefix of its own, so faults such as ``pg_terminate_backend`` or flushing the queues
touch nothing else. Jobs are ``probe_write`` calls that log every physical effect (before the
write) to an effects log; faults are logged as they are injected; failpoints that fire in the
workers log themselves too. The checker then judges the ledger against those logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ledger.db import create_engine, upgrade
from ledger.transitions import Status
from recovery.sweep import sweep
from worker.config import Settings
from worker.failpoints import POINTS
from worker.processes import ManagedProcess, beat_process, service_env, stop_all, worker_process
from worker.submit import Submitter
from worker.tasks import publish

#: Jobs are submitted over this share of the fault window, so faults keep meeting work.
SUBMIT_SHARE = 0.9
#: External faults, injected on the seeded schedule (failpoints fire inside the workers).
EXTERNAL = ("kill_main", "kill_child", "zombie", "redis_flush", "pg_terminate", "duplicate")


@dataclass
class ChaosConfig:
    out: Path
    db: str  # a Postgres URL: the run creates its own database on that server
    broker: str  # a Redis URL: the run uses its own key prefix
    workers: int = 2
    concurrency: int = 2
    jobs: int = 300
    duration: float = 60.0  # seconds during which faults are injected (jobs: over 90% of it)
    faults: int = 0  # external faults to inject (0: one every ~duration/24 s, at least 24)
    seed: int = 1
    lease_seconds: float = 8.0  # shorter leases let a slow fsync trip the time limits
    hold_ms: int = 0  # 0: chosen so the workers are about half busy
    failpoint_percent: float = 0.0  # 0: about 8 firings per point (min 0.5 %)
    keep_db: bool = False
    progress: Callable[[str], None] = print

    def __post_init__(self) -> None:
        if not self.faults:
            self.faults = max(24, int(self.duration / 2.5))
        slots = self.workers * self.concurrency
        rate = self.jobs / (self.duration * SUBMIT_SHARE)
        if not self.hold_ms:
            self.hold_ms = int(min(1500, max(50, 500 * slots / rate)))
        if not self.failpoint_percent:
            self.failpoint_percent = round(max(0.5, 100 * 8 / self.jobs), 2)


@dataclass
class Fault:
    t: float
    kind: str
    target: str = ""
    pids: list[int] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "kind": self.kind,
            "target": self.target,
            "pids": self.pids,
            **self.detail,
        }


class ChaosRun:
    """One run: set up, inject, recover, then hand everything to the checker."""

    def __init__(self, config: ChaosConfig) -> None:
        self.cfg = config
        self.rng = random.Random(config.seed)
        self.run_id = time.strftime("%Y%m%d%H%M%S") + uuid.uuid4().hex[:4]
        self.scope = f"chaos-{self.run_id}"
        self.prefix = f"chaos-{self.run_id}:"
        self.out = config.out
        self.faults: list[Fault] = []
        self.workers: list[ManagedProcess] = []
        self.beat: ManagedProcess | None = None
        self.submitted: list[tuple[str, str, dict[str, Any]]] = []
        self.began = 0.0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._paused: set[str] = set()

    # ------------------------------------------------------------------ setup

    def _database(self) -> str:
        server = sa.make_url(
            self.cfg.db
            if "+" in self.cfg.db.split(":")[0]
            else self.cfg.db.replace("postgresql://", "postgresql+psycopg://", 1)
        )
        if server.get_backend_name() != "postgresql":
            raise ValueError("chaos needs Postgres (TOOLLEDGER_DB) and Redis (TOOLLEDGER_BROKER)")
        self.db_name = f"toolledger_chaos_{self.run_id}"
        self.admin = create_engine(
            server.render_as_string(False),
            isolation_level="AUTOCOMMIT",
            pool_size=1,
            max_overflow=1,
        )
        with self.admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {self.db_name}")
        url = server.set(database=self.db_name).render_as_string(False)
        engine = create_engine(url)
        upgrade(engine)
        engine.dispose()
        return url

    def settings_env(self) -> dict[str, str]:
        return {
            "db": self.db_url,
            "broker": self.cfg.broker,
            "broker_prefix": self.prefix,
            "home": str(self.out / "home"),
            "sandbox": str(self.out / "sandbox"),
            "tools": "worker.probe",
            "effects_log": str(self.out / "effects.log"),
            "failpoint_log": str(self.out / "failpoints.log"),
            "lease_seconds": str(self.cfg.lease_seconds),
            "visibility_timeout": "20",
            "sweep_interval": "1",
            "sweep_grace": "0",
            "requeue_after": "6",
        }

    def _failpoints(self) -> str:
        pct = self.cfg.failpoint_percent
        return ";".join(f"{point}={pct}%kill" for point in POINTS)

    def setup(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in ("effects.log", "failpoints.log", "faults.log"):
            (self.out / name).unlink(missing_ok=True)
        self.db_url = self._database()
        env = service_env(None, **self.settings_env())
        self.settings = Settings.from_env(
            {f"TOOLLEDGER_{k.upper()}": v for k, v in self.settings_env().items()}
        )
        worker_env = {**env, "TOOLLEDGER_FAILPOINTS": self._failpoints()}
        logs = self.out / "logs"
        self.workers = [
            worker_process(f"chaos-w{i + 1}", worker_env, logs, concurrency=self.cfg.concurrency)
            for i in range(self.cfg.workers)
        ]
        self.beat = beat_process("chaos-beat", env, logs)
        for p in [*self.workers, self.beat]:
            p.start()
        for p in [*self.workers, self.beat]:
            p.wait_ready(90)
        self.submitter = Submitter(self.settings)

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        self.setup()
        self.began = time.time()
        threads = [
            threading.Thread(target=self._submit_jobs, name="submit"),
            threading.Thread(target=self._supervise, name="supervise", daemon=True),
        ]
        for t in threads:
            t.start()
        try:
            self._inject()
            threads[0].join()
            faults_end = time.time()
            self.progress(f"faults done ({len(self.faults)}); waiting for recovery")
            recovered = self._wait_quiet(timeout=120)
            final = self._final_sweep()
            return {"faults_end": faults_end, "recovered_s": recovered, "final_sweep": final}
        finally:
            self._stopping.set()
            stop_all([*self.workers, *([self.beat] if self.beat else [])])

    def progress(self, text: str) -> None:
        self.cfg.progress(f"[{time.time() - self.began:6.1f}s] {text}")

    def _submit_jobs(self) -> None:
        window = self.cfg.duration * SUBMIT_SHARE
        for i in range(self.cfg.jobs):
            due = self.began + window * i / self.cfg.jobs
            time.sleep(max(0.0, due - time.time()))
            cid = f"job-{i:06d}"
            args = {
                "path": f"out/{i % 97:02d}/{cid}.txt",
                "content": f"{cid} {self.run_id}",
                "hold_ms": self.cfg.hold_ms,
            }
            self._submit_with_retry(cid, args)
            with self._lock:
                self.submitted.append((cid, f"probe_write:{cid}", args))
            if i and i % max(1, self.cfg.jobs // 10) == 0:
                self.progress(f"submitted {i}/{self.cfg.jobs} jobs, {len(self.faults)} faults")

    def _submit_with_retry(self, cid: str, args: dict[str, Any]) -> None:
        for tries in range(30):  # pg_terminate may cut the submitter's connection too
            try:
                call = self.submitter.prepare(self.scope, cid, "probe_write", args)
                self.submitter.submit(call, approved_by="chaos")
                return
            except sa.exc.SQLAlchemyError:
                time.sleep(0.1 * (tries + 1))
        raise RuntimeError(f"could not submit {cid}")

    def _supervise(self) -> None:
        """Restart killed workers, as systemd or Kubernetes would."""
        while not self._stopping.wait(0.3):
            for w in self.workers:
                if not w.alive() and w.name not in self._paused:
                    w.restart()

    # ------------------------------------------------------------------ faults

    def _schedule(self) -> list[tuple[float, str]]:
        kinds = [EXTERNAL[i % len(EXTERNAL)] for i in range(self.cfg.faults)]
        self.rng.shuffle(kinds)
        gaps = [self.rng.expovariate(1.0) for _ in kinds]
        scale = self.cfg.duration * 0.95 / sum(gaps)
        at, plan = 0.5, []
        for gap, kind in zip(gaps, kinds, strict=True):
            at += gap * scale
            plan.append((at, kind))
        return plan

    def _inject(self) -> None:
        for at, kind in self._schedule():
            time.sleep(max(0.0, self.began + at - time.time()))
            fault = getattr(self, f"_fault_{kind}")()
            if fault is not None:
                fault.t = time.time()
                self.faults.append(fault)
                with (self.out / "faults.log").open("a") as f:
                    f.write(json.dumps(fault.to_json()) + "\n")

    def _pick(self) -> ManagedProcess | None:
        alive = [w for w in self.workers if w.alive() and w.name not in self._paused]
        return self.rng.choice(alive) if alive else None

    def _fault_kill_main(self) -> Fault | None:
        w = self._pick()
        if w is None:
            return None
        pids = [w.pid, *w.children()]
        w.signal(signal.SIGKILL)  # the main process only; the supervisor restarts the worker
        return Fault(0, "kill_main", w.name, pids)

    def _fault_kill_child(self) -> Fault | None:
        w = self._pick()
        children = w.children() if w else []
        if not w or not children:
            return None
        child = self.rng.choice(children)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        return Fault(0, "kill_child", w.name, [child])

    def _fault_zombie(self) -> Fault | None:
        w = self._pick()
        if w is None:
            return None
        pids = [w.pid, *w.children()]
        self._paused.add(w.name)
        w.signal(signal.SIGSTOP, group=True)
        frozen = self.cfg.lease_seconds + 2.5

        def wake() -> None:
            w.signal(signal.SIGCONT, group=True)
            self._paused.discard(w.name)

        threading.Timer(frozen, wake).start()
        return Fault(0, "zombie", w.name, pids, {"frozen_s": frozen})

    def _fault_redis_flush(self) -> Fault | None:
        import redis

        client = redis.Redis.from_url(self.cfg.broker)
        keys = [
            k
            for k in client.scan_iter(match=f"{self.prefix}*", count=1000)
            if b"_kombu.binding" not in k
        ]
        deleted = client.delete(*keys) if keys else 0
        client.close()
        return Fault(0, "redis_flush", "redis", [], {"keys_deleted": deleted})

    def _fault_pg_terminate(self) -> Fault | None:
        with self.admin.connect() as conn:
            n = conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = :db AND pid <> pg_backend_pid()"
                ),
                {"db": self.db_name},
            ).scalar_one()
        return Fault(0, "pg_terminate", "postgres", [], {"backends": n})

    def _fault_duplicate(self) -> Fault | None:
        with self._lock:
            if not self.submitted:
                return None
            picked = self.rng.sample(self.submitted, min(5, len(self.submitted)))
        for _cid, key, _args in picked:
            try:
                publish(self.submitter.app, self.settings, self.scope, key, 1)
            except Exception as exc:  # noqa: BLE001 - the broker may be mid-flush
                self.progress(f"duplicate publish of {key} failed: {exc}")
        return Fault(0, "duplicate", "broker", [], {"keys": [k for _, k, _ in picked]})

    # ------------------------------------------------------------------ the end

    def _open_calls(self) -> int:
        ledger = self.submitter.ledger
        return sum(
            len(ledger.list_calls(scope=self.scope, status=s, limit=0))
            for s in (Status.APPROVED, Status.RUNNING, Status.PENDING_APPROVAL)
        )

    def _wait_quiet(self, timeout: float) -> float:
        started = time.time()
        while time.time() - started < timeout:
            try:
                if len(self.submitted) == self.cfg.jobs and self._open_calls() == 0:
                    return round(time.time() - started, 1)
            except sa.exc.SQLAlchemyError:
                pass
            time.sleep(0.5)
        return -1.0

    def _final_sweep(self) -> dict[str, Any]:
        sub = self.submitter
        summary = sweep(
            sub.ledger, sub.registry, sub.sandbox, grace_seconds=0, requeue_after=3600, publish=None
        )
        return summary.to_json()

    def teardown(self) -> None:
        self.submitter.close()
        if not self.cfg.keep_db:
            with self.admin.connect() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {self.db_name} WITH (FORCE)")
        self.admin.dispose()
        self.forget_broker_keys()

    def forget_broker_keys(self) -> None:
        """Delete every Redis key under this run's prefix."""
        import redis

        client = redis.Redis.from_url(self.cfg.broker)
        keys = list(client.scan_iter(match=f"{self.prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
