"""The folder index (toolledger.folders) answers what a fresh listing would, on a real
filesystem with real inotify: after any sequence of names made, removed and moved, by this
process or another; after its queue overflowed; across a fork; and it steps aside where it
cannot vouch (a filesystem it does not watch, a failure), leaving the alias check to a listing."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolledger import folders
from toolledger.folders import FolderNames, fold
from toolledger.sandbox import AliasRefused, refuse_alias

if not sys.platform.startswith("linux"):
    pytest.skip("inotify is Linux's", allow_module_level=True)

NAMES = ["a", "A", "b", "B.txt", "b.TXT", "Straße", "STRASSE", "e\u0301", "\u00e9", "K", "\u212a"]


def expected(folder: Path, name: str) -> list[str]:
    """What a fresh listing says: the other names that fold like ``name``."""
    return sorted(n for n in os.listdir(folder) if n != name and fold(n) == fold(name))


@pytest.fixture
def index():
    found = FolderNames()
    yield found
    found.close()


@pytest.fixture
def fresh_module_index(monkeypatch):
    """The module's per-process index, fresh for the test and forgotten after it."""
    monkeypatch.setattr(folders, "_index", None)
    monkeypatch.setattr(folders, "_disabled", False)
    yield
    if folders._index is not None:
        folders._index.close()


class _Folder:
    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)

    def close(self) -> None:
        os.close(self.fd)


operation = st.one_of(
    st.tuples(st.just("file"), st.sampled_from(NAMES)),
    st.tuples(st.just("dir"), st.sampled_from(NAMES)),
    st.tuples(st.just("remove"), st.sampled_from(NAMES)),
    st.tuples(st.just("rename"), st.sampled_from(NAMES), st.sampled_from(NAMES)),
    st.tuples(st.just("out"), st.sampled_from(NAMES)),
    st.tuples(st.just("in"), st.sampled_from(NAMES)),
    st.tuples(st.just("link"), st.sampled_from(NAMES), st.sampled_from(NAMES)),
    st.tuples(st.just("exchange"), st.sampled_from(NAMES), st.sampled_from(NAMES)),
    st.tuples(st.just("exchange_out"), st.sampled_from(NAMES)),
)

