"""The chaos run's fault log counts only faults that did something (helper-96: a Redis flush
of an idle queue, which has no key, and a Postgres crash that found no postmaster were
logged, and could meet "every fault kind at least once" and explain unknowns they did not
cause)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import redis

from toolledger.harness.chaos.harness import ChaosConfig, ChaosRun, Fault


def test_redis_flush__of_nothing_is_no_fault(redis_server: str) -> None:
    prefix = f"tl-chaos-flush-{uuid.uuid4().hex[:8]}:"
    run: Any = SimpleNamespace(cfg=SimpleNamespace(broker=redis_server), prefix=prefix)
    assert ChaosRun._fault_redis_flush(run) is None
    client = redis.Redis.from_url(redis_server)
    try:
        client.rpush(f"{prefix}toolledger", b"message")
        client.set(f"{prefix}_kombu.binding.x", b"kept")  # the bindings are not flushed
        fault = ChaosRun._fault_redis_flush(run)
        assert fault is not None and fault.detail == {"keys_deleted": 1}, fault
        assert client.get(f"{prefix}_kombu.binding.x") == b"kept"
    finally:
        client.delete(f"{prefix}_kombu.binding.x", f"{prefix}toolledger")
        client.close()


def test_pg_crash__without_a_postmaster_is_no_fault() -> None:
    started: list[bool] = []
    cluster = SimpleNamespace(crash=lambda: None, start=lambda: started.append(True))
    run: Any = SimpleNamespace(cluster=cluster)
    assert ChaosRun._fault_pg_crash(run) is None
    assert started == [True]  # left running, as a crash's end leaves it


def _bare_run(tmp_path: Path, **config: Any) -> ChaosRun:
    """A run with no world: its injector and its targeting, on faults the test makes."""
    cfg = ChaosConfig(out=tmp_path, db="", broker="", lease_seconds=1.0, **config)
    run = ChaosRun(cfg)
    run.began = time.time()
    return run


@dataclass
class FakeWorker:
    name: str
    pid: int
    kids: list[int] = field(default_factory=list)
    kind: str = "worker"
    restarts: int = 0

    def alive(self) -> bool:
        return True

    def children(self) -> list[int]:
        return list(self.kids)

    def log_text(self) -> str:
        return "celery@x ready."

    def signal(self, sig: int, *, group: bool = False) -> None:
        pass


class FakePartition:
    is_cut = False

    def cut(self) -> None:
        pass

    def heal(self) -> None:
        pass


def test_inject__a_fault_waiting_for_work_in_flight_holds_up_no_other(tmp_path: Path) -> None:
    """A kill due while nothing is in flight waits for work, bounded, while the faults due
    after it go in on time: the injector waited up to 34 s for one fault's target, holding
    every later fault, then fired the backlog at once (CI: 10 faults within 0.5 s)."""
    run: Any = _bare_run(tmp_path, faults=2, duration=1.0)
    run._schedule = lambda: [(0.0, "kill_main"), (0.2, "redis_flush")]
    run._held_executions = lambda: {}  # nothing in flight on any worker
    run._fault_kill_main = lambda: None  # and so no target
    missed_when_flushed: list[dict[str, int]] = []

    def flush() -> Fault:
        missed_when_flushed.append(dict(run.missed))
        return Fault(0, "redis_flush", "redis")

    run._fault_redis_flush = flush
    run._inject()
    assert missed_when_flushed == [{}]  # in while the kill still waited
    assert run.missed == {"kill_main": 1}  # which then gave up, counted
    assert [f.kind for f in run.faults] == ["redis_flush"]


def test_pick__only_a_worker_up_that_holds_work_in_flight(tmp_path: Path) -> None:
    """A kill, a freeze or a cut strikes a worker holding a claimed execution, never one
    frozen by a zombie (a partition and a freeze struck one worker at once) nor one that
    holds nothing (CI's kills met no execution in flight, 0 of 3 of each kind)."""
    for seed in range(20):
        run: Any = _bare_run(tmp_path, seed=seed)
        frozen, idle, busy = (
            FakeWorker("w1", 101, [111]),
            FakeWorker("w2", 202, [212]),
            FakeWorker("w3", 303, [313]),
        )
        run.workers = [frozen, idle, busy]
        run.partitions = {w.name: FakePartition() for w in run.workers}
        run._paused = {"w1"}
        run._busy = {111: "w1", 313: "w3"}  # the frozen one's execution, and w3's child's
        fault = ChaosRun._fault_partition(run)
        for timer in run._timers:
            timer.cancel()
        assert fault is not None and fault.target == "w3", (seed, fault)
        assert ChaosRun._pick(run, "partition") is None  # w3 is cut now: nobody else holds work
        run.partitions["w3"].is_cut = False
        child = ChaosRun._fault_kill_child
        run._busy = {313: "w3"}
        with mock.patch("os.kill") as kill:
            fault = child(run)
        assert fault is not None and fault.pids == [313] and kill.call_args.args[0] == 313


def test_inject__one_worker_taken_out_at_a_time(tmp_path: Path) -> None:
    """With one of two workers frozen, a freeze, a cut or a kill of the main process waits:
    the last worker up is not taken out (both stood frozen or cut most of CI's window)."""
    run: Any = _bare_run(tmp_path)
    run.workers = [FakeWorker("w1", 101, [111]), FakeWorker("w2", 202, [212])]
    run.partitions = {w.name: FakePartition() for w in run.workers}
    run._paused = {"w1"}
    run._held_executions = lambda: {212: "w2"}
    for kind in ("zombie", "partition", "kill_main"):
        assert run._try_fault(kind, {212: "w2"}) is None, kind
    run._paused = set()
    fault = run._try_fault("partition", {212: "w2"})
    for timer in run._timers:
        timer.cancel()
    assert fault is not None and fault.target == "w2"


def test_default_faults__scale_with_the_fleet() -> None:
    """The default density follows what the fleet can take: more workers, more faults; and
    two of each kind at least."""
    two = ChaosConfig(out=Path("."), db="", broker="", workers=2, duration=45)
    four = ChaosConfig(out=Path("."), db="", broker="", workers=4, duration=45)
    assert two.faults >= 2 * len(two.kinds)
    assert four.faults > two.faults


def test_up__a_worker_whose_child_a_failpoint_just_stopped_is_not(tmp_path: Path) -> None:
    """A failpoint stops a prefork child (SIGSTOP) at once; the supervisor notices it within
    0.3 s. A fault due meanwhile took the worker for one up and froze it: its wake then woke
    the stopped child before its revocation, and the run's fence measure met nothing."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.time() + 10
        while _state(child.pid) != "T" and time.time() < deadline:
            time.sleep(0.05)
        run: Any = _bare_run(tmp_path)
        stopped, other = FakeWorker("w1", os.getpid(), [child.pid]), FakeWorker("w2", 1)
        run.workers = [stopped, other]
        run.partitions = {}
        assert [w.name for w in run._up()] == ["w2"]
    finally:
        child.kill()
        child.wait()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_try_fault__a_database_fault_waits_only_for_a_woken_process_running(
    tmp_path: Path,
) -> None:
    """A Postgres crash or terminate waits while a woken process runs on to the fence, not
    while it stands stopped again or has ended; a partition (its target's cut only) never
    waits for it. On threads the first worker's one process stopped at each point in turn
    and was killed whole, so it stood in the harness's books as on its way to the fence from
    its first wake to the end: CI's threads run never injected a crash, 4 runs of 4."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    run: Any = _bare_run(tmp_path)
    stopper, busy_one = FakeWorker("w1", os.getpid()), FakeWorker("w2", 202, [212])
    run.workers = [stopper, busy_one, FakeWorker("w3", 303)]  # a cut leaves w3 up
    run.partitions = {w.name: FakePartition() for w in run.workers}
    struck: list[str] = []
    for kind in ("pg_crash", "pg_terminate"):
        setattr(run, f"_fault_{kind}", lambda kind=kind: struck.append(kind) or Fault(0, kind))
    busy = {212: "w2"}
    run._held_executions = lambda: busy
    run._completing = {os.getpid(): ("e1", time.time())}  # woken, running: it waits
    assert run._try_fault("pg_crash", busy) is None
    fault = run._try_fault("partition", busy)  # the other worker's cut meets it not
    for timer in run._timers:
        timer.cancel()
    assert fault is not None and fault.target == "w2", fault
    run.partitions["w2"].is_cut = False
    run._stopped = {os.getpid(): time.time()}  # stopped again at a later point: frozen
    assert run._try_fault("pg_crash", busy) is not None
    run._stopped = {}
    run._completing = {gone.pid: ("e1", time.time())}  # killed whole since its wake
    assert run._try_fault("pg_terminate", busy) is not None
    assert struck == ["pg_crash", "pg_terminate"]


def test_inject__a_kind_not_struck_yet_waits_past_the_window_for_work(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A kind never struck still waits for work past the window's end and a lease: on a
    loaded machine a threads fleet killed whole by each failpoint firing had two workers up
    for about a second of CI's window, and kill_main and zombie were never injected."""
    monkeypatch.setattr("toolledger.harness.chaos.harness.FREEZE_PAST_LEASE", 0.0)
    run: Any = _bare_run(tmp_path, faults=1, duration=0.2)
    run.cfg.lease_seconds = 1.0  # one wait: 1 s; the window's end and a wait: 1.2 s
    run._schedule = lambda: [(0.0, "kill_main")]
    seen_after = run.began + 0.2 + 1.0 + 0.3  # work shows up once the old wait is over
    run._held_executions = lambda: {101: "w1"} if time.time() >= seen_after else {}
    run._fault_kill_main = lambda: Fault(0, "kill_main", "w1")
    run._inject()
    assert run.missed == {}, run.missed
    assert [f.kind for f in run.faults] == ["kill_main"]


def test_inject__a_repeat_that_takes_a_worker_out_leaves_it_to_a_kind_not_struck(
    tmp_path: Path,
) -> None:
    """Two due at once for the one worker that may be taken out: a second cut waits while a
    kill of a main process, not struck yet, waits for its target (a second cut took it)."""
    run: Any = _bare_run(tmp_path, faults=3, duration=0.5)
    run.workers = [FakeWorker("w1", 101), FakeWorker("w2", 202)]
    run.partitions = {w.name: FakePartition() for w in run.workers}
    run._schedule = lambda: [(0.0, "partition"), (0.1, "kill_main"), (0.1, "partition")]
    run._held_executions = lambda: {101: "w1"}
    kill_tries: list[float] = []

    def kill_main() -> Fault | None:
        kill_tries.append(time.time())
        return Fault(0, "kill_main", "w1") if len(kill_tries) > 3 else None

    run._fault_kill_main = kill_main
    run._fault_partition = lambda: Fault(0, "partition", "w1")
    run._all_done = lambda: True  # no waiting past the window here
    run._inject()
    assert [f.kind for f in run.faults][:2] == ["partition", "kill_main"], run.faults


def test_pick__a_kind_that_takes_a_worker_out_leaves_one_up_at_the_pick(tmp_path: Path) -> None:
    """A worker may go out between the count of those up and the pick (a failpoint killed
    it): the pick counts again, and a freeze never takes the last one up (a zombie froze the
    last worker up beside one frozen: none up for 10 s). A child kill takes no worker out."""
    run: Any = _bare_run(tmp_path)
    run.workers = [FakeWorker("w1", 101, [111]), FakeWorker("w2", 202, [212])]
    run.partitions = {w.name: FakePartition() for w in run.workers}
    run._paused = {"w1"}  # went out after the count
    run._busy = {212: "w2"}
    for kind in ("zombie", "partition", "kill_main"):
        assert ChaosRun._pick(run, kind) is None, kind
    picked = ChaosRun._pick(run, "kill_child")
    assert picked is not None and picked.name == "w2"


def test_held_executions__a_dead_child_not_yet_reaped_holds_nothing(tmp_path: Path) -> None:
    """A pool child a failpoint killed is listed until its parent reaps it, and its execution
    stays running in the ledger until the sweep: it was taken for work in flight, and a
    zombie froze a worker whose only such children had died (it met nothing)."""
    import sqlalchemy as sa

    dead = subprocess.Popen(["true"])  # exits; not waited for: a zombie process until reaped
    deadline = time.time() + 10
    while _state(dead.pid) != "Z" and time.time() < deadline:
        time.sleep(0.05)
    run: Any = _bare_run(tmp_path)
    run.scope = "s"
    run.workers = [FakeWorker("w1", os.getpid(), [dead.pid])]
    run.partitions = {}
    run._probe = sa.create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        with run._probe.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE executions (scope TEXT, status TEXT, worker_id TEXT)"
            )
            conn.exec_driver_sql(
                "INSERT INTO executions VALUES ('s', 'running', ?)", (f"vm:{dead.pid}",)
            )
        assert run._held_executions() == {}
        with run._probe.begin() as conn:  # and a live one is seen
            conn.exec_driver_sql(
                "INSERT INTO executions VALUES ('s', 'running', ?)", (f"vm:{os.getpid()}",)
            )
        assert run._held_executions() == {os.getpid(): "w1"}
    finally:
        run._probe.dispose()
        dead.wait()


def test_zombie__a_worker_found_holding_nothing_once_frozen_is_thawed(tmp_path: Path) -> None:
    """The work in flight is read, then the worker frozen: if its execution ended or its child
    died in between, the freeze meets nothing (prefork at load 20: a child a failpoint killed
    0.2 s before). Frozen, the ledger is read again; holding nothing, it is thawed at once and
    nothing is injected."""
    import sqlalchemy as sa

    sent: list[int] = []

    class Signalled(FakeWorker):
        def signal(self, sig: int, *, group: bool = False) -> None:
            sent.append(sig)

    run: Any = _bare_run(tmp_path)
    run.scope = "s"
    worker = Signalled("w1", os.getpid())
    run.workers = [worker, FakeWorker("w2", 202)]
    run.partitions = {}
    run._busy = {os.getpid(): "w1"}  # as read when the fault was due
    run._probe = sa.create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        with run._probe.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE executions (scope TEXT, status TEXT, worker_id TEXT)"
            )
        assert run._fault_zombie() is None  # nothing running on it by now
        assert sent == [signal.SIGSTOP, signal.SIGCONT] and run._paused == set()
        with run._probe.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO executions VALUES ('s', 'running', ?)", (f"vm:{os.getpid()}",)
            )
        fault = run._fault_zombie()
        for timer in run._timers:
            timer.cancel()
        assert fault is not None and fault.target == "w1" and run._paused == {"w1"}
    finally:
        run._probe.dispose()
