"""A path's lock file need not live for ever (``Effects.sweep_locks``, ``sandbox upgrade``).

A sandbox kept a zero-byte lock file for every path ever landed on: an inode each, so one of
unique report names runs out of inodes long before bytes. Once the sandbox is at format 2
(``toolledger sandbox upgrade``, after every older process stopped), the sweep removes the
lock files no lander holds. The exclusion must hold across removals: a lander that locked a
file removed meanwhile locks again (``Effects._path_lock``). Before format 2 nothing is
removed, because an older version's lander does not look."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import select
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_cli
from toolledger import effects as effects_module
from toolledger.builtin_tools import BUILTINS
from toolledger.config import ConfigError, Settings
from toolledger.effects import PathBusy, effects_of, path_hash
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.recovery.sweep import sweep
from toolledger.sandbox import Sandbox
from toolledger.tools import Registry
from toolledger.worker.app import check_sandbox_format
from toolledger.worker.pipeline import Executor, LeaseKeeper

REGISTRY = Registry([t for t in BUILTINS if t.name in ("write_file", "append_file")])


def lock_files(sandbox: Sandbox) -> list[str]:
    paths = effects_of(sandbox).paths_dir
    return sorted(p.name for p in paths.glob("*/*.lock")) if paths.is_dir() else []


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path / "sandbox").prepare()


@pytest.fixture
def run(ledger: Ledger, scope: str, sandbox: Sandbox) -> Any:
    def _run(tool: str, args: dict[str, Any]) -> None:
        cid = f"c{time.monotonic_ns()}"
        ledger.submit(scope, cid, tool, args, approved_by="al")
        executor = Executor(
            ledger, REGISTRY, sandbox, worker_id="w", lease_seconds=30,
            leases=LeaseKeeper(ledger, 30),
        )  # fmt: skip
        outcome = executor.execute(scope, f"{tool}:{cid}", 1)
        assert outcome.state == "finished", outcome

    return _run


def a_pass(ledger: Ledger, sandbox: Sandbox) -> None:
    summary = sweep(ledger, REGISTRY, sandbox, grace_seconds=60, requeue_after=60, publish=None)
    assert not summary.errors, summary.errors


def test_locks__the_sweep_removes_landed_paths_lock_files_once_the_sandbox_is_upgraded(
    run, ledger, sandbox, scope
):
    for i in range(3):
        run("write_file", {"path": f"report-{i}.txt", "content": f"{i}"})
        run("append_file", {"path": "log.txt", "content": f"{i}\n"})
    landed = [f"{path_hash(scope, p)}.lock" for p in ("report-0.txt", "report-1.txt")]
    assert set(landed) <= set(lock_files(sandbox))
    a_pass(ledger, sandbox)
    assert len(lock_files(sandbox)) == 4  # format 1: an older lander may still come
    effects_of(sandbox).upgrade()
    a_pass(ledger, sandbox)
    assert lock_files(sandbox) == []
    # the paths are written again as before (their lock files made again, then removed)
    run("write_file", {"path": "report-0.txt", "content": "again"})
    run("append_file", {"path": "log.txt", "content": "3\n"})
    assert (sandbox.root / scope / "report-0.txt").read_text() == "again"
    assert (sandbox.root / scope / "log.txt").read_text() == "0\n1\n2\n3\n"
    a_pass(ledger, sandbox)
    assert lock_files(sandbox) == []


# ---------------------------------------------------------------------------- exclusion


def _land_often(root: str, h: str, rounds: int, inside: str, clashes: Any, removed: Any) -> None:
    """Take the path's lock ``rounds`` times, and on until the remover has removed its file
    more than 20 times (60 s at most: on a loaded machine 500 rounds saw it removed only 10
    times); count the times another holder was inside."""
    effects = effects_of(Sandbox(Path(root), lock_wait=60.0))
    deadline, n = time.monotonic() + 60, 0
    while n < rounds or (removed.value <= 20 and time.monotonic() < deadline):
        n += 1
        with effects._path_lock(h):
            try:
                fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                with clashes.get_lock():
                    clashes.value += 1
                continue
            os.close(fd)
            time.sleep(0)
            os.unlink(inside)


def _remove_often(root: str, stop: Any, removed: Any) -> None:
    effects = effects_of(Sandbox(Path(root)))
    while not stop.is_set():
        got = effects.sweep_locks(limit=None)
        with removed.get_lock():
            removed.value += got


def test_locks__no_two_landers_hold_a_path_while_the_sweep_removes_its_file(sandbox, tmp_path):
    effects_of(sandbox).upgrade()
    h = path_hash("s", "hot.txt")
    fork = multiprocessing.get_context("fork")
    clashes, removed, stop = fork.Value("i", 0), fork.Value("i", 0), fork.Event()
    inside = str(tmp_path / "inside")
    landers = [
        fork.Process(target=_land_often, args=(str(sandbox.root), h, 500, inside, clashes, removed))
        for _ in range(4)
    ]
    remover = fork.Process(target=_remove_often, args=(str(sandbox.root), stop, removed))
    remover.start()
    for p in landers:
        p.start()
    for p in landers:
        p.join(180)
    stop.set()
    remover.join(30)
    assert [p.exitcode for p in [*landers, remover]] == [0] * 5
    assert removed.value > 10, removed.value  # the file came and went under the landers
    assert clashes.value == 0


# ---------------------------------------------------------------------------- the sweep


def test_locks__sweep_locks_removes_only_free_lock_files_and_only_at_format_2(sandbox):
    effects = effects_of(sandbox)
    shard = effects.paths_dir / "ab"
    shard.mkdir(parents=True)
    free, held = "ab" + "0" * 30, "ab" + "1" * 30
    fifo, folder = "ab" + "2" * 30 + ".lock", "ab" + "3" * 30 + ".lock"
    for name in (f"{free}.lock", f"{held}.lock", "notes.txt"):
        (shard / name).touch()
    os.mkfifo(shard / fifo)  # not a file of ours: left alone
    (shard / folder).mkdir()
    assert effects.sweep_locks(limit=None) == 0  # format 1
    assert effects.state_format() == 1
    effects.upgrade()
    assert effects.state_format() == 2
    with effects._path_lock(held):  # a lander on that path now
        effects._next_shard = 0xAB
        assert effects.sweep_locks(limit=0) == 1  # one shard: this one
    assert effects._next_shard == 0xAC
    assert sorted(p.name for p in shard.iterdir()) == sorted(
        [f"{held}.lock", "notes.txt", fifo, folder]
    )
    assert effects.lock_file_count() == 1  # the held one (a FIFO or a folder is none)


def test_locks__a_pass_goes_on_from_where_the_last_stopped_and_over_every_shard(sandbox):
    effects = effects_of(sandbox)
    effects.upgrade()
    for shard in ("00", "7f", "ff"):
        (effects.paths_dir / shard).mkdir(parents=True)
        for i in range(3):
            (effects.paths_dir / shard / (shard + f"{i}" * 30 + ".lock")).touch()
    effects._next_shard = 0xFE
    assert effects.sweep_locks(limit=2) == 3  # fe (none), ff (3): past the limit, stop there
    assert effects._next_shard == 0x00
    assert effects.sweep_locks(limit=None) == 6
    assert lock_files(sandbox) == []


def test_locks__upgrade_never_takes_a_later_format_back(sandbox):
    later = "3\n# made by a later version\n"
    (sandbox.root / ".toolledger" / "format").write_text(later)
    effects_of(sandbox).upgrade()
    assert (sandbox.root / ".toolledger" / "format").read_text() == later


def test_locks__a_format_file_that_is_not_a_number_is_an_error_of_the_pass(
    ledger, sandbox, monkeypatch
):
    """Nothing is settled where the format cannot be read (helper-94: the pass settled
    first, and said so after)."""
    (sandbox.root / ".toolledger" / "format").write_text("two\n")
    settled: list[Any] = []
    monkeypatch.setattr(effects_module.Effects, "settle", lambda *a, **k: settled.append(a))
    summary = sweep(ledger, REGISTRY, sandbox, grace_seconds=60, requeue_after=60, publish=None)
    assert any("not a format number" in e for e in summary.errors)
    assert settled == []


# ---------------------------------------------------------------------------- the command


def test_locks__sandbox_upgrade_marks_the_format_and_removes_every_free_lock_file(capsys, sandbox):
    effects = effects_of(sandbox)
    hashes = [path_hash("s", f"f{i}") for i in range(300)]
    for h in hashes:
        with effects._path_lock(h):
            pass
    assert effects.lock_file_count() == 300
    argv = ["--sandbox", str(sandbox.root), "sandbox", "upgrade", "--json"]
    with effects_of(Sandbox(sandbox.root))._path_lock(hashes[7]):  # a lander holds one
        code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert json.loads(out) == {
        "sandbox": str(sandbox.root),
        "format": 2,
        "was": 1,
        "lock_files_removed": 299,
        "lock_files_left": 1,
        "left_as_is": False,
    }
    assert lock_files(sandbox) == [f"{hashes[7]}.lock"]
    assert (sandbox.root / ".toolledger" / "format").read_text().startswith("2\n")
    code, out, err = run_cli(capsys, *argv)  # again: nothing to do
    assert code == 0, err
    assert json.loads(out)["was"] == 2 and json.loads(out)["lock_files_removed"] == 1
    code, out, err = run_cli(capsys, *argv[:-2], "upgrade")
    assert code == 0 and "at format 2 (was 2)" in out and "256/256 shards" in err


def test_locks__sandbox_upgrade_of_a_missing_sandbox_is_refused_and_makes_nothing(capsys, tmp_path):
    missing = tmp_path / "nowhere"
    code, out, err = run_cli(capsys, "--sandbox", str(missing), "sandbox", "upgrade")
    assert code == 2 and out == ""
    assert err.strip() == f"toolledger: error: no sandbox at {missing} (a new one: --new makes it)"
    assert not missing.exists()


def test_locks__sandbox_upgrade_new_before_the_first_start_makes_the_folder(capsys, tmp_path):
    """README: ``--new`` runs "before every start": before the first, the folder may not exist
    (a worker makes it at its start); it was refused (exit 2, a deployment's first step
    failed)."""
    missing = tmp_path / "deep" / "sandbox"
    argv = ["--sandbox", str(missing), "sandbox", "upgrade", "--new", "--json"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert json.loads(out)["format"] == 2 and json.loads(out)["left_as_is"] is False
    assert (missing / ".toolledger" / "format").read_text().startswith("2\n")
    (tmp_path / "file").write_text("x")  # a file where the folder should be: refused
    code, out, err = run_cli(capsys, "--sandbox", str(tmp_path / "file"), *argv[2:])
    # refused by the settings now, before any command (a configuration error, exit 2 as ever)
    assert code == 2 and out == "" and "is not a directory" in err, err


def test_locks__sandbox_upgrade_of_a_folder_no_worker_used_needs_new(capsys, tmp_path):
    folder = tmp_path / "fresh"
    folder.mkdir()
    code, out, err = run_cli(capsys, "--sandbox", str(folder), "sandbox", "upgrade")
    assert code == 2 and out == "" and "--new to mark it anyway" in err
    assert list(folder.iterdir()) == []
    code, out, err = run_cli(capsys, "--sandbox", str(folder), "sandbox", "upgrade", "--new")
    assert code == 0, err
    assert (folder / ".toolledger" / "format").read_text().startswith("2\n")


def test_locks__sandbox_upgrade_new_leaves_a_used_folder_as_it_is(capsys, sandbox):
    # A deployment's first step (compose's sandbox-init runs it on every `up`): on a sandbox
    # already used, perhaps by an earlier version still running, it must change nothing.
    effects = effects_of(sandbox)
    with effects._path_lock(path_hash("s", "used.txt")):
        pass
    argv = ["--sandbox", str(sandbox.root), "sandbox", "upgrade", "--new"]
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    assert json.loads(out) == {
        "sandbox": str(sandbox.root),
        "format": 1,
        "was": 1,
        "lock_files_removed": 0,
        "lock_files_left": 1,
        "left_as_is": True,
    }
    assert effects.state_format() == 1 and effects.lock_file_count() == 1
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and "in use, at format 1: left as it is" in out
    assert "without --new" in out
    effects.upgrade()
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and out.strip().endswith("in use, at format 2: left as it is")
    assert effects.lock_file_count() == 1  # the sweep's to remove, not this command's


def test_locks__a_later_format_is_refused_by_the_sweep_the_worker_and_the_command(
    capsys, ledger, sandbox, scope
):
    (sandbox.root / ".toolledger" / "format").write_text("3\n")
    ledger.submit(scope, "c1", "write_file", {"path": "a", "content": "x"}, approved_by="al")
    claim = ledger.claim(scope, "write_file:c1", 1, worker_id="dead", lease_seconds=0.05)
    assert claim is not None
    time.sleep(0.1)  # its lease expired: a pass would mark it unknown and reconcile it
    summary = sweep(ledger, REGISTRY, sandbox, grace_seconds=0, requeue_after=60, publish=None)
    # before it changes anything (it checked where it removes lock files, after landing; then
    # before settling, but after marking, and reconciled after: helper-92)
    assert any("format 3, of a later toolledger" in e for e in summary.errors), summary.errors
    assert summary.marked_unknown == summary.reconciled == summary.landed == 0
    assert ledger.execution(claim.execution_id).status is Status.RUNNING
    with pytest.raises(ConfigError, match="at format 3, of a later toolledger"):
        Executor(ledger, REGISTRY, sandbox, worker_id="w", lease_seconds=30)
    settings = Settings.from_env({"TOOLLEDGER_SANDBOX": str(sandbox.root)})
    with pytest.raises(ConfigError, match="at format 3, of a later toolledger"):
        check_sandbox_format(settings)
    code, out, err = run_cli(capsys, "--sandbox", str(sandbox.root), "sandbox", "upgrade")
    assert code == 5 and out == ""
    assert err.strip() == (
        f"toolledger: error: sandbox {sandbox.root} is at format 3, of a later version"
    )
    assert (sandbox.root / ".toolledger" / "format").read_text() == "3\n"


def test_locks__nothing_is_removed_off_a_local_filesystem(capsys, sandbox, monkeypatch):
    from toolledger import folders

    effects = effects_of(sandbox)
    with effects._path_lock(path_hash("s", "nfs.txt")):
        pass
    monkeypatch.setattr(folders, "local_filesystem", lambda fd: False)
    code, _, err = run_cli(capsys, "--sandbox", str(sandbox.root), "sandbox", "upgrade")
    assert code == 2 and "is not on a local filesystem" in err
    fresh = sandbox.root.parent / "fresh-nfs"  # compose's sandbox-init on a network volume:
    fresh.mkdir()  # the stack must start, the folder left as it is
    code, out, err = run_cli(capsys, "--sandbox", str(fresh), "sandbox", "upgrade", "--new")
    assert code == 0, err
    assert "not on a local filesystem (its lock files stay), at format 1: left as it is" in out
    assert list(fresh.iterdir()) == []
    assert effects.state_format() == 1
    effects.upgrade()  # marked anyway (moved there afterwards): the sweep still leaves them
    assert effects.sweep_locks(limit=None) == 0
    assert effects.lock_file_count() == 1


# ------------------------------------------------------------------ removal, step by step


def test_locks__a_remover_that_opened_a_file_since_replaced_leaves_the_replacement(sandbox):
    # Two removers (two sweeps, a sweep and the command) open one file; the first removes it;
    # a lander makes the path's file again and holds it; the second now gets the lock of the
    # file it opened, which is free: it must not remove the one at the path.
    effects = effects_of(sandbox)
    h = path_hash("s", "two-removers.txt")
    with effects._path_lock(h):
        pass
    shard = effects.paths_dir / h[:2]
    sfd = os.open(shard, os.O_RDONLY | os.O_DIRECTORY)
    late = os.open(shard / f"{h}.lock", os.O_RDWR)  # the second remover's open
    try:
        assert effects_module._remove_lock(sfd, f"{h}.lock") == 1  # the first remover
        with effects._path_lock(h):  # a lander: the path's file made again, held
            replacement = os.stat(shard / f"{h}.lock").st_ino
            assert effects_module._remove_if_free(late, sfd, f"{h}.lock") == 0
            assert os.stat(shard / f"{h}.lock").st_ino == replacement
    finally:
        os.close(late)
        os.close(sfd)


def test_locks__a_lock_file_is_removed_while_its_lock_is_held(sandbox, monkeypatch):
    # unlinked after its lock was let go, a lander could lock it in between and hold a file
    # that is gone the moment after, while the next lander makes and locks another
    effects = effects_of(sandbox)
    effects.upgrade()
    h = path_hash("s", "held-while-removed.txt")
    with effects._path_lock(h):
        pass
    seen: list[bool] = []
    unlink = os.unlink

    def looking(name: Any, *args: Any, dir_fd: int | None = None) -> None:
        fd = os.open(name, os.O_RDWR, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append(False)  # nobody held it
        except BlockingIOError:
            seen.append(True)
        finally:
            os.close(fd)
        unlink(name, *args, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", looking)
    assert effects.sweep_locks(limit=None) == 1
    assert seen == [True]


def test_locks__the_sweep_follows_no_symlink_out_of_paths(sandbox, tmp_path):
    effects = effects_of(sandbox)
    effects.upgrade()
    outside = tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    bait = outside / "ab" / ("ab" + "0" * 30 + ".lock")
    bait.touch()
    effects.paths_dir.mkdir(parents=True)
    (effects.paths_dir / "ab").symlink_to(outside / "ab")  # a shard that is a symlink
    (effects.paths_dir / "cd").mkdir()
    (effects.paths_dir / "cd" / ("cd" + "0" * 30 + ".lock")).symlink_to(bait)  # a file
    assert effects.sweep_locks(limit=None) == 0
    assert bait.exists()
    linked = sandbox.root / ".toolledger" / "paths-elsewhere"
    effects.paths_dir.rename(linked)
    effects.paths_dir.symlink_to(outside)  # paths/ itself
    with pytest.raises(OSError, match="is not a folder"):
        effects.sweep_locks(limit=None)
    assert bait.exists()


def test_locks__a_lander_never_follows_a_symlink_in_the_lock_files_place(sandbox, tmp_path):
    effects = effects_of(sandbox)
    h = path_hash("s", "linked.txt")
    lock = effects.paths_dir / h[:2] / f"{h}.lock"
    lock.parent.mkdir(parents=True)
    lock.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="Too many levels of symbolic links"), effects._path_lock(h):
        pass
    assert not (tmp_path / "elsewhere").exists()


def test_locks__a_file_never_the_one_locked_gives_up_at_lock_wait(tmp_path, monkeypatch):
    # a filesystem whose stat and fstat disagree: every lock seems to be of a removed file
    effects = effects_of(Sandbox(tmp_path / "sb", lock_wait=0.3).prepare())
    monkeypatch.setattr(effects_module, "_same_file", lambda *a, **k: False)
    raised: list[BaseException] = []

    def lock() -> None:
        try:
            with effects._path_lock(path_hash("s", "never.txt")):
                pass
        except BaseException as exc:  # noqa: BLE001 - told to the test
            raised.append(exc)

    lander = threading.Thread(target=lock, daemon=True)
    lander.start()
    lander.join(10)
    assert not lander.is_alive(), "still locking again after 10 s (lock_wait 0.3 s)"
    assert [type(e) for e in raised] == [PathBusy]


def _fork_sleeper() -> int:
    """A child that does nothing with any lock and lives until killed (a tool's forked helper,
    a prefork child). Returns once the child runs: its copies of lock files are closed by the
    fork's hooks before ``os.fork`` returns in it, so until then (a loaded machine may not run
    a new child for a second: CI's one failure of this file) it holds them, as it would
    without the hooks; the claim tested is that it keeps none once it runs."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        os.write(w, b".")
        os.close(w)
        time.sleep(60)
        os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 60)
        assert ready and os.read(r, 1) == b".", "a forked child did not run within 60 s"
    finally:
        os.close(r)
    return pid


