"""The baseline: the same job as the probe (log the effect, write the file) as a plain Celery
task with acks_late, reject_on_worker_lost and prefetch 1 — and no ledger. Same harness, same
faults (there is no database to terminate). What it duplicates and loses is why the ledger
exists. Run by ``toolledger chaos --baseline``; workers: ``celery -A recovery.chaos.baseline``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery

from recovery.chaos.harness import ChaosRun, Fault
from worker.processes import ManagedProcess, service_env

QUEUE = "baseline"
TASK = "baseline.write"


def make_app(broker: str, prefix: str = "") -> Celery:
    app = Celery("baseline", broker=broker, set_as_current=False)
    transport: dict[str, Any] = {"visibility_timeout": 20}
    if prefix:
        transport["global_keyprefix"] = prefix
    app.conf.update(
        broker_transport_options=transport,
        result_backend_transport_options=transport,
        visibility_timeout=20,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
    )
    return app


# Read at the edge, from the same TOOLLEDGER_* variables as the real workers.
app = make_app(
    os.environ.get("TOOLLEDGER_BROKER", "redis://127.0.0.1:6379/0"),
    os.environ.get("TOOLLEDGER_BROKER_PREFIX", ""),
)


@app.task(name=TASK, shared=False)  # type: ignore[untyped-decorator]
def write(key: str, path: str, content: str, hold_ms: int) -> None:
    time.sleep(hold_ms / 2000)
    line = (
        json.dumps(
            {"scope": "baseline", "key": key, "attempt": 1, "pid": os.getpid(), "t": time.time()}
        )
        + "\n"
    )
    fd = os.open(os.environ["TOOLLEDGER_EFFECTS_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, line.encode())
    os.fsync(fd)
    os.close(fd)
    target = Path(os.environ["TOOLLEDGER_SANDBOX"]) / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    time.sleep(hold_ms / 2000)


class BaselineRun(ChaosRun):
    """ChaosRun's schedule and faults against the plain Celery task."""

    def setup(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "effects.log").unlink(missing_ok=True)
        (self.out / "faults.log").unlink(missing_ok=True)
        env = service_env(
            None,
            broker=self.cfg.broker,
            broker_prefix=self.prefix,
            effects_log=str(self.out / "effects.log"),
            sandbox=str(self.out / "sandbox"),
        )
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "recovery.chaos.baseline",
            "worker",
            "--pool",
            "prefork",
            "--concurrency",
            str(self.cfg.concurrency),
            "-Q",
            QUEUE,
            "--without-gossip",
            "--without-mingle",
            "--loglevel",
            "INFO",
        ]
        self.workers = [
            ManagedProcess(
                f"base-w{i + 1}",
                "worker",
                [*argv, "--hostname", f"base-w{i + 1}@%h"],
                env,
                self.out / "logs" / f"base-w{i + 1}.log",
            )
            for i in range(self.cfg.workers)
        ]
        for w in self.workers:
            w.start()
        for w in self.workers:
            w.wait_ready(90)
        self.env = env
        self.app = make_app(self.cfg.broker, self.prefix)

    def _submit_with_retry(self, cid: str, args: dict[str, Any]) -> None:
        self.app.send_task(
            TASK, args=(cid, args["path"], args["content"], args["hold_ms"]), queue=QUEUE
        )

    def _fault_duplicate(self) -> Fault | None:
        with self._lock:
            picked = self.rng.sample(self.submitted, min(5, len(self.submitted)))
        for cid, _key, args in picked:
            self._submit_with_retry(cid, args)
        return Fault(0, "duplicate", "broker", [], {"keys": [c for c, _, _ in picked]})

    def _fault_pg_terminate(self) -> Fault | None:
        return None  # no database: nothing to terminate

    def _wait_quiet(self, timeout: float) -> float:
        """Until every job ran or the effects log stops growing past a visibility timeout
        (after which Redis would have redelivered anything it still held)."""
        started, last, last_change = time.time(), -1, time.time()
        while time.time() - started < timeout:
            effects = {e["key"] for e in _effects(self.out)}
            if len(effects) == self.cfg.jobs and time.time() - last_change > 25:
                break
            n = sum(1 for _ in _effects(self.out))
            if n != last:
                last, last_change = n, time.time()
            elif time.time() - last_change > 25:
                break
            time.sleep(0.5)
        return round(time.time() - started, 1)

    def _final_sweep(self) -> dict[str, Any]:
        return {}

    def teardown(self) -> None:
        self.app.close()
        self.forget_broker_keys()

    def results(self) -> dict[str, Any]:
        per_key = Counter(e["key"] for e in _effects(self.out))
        jobs = [cid for cid, _, _ in self.submitted]
        return {
            "jobs": len(jobs),
            "duplicates": sum(1 for cid in jobs if per_key[cid] > 1),
            "duplicate_effects": sum(n - 1 for n in per_key.values() if n > 1),
            "lost": sum(1 for cid in jobs if per_key[cid] == 0),
            "faults": dict(Counter(f.kind for f in self.faults)),
        }


def _effects(out: Path) -> list[dict[str, Any]]:
    path = out / "effects.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
