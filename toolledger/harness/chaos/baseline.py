"""The baseline: the same workload as plain Celery tasks — acks_late, reject_on_worker_lost,
prefetch 1, no ledger — under the same faults (those that need no database). A write writes
the file, an append appends, a charge calls the same downstream service with the job's id as
its key (so the service's own dedupe is on the baseline's side too). What it duplicates, loses
and leaves wrong is why the ledger exists. Run by ``toolledger chaos --baseline``; workers:
``celery -A toolledger.harness.chaos.baseline``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery

from toolledger import jsonlines
from toolledger.harness.chaos.faults import BASELINE
from toolledger.harness.chaos.harness import SUBMIT_SHARE, ChaosConfig, ChaosRun
from toolledger.harness.chaos.workload import Job, Workload
from toolledger.harness.processes import ManagedProcess, service_env

QUEUE = "baseline"
TASK = "baseline.run"


def make_app(broker: str, prefix: str = "") -> Celery:
    app = Celery("baseline", broker=broker, set_as_current=False)
    transport: dict[str, Any] = {"visibility_timeout": 30}
    if prefix:
        transport["global_keyprefix"] = prefix
    app.conf.update(
        broker_transport_options=transport,
        result_backend_transport_options=transport,
        visibility_timeout=30,
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


def _append_line(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


@app.task(name=TASK, shared=False)  # type: ignore[untyped-decorator]
def run(job: dict[str, Any]) -> None:
    """What a team writes without a ledger: do it, then say it is done."""
    args, sandbox = job["args"], Path(os.environ["TOOLLEDGER_SANDBOX"])
    time.sleep(args["hold_ms"] / 2000)
    if job["kind"] in ("write", "shared"):
        target = sandbox / args["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(args["content"])
    elif job["kind"] == "append":
        _append_line(sandbox / args["path"], args["content"])
    else:
        body = {"key": job["cid"], "account": args["account"], "cents": args["cents"]}
        request = urllib.request.Request(  # noqa: S310 - the harness's service on loopback
            f"{os.environ['TOOLLEDGER_CHAOS_DOWNSTREAM']}/charge",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=3):  # noqa: S310
            pass
    time.sleep(args["hold_ms"] / 2000)
    done = {"cid": job["cid"], "t": time.time(), "pid": os.getpid()}
    jsonlines.append(os.environ["TOOLLEDGER_BASELINE_DONE"], done)


class BaselineRun(ChaosRun):
    """ChaosRun's workload and fault schedule against plain Celery tasks."""

    def __init__(self, config: ChaosConfig, workload: Workload) -> None:
        super().__init__(config)
        self.workload = workload
        self.kinds = [k for k in BASELINE if k in config.kinds]
        self.sent: set[str] = set()  # jobs sent at least once (duplicates are faults)

    def setup(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in ("done.log", "faults.log", "charges.log"):
            (self.out / name).unlink(missing_ok=True)
        self._start_downstream()
        self.env = service_env(
            None,
            broker=self.cfg.broker,
            broker_prefix=self.prefix,
            sandbox=str(self.out / "sandbox"),
            baseline_done=str(self.out / "done.log"),
            chaos_downstream=self.downstream_url,
        )
        argv = [sys.executable, "-m", "celery", "-A", "toolledger.harness.chaos.baseline", "worker",
                "--pool", "prefork", "--concurrency", str(self.cfg.concurrency), "-Q", QUEUE,
                "--without-gossip", "--without-mingle", "--loglevel", "INFO"]  # fmt: skip
        self.workers = [
            ManagedProcess(
                f"base-w{i + 1}",
                "worker",
                [*argv, "--hostname", f"base-w{i + 1}@%h"],
                self.env,
                self.out / "logs" / f"base-w{i + 1}.log",
            )
            for i in range(self.cfg.workers)
        ]
        for w in self.workers:
            w.start()
        for w in self.workers:
            w.wait_ready(90)
        self.app = make_app(self.cfg.broker, self.prefix)

    def run(self) -> dict[str, Any]:
        self.setup()
        self.began = time.time()
        agent = threading.Thread(target=self._agent, name="baseline-agent")
        agent.start()
        threading.Thread(target=self._supervise, name="supervise", daemon=True).start()
        try:
            self._inject()
            self._heal_all()
            agent.join()
            return {"recovered_s": self._wait_quiet(stall=35)}
        finally:
            self._stopping.set()
            from toolledger.harness.processes import stop_all

            stop_all(self.workers)

    def _send(self, job: Job) -> None:
        self._publish(job)
        self.sent.add(job.cid)

    def _publish(self, job: Job) -> None:
        self.app.send_task(TASK, args=(job.to_json(),), queue=QUEUE)

    def submitted(self) -> int:
        return len(self.sent)

    def _agent(self) -> None:
        """Send each job at its time; a shared path's writer after the one before it is done
        (or has had the same time to be as in the toolledger run)."""
        jobs, window = self.workload.jobs, self.cfg.duration * SUBMIT_SHARE
        waiting: list[tuple[Job, float]] = []
        for i, job in enumerate(jobs):
            time.sleep(max(0.0, self.began + window * i / len(jobs) - time.time()))
            waiting.append((job, time.time())) if job.after else self._send(job)
            waiting = self._release(waiting)
        while waiting:
            time.sleep(0.2)
            waiting = self._release(waiting)

    def _release(self, waiting: list[tuple[Job, float]]) -> list[tuple[Job, float]]:
        done = {d["cid"] for d in self._lines("done.log")}
        still = []
        for job, since in waiting:
            if job.after in done or time.time() - since > self.cfg.lease_seconds * 3:
                self._send(job)
            else:
                still.append((job, since))
        return still

    def _held_executions(
        self, workers: list[ManagedProcess] | None = None
    ) -> dict[int, str] | None:
        """Unknown: plain Celery keeps no ledger, so its faults strike on schedule."""
        return None

    def _fault_duplicate(self) -> Any:
        from toolledger.harness.chaos.harness import Fault

        picked = self.rng.sample(self.workload.jobs, min(5, len(self.workload.jobs)))
        for job in picked:
            self._publish(job)  # a duplicate, not a submission
        return Fault(0, "duplicate", "broker", [], {"keys": [j.cid for j in picked]})

    def _wait_quiet(self, stall: float) -> float:
        """Until every job is done or nothing changed for ``stall`` seconds, longer than a
        visibility timeout (after which Redis would have redelivered anything it held)."""
        started, last, last_change = time.time(), -1, time.time()
        while time.time() - last_change < stall:
            n = len(self._lines("done.log"))
            if n != last:
                last, last_change = n, time.time()
            done = {d["cid"] for d in self._lines("done.log")}
            if len(done) >= len(self.workload.jobs):
                break
            time.sleep(0.5)
        return round(time.time() - started, 1)

    def teardown(self) -> None:
        self.app.close()
        if self.downstream is not None:
            self.downstream.kill()
            self.downstream.wait(10)
        self.forget_broker_keys()

    def results(self) -> dict[str, Any]:
        jobs, root = self.workload.jobs, self.out / "sandbox"
        done = self._lines("done.log")
        done_once = {d["cid"] for d in done}
        files = {j.group: _read(root / j.group) for j in jobs if j.group}
        lines = Counter(
            line for text in files.values() if text for line in text.splitlines(keepends=True)
        )
        # a charge the service saw again for one job (a re-execution): its dedupe by key turns
        # the repeats into replays, so counting only "charge" lines could never find one
        # (helper-96); every repeat is a second charge at a service without that dedupe
        charges = Counter(
            c["key"] for c in self._lines("charges.log") if c["kind"] in ("charge", "replay")
        )
        dup_lines = [j.cid for j in jobs if j.kind == "append" and lines[j.line] > 1]
        dup_charges = [j.cid for j in jobs if j.kind == "charge" and charges[j.cid] > 1]
        last_done: dict[str, str] = {}
        for d in done:  # in the order they said "done"
            job = next((j for j in jobs if j.cid == d["cid"]), None)
            if job is not None and job.kind == "shared":
                last_done[job.group] = job.args["content"]
        wrong = [p for p, content in last_done.items() if files.get(p) != content]
        return {
            "jobs": len(jobs),
            "duplicates": len(dup_lines) + len(dup_charges),
            "duplicate_lines": len(dup_lines),
            "duplicate_charges": len(dup_charges),
            "re_executions": len(done) - len(done_once),
            "shared_path_mismatches": len(wrong),
            "lost": sum(1 for j in jobs if j.cid not in done_once),
            "faults": dict(Counter(f.kind for f in self.faults)),
        }


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def run_baseline(cfg: ChaosConfig, workload: Workload) -> dict[str, Any]:
    base_cfg = ChaosConfig(**{**cfg.__dict__, "out": cfg.out / "baseline"})
    base_cfg.progress(f"baseline: the same {cfg.jobs} jobs and faults, plain Celery, no ledger")
    run = BaselineRun(base_cfg, workload)
    try:
        outcome = run.run()
        results = run.results()
    finally:
        run.teardown()
    return {**results, "recovered_s": outcome["recovered_s"]}