def _kill(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_locks__a_child_forked_while_a_path_is_held_does_not_keep_its_lock(sandbox):
    # A threads worker's tool forks (multiprocessing, fork) while another thread lands on a
    # path: the child's copy of the lock file shared the flock, so the path stayed busy after
    # the landing ended, for as long as the unrelated child lived (a cold review).
    sandbox.lock_wait = 0.5
    eff, h = effects_of(sandbox), path_hash("s1", "log")
    inside, forked = threading.Event(), threading.Event()

    def lander() -> None:
        with eff._path_lock(h):
            inside.set()
            forked.wait(10)

    thread = threading.Thread(target=lander)
    thread.start()
    assert inside.wait(10)
    pid = _fork_sleeper()
    try:
        forked.set()
        thread.join(10)
        with eff._path_lock(h):  # free once the landing ended, the child alive
            pass
    finally:
        _kill([pid])


def test_locks__children_forked_while_paths_are_locked_and_unlocked_keep_none(sandbox):
    # Forks racing the opening, locking and closing of lock files by other threads: whatever
    # the moment of the fork, no child keeps a path's lock once its holder let go.
    sandbox.lock_wait = 2.0
    eff = effects_of(sandbox)
    hashes = [path_hash("s1", f"f{i}") for i in range(4)]
    stop = threading.Event()

    def lander(h: str) -> None:
        while not stop.is_set():
            with eff._path_lock(h):
                time.sleep(0.0005)

    threads = [threading.Thread(target=lander, args=(h,)) for h in hashes]
    for t in threads:
        t.start()
    pids: list[int] = []
    try:
        for _ in range(40):
            pids.append(_fork_sleeper())
            time.sleep(0.002)
        stop.set()
        for t in threads:
            t.join(10)
        sandbox.lock_wait = 0.3
        for h in hashes:
            with eff._path_lock(h):
                pass
    finally:
        stop.set()
        _kill(pids)


def test_locks__a_fork_by_the_thread_inside_a_lock_files_opening_does_not_wait_for_itself():
    """A signal handler that forks while its own thread holds the lock files' guard (inside
    ``_open_lock``) waited for that guard at the fork, for ever (a cold review of the day's
    diff): the guard is reentrant. In a child process, given 30 s, so that a hang fails."""
    import subprocess
    import sys

    code = (
        "import os\n"
        "from toolledger import effects\n"
        "with effects._lock_fds_guard:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "print('forked')\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=30)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise AssertionError("the fork waited for the guard its own thread held") from None
    assert out.stdout.strip() == "forked", out.stderr
