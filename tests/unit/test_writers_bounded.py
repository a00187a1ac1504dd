"""A writer's wait for its turn in the writers' queue (ledger.writers) is bounded by its busy
timeout, in every process but the worker's: behind a process frozen (SIGSTOP) in its turn, it
goes around the queue after the timeout, and writes if SQLite's lock is free, or fails with
"database is locked" if the frozen process holds that too, as before the queue; the thread that
waited for it lets go of the lock once it comes. The worker waits as long as it takes. Turns
taken through waiting threads still exclude each other, and a forked child keeps none of them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa

from tests.unit.test_writers import _a_child_has_no_queue_file, _locked
from toolledger.ledger import db, writers
from toolledger.ledger.ledger import Ledger

TIMEOUT = 1.0

HOLDER = textwrap.dedent(
    """
    import os, signal, sqlite3, sys
    from toolledger.ledger import writers

    database, sqlite_too = sys.argv[1], sys.argv[2] == "1"
    with writers.turn(database):
        if sqlite_too:
            conn = sqlite3.connect(database, isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")
        print("held", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    """
)


_STOP = "os.kill(os.getpid(), signal.SIGSTOP)"
assert _STOP in HOLDER


@pytest.fixture(autouse=True)
def _mode() -> Iterator[None]:
    before = writers.blocking()
    writers.set_blocking(False)  # every process's default
    yield
    writers.set_blocking(before)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    ledger = Ledger(f"sqlite:///{tmp_path.resolve() / 'ledger.db'}", timeout=TIMEOUT)
    ledger.upgrade()
    yield ledger
    ledger.close()


def _database(ledger: Ledger) -> str:
    database = writers.database_file(ledger.engine.url)
    assert database is not None
    return database


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@contextlib.contextmanager
def frozen_holder(database: str, *, sqlite_too: bool) -> Iterator[subprocess.Popen[str]]:
    """Another process in its turn (and in SQLite's write lock too, if ``sqlite_too``),
    stopped there; killed at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, database, "1" if sqlite_too else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        deadline = time.monotonic() + 10
        while not _stopped(proc.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def _write(ledger: Ledger, path: str) -> None:
    if path == "write_transaction":
        with db.write_transaction(ledger.engine) as conn:
            conn.exec_driver_sql("SELECT 1")
    else:
        ledger.store._transaction(lambda conn: True)  # type: ignore[attr-defined]


class Writer(threading.Thread):
    """A write on a thread of its own: the test outlives a writer that hangs."""

    def __init__(self, ledger: Ledger, path: str) -> None:
        super().__init__(daemon=True)
        self.ledger, self.path = ledger, path
        self.error: BaseException | None = None
        self.took = -1.0

    def run(self) -> None:
        started = time.monotonic()
        try:
            _write(self.ledger, self.path)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
        self.took = time.monotonic() - started


def _waiting_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "toolledger-writers-turn"]


@pytest.mark.parametrize("path", ["write_transaction", "fast store"])
def test_behind_a_turn_frozen_outside_sqlites_lock_a_writer_writes_after_its_timeout(
    ledger: Ledger, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="toolledger.ledger")
    with frozen_holder(_database(ledger), sqlite_too=False):
        writer = Writer(ledger, path)
        writer.start()
        writer.join(10)
        assert not writer.is_alive(), "waited for a frozen turn without a timeout"
        assert writer.error is None
        assert TIMEOUT * 0.9 <= writer.took < TIMEOUT * 3
    assert "was held for 1.0 s (a writer frozen in its turn?)" in caplog.text


@pytest.mark.parametrize("path", ["write_transaction", "fast store"])
def test_behind_a_writer_frozen_inside_sqlites_lock_a_writer_fails_after_its_timeout(
    ledger: Ledger, path: str
) -> None:
    """As before the queue: one timeout, then "database is locked" (the queue's wait is
    taken off the busy timeout, so the two waits are not added up)."""
    with frozen_holder(_database(ledger), sqlite_too=True):
        writer = Writer(ledger, path)
        writer.start()
        writer.join(10)
        assert not writer.is_alive(), "waited for a frozen turn without a timeout"
        assert isinstance(writer.error, sa.exc.OperationalError)
        assert "database is locked" in str(writer.error)
        assert writer.took < TIMEOUT * 2
    with ledger.engine.connect() as conn:  # the shortened busy timeout was put back
        raw = conn.connection.dbapi_connection
        assert raw is not None
        assert raw.execute("PRAGMA busy_timeout").fetchone()[0] == TIMEOUT * 1000


def test_the_thread_that_waited_lets_go_once_the_turn_comes_after_its_writer_left(
    ledger: Ledger,
) -> None:
    database = _database(ledger)
    with frozen_holder(database, sqlite_too=False):
        _write(ledger, "write_transaction")  # went around the queue after the timeout
        assert _waiting_threads()  # still blocked in flock behind the frozen process
    # the frozen process is dead: its lock went, the waiting thread got it and let go
    deadline = time.monotonic() + 10
    while _waiting_threads() or _locked(Path(database)):
        assert time.monotonic() < deadline, "the lock that came too late was kept"
        time.sleep(0.01)
    _write(ledger, "fast store")  # and the queue works as before
    assert not _locked(Path(database))


@pytest.mark.parametrize("path", ["write_transaction", "fast store"])
def test_a_process_that_blocks_waits_for_a_frozen_turn_as_long_as_it_is_held(
    ledger: Ledger, path: str
) -> None:
    writers.set_blocking()
    with frozen_holder(_database(ledger), sqlite_too=False):
        writer = Writer(ledger, path)
        writer.start()
        writer.join(TIMEOUT * 2.5)
        assert writer.is_alive()  # no timeout: still in the queue
    writer.join(10)  # the holder died: the turn came
    assert not writer.is_alive() and writer.error is None


def test_the_worker_waits_for_its_turn_without_a_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery import signals

    from toolledger.config import Settings
    from toolledger.worker.app import create_app

    monkeypatch.setenv("TOOLLEDGER_METRICS", "off")  # worker_init would serve them here
    app = create_app(Settings.from_env({"TOOLLEDGER_HOME": str(tmp_path / "home")}))
    assert not writers.blocking()

    class Worker:  # what worker_init's handlers read of Celery's WorkController
        pool_cls = "threads"

    worker = Worker()
    worker.app = app  # type: ignore[attr-defined]
    signals.worker_init.send(sender=worker)
    assert writers.blocking()


def test_turns_taken_through_waiting_threads_exclude_each_other(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six threads contending: most turns come through a waiting thread's own file, and
    never two at once; the last one lets go."""
    monkeypatch.setattr(writers, "DEFAULT_PATIENCE_SECONDS", 2.0)  # a turn kept: seconds, not hours
    database = str(tmp_path / "ledger.db")
    inside, most, errors = [0], [0], []
    guard = threading.Lock()

    def write() -> None:
        try:
            for _ in range(30):
                with writers.turn(database):
                    with guard:
                        inside[0] += 1
                        most[0] = max(most[0], inside[0])
                    time.sleep(0.001)
                    with guard:
                        inside[0] -= 1
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    caplog.set_level(logging.WARNING, logger="toolledger.ledger")
    threads = [threading.Thread(target=write, daemon=True) for _ in range(6)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads)
    assert not errors and most[0] == 1
    assert "writing without it" not in caplog.text
    assert not _locked(Path(database))


def test_a_signal_handler_raising_as_the_waiting_thread_starts_abandons_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Thread.start`` waits for the thread to run; a handler raising there must leave the
    wait abandoned, or the lock, once it came, would be kept for a turn that has ended."""
    database = str(tmp_path / "ledger.db")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER.replace(_STOP, "sys.stdin.read()"), database, "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    start = threading.Thread.start

    def start_then_raise(self: threading.Thread) -> None:
        start(self)
        if self.name == "toolledger-writers-turn":
            raise KeyboardInterrupt  # what a handler raising in ``_started.wait()`` does

    monkeypatch.setattr(threading.Thread, "start", start_then_raise)
    try:
        with pytest.raises(KeyboardInterrupt), writers.turn(database):
            pass
    finally:
        monkeypatch.undo()
        holder.kill()
        holder.wait(10)
    deadline = time.monotonic() + 10  # the lock came to the waiting thread, which let go
    while _waiting_threads() or _locked(Path(database)):
        assert time.monotonic() < deadline, "a turn that ended kept the lock"
        time.sleep(0.01)


def test_a_child_forked_as_a_waited_turn_ends_keeps_no_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's fork can come between the end of a turn taken through a waiting
    thread's file and ``_every``'s knowing that file closed: the child's copy must not keep
    the lock (the turn lets go by unlocking, which holds for every copy, then closes)."""
    database = str(tmp_path / "ledger.db")
    other = os.open(writers.queue_file(database), os.O_RDONLY | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_EX)
    threading.Timer(0.2, fcntl.flock, (other, fcntl.LOCK_UN)).start()
    armed, children = [False], []

    class ForkingSuppress(contextlib.suppress):
        def __enter__(self) -> None:
            if armed[0]:
                armed[0] = False
                pid = os.fork()
                if pid == 0:  # pragma: no cover - a child that outlives the turn
                    time.sleep(3)
                    os._exit(0)
                children.append(pid)
            super().__enter__()

    monkeypatch.setattr(
        writers,
        "contextlib",
        SimpleNamespace(suppress=ForkingSuppress, contextmanager=contextlib.contextmanager),
    )
    try:
        with writers.turn(database):  # contended: through a waiting thread's file
            assert writers._held.files[database].via is not None
            armed[0] = True  # the fork comes as the turn lets go
        monkeypatch.undo()
        assert children
        started = time.monotonic()
        fcntl.flock(other, fcntl.LOCK_EX)  # the next writer's turn
        assert time.monotonic() - started < 1.0, "a child kept the ended turn's lock"
    finally:
        os.close(other)
        for pid in children:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def test_behind_a_frozen_turn_writers_leave_one_waiting_thread_not_one_per_write(
    tmp_path: Path,
) -> None:
    """Once a waiting thread has outwaited its writer, the next writers go around the queue at
    once (to SQLite's busy timeout): not a thread and a file left waiting per write for as long
    as the freeze lasts. When the frozen writer dies, the queue is used again."""
    import sqlite3

    database = str(tmp_path.resolve() / "ledger.db")
    conn = sqlite3.connect(database, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 50")
    conn.execute("CREATE TABLE t (x)")
    with frozen_holder(database, sqlite_too=False):
        fds = len(os.listdir("/proc/self/fd"))
        for i in range(40):
            with writers.turn(database, lambda: conn) as waited:
                with writers.within_budget(waited, lambda: conn):
                    conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT INTO t VALUES (?)", (i,))
                conn.execute("COMMIT")
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 40
        assert len(_waiting_threads()) == 1
        assert len(os.listdir("/proc/self/fd")) - fds <= 2  # the thread's own and the waiter's
    deadline = time.monotonic() + 10
    while _waiting_threads() or writers._stuck:
        assert time.monotonic() < deadline, "the frozen writer's death went unnoticed"
        time.sleep(0.01)
    conn.close()


def test_a_forked_child_does_not_think_the_queue_stuck(tmp_path: Path) -> None:
    """The parent's waiting threads do not exist in a child: it must wait in the queue anew,
    not go around it for good."""
    writers._stuck[str(tmp_path / "ledger.db")] = 1
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit code
            os._exit(0 if not writers._stuck else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        writers._stuck.clear()
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_fork_between_a_queue_files_opening_and_its_knowing_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread opens its queue file; another forks before the file is known to the set a
    child closes: the child would keep a copy (and, were the parent killed in a turn on it,
    the lock as long as it lives). The fork waits until the file is known."""
    database = tmp_path / "ledger.db"
    opened, go = threading.Event(), threading.Event()

    class Slow(writers._QueueFile):
        __slots__ = ()

        def __init__(self, fd: int) -> None:
            opened.set()
            go.wait(10)  # the file is open, not yet known
            super().__init__(fd)

    monkeypatch.setattr(writers, "_QueueFile", Slow)

    forked = threading.Event()

    def write() -> None:
        with writers.turn(str(database)):
            pass
        # the thread (and its open file) lives until the fork is done: a thread ending as
        # the child is forked may close its file between the two (a race ``close`` says is
        # harmless), which made this test fail now and then on a loaded machine
        forked.wait(10)

    thread = threading.Thread(target=write)
    thread.start()
    try:
        assert opened.wait(10)
        threading.Timer(0.3, go.set).start()  # the fork below comes first, then waits
        assert _a_child_has_no_queue_file(database)
    finally:
        forked.set()
        go.set()
        thread.join(10)
