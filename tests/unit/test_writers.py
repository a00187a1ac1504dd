"""The writers' queue (ledger.writers): a turn holds the queue file's lock against every other
thread and process, is counted when taken again (ended in any order), is not shared with a
forked child (nor kept by one past its parent), is let go when a signal handler raises, names
one queue for every spelling of a file, keeps few files open, bounds a writer's wait by the
busy timeout even behind a writer that is not toolledger's, and both of the ledger's write
paths on SQLite take it; where it cannot be had, writing goes on. Each in both ways of
waiting (test_writers_bounded.py: what differs between them)."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from toolledger.ledger import db, writers
from toolledger.ledger.ledger import Ledger


def _locked(database: Path) -> bool:
    """Whether somebody holds the queue file's lock (asked through an open file of our own)."""
    fd = os.open(writers.queue_file(str(database)), os.O_RDONLY | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing lets go of a lock we took
    return False


@pytest.fixture(autouse=True, params=["bounded", "blocking"])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test in both of the queue's ways of waiting: at most the busy timeout (every
    process's default), and as long as it takes (the worker's)."""
    before = writers.blocking()
    writers.set_blocking(request.param == "blocking")
    yield request.param
    writers.set_blocking(before)


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "ledger.db"


def test_turn__holds_the_queue_files_lock_for_the_body_only(database: Path) -> None:
    queue = Path(writers.queue_file(str(database)))
    assert not queue.exists()
    with writers.turn(str(database)):
        assert queue.exists()  # made by the turn (``_locked`` would make it too)
        assert _locked(database)
    assert not _locked(database)


def test_turn__taken_again_inside_itself_is_counted_not_let_go_early(database: Path) -> None:
    with writers.turn(str(database)):
        with writers.turn(str(database)):
            assert _locked(database)
        assert _locked(database)  # the inner turn's end is not the outer's
        with writers.turn(str(database)), writers.turn(str(database)):
            pass
        assert _locked(database)  # nor are two more inner ones
    assert not _locked(database)


def test_turn__ended_out_of_order_is_let_go_by_the_last_to_end(database: Path) -> None:
    """Two turns on one thread that end out of order (generators, tasks interleaved): the
    lock goes when the last one ends, and the next turn takes it again."""
    outer, inner = writers.turn(str(database)), writers.turn(str(database))
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert _locked(database)  # the inner one is still in its turn
    inner.__exit__(None, None, None)
    assert not _locked(database)
    with writers.turn(str(database)):
        assert _locked(database)


def test_turn__a_signal_handler_raising_as_the_lock_comes_leaves_it_free(
    database: Path,
) -> None:
    """An exception from a signal handler as ``flock`` returns (a shutdown, a timeout) must
    not leave the turn held: every writer of every process would then wait for good."""

    class Stop(Exception):
        pass

    def handler(*_: object) -> None:
        raise Stop

    holding = threading.Event()

    def holder() -> None:
        with writers.turn(str(database)):
            holding.set()
            time.sleep(0.3)  # the main thread is waiting in flock by now
            # to this thread, so flock is not interrupted: the handler runs in the main
            # thread as soon as flock returns there, as this turn ends
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        thread = threading.Thread(target=holder)
        thread.start()
        holding.wait(10)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # delivered to the holder
        try:
            with pytest.raises(Stop), writers.turn(str(database)):
                pass
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        thread.join(10)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not _locked(database)
    with writers.turn(str(database)):
        assert _locked(database)


def test_turn__another_thread_waits_until_the_holder_lets_go(database: Path) -> None:
    entered = threading.Event()

    def other() -> None:
        with writers.turn(str(database)):
            entered.set()

    with writers.turn(str(database)):
        thread = threading.Thread(target=other)
        thread.start()
        assert not entered.wait(0.5)  # its own open file: it queues like another process
    assert entered.wait(10)
    thread.join(10)


def test_turn__a_forked_child_queues_behind_its_parent(database: Path) -> None:
    """The child inherits the parent's open file, and with it the parent's lock, unless it
    forgets it at fork: then it would enter at once, as a nested turn does."""
    with writers.turn(str(database)):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit code
            code = 1
            try:
                signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError()))
                signal.alarm(1)
                with writers.turn(str(database)):
                    code = 1  # entered while the parent holds the turn
            except TimeoutError:
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _queue_fds(database: Path) -> list[str]:
    queue = os.path.realpath(writers.queue_file(str(database)))
    return [
        fd for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == queue
    ]


def _a_child_has_no_queue_file(database: Path) -> bool:
    """Fork now: whether the child, once the fork hooks have run, holds no queue file."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        os._exit(0 if not _queue_fds(database) else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("contended", [False, True])
