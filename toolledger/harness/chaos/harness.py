"""The chaos harness: real workers, an agent and an operator on a Postgres and a Redis prefix of
the run's own, faults on a seeded schedule, and everything logged for the checker.

The run owns its world: a Postgres cluster of its own (initdb, its own port; so that it can
crash it and start it again), a Redis key prefix, a sandbox, a downstream payments service,
and — where the machine allows it — one network namespace per worker through which that
worker alone reaches Postgres (so that it alone can be partitioned). The version of
toolledger under test runs every process that touches the ledger (workers, the beat, the
agent, the operator, the final sweep): today's by default, or an older checkout (``code``),
to show what this harness finds there. The harness itself only schedules, injects and
records; the checker reads the ledger afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa

from toolledger import failpoints, jsonlines
from toolledger.harness import scratch
from toolledger.harness.chaos import partition as partitions
from toolledger.harness.chaos.faults import DISABLES, EXTERNAL, MEETS_WORK, WHOLE_DATABASE
from toolledger.harness.chaos.pgcluster import PgCluster, find_bin, free_port
from toolledger.harness.chaos.workload import Workload, make_workload
from toolledger.harness.processes import (
    READY_MARKERS,
    ManagedProcess,
    beat_process,
    children_of,
    process_state,
    stop_all,
    worker_process,
)
from toolledger.ledger.db import create_engine

PLUGIN = Path(__file__).parent / "plugin"
ROLES = PLUGIN / "toolledger_chaos_roles.py"
#: Jobs are submitted over this share of the fault window, so faults keep meeting work.
SUBMIT_SHARE = 0.85
#: Failpoints where a process that stops itself (SIGSTOP) and is woken after the sweep revoked
#: its execution meets the fence: before its tool (never started), inside or after the effect
#: (its commit refused, its staged bytes never landed). A zombie fault freezes a worker at a
#: random instant, which almost never falls between the last check and the commit.
STOPPABLE = ("after_claim", "before_effect", "after_stage", "after_effect")
#: How long past the lease a frozen process is held: the sweep revokes it meanwhile.
FREEZE_PAST_LEASE = 6.0
#: The longest a prefork parent stays stopped after its child was woken (``_wake_stopped``).
PARENT_HOLD = 20.0
#: How many waits (a lease and FREEZE_PAST_LEASE each) past the fault window a kind not
#: struck yet still waits for a worker up with work, while calls are open, beside one for each
#: kind that takes a worker out (those go one at a time, each holding its worker up to a wait):
#: time for the fleet to come back from a freeze or a cut, the first worker's failpoint stop
#: and a restart or two. On a loaded 2-core machine (load 10) a threads worker's restart took 2
#: to 16 s, and its process killed whole by each failpoint firing (13 in a run) left two
#: workers up at once for about a second of CI's 36 s window: kill_main 3 and zombie 3 never
#: injected, one wait past it; with three, the last kind went in 5 s before the bound (73 s);
#: at load 13 restarts took 8 to 17 s and the failpoint kills ran to 68 s, and with four
#: kill_main and partition gave up at 92 s while 150 calls were still open.
UNSTRUCK_WAITS = 5


@dataclass
class ChaosConfig:
    out: Path
    db: str  # a Postgres server URL: used only if the run cannot have a cluster of its own
    broker: str  # a Redis URL: the run uses its own key prefix
    workers: int = 2
    concurrency: int = 2
    pool: str = "prefork"  # Celery's worker pool: prefork, or threads (no children to kill)
    jobs: int = 300
    duration: float = 60.0  # seconds during which faults are injected
    faults: int = 0  # external faults to inject (0: one every ~duration/24 s, at least 24)
    seed: int = 1
    lease_seconds: float = 8.0
    hold_ms: int = 0  # 0: chosen so the workers are about half busy
    failpoint_percent: float = 0.0  # 0: about 8 firings per point (min 0.5 %)
    #: of the hits of each STOPPABLE point, the share that stops its process until the sweep
    #: revoked its execution (the fleet's first hit of each always does)
    stop_percent: float = 0.0
    keep_db: bool = False
    code: Path | None = None  # the toolledger checkout under test (None: this one)
    kinds: tuple[str, ...] = EXTERNAL
    progress: Callable[[str], None] = print

    def __post_init__(self) -> None:
        if not self.faults:
            self.faults = default_faults(self)
        slots = self.workers * self.concurrency
        rate = self.jobs / (self.duration * SUBMIT_SHARE)
        if not self.hold_ms:
            self.hold_ms = int(min(1500, max(50, 500 * slots / rate)))
        if not self.failpoint_percent:
            self.failpoint_percent = round(max(0.5, 100 * 8 / self.jobs), 2)


def default_faults(cfg: ChaosConfig) -> int:
    """As many faults as the fleet can take while each meets work: the kinds that take a
    worker out (a freeze, a cut: a lease and more each; a kill until the restart) one at a
    time while one worker is left up, so the window holds about ``(workers - 1) * duration
    / (lease + FREEZE_PAST_LEASE)`` of them, the other kinds in proportion; two of each kind
    at least. One every 2.5 s whatever the fleet (24 in CI's 45 s on two workers, a quarter
    of them 14 s freezes or cuts) left both workers frozen or cut most of the window, and
    the kills met no execution in flight (a cold review)."""
    kinds = len(cfg.kinds) or 1
    disabling = max(1, sum(1 for k in cfg.kinds if k in DISABLES))
    hold = cfg.lease_seconds + FREEZE_PAST_LEASE
    fits = (max(1, cfg.workers) - 1 or 1) * cfg.duration / hold
    return max(2 * kinds, int(fits * kinds / disabling))


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


class Code:
    """How to run a version of toolledger: ``python -m toolledger`` (``python -m worker`` for a
    checkout from before the namespace) with its tree first on the path."""

    def __init__(self, tree: Path | None) -> None:
        self.tree = tree
        self.legacy = tree is not None and not (tree / "toolledger" / "__main__.py").exists()

    def env(self) -> dict[str, str]:
        paths = [str(self.tree)] if self.tree else []
        paths += [str(PLUGIN), os.environ.get("PYTHONPATH", "")]
        env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        if self.legacy:
            env["TOOLLEDGER_CHAOS_LEGACY"] = "1"
        return env

    def cli(self) -> list[str]:
        return [sys.executable, "-m", "worker" if self.legacy else "toolledger"]

    def failpoints(self) -> list[str]:
        return self._probe_failpoints()[0]

    def first_failpoints(self) -> bool:
        """Whether this version's failpoints know ``first+`` (older baselines do not)."""
        return self._probe_failpoints()[1]

    def chained_failpoints(self) -> bool:
        """Whether this version's failpoints chain actions with ``->``."""
        return self._probe_failpoints()[2]

    @functools.cache  # noqa: B019 - a handful of Code objects per run, each probed once
    def _probe_failpoints(self) -> tuple[list[str], bool, bool]:
        where = "worker.failpoints" if self.legacy else "toolledger.failpoints"
        probe = (
            f"import {where} as f; print(','.join(f.POINTS)); "
            "print(int(hasattr(f, 'first_markers'))); print(int(hasattr(f, 'MAX_CHAIN')))"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe],
            env={**os.environ, **self.env()},
            cwd=self.tree or None,
            capture_output=True,
            text=True,
            check=True,
        )
        points, first, chained = out.stdout.split()
        return points.split(","), first == "1", chained == "1"


