"""The writers' queue (ledger.writers): a turn holds the queue file's lock against every other
thread and process, is counted when taken again, is not shared with a forked child, and both
of the ledger's write paths on SQLite take it; where it cannot be had, writing goes on."""

from __future__ import annotations

import fcntl
import gc
import os
import signal
import threading
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


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "ledger.db"


def test_turn__holds_the_queue_files_lock_for_the_body_only(database: Path) -> None:
    assert not _locked(database)
    with writers.turn(str(database)):
        assert _locked(database)
    assert not _locked(database)
    assert Path(writers.queue_file(str(database))).exists()


def test_turn__taken_again_inside_itself_is_counted_not_let_go_early(database: Path) -> None:
    with writers.turn(str(database)):
        with writers.turn(str(database)):
            assert _locked(database)
        assert _locked(database)  # the inner turn's end is not the outer's
    assert not _locked(database)


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
        ("sqlite:///some/ledger.db", "some/ledger.db"),
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
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):  # threads that come and go, one per request
        thread = threading.Thread(target=write)
        thread.start()
        thread.join()
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