_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> None:
    """renameat2(RENAME_EXCHANGE): the two names stay, their files swap."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    at_fdcwd = -100
    if libc.renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _do(op: tuple, here: Path, elsewhere: Path) -> None:
    kind, name, *rest = op
    target = here / name
    try:
        if kind == "file":
            target.touch()
        elif kind == "dir":
            target.mkdir()
        elif kind == "remove":
            target.rmdir() if target.is_dir() else target.unlink()
        elif kind == "rename":
            os.rename(target, here / rest[0])
        elif kind == "out":
            os.rename(target, elsewhere / f"{name}-{os.urandom(4).hex()}")
        elif kind == "in":
            moved = elsewhere / f"in-{os.urandom(4).hex()}"
            moved.touch()
            os.rename(moved, target)
        elif kind == "link":
            os.link(target, here / rest[0])
        elif kind == "exchange":
            exchange(target, here / rest[0])
        elif kind == "exchange_out":
            other = elsewhere / f"x-{os.urandom(4).hex()}"
            other.touch()
            exchange(target, other)
    except OSError:
        pass  # absent, exists, a directory in the way: the folder is what it is


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=st.lists(operation, max_size=25), query=st.sampled_from(NAMES))
def test_folders__answers_what_a_fresh_listing_says_after_any_changes(
    ops, query, index, tmp_path_factory
):
    root = tmp_path_factory.mktemp("f")
    here, elsewhere = _Folder(root / "here"), _Folder(root / "elsewhere")
    listed = index.listed  # the index lives across examples
    try:
        assert index.siblings(here.fd, query) == expected(here.path, query)  # watched now
        for op in ops:
            _do(op, here.path, elsewhere.path)
            for name in (query, op[1]):
                assert index.siblings(here.fd, name) == expected(here.path, name), (op, name)
        assert index.listed == listed + 1  # listed once: the events kept it current
    finally:
        here.close()
        elsewhere.close()


def test_folders__sees_names_another_process_made(index, tmp_path):
    here = _Folder(tmp_path / "here")
    assert index.siblings(here.fd, "readme") == []
    subprocess.run(["touch", str(here.path / "README")], check=True)
    assert index.siblings(here.fd, "readme") == ["README"]
    subprocess.run(["rm", str(here.path / "README")], check=True)
    assert index.siblings(here.fd, "readme") == []
    here.close()


def test_folders__a_lost_queue_lists_every_folder_again(index, tmp_path):
    """Past max_queued_events the kernel drops events and says so (IN_Q_OVERFLOW): the index
    cannot know what it missed, so it lists again."""
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    if limit > 50_000:
        pytest.skip(f"max_queued_events is {limit}: too many files to overflow it here")
    here = _Folder(tmp_path / "here")
    assert index.siblings(here.fd, "x") == []
    for i in range(limit + 10):
        (here.path / f"n{i}").touch()
    (here.path / "X").touch()  # made after the overflow: in no event the index read
    assert index.siblings(here.fd, "x") == ["X"]
    assert index.listed == 2
    here.close()


def test_folders__a_folder_removed_and_made_again_is_listed_again(index, tmp_path):
    here = _Folder(tmp_path / "here")
    (here.path / "Old").touch()
    assert index.siblings(here.fd, "old") == ["Old"]
    here.close()
    (here.path / "Old").unlink()
    here.path.rmdir()
    again = _Folder(tmp_path / "here")
    (again.path / "NEW").touch()
    assert index.siblings(again.fd, "old") == []
    assert index.siblings(again.fd, "new") == ["NEW"]
    again.close()


def test_folders__beyond_its_size_the_oldest_folder_is_dropped_and_listed_again(
    index, tmp_path, monkeypatch
):
    monkeypatch.setattr(folders, "MAX_FOLDERS", 2)
    three = [_Folder(tmp_path / f"d{i}") for i in range(3)]
    for f in three:
        assert index.siblings(f.fd, "a") == []
    (three[0].path / "A").touch()  # d0 was dropped: no watch saw this
    assert index.siblings(three[0].fd, "a") == ["A"]
    assert index.listed == 4
    for f in three:
        f.close()


def test_folders__a_filesystem_it_does_not_watch_is_left_to_a_listing(
    tmp_path, monkeypatch, fresh_module_index
):
    """An NFS or FUSE folder can change on another machine, behind inotify's back: None, and
    refuse_alias lists the folder as before (it still refuses)."""
    monkeypatch.setattr(folders, "LOCAL_FILESYSTEMS", frozenset())
    here = _Folder(tmp_path / "here")
    (here.path / "Name").touch()
    assert folders.siblings(here.fd, "name") is None
    with pytest.raises(AliasRefused, match="'Name'"):
        refuse_alias(here.fd, "name", "path 'name'")
    here.close()


def test_folders__a_failing_index_gives_way_to_listing_for_good(
    tmp_path, monkeypatch, fresh_module_index
):
    here = _Folder(tmp_path / "here")
    (here.path / "Name").touch()

    def broken(self, parent, name):
        raise RuntimeError("lost track")

    monkeypatch.setattr(FolderNames, "siblings", broken)
    with pytest.raises(AliasRefused, match="'Name'"):
        refuse_alias(here.fd, "name", "path 'name'")
    assert folders._disabled and folders.index() is None
    here.close()


def _child_sees(fd: int, path: str, queue) -> None:
    try:
        mine = folders.index()
        before = folders.siblings(fd, "child")
        Path(path, "CHILD").touch()
        after = folders.siblings(fd, "child")
        queue.put((mine is not None and mine.pid == os.getpid(), before, after))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put(repr(exc))


def test_folders__a_forked_child_keeps_an_index_of_its_own(tmp_path, fresh_module_index):
    """Prefork: the child must not read (and so steal) the parent's events."""
    here = _Folder(tmp_path / "here")
    parent = folders.index()
    assert parent is not None
    assert folders.siblings(here.fd, "child") == []
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_sees, args=(here.fd, str(here.path), queue))
    child.start()
    child.join(30)
    assert queue.get(timeout=5) == (True, [], ["CHILD"])
    assert folders.index() is parent
    assert folders.siblings(here.fd, "child") == ["CHILD"]  # the parent's events are intact
    here.close()


def test_folders__names_beyond_the_budget_are_not_kept(index, tmp_path, monkeypatch):
    """A folder larger than MAX_NAMES is answered from a listing at every check, as before; and
    folders whose names together pass it are dropped, oldest first, as they grow."""
    monkeypatch.setattr(folders, "MAX_NAMES", 5)
    big = _Folder(tmp_path / "big")
    for i in range(8):
        (big.path / f"n{i}").touch()
    assert index.siblings(big.fd, "N3") == ["n3"]
    (big.path / "N7").touch()  # not watched: the next check lists again and sees it
    assert index.siblings(big.fd, "n7") == ["N7"]
    assert index.listed == 2 and index.names == 0
    small = [_Folder(tmp_path / f"s{i}") for i in range(2)]
    for f in small:
        (f.path / "a").touch()
        (f.path / "b").touch()
        assert index.siblings(f.fd, "A") == ["a"]
    assert index.names == 4
    for name in ("c", "d"):  # s1 grows past the budget: s0, the older, is dropped
        (small[1].path / name).touch()
    assert index.siblings(small[1].fd, "C") == ["c"]
    assert index.names == 4 and index.listed == 4
    (small[0].path / "B").touch()
    assert index.siblings(small[0].fd, "b") == ["B"]  # listed again: it was dropped
    for f in (big, *small):
        f.close()