def test_turn__a_forked_child_keeps_no_copy_of_another_threads_turn(
    database: Path, contended: bool
) -> None:
    """A copy in the child of the file another thread holds its turn with would keep the
    lock past the parent's death, as long as the child lives. Contended, the turn comes
    (bounded) through a waiting thread's own file."""
    inside, leave = threading.Event(), threading.Event()

    def writer() -> None:
        with writers.turn(str(database)):
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=writer)
    with writers.turn(str(database)) if contended else contextlib.nullcontext():
        thread.start()
        time.sleep(0.2 if contended else 0)  # the writer is waiting for its turn
    try:
        assert inside.wait(10)
        assert _a_child_has_no_queue_file(database)
    finally:
        leave.set()
        thread.join(10)
    assert not _locked(database)


def test_turn__a_child_forked_inside_a_turn_leaves_it_cleanly(database: Path) -> None:
    """The child closed its copy of the file at fork; leaving the turn it was forked in
    must not try to unlock a closed file, nor let go of the parent's lock."""
    held = writers.turn(str(database))
    held.__enter__()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit code
            code = 1
            try:
                held.__exit__(None, None, None)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert _locked(database)
    finally:
        held.__exit__(None, None, None)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not _locked(database)


def test_turn__every_spelling_of_a_file_shares_one_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative and absolute, through a symlink to the file or to its folder: one queue
    file. Two would lose the order, and make a write nested in another (two engines on one
    file) wait on its own thread's lock."""
    real = tmp_path / "data" / "ledger.db"
    real.parent.mkdir()
    real.touch()
    (tmp_path / "alias.db").symlink_to(real)
    (tmp_path / "linked").symlink_to(real.parent)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(writers, "_real_paths", {})  # relative ones resolved in another folder
    spellings = [
        f"sqlite:///{real}",
        "sqlite:///data/ledger.db",
        "sqlite:///data/../data/ledger.db",
        f"sqlite:///{tmp_path}/alias.db",
        "sqlite:///linked/ledger.db",
    ]
    files = {writers.database_file(sa.make_url(url)) for url in spellings}
    assert files == {str(real.resolve())}


def test_turn__a_thread_keeps_few_open_files_however_many_databases_it_writes(
    tmp_path: Path,
) -> None:
    def count() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = count()
    for i in range(writers.KEEP + 12):
        with writers.turn(str(tmp_path / f"ledger-{i}.db")):
            pass
    assert count() - before <= writers.KEEP
    with writers.turn(str(tmp_path / "ledger-0.db")):  # closed, opened again: still a queue
        assert _locked(tmp_path / "ledger-0.db")