class ChaosRun:
    """One run: set up, inject, recover, then hand everything to the checker."""

    def __init__(self, config: ChaosConfig) -> None:
        self.cfg = config
        self.rng = random.Random(config.seed)
        self.run_id = time.strftime("%Y%m%d%H%M%S") + uuid.uuid4().hex[:4]
        self.scope = f"chaos-{self.run_id}"
        self.prefix = f"chaos-{self.run_id}:"
        self.out = config.out
        self.code = Code(config.code)
        self.faults: list[Fault] = []
        #: scheduled faults that found no target until their deadline, by kind (reported:
        #: dropped without a word, a kind never injected looked like one not asked for)
        self.missed: Counter[str] = Counter()
        self.workers: list[ManagedProcess] = []
        self.partitions: dict[str, partitions.Partition] = {}
        self.roles: dict[str, subprocess.Popen[bytes]] = {}
        self.beat: ManagedProcess | None = None
        self.sweeper: ManagedProcess | None = None
        self.cluster: PgCluster | None = None
        self.downstream: subprocess.Popen[bytes] | None = None
        self.workload = Workload()
        self.began = 0.0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._paused: set[str] = set()
        self._timers: list[threading.Timer] = []  # the faults' heals, waited for at the end
        self._stopped: dict[int, float] = {}  # pid stopped by a failpoint -> first seen
        self.woken: list[dict[str, Any]] = []  # each of them, woken after the revocation
        self._probe: sa.Engine | None = None  # reads the run's ledger for _on_record
        #: the held executions' processes when the fault being injected was due (pid -> worker)
        self._busy: dict[int, str] | None = {}
        self._ready: dict[str, int] = {}  # worker -> its restarts when it was last seen ready
        self._restarted: dict[str, float] = {}  # worker -> when the supervisor last restarted it
        #: prefork parents stopped with their child (the value: whether it was woken since)
        self._held_parents: dict[int, bool] = {}
        #: woken processes -> (the execution they stopped on, when): until it is on record
        self._completing: dict[int, tuple[str | None, float]] = {}
        self.kinds = list(config.kinds)
        if config.pool != "prefork":  # one process per worker: no pool child to kill
            self.kinds = [k for k in self.kinds if k != "kill_child"]

    # ------------------------------------------------------------------ setup

    def progress(self, text: str) -> None:
        self.cfg.progress(f"[{time.time() - self.began:6.1f}s] {text}" if self.began else text)

    def _postgres(self) -> str:
        """The run's own cluster if this machine can make one, else a database on ``db``."""
        pg_bin = find_bin()
        if pg_bin is not None:
            # Its own directory under the system's temp: Postgres's user must reach it, and
            # the run's directory may sit below others it cannot enter (pytest's tmp_path).
            where = Path(tempfile.mkdtemp(prefix="toolledger-chaos-pg-"))
            self.cluster = PgCluster(where, pg_bin).init()
            self.cluster.start()
            server = self.cluster.url
        else:
            server = self.cfg.db
            self.kinds = [k for k in self.kinds if k != "pg_crash"]
            self.progress("no initdb here: no cluster of the run's own, no Postgres crashes")
        url = sa.make_url(server.replace("postgresql://", "postgresql+psycopg://", 1))
        if url.get_backend_name() != "postgresql":
            raise ValueError("chaos needs Postgres (TOOLLEDGER_DB) and Redis (TOOLLEDGER_BROKER)")
        self.db_server = url.render_as_string(False)
        self.db_name = f"toolledger_chaos_{self.run_id}"
        # for the pg_terminate fault: a session of its own, outside the run's database
        self.admin = create_engine(
            self.db_server, isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=1
        )
        return scratch.create_database(self.db_server, self.db_name)

    def settings_env(self, **extra: str) -> dict[str, str]:
        env = {
            "db": self.db_url,
            "broker": self.cfg.broker,
            "broker_prefix": self.prefix,
            "home": str(self.out / "home"),
            "sandbox": str(self.out / "sandbox"),
            "tools": "toolledger_chaos_tools",
            "effects_log": str(self.out / "effects.log"),
            "failpoint_log": str(self.out / "failpoints.log"),
            "lease_seconds": str(self.cfg.lease_seconds),
            "visibility_timeout": "30",
            "sweep_interval": "1",
            "sweep_grace": "0",
            "requeue_after": "6",
            "chaos_downstream": self.downstream_url,
            **extra,
        }
        base = {k: v for k, v in os.environ.items() if not k.startswith("TOOLLEDGER_")}
        base.update({f"TOOLLEDGER_{k.upper()}": v for k, v in env.items()})
        base.update(self.code.env())
        base.setdefault("PYTHONUNBUFFERED", "1")
        return base

    def worker_failpoints(self, index: int) -> str:
        """The failpoints of the run's ``index``-th worker: only the first one stops at the
        fence's points. Every job hits them in its first seconds, and a stop holds its process
        (a prefork child's parent with it) until the sweep revoked its execution: stops on
        every worker stood the whole fleet still for the first ~35 s of a run, no call ended,
        and the external faults, waiting for a target, struck a fleet holding nothing."""
        return self._failpoints(stops=index == 0)

    def _failpoints(self, *, stops: bool = True) -> str:
        pct = self.cfg.failpoint_percent
        # first+: the fleet's first hit of each point fires for sure, then pct of the rest; a
        # short run then covers every window instead of hoping the percentage reaches each.
        first = "first+" if self.code.first_failpoints() else ""
        chained = self.code.chained_failpoints()  # older baselines: kills only

        def spec(point: str) -> str:
            kill = f"{first}{pct}%kill"
            if not chained or point not in STOPPABLE:
                return kill
            # a worker that does not stop never fires its chain's head (nor takes its
            # first+ marker), and its kill is the chain's second, sharing that marker
            head = f"first+{self.cfg.stop_percent}%stop" if stops else "0%stop"
            return f"{head}->{kill}"

        return ";".join(f"{point}={spec(point)}" for point in self.code.failpoints())

    def _partitions(self) -> None:
        why = partitions.unavailable() if "partition" in self.kinds else "not asked for"
        if why or self.cluster is None:
            self.kinds = [k for k in self.kinds if k != "partition"]
            self.progress(f"no partitions in this run: {why or 'no cluster of its own'}")
            return
        for i in range(self.cfg.workers):
            part = partitions.Partition(self.cluster.unix_socket)
            address = part.start()
            self.partitions[f"chaos-w{i + 1}"] = part
            part.url = str(  # type: ignore[attr-defined]
                sa.make_url(self.db_url)
                .set(host=address.split(":")[0], port=int(address.split(":")[1]))
                .render_as_string(False)
            )

    def _start_downstream(self) -> None:
        port = free_port()
        self.downstream_url = f"http://127.0.0.1:{port}"
        self.downstream = subprocess.Popen(
            [sys.executable, "-m", "toolledger.harness.chaos.downstream", "--port", str(port),
             "--log", str(self.out / "charges.log")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        assert self.downstream.stdout is not None
        if b"downstream ready" not in self.downstream.stdout.readline():
            raise RuntimeError("the downstream service did not start")

    def setup(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        # an earlier run's world in a reused --out: the checker judges the whole sandbox
        shutil.rmtree(self.out / "sandbox", ignore_errors=True)
        for name in ("effects.log", "failpoints.log", "faults.log", "charges.log", "woken.log",
                     "operator.log", "submitted.log", "finish", "operator.done"):  # fmt: skip
            (self.out / name).unlink(missing_ok=True)
        for marker in failpoints.first_markers(str(self.out / "failpoints.log")):
            Path(marker).unlink(missing_ok=True)
        self.db_url = self._postgres()
        self._start_downstream()
        self._cli("db", "upgrade")  # by the version under test
        if self.code.tree is None:  # this checkout: every sweep pass removes free lock files
            (self.out / "sandbox").mkdir(exist_ok=True)  # (landings run as their files go)
            self._cli("sandbox", "upgrade", "--new")
        self._partitions()
        self.workload = make_workload(self.cfg.jobs, self.cfg.seed, self.run_id, self.cfg.hold_ms)
        logs = self.out / "logs"
        self.workers = []
        for i in range(self.cfg.workers):
            name = f"chaos-w{i + 1}"
            part = self.partitions.get(name)
            extra = {"db": part.url} if part else {}  # type: ignore[attr-defined]
            env = self.settings_env(failpoints=self.worker_failpoints(i), **extra)
            self.workers.append(
                worker_process(
                    name, env, logs, concurrency=self.cfg.concurrency, pool=self.cfg.pool
                )
            )
        self.beat = beat_process("chaos-beat", self.settings_env(), logs)
        # A sweeper of its own, as production runs one (the compose file's): the workers take
        # sweeps too, and while both stand stopped with a process a failpoint stopped, nothing
        # would revoke anything, and a woken process's commit would simply be taken
        self.sweeper = worker_process(
            "chaos-sweeper", self.settings_env(), logs, concurrency=1,
            extra=("--queues", "toolledger.sweep"),
        )  # fmt: skip
        for p in [*self.workers, self.beat, self.sweeper]:
            p.cwd = self.code.tree
            p.start()
        for p in [*self.workers, self.beat, self.sweeper]:
            p.wait_ready(90)

    def _cli(self, *argv: str, ok: tuple[int, ...] = (0,)) -> str:
        proc = subprocess.run(
            [*self.code.cli(), *argv],
            env=self.settings_env(),
            cwd=self.code.tree or None,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode not in ok:
            raise RuntimeError(f"toolledger {' '.join(argv)} failed: {proc.stderr[-2000:]}")
        return proc.stdout

    def _plan(self) -> Path:
        plan = {
            "scope": self.scope,
            "jobs": [j.to_json() for j in self.workload.jobs],
            "began": self.began,
            "window": self.cfg.duration * SUBMIT_SHARE,
            "chain_wait": self.cfg.lease_seconds * 3,
            "sandbox": str(self.out / "sandbox"),
            "downstream": self.downstream_url,
            "submitted_log": str(self.out / "submitted.log"),
            "operator_log": str(self.out / "operator.log"),
            "operator_every": 2.0,
            "finish_file": str(self.out / "finish"),
            "operator_done": str(self.out / "operator.done"),
        }
        path = self.out / "plan.json"
        path.write_text(json.dumps(plan))
        return path

    def _role(self, role: str, plan: Path) -> subprocess.Popen[bytes]:
        log = (self.out / "logs" / f"{role}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, str(ROLES), role, str(plan)],
            env=self.settings_env(),
            cwd=self.code.tree or None,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.roles[role] = proc
        return proc

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        self.setup()
        self.began = time.time()
        plan = self._plan()
        self._role("submit", plan)
        self._role("operate", plan)
        supervisor = threading.Thread(target=self._supervise, name="supervise", daemon=True)
        supervisor.start()
        try:
            self._inject()
            self._let_faults_end()
            self._heal_all(stopped_too=False)  # a process stopped since waits for its wake
            self.progress(f"faults done ({len(self.faults)}); waiting for the agent")
            self.roles["submit"].wait(timeout=max(60.0, self.cfg.duration))
            recovered = self._wait_quiet(stall=120)
            final = self._final_sweep()
            return {"recovered_s": recovered, "final_sweep": final}
        finally:
            self._stopping.set()
            for proc in self.roles.values():
                if proc.poll() is None:
                    proc.kill()
            self._heal_all()
            stop_all([*self.workers, *(p for p in (self.beat, self.sweeper) if p)])

    def _supervise(self) -> None:
        """Restart killed workers, as systemd or Kubernetes would; wake the processes a
        failpoint stopped once their executions' leases are long gone."""
        while not self._stopping.wait(0.3):
            for w in self.workers:
                if not w.alive() and w.name not in self._paused:
                    w.restart()
                    self._restarted[w.name] = time.time()
                self._taken_out(w)  # notes when a restarted worker is ready (its progress)
            if self.sweeper is not None and not self.sweeper.alive():
                self.sweeper.restart()
            with contextlib.suppress(Exception):  # a process gone meanwhile
                self._wake_stopped()

    def _wake_stopped(self) -> None:
        """A process a failpoint stopped is woken once its lease is long gone. A prefork
        child's parent is stopped with it, as a paused machine stops both (else the parent's
        hard time limit kills the child before it can meet the fence), and woken only once
        the child has put its late result on record (or after ``PARENT_HOLD`` seconds, for
        one that had to spool it): the child runs first, as it may after any freeze."""
        now, held = time.time(), self.cfg.lease_seconds + FREEZE_PAST_LEASE
        seen = set()
        for w in self.workers:
            if w.name in self._paused:  # a zombie fault's whole group: its timer wakes it
                continue
            for pid in [w.pid, *w.children()]:
                if pid in self._held_parents or not _is_stopped(pid):
                    continue
                seen.add(pid)
                if pid not in self._stopped:
                    self._stopped[pid] = now
                    if pid != w.pid and w.pid not in self._held_parents:
                        os.kill(w.pid, signal.SIGSTOP)
                        self._held_parents[w.pid] = False
                elif self._may_wake(pid, now - self._stopped[pid], held, w):
                    os.kill(pid, signal.SIGCONT)
                    since = self._stopped.pop(pid)
                    # the checker holds a stop as lasting to its wake: a threads process
                    # another thread stopped sends its claim when woken, past the firing
                    woke = {"pid": pid, "worker": w.name, "t": since, "held_s": held, "woke": now}
                    self.woken.append(woke)
                    jsonlines.append(self.out / "woken.log", woke, fsync=False)
                    self._completing[pid] = (self._stopped_on(pid), now)
                    if w.pid in self._held_parents:
                        self._held_parents[w.pid] = True
        for pid in set(self._stopped) - seen:  # woken by someone else, or gone
            del self._stopped[pid]
        for pid, (eid, at) in list(self._completing.items()):
            if pid in self._stopped:
                continue  # stopped again at a later point: woken again later
            ended = not _alive(pid)  # killed whole (threads: another thread's failpoint)
            if ended or now - at >= PARENT_HOLD or (eid and self._on_record(eid, at)):
                del self._completing[pid]
                how = "ended" if ended else "on record" if now - at < PARENT_HOLD else "held"
                self.progress(f"woken process {pid}: {how} {now - at:.1f} s after its wake")
        for parent in list(self._held_parents):
            # released once no child of it is stopped or on its way to the fence, woken by
            # the harness or not (a zombie fault's timer may have woken the group meanwhile)
            if not any(c in self._stopped or c in self._completing for c in children_of(parent)):
                self._release_parent(parent)

    def _may_wake(self, pid: int, stopped_for: float, held: float, w: ManagedProcess) -> bool:
        """Once its lease is long gone, its worker is not cut off, and the sweep has revoked
        its execution (else its commit would simply be taken: nothing would meet the fence);
        after ``PARENT_HOLD`` more seconds whatever the sweep did, so that the run goes on."""
        if stopped_for < held or self._cut(w):
            return False
        eid = self._stopped_on(pid)
        return stopped_for >= held + PARENT_HOLD or eid is None or self._revoked(eid)

    def _revoked(self, eid: str) -> bool:
        return self._probe_events(eid, "unknown", since=0.0)

    def _stopped_on(self, pid: int) -> str | None:
        """The execution ``pid`` stopped on: its last ``stop`` firing's."""
        stops = [
            f
            for f in jsonlines.read(self.out / "failpoints.log")
            if f.get("pid") == pid and f.get("action") == "stop"
        ]
        return stops[-1].get("ref") if stops else None

    def _on_record(self, eid: str, woken_at: float) -> bool:
        """Whether ``eid`` has put something on record since it was woken."""
        return self._probe_events(eid, "evidence", since=woken_at)

    def _probe_events(self, eid: str, kind: str, since: float) -> bool:
        """Whether ``eid`` has an event of ``kind`` at ``since`` or later (a second's slack)."""
        if self._probe is None:
            self._probe = create_engine(self.db_url, pool_size=1, max_overflow=0)
        with contextlib.suppress(sa.exc.SQLAlchemyError), self._probe.connect() as conn:
            found = conn.execute(
                sa.text(
                    "SELECT 1 FROM execution_events WHERE execution_id = :e "
                    "AND kind = :k AND at >= to_timestamp(:t) - interval '1 second'"
                ),
                {"e": eid, "k": kind, "t": since},
            ).first()
            return found is not None
        return False

    def _release_parent(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self._held_parents.pop(pid, None)

    def _let_faults_end(self) -> None:
        """Every fault runs its course before the run heals what is left: the last zombie and
        partition were cut short at once (a cold review), and so was a process a failpoint
        stopped, woken before its execution was revoked."""
        deadline = time.time() + self.cfg.lease_seconds + FREEZE_PAST_LEASE + PARENT_HOLD + 5
        while (self._stopped or self._held_parents or self._completing) and (
            time.time() < deadline
        ):
            time.sleep(0.3)
        for timer in list(self._timers):
            timer.join()

    def _cut(self, w: ManagedProcess) -> bool:
        """Whether ``w`` is partitioned now (a stopped process is woken once it is not)."""
        return bool(getattr(self.partitions.get(w.name), "is_cut", False))

    def _has_stopped(self, w: ManagedProcess) -> bool:
        held = self._stopped.keys() | self._held_parents.keys() | self._completing.keys()
        return any(pid in held for pid in [w.pid, *w.children()])

    # ------------------------------------------------------------------ faults

    def _schedule(self) -> list[tuple[float, str]]:
        kinds = [self.kinds[i % len(self.kinds)] for i in range(self.cfg.faults)]
        self.rng.shuffle(kinds)
        gaps = [self.rng.expovariate(1.0) for _ in kinds]
        scale = self.cfg.duration * 0.95 / sum(gaps)
        at, plan = 0.5, []
        for gap, kind in zip(gaps, kinds, strict=True):
            at += gap * scale
            plan.append((at, kind))
        return plan

    def _inject(self) -> None:
        """Each fault, once due, waits (bounded) until it can strike work in flight, without
        holding up the faults due after it: one that waited for a target blocked the whole
        schedule for up to 34 s and the backlog then fired at once, and kills, terminates
        and crashes met no execution in CI (a cold review)."""
        plan = self._schedule()
        pending: list[tuple[float, str]] = []  # due, not yet injected: (deadline, kind)
        wait = self.cfg.lease_seconds + FREEZE_PAST_LEASE
        disabling = sum(1 for k in self.kinds if k in DISABLES)
        unstruck_until = self.began + self.cfg.duration + (UNSTRUCK_WAITS + disabling) * wait
        done = 0
        while plan or pending:
            while plan and self.began + plan[0][0] <= time.time():
                at, kind = plan.pop(0)
                pending.append((self.began + at + wait, kind))
            busy = self._held_executions() if pending else None
            # a kind struck less often first: two due at once for the one worker that may be
            # taken out, the one whose kind has not met the fleet yet takes it
            struck = Counter(f.kind for f in self.faults)
            pending.sort(key=lambda p: (struck[p[1]], p[0]))
            # the one worker that may be taken out is kept for a kind that has not taken one
            # yet: a second cut took it while a kill_main waited, 14 s of the few seconds a
            # threads fleet had two workers up (CI)
            keep = any(k in DISABLES and not struck[k] for _, k in pending)
            for item in list(pending):
                deadline, kind = item
                waits = keep and kind in DISABLES and struck[kind] > 0
                fault = None if waits else self._try_fault(kind, busy)
                if fault is not None:
                    fault.t = fault.t or time.time()
                    self.faults.append(fault)
                    jsonlines.append(self.out / "faults.log", fault.to_json(), fsync=False)
                    busy = self._held_executions()  # what is in flight in the fleet it left
                elif time.time() >= deadline and (
                    struck[kind] or time.time() >= unstruck_until or self._all_done()
                ):
                    # a kind not struck yet waits past the window while calls are open: a
                    # threads fleet restarting after each failpoint kill had no worker up and
                    # holding work within a lease of a kill's time, three times of three
                    self.missed[kind] += 1
                    up = ", ".join(w.name for w in self._up()) or "none"
                    self.progress(
                        f"a {kind} fault found no target: not injected (workers up: {up}; "
                        f"processes of theirs holding an execution: {len(busy or {})})"
                    )
                else:
                    continue
                pending.remove(item)
                done += 1
                if done % max(1, self.cfg.faults // 10) == 0:
                    jobs = self.submitted()
                    self.progress(
                        f"{len(self.faults)} faults, {jobs}/{self.cfg.jobs} jobs submitted"
                    )
            time.sleep(0.1)

    def _all_done(self) -> bool:
        """Whether the agent submitted every call and none is open: no work left to meet."""
        submit = self.roles.get("submit")
        if submit is None or submit.poll() is None:
            return False
        try:
            return self._open_calls() == 0
        except sa.exc.SQLAlchemyError:
            return False

    def _try_fault(self, kind: str, busy: dict[int, str] | None) -> Fault | None:
        """Inject ``kind`` now if it can strike work in flight, else None (it waits). ``busy``
        None: what is in flight is not known (the baseline keeps no ledger)."""
        if kind in WHOLE_DATABASE and self._to_the_fence():
            return None  # a woken process goes on to the fence: the run's one measure of it
        if kind in MEETS_WORK and busy is not None and not busy:
            return None  # no execution in flight on a worker that is up: it would meet none
        if kind in DISABLES and len(self._up()) < min(2, len(self.workers)):
            # the last worker up is not taken out: freezes and cuts struck every worker at
            # once and held the whole fleet most of CI's window. A worker a failpoint stopped
            # counts as out (the run's own measure of the fence: it holds the first worker
            # most of a short run's first 40 s), or a fault on the other stood the fleet still
            return None
        if kind in MEETS_WORK and busy is not None:
            # read again at the strike: the loop's read, up to a second old on a loaded
            # machine, named a child whose 0.4 s execution had ended (a zombie met nothing)
            busy = self._held_executions()
            if not busy:
                return None
        self._busy = busy
        fault: Fault | None = getattr(self, f"_fault_{kind}")()
        return fault

    def _to_the_fence(self) -> bool:
        """Whether a woken process is running on to the fence now. One a failpoint stopped
        again is frozen and one that ended goes nowhere: on threads the first worker's one
        process stops at each point in turn and is killed whole, so it stood woken, stopped
        again or dead through the whole window after its first wake, and a Postgres crash or
        terminate waiting for none to be on its way was never injected (CI: 4 runs of 4). A
        partition cuts only its target, never a worker holding a woken process (not up)."""
        return any(pid not in self._stopped and _alive(pid) for pid in self._completing)

    def _up(self) -> list[ManagedProcess]:
        """The workers that can take work now: not taken out by a fault (``_taken_out``) nor
        stopped by a failpoint."""
        return [
            w
            for w in self.workers
            if not self._taken_out(w)
            and not self._has_stopped(w)
            # stopped by a failpoint and not yet seen by the supervisor (it looks every 0.3
            # s): a zombie froze a worker 0.2 s after its child stopped, and its wake ended
            # the stop's wait for the revocation (CI: no revoked execution met the fence)
            and not any(_is_stopped(pid) for pid in [w.pid, *w.children()])
        ]

    def _taken_out(self, w: ManagedProcess) -> bool:
        """Whether a fault has ``w`` out of the fleet now: frozen, cut off, or killed and not
        yet ready again."""
        if not w.alive() or w.name in self._paused or self._cut(w):
            return True
        if self._ready.get(w.name) != w.restarts:
            if READY_MARKERS[w.kind] not in w.log_text():
                return True  # restarting: it holds nothing yet
            self._ready[w.name] = w.restarts
            if w.name in self._restarted:
                since = time.time() - self._restarted[w.name]
                self.progress(f"{w.name} ready {since:.1f} s after its restart {w.restarts}")
        return False

    def _held_executions(
        self, workers: list[ManagedProcess] | None = None
    ) -> dict[int, str] | None:
        """The processes of ``workers`` (None: those up now) that hold a claimed execution not
        yet ended, by the ledger (``executions.worker_id`` ends with the pid): pid -> worker."""
        # a pool child a failpoint killed is listed until its parent reaps it, its execution
        # still running by the ledger: a zombie froze a worker whose only "busy" children had
        # died, and met nothing (prefork, load 12)
        fleet = self._up() if workers is None else workers
        pids = {pid: w.name for w in fleet for pid in [w.pid, *w.children()] if _alive(pid)}
        if not pids:
            return {}
        if self._probe is None:
            self._probe = create_engine(self.db_url, pool_size=1, max_overflow=0)
        try:
            with self._probe.connect() as conn:
                held = conn.execute(
                    sa.text(
                        "SELECT worker_id FROM executions WHERE scope = :s AND status = 'running'"
                    ),
                    {"s": self.scope},
                ).scalars()
                found = [_pid_of(worker_id) for worker_id in held]
        except sa.exc.SQLAlchemyError:
            return {}  # the server is down or cut: nothing is known to be in flight
        return {pid: pids[pid] for pid in found if pid in pids}

    def submitted(self) -> int:
        """How many jobs the agent has submitted so far (for the progress line)."""
        return len(self._lines("submitted.log"))

    def _pick(self, kind: str) -> ManagedProcess | None:
        """A worker for a kill, a freeze or a cut: one that is up and holds an execution in
        flight by the ledger (``_busy``, read when the fault was due). A worker frozen, cut
        off, stopped or restarting claims nothing, and a fault on it met nothing: CI's three
        kills of each kind met none, and a partition and a freeze struck one worker at once.
        None for a kind that takes its worker out if that would leave none up: a failpoint
        killed the first worker between ``_try_fault``'s count and the pick, and a zombie froze
        the last one up beside another frozen (no worker up for 10 s; kill_main and
        partition then gave up)."""
        up = self._up()
        if kind in DISABLES and len(up) < min(2, len(self.workers)):
            return None
        if self._busy is not None:
            up = [w for w in up if w.name in self._busy.values()]
        return self.rng.choice(up) if up else None

    def _fault_kill_main(self) -> Fault | None:
        w = self._pick("kill_main")
        if w is None:
            return None
        pids = [w.pid, *w.children()]
        w.signal(signal.SIGKILL)  # the main process only; the supervisor restarts the worker
        return Fault(0, "kill_main", w.name, pids)

    def _fault_kill_child(self) -> Fault | None:
        w = self._pick("kill_child")
        children = w.children() if w else []
        if self._busy is not None:
            children = [c for c in children if c in self._busy]
        if not w or not children:
            return None
        child = self.rng.choice(children)  # a child holding an execution in flight
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            return None  # gone already: nothing was injected (it was counted)
        return Fault(0, "kill_child", w.name, [child])

    def _fault_zombie(self) -> Fault | None:
        w = self._pick("zombie")
        if w is None:
            return None
        pids = [w.pid, *w.children()]
        self._paused.add(w.name)
        w.signal(signal.SIGSTOP, group=True)
        if self._busy is not None and not self._held_executions([w]):
            # frozen, it holds nothing in flight by the ledger: its execution ended, or its
            # child died, since the read a moment ago (prefork at load 20: a child killed by a
            # failpoint 0.2 s before the freeze, the zombie met nothing). Thawed at once, it
            # waits on, as a scheduler's hiccup would have held it
            w.signal(signal.SIGCONT, group=True)
            self._paused.discard(w.name)
            return None
        # past its lease, and long enough for the sweep to revoke it and for the operator
        # or a later writer to act before it wakes: what a zombie could then land would show
        frozen = self.cfg.lease_seconds + FREEZE_PAST_LEASE

        def wake() -> None:
            w.signal(signal.SIGCONT, group=True)
            self._paused.discard(w.name)

        self._later(frozen, wake)
        return Fault(0, "zombie", w.name, pids, {"frozen_s": frozen})

    def _fault_partition(self) -> Fault | None:
        """One worker cut off from Postgres (packets vanish) past its lease, then healed."""
        w = self._pick("partition")  # up: neither cut already, frozen, stopped nor restarting
        if w is None:
            return None
        part = self.partitions[w.name]
        part.cut()
        part.is_cut = True  # type: ignore[attr-defined]
        held = self.cfg.lease_seconds + FREEZE_PAST_LEASE

        def heal() -> None:
            with contextlib.suppress(Exception):
                part.heal()
            part.is_cut = False  # type: ignore[attr-defined]

        self._later(held, heal)
        return Fault(0, "partition", w.name, [w.pid, *w.children()], {"cut_s": held})

    def _later(self, seconds: float, heal: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, heal)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _fault_pg_crash(self) -> Fault | None:
        """SIGKILL the postmaster; start it again (crash recovery) a few seconds later."""
        if self.cluster is None:
            return None
        t = time.time()
        pid = self.cluster.crash()
        if pid is None:  # no postmaster to kill (down already): a fault that did nothing is
            self.cluster.start()  # none, and would explain unknowns it did not cause
            return None
        down = self.rng.uniform(1.0, 3.0)
        time.sleep(down)
        self.cluster.start()
        return Fault(t, "pg_crash", "postgres", [pid], {"down_s": round(down, 2)})

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
        if not deleted:  # an idle queue has no key: a flush of nothing did nothing (the
            return None  # fault log counts only faults that did something: helper-96)
        return Fault(0, "redis_flush", "redis", [], {"keys_deleted": deleted})

    def _fault_pg_terminate(self) -> Fault | None:
        try:
            with self.admin.connect() as conn:
                n = conn.execute(
                    sa.text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = :db AND pid <> pg_backend_pid()"
                    ),
                    {"db": self.db_name},
                ).scalar_one()
        except sa.exc.SQLAlchemyError:
            return None  # the server is down (a crash in progress)
        if not n:
            return None  # nobody connected: nothing was injected (it was counted)
        return Fault(0, "pg_terminate", "postgres", [], {"backends": n})

    def _fault_duplicate(self) -> Fault | None:
        """Five messages published again, as a duplicating broker or a retrying producer."""
        from celery import Celery

        picked = self.rng.sample(self.workload.jobs, min(5, len(self.workload.jobs)))
        app = Celery("chaos", broker=self.cfg.broker, set_as_current=False)
        app.conf.broker_transport_options = {"global_keyprefix": self.prefix}
        sent = []
        try:
            for job in picked:
                with contextlib.suppress(Exception):  # the broker may be mid-flush
                    app.send_task("toolledger.execute", args=(self.scope, job.key, 1),
                                  queue="toolledger")  # fmt: skip
                    sent.append(job.key)
        finally:
            app.close()
        if not sent:
            return None  # nothing published: nothing was injected (it was counted)
        return Fault(0, "duplicate", "broker", [], {"keys": sent})

    def _heal_all(self, *, stopped_too: bool = True) -> None:
        for part in self.partitions.values():
            with contextlib.suppress(Exception):
                part.heal()
        for w in self.workers:
            if stopped_too or not self._has_stopped(w):
                w.signal(signal.SIGCONT, group=True)
        self._paused.clear()
        if self.cluster is not None and self.cluster.postmaster_pid() is None:
            self.cluster.start()

    # ------------------------------------------------------------------ the end

    def _lines(self, name: str) -> list[dict[str, Any]]:
        return jsonlines.read(self.out / name)

    def _open_calls(self) -> int:
        """Calls not ended (approved, running, pending): read with plain SQL, which works on
        the schema of any version under test."""
        with create_engine(self.db_url, pool_size=1).connect() as conn:
            return int(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM operations WHERE scope = :s AND status IN "
                        "('approved', 'running', 'pending_approval')"
                    ),
                    {"s": self.scope},
                ).scalar_one()
            )

    def _wait_quiet(self, stall: float) -> float:
        """Until every call ended and the operator found nothing more to do; gives up (-1)
        only when nothing has moved for ``stall`` seconds — a backlog is worked off, however
        long it took the faults to build it."""
        (self.out / "finish").write_text("finish")
        started = last_move = time.time()
        last_open = -1
        while time.time() - last_move < stall:
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                open_calls = self._open_calls()
                woken = not (self._stopped or self._held_parents or self._completing)
                if (self.out / "operator.done").exists() and open_calls == 0 and woken:
                    return round(time.time() - started, 1)
                if open_calls != last_open:
                    last_open, last_move = open_calls, time.time()
                    self.progress(f"{open_calls} calls in flight")
            time.sleep(2.0)
        return -1.0

    def _final_sweep(self) -> dict[str, Any]:
        # exit 1: the pass reported errors, which its JSON lists for the checker
        out = self._cli("sweep", "--grace", "0", "--requeue-after", "3600", "--json", ok=(0, 1))
        return json.loads(out)  # type: ignore[no-any-return]

    def teardown(self) -> None:
        for part in self.partitions.values():
            part.close()
        if self.downstream is not None:
            self.downstream.kill()
            self.downstream.wait(10)
        with contextlib.suppress(Exception):
            if self._probe is not None:
                self._probe.dispose()
            self.admin.dispose()
            if not self.cfg.keep_db:
                scratch.drop_database(self.db_server, self.db_name)
        if self.cluster is not None:
            with contextlib.suppress(OSError):
                shutil.copy(self.cluster.root / "postgres.log", self.out / "logs")
            if not self.cfg.keep_db:
                self.cluster.destroy()
                shutil.rmtree(self.cluster.root, ignore_errors=True)
        self.forget_broker_keys()

    def forget_broker_keys(self) -> None:
        """Delete every Redis key under this run's prefix."""
        import redis

        client = redis.Redis.from_url(self.cfg.broker)
        keys = list(client.scan_iter(match=f"{self.prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def _pid_of(worker_id: str | None) -> int | None:
    """The pid an execution's ``worker_id`` (``host:pid``) names."""
    try:
        return int((worker_id or "").rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` is still running (a zombie not yet reaped has ended)."""
    return process_state(pid) not in (None, psutil.STATUS_ZOMBIE)


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (``T`` in /proc; a zombie reads ``Z``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"