@pytest.mark.parametrize("across", [False, True])
def test_folders__an_exchange_leaves_both_names_in_place(index, tmp_path, across):
    """RENAME_EXCHANGE reports each name moved away and the other moved in: in the folder of
    the second name, its removal comes last, though the name stays."""
    here = _Folder(tmp_path / "here")
    there = _Folder(tmp_path / "there") if across else here
    (here.path / "one").touch()
    (there.path / "Two").touch()
    assert index.siblings(here.fd, "ONE") == ["one"]
    assert index.siblings(there.fd, "two") == ["Two"]
    exchange(here.path / "one", there.path / "Two")
    assert index.siblings(here.fd, "ONE") == ["one"]
    assert index.siblings(there.fd, "two") == ["Two"]
    here.close()
    if across:
        there.close()


def test_folders__each_folder_s_filesystem_is_asked_not_its_device_number(index, tmp_path):
    """A device number freed by an unmount goes to the next mount, which may be an overlay or
    FUSE: whether a folder is watched is asked of its own filesystem, folder by folder."""
    first, second = _Folder(tmp_path / "first"), _Folder(tmp_path / "second")
    assert os.fstat(first.fd).st_dev == os.fstat(second.fd).st_dev
    assert index.siblings(first.fd, "a") == []
    index._libc.fs_type = lambda fd: 0x794C7630  # overlayfs, now on the same device number
    assert index.siblings(second.fd, "a") is None
    first.close()
    second.close()


class _Interrupt(BaseException):
    pass


@contextlib.contextmanager
def _fold_raises(monkeypatch, exc: type[BaseException]):
    """Within: folding a name raises ``exc`` (raised into the index while it applies events),
    which the block must let out; after: folding works again."""
    real = folders.fold

    def raising(name: str) -> str:
        raise exc()

    monkeypatch.setattr(folders, "fold", raising)
    with pytest.raises(exc):
        yield
    monkeypatch.setattr(folders, "fold", real)


def test_folders__events_lost_to_an_interrupt_are_listed_again(index, tmp_path, monkeypatch):
    """Events read from the kernel are gone from its queue: an interrupt while applying them
    (a KeyboardInterrupt, a timeout raised into the thread) must not leave the index short."""
    here = _Folder(tmp_path / "here")
    assert index.siblings(here.fd, "b") == []
    (here.path / "B").touch()
    with _fold_raises(monkeypatch, _Interrupt):
        index.siblings(here.fd, "b")
    assert index.siblings(here.fd, "b") == ["B"]
    here.close()


class _SoftTimeLimit(Exception):  # named as Celery names its own
    pass


def test_folders__the_caller_s_exceptions_go_on_and_leave_the_index_on(
    tmp_path, monkeypatch, fresh_module_index
):
    """Celery's SoftTimeLimitExceeded is an Exception raised into the task wherever it runs:
    swallowed here, the task would run on past its limit."""
    here = _Folder(tmp_path / "here")
    assert folders.siblings(here.fd, "x") == []
    (here.path / "X").touch()
    with _fold_raises(monkeypatch, _SoftTimeLimit):
        folders.siblings(here.fd, "x")
    assert not folders._disabled
    assert folders.siblings(here.fd, "x") == ["X"]
    here.close()


def test_folders__a_closed_index_reads_nothing(index, tmp_path):
    """Closed (after a failure, by another thread): its fd number may belong to a file by now,
    whose bytes must never be read as events."""
    here = _Folder(tmp_path / "here")
    assert index.siblings(here.fd, "a") == []
    index.close()
    assert index.siblings(here.fd, "a") is None
    here.close()


def test_folders__a_descriptor_that_reads_as_a_file_is_an_error_not_a_loop(index, tmp_path):
    here = _Folder(tmp_path / "here")
    empty = tmp_path / "empty"
    empty.touch()
    inotify_fd, index.fd = index.fd, os.open(empty, os.O_RDONLY)
    with pytest.raises(OSError, match="read as a file"):
        index.siblings(here.fd, "a")
    os.close(index.fd)
    index.fd = inotify_fd
    here.close()