@pytest.mark.parametrize("path", ["write_transaction", "fast store"])
def test_turn__writers_queued_behind_a_foreign_writer_give_up_after_one_timeout(
    path: str, database: Path
) -> None:
    """A writer that is not toolledger's (the ``sqlite3`` shell, a migration) holds SQLite's
    write lock, not the queue's: each queued writer must not spend a whole busy timeout in
    turn (the k-th would wait k timeouts, and a lease renewal past its lease)."""
    import sqlite3

    timeout, writers_n = 1.0, 4
    ledger = Ledger(f"sqlite:///{database}", timeout=timeout)
    ledger.upgrade()
    foreign = sqlite3.connect(database, isolation_level=None)
    foreign.execute("BEGIN IMMEDIATE")
    waits: list[float] = []

    def write() -> None:
        started = time.monotonic()
        with pytest.raises(sa.exc.OperationalError, match="database is locked"):
            if path == "write_transaction":
                with db.write_transaction(ledger.engine) as conn:
                    conn.exec_driver_sql("SELECT 1")
            else:
                ledger.store._transaction(lambda conn: True)  # type: ignore[attr-defined]
        waits.append(time.monotonic() - started)

    try:
        threads = [threading.Thread(target=write) for _ in range(writers_n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(waits) == writers_n
        # In turn, each after a whole timeout, they would wait 1, 2, 3, 4 s; each going around
        # the queue at its own patience but then with a whole busy timeout, 1, 2, 2, 2 s. The
        # median, not the slowest: a writer that reaches its turn late (a stalled thread on a
        # busy machine: 1.3, 1.3, 1.3, 2.3 s in one CI run) finds the queue given up on by
        # then and goes around it at once, with its whole timeout, as it should.
        assert statistics.median(waits) < 1.6 * timeout, waits
        assert max(waits) < 3 * timeout, waits
        foreign.execute("ROLLBACK")
        with ledger.engine.connect() as conn:  # the shortened timeout was put back
            raw = conn.connection.dbapi_connection
            assert raw is not None
            assert raw.execute("PRAGMA busy_timeout").fetchone()[0] == 1000
    finally:
        foreign.close()
        ledger.close()


def test_turn__without_a_queue_file_to_open_writing_goes_on(tmp_path: Path) -> None:
    nowhere = tmp_path / "absent" / "ledger.db"
    with writers.turn(str(nowhere)):
        pass
    with writers.turn(None):
        pass
    assert not nowhere.parent.exists()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sqlite:///some/ledger.db", os.path.realpath("some/ledger.db")),
        ("sqlite:///x.db?mode=memory&uri=true", None),
        ("sqlite://", None),
        ("sqlite:///:memory:", None),
        ("sqlite:///file:x?mode=memory&uri=true", None),
        ("sqlite:///file:/data/ledger.db?uri=true", None),
        ("postgresql+psycopg://localhost/test", None),
    ],
)
def test_database_file__names_a_file_only_where_there_is_one(
    url: str, expected: str | None
) -> None:
    assert writers.database_file(sa.make_url(url)) == expected


def test_both_write_paths_of_a_sqlite_ledger_write_in_turn(database: Path) -> None:
    ledger = Ledger(f"sqlite:///{database}")
    ledger.upgrade()
    try:
        with db.write_transaction(ledger.engine) as conn:
            conn.exec_driver_sql("SELECT 1")
            assert _locked(database)
        assert not _locked(database)
        seen: list[bool] = []

        def steps(conn: object) -> bool:
            seen.append(_locked(database))
            return True

        ledger.store._transaction(steps)  # type: ignore[attr-defined]
        assert seen == [True] and not _locked(database)
    finally:
        ledger.close()


def test_turn__a_thread_that_ends_leaves_no_open_file_behind(database: Path) -> None:
    def write() -> None:
        with writers.turn(str(database)):
            pass

    write()  # this thread's file, kept for its next turn
    before = _open_on(writers.queue_file(str(database)))
    for _ in range(20):  # threads that come and go, one per request
        thread = threading.Thread(target=write)
        thread.start()
        thread.join()
    gc.collect()
    assert _open_on(writers.queue_file(str(database))) == before == 1


def _open_on(path: str) -> int:
    """How many of this process's descriptors are open on ``path``. (Counting every one of
    them, the collector closing an earlier test's files meanwhile failed CI: 271 == 273.)"""
    target, count = os.path.realpath(path), 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}") == target
    return count
