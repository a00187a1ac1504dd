"""Fenced effects (DESIGN invariant 10): nothing of a revoked execution lands in the sandbox.

The argument. A tool's writes are *staged*: its bytes go to ``ROOT/.toolledger/pending/``,
where nobody reads them, and nothing under the scope's directory changes while it runs. They
*land* (rename into place, or append) only after the execution's own terminal commit — the
compare-and-set ``running → succeeded`` on (execution_id, lease token) in the ledger. A
revocation (the sweep's ``running → unknown``; everything else — a human's resolution, a
retry, a newer attempt — comes after it) is a compare-and-set on the same row from
``running``. The database lets exactly one of the two happen. So:

- revoked first: the commit fails, and the staged bytes are discarded, never landed. It does
  not matter how long the executor was frozen, where, or whether its database session was
  killed meanwhile: the decision is the commit, and a commit cannot succeed after revocation.
- committed first: the execution is not revoked and cannot be any more (only a decision a
  human or a reconciler made can be reviewed; an executor's own success stands).

Nothing depends on the revoker seeing the sandbox (a human's CLI on a laptop is fine), and no
lock is held across a freeze that matters: a process frozen before its commit holds nothing
here; one frozen while landing holds one path's lock (below), which delays later effects on
that one path — their calls are recorded, their bytes land when the lock frees — and nothing
else. A crash after the commit leaves the staged bytes: whoever comes next lands them
(``Effects.settle``: the worker at start, every sweep, the next writer of that path).

Order on one path. Effects on a path land in the order of their commits: two commits that
touch one path take that path's advisory lock before their event draws its ``seq`` and keep it
to their end (``Ledger.finish``), so on one path the seqs follow commit order. A lander holds
the path's ``flock``, first finishes an append a crash interrupted, then looks at every
effect staged on the path (listed again after the ledger answered: an effect staged after
the first listing may have committed before an effect it lists): those committed (all
older than any still running, which will commit after them) land in seq order — an older
write that a newer one replaces, or an append that a newer write replaces, is dropped.
If the ledger cannot be asked, nothing lands on that path until it can. The lock's file
(``paths/``) is removed by the sweep when no lander holds it, once the sandbox is at format
2 (``toolledger sandbox upgrade``); a lander that locked a file removed meanwhile sees it is
no longer at its path and locks again.

Crash safety. A write lands by one ``rename`` (atomic, then the directory is fsynced); an
append first renames its stage to ``applying-<offset>`` (fsynced) and then writes at that
offset, so finishing it again after a crash writes the same bytes at the same place: exactly
one append. An append whose target turns out unsafe when it lands (a symlink, a hard link to a
file elsewhere, a name aliasing its sibling: ``sandbox``), checked on the descriptor it would
write through, is refused before a byte is written and set aside with its intent (``*.refused``,
the call flagged ``not_landed``): never redone. An error of a moment (out of descriptors,
memory or space, an I/O error), or one after the bytes moved (the folder's fsync, the intent's
removal), sets nothing aside and tells nothing: the effect is left for the next settle, and
nothing newer on its path lands before it. What is supported: one host, or a shared
filesystem whose ``flock`` is coherent across hosts (local disks; NFSv4 with its lock manager).
A filesystem without coherent locks can reorder two landings on one path; it can never land a
revoked execution's bytes.

Outside the sandbox nothing is fenced: a tool that calls a service must send
``ctx.service_key`` (or a fence token) and the service must check it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import secrets
import stat
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from toolledger import failpoints, jsonlines
from toolledger.config import ConfigError
from toolledger.ledger.records import EffectState
from toolledger.ledger.transitions import Status
from toolledger.sandbox import PathRefused, Sandbox, kind_of, refuse_alias, refuse_hard_link

if TYPE_CHECKING:
    from toolledger.ledger.ledger import Ledger

log = logging.getLogger("toolledger.effects")

#: The sandbox's own state, under its root (``Sandbox.prepare``). No scope can be named so
#: (a scope starts with a letter or a digit), so no tool can reach it.
STATE_DIR = ".toolledger"
#: How often a lander retries a busy path lock while it waits.
LOCK_POLL_SECONDS = 0.01
#: What became of an effect a lander took up (``Effects._land``): it reached its target, or it
#: was set aside and its call flagged.
LANDED, ASIDE = "landed", "aside"


def flock_by(fd: int, deadline: float) -> bool:
    """An exclusive ``flock`` of ``fd``, polled every ``LOCK_POLL_SECONDS`` until
    ``deadline`` (``time.monotonic()``); whether it is held (``flock`` itself has no
    timeout, and a holder may be frozen)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCK_POLL_SECONDS)


class Book(Protocol):
    """What landing asks of the ledger (``ledger.Ledger`` is one)."""

    def effect_states(self, execution_ids: list[str]) -> dict[str, EffectState]: ...

    def record_not_landed(self, execution_id: str, detail: dict[str, Any]) -> None: ...


_STAGE = re.compile(
    r"^(?P<eid>[0-9a-f-]{36})\.(?P<n>\d+)\.(?P<h>[0-9a-f]{32})\."
    r"(?P<kind>write|append|refused|applying-(?P<offset>\d+)"
    r"|replaced-(?P<by>\d+)-(?P<was>write|append))$"
)
_SPOOL = re.compile(r"^(?P<eid>[0-9a-f-]{36})\.spool$")
#: A spool's temporary file (``_replace_durably``), left by a process killed writing it.
_SPOOL_TMP = re.compile(r"^(?P<eid>[0-9a-f-]{36})\.spool\.tmp\d+(\.[0-9a-f]{8})?$")
#: The reason a spool gives for a claim whose commit its executor could not learn (the only
#: spool whose execution may not exist: ``worker.pipeline``'s ``_claim_unsure``).
CLAIM_UNKNOWN = "claim commit unknown"
#: How old such a file must be before a settle removes it (its execution no longer running):
#: a writer frozen mid-write and woken later loses the late result it was keeping; an hour
#: makes that a process stopped that long, never one merely slow.
SPOOL_LEFTOVER_AGE = 3600.0
#: A path's lock file, under ``paths/<first two of its hash>/``.
_LOCK = re.compile(r"^[0-9a-f]{32}\.lock$")
#: The sandbox state's format, in ``.toolledger/format`` (absent: 1). At 2, every process
#: that lands locks again after the file it locked was removed, so lock files may be removed
#: (``Effects.sweep_locks``); ``toolledger sandbox upgrade`` writes it.
FORMAT = 2
#: Lock files a sweep pass looks at, at most (whole shards: a pass may go a shard past it).
SWEEP_LOCKS_LIMIT = 10_000


class FormatTooNew(ConfigError):
    """The sandbox's state is at a format a later toolledger wrote: its landers may rely on
    what this version's do not do (``FORMAT``), so this one lands nothing there."""


class BadSpool(ValueError):
    """A spool file that is not a spooled result (cut short, edited): it can never be read."""


class LeaseLost(Exception):
    """This process no longer holds the execution's lease: it stops writing."""


class TimeLimitPassed(LeaseLost):
    """The execution ran past the time limit: its claim was given up (as Celery's hard limit
    kills a prefork child), not lost to the database. Told apart so that a run's checker
    cannot mistake one for the other."""


def _open_made(path: Path, flags: int, mode: int = 0o777) -> int:
    """``os.open(path)``, making its missing directories first only when it has to: three
    opens per write found them there, and a ``mkdir(exist_ok=True)`` each cost two system
    calls and an exception. ``path`` itself is made by the open (O_CREAT) or is the
    directory to open."""
    try:
        return os.open(path, flags, mode)
    except FileNotFoundError:
        (path if flags & os.O_DIRECTORY else path.parent).mkdir(parents=True, exist_ok=True)
        return os.open(path, flags, mode)


#: The clock a lease is kept by in this process: CLOCK_BOOTTIME, which counts the time a
#: host spent suspended, where time.monotonic() (CLOCK_MONOTONIC) stops. A laptop asleep
#: past a lease woke to read its claim as held: the database had revoked it by its own clock,
#: and a tool asking ``ctx.lease_lost`` before an effect outside the sandbox went ahead (a
#: cold review, 12-07). Elsewhere (macOS, Windows) the monotonic clock, as before.
_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def lease_clock() -> float:
    """Seconds on the lease's clock (``_BOOTTIME``), for its deadlines and renewals."""
    return time.monotonic() if _BOOTTIME is None else time.clock_gettime(_BOOTTIME)


class LeaseFlag(threading.Event):
    """A tool's ``ctx.lease_lost``: set once the claim is lost, and *seen* set by ``is_set``
    and ``wait`` as soon as the lease's deadline on this process's clock has passed, whether
    or not the lease keeper's thread has run since. After a freeze (SIGSTOP, a VM paused)
    the tool's thread may run before the keeper's: a tool that checked the flag before an
    effect it cannot undo went ahead, its execution already revoked by the ledger (a cold
    review, 2 of 5 runs, 12-05)."""

    def __init__(self) -> None:
        super().__init__()
        self.deadline = math.inf  # the watch's, kept current by it

    def is_set(self) -> bool:
        if super().is_set():
            return True
        if lease_clock() >= self.deadline:
            self.set()
            return True
        return False

    isSet = is_set  # threading.Event's old name, kept in step

    def wait(self, timeout: float | None = None) -> bool:
        """Until the flag is set, the deadline passes, or ``timeout`` (the Event's contract)."""
        end = math.inf if timeout is None else lease_clock() + timeout
        while not self.is_set():
            left = min(self.deadline, end) - lease_clock()
            if left <= 0:
                return self.is_set()
            super().wait(None if math.isinf(left) else left)
        return True


@dataclass
class LeaseWatch:
    """One claim's lease as this process sees it, on its own clock (``lease_clock``).

    ``deadline``: after it, the claim is treated as lost even if the database could not be
    asked (the lease keeper moves it forward after each successful renewal). ``lost`` is set
    once the keeper learns the row is no longer ours, and reads as set once the deadline
    passes (``LeaseFlag``).
    """

    execution_id: str
    deadline: float
    lost: LeaseFlag = field(default_factory=LeaseFlag)
    renew_until: float = math.inf  # the keeper stops renewing then (the time limit)
    timed_out: bool = False  # lost because the time limit passed, not the database

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "deadline" and "lost" in self.__dict__:  # the flag sees the deadline
            self.lost.deadline = value
        elif name == "lost":
            value.deadline = self.__dict__.get("deadline", math.inf)

    def valid(self) -> bool:
        if self.lost.is_set():
            return False
        if lease_clock() >= self.deadline:
            self.lost.set()
            return False
        return True

    def check(self) -> None:
        if not self.valid():
            raise self.error()

    def error(self) -> LeaseLost:
        """What a write (or a result) after the loss is told: TimeLimitPassed or LeaseLost."""
        if self.timed_out:
            return TimeLimitPassed(
                f"{self.execution_id} ran past the time limit: its claim is given up"
            )
        return LeaseLost(f"the lease of {self.execution_id} is lost: no more effects")


@dataclass(frozen=True)
class Staged:
    """One effect a running execution staged: what will land if its commit succeeds."""

    n: int
    kind: str  # "write" | "append"
    path: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:  # asdict's deep copy costs 10x this on every call
        return {"n": self.n, "kind": self.kind, "path": self.path, "size": self.size,
                "sha256": self.sha256}  # fmt: skip


def path_hash(scope: str, path: str) -> str:
    """The name of a path's lock and stages (the path itself may be long)."""
    key = f"{scope}\x00{path}".encode("utf-8", "surrogateescape")
    return hashlib.sha256(key).hexdigest()[:32]


def lock_keys(scope: str, staged: list[Staged] | list[dict[str, Any]]) -> list[int]:
    """The paths' keys for the commit's advisory locks (``Ledger.finish``): 60 bits of the
    path's hash, so that two commits on one path draw their seqs in commit order."""
    paths = {s.path if isinstance(s, Staged) else s["path"] for s in staged}
    return sorted(int(path_hash(scope, p)[:15], 16) for p in paths)


@dataclass(frozen=True)
class StageFile:
    """A file in the pending area: ``<execution_id>.<n>.<path hash>.<kind>``."""

    execution_id: str
    n: int
    h: str
    kind: str  # write | append | applying | refused | replaced
    offset: int = 0
    #: a replaced effect's: the seq of the write that replaces it, and what it was staged as
    by: int = 0
    was: str = ""

    @property
    def name(self) -> str:
        kind = self.kind
        if kind == "applying":
            kind = f"applying-{self.offset}"
        elif kind == "replaced":
            kind = f"replaced-{self.by}-{self.was}"
        return f"{self.execution_id}.{self.n}.{self.h}.{kind}"

    @classmethod
    def parse(cls, name: str) -> StageFile | None:
        m = _STAGE.match(name)
        if m is None:
            return None
        if m["by"] is not None:
            return cls(m["eid"], int(m["n"]), m["h"], "replaced", 0, int(m["by"]), m["was"])
        kind = "applying" if m["offset"] is not None else m["kind"]
        return cls(m["eid"], int(m["n"]), m["h"], kind, int(m["offset"] or 0))

    def replaced_by(self, seq: int) -> StageFile:
        """The name this staged write or append takes once the write of ``seq`` replaces it."""
        was = self.was if self.kind == "replaced" else self.kind
        return StageFile(self.execution_id, self.n, self.h, "replaced", 0, seq, was)


@dataclass
class Landing:
    """What one publish or settle did."""

    landed: int = 0  # effects that reached their target
    discarded: int = 0  # staged bytes of revoked, failed or superseded effects, dropped
    busy: int = 0  # paths whose lock a frozen or slow lander holds: left for later
    refused: int = 0  # effects whose target became unsafe after commit: kept aside
    recorded: int = 0  # spooled results recorded by their executor's lease
    evidence: int = 0  # spooled results recorded as late evidence
    left: int = 0  # staged effects of executions still running
    leftovers: int = 0  # spools' temporary files that killed processes left, removed
    strangers: int = 0  # staged by executions this ledger does not know (another's?): kept
    #: spooled results that could not be settled now, one line each (the sweep reports them)
    problems: list[str] = field(default_factory=list, compare=False)
    #: those of them that are committed effects left for the next settle by an error of a
    #: moment (a full disk, a quota, EIO): a read now would not see them. (Not a
    #: path's own lasting error: it would refuse every read of every scope until mended.)
    unlanded: list[str] = field(default_factory=list, compare=False)

    @property
    def failed(self) -> int:
        return len(self.problems)

    def to_json(self) -> dict[str, int]:
        counts = {
            name: value
            for name, value in asdict(self).items()
            if name not in ("problems", "unlanded")
        }
        return {**counts, "failed": self.failed}

    def add(self, other: Landing) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass(frozen=True)
class Commit:
    """An execution's own terminal commit: whose effects land, in which order (``seq``)."""

    execution_id: str
    seq: int
    scope: str
    key: str
    attempt: int

    @classmethod
    def of(cls, state: EffectState) -> Commit:
        return cls(state.execution_id, state.seq, state.scope, state.idempotency_key, state.attempt)


@dataclass(frozen=True)
class _Step:
    commit: Commit
    file: StageFile
    path: str
    sha256: str

    @property
    def seq(self) -> int:
        return self.commit.seq

    @property
    def scope(self) -> str:
        return self.commit.scope


_EFFECTS: weakref.WeakKeyDictionary[Sandbox, Effects] = weakref.WeakKeyDictionary()


class NotAFile(OSError):
    """Something else (a folder, a FIFO, a socket) where a stage file should be."""


#: Errors of a moment (descriptors, memory, space, the disk): what meets them is left as it
#: is for the next settle, never set aside. Any other error is the file's or its target's.
_PASSING = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.ENOSPC,
     errno.EDQUOT, errno.EIO}
)  # fmt: skip


class _Unfinished(OSError):
    """An effect whose bytes have moved but whose bookkeeping failed (its folder's fsync, its
    intent's removal): never set aside nor told not landed; the next settle finishes it, and
    nothing newer on its path lands before."""


def _left_for_later(exc: Exception) -> bool:
    return isinstance(exc, _Unfinished) or (isinstance(exc, OSError) and exc.errno in _PASSING)


def _not_a_file(exc: OSError) -> bool:
    """The error of opening something else than a regular file as one (links not followed)."""
    return isinstance(exc, NotAFile) or exc.errno in (errno.ELOOP, errno.ENXIO)


class PathBusy(Exception):
    """Another lander holds the path's lock (it may be frozen): try later."""


class _NotLocked(OSError):
    """The file this lander locked is no longer its path's lock file: removed while held."""


def _held(locked: Callable[[], bool]) -> bool:
    """Whether the lander still holds its path's lock file (not if it cannot tell)."""
    try:
        return locked()
    except OSError:
        return False


def _check_locked(locked: Callable[[], bool]) -> None:
    """_NotLocked unless the lander still holds its path's lock file: checked before each
    move of bytes, so one whose file was removed while it was frozen moves nothing."""
    if not _held(locked):
        raise _NotLocked(errno.ENOLCK, "the path's lock file was removed while held")


def _same_file(fd: int, name: str | Path, dir_fd: int | None = None) -> bool:
    """Whether the file open as ``fd`` is the one at ``name`` now (not one removed from it)."""
    try:
        there = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (there.st_ino, there.st_dev) == (mine.st_ino, mine.st_dev)


#: This process's open lock files (a path's, a sweep's removal), whichever thread opened them.
#: A forked child (a tool that forks without exec, ``multiprocessing``, billiard's prefork
#: children) gets a copy of each; an flock belongs to the open file, shared by the copies, so
#: a lock the parent held or took later would stay held until the child died, and every later
#: effect on that path would wait for an unrelated process (a cold review: PathBusy for as
#: long as the child lived). O_CLOEXEC acts on exec only: the child closes them at fork.
_lock_fds: set[int] = set()
#: Held while a lock file is opened and made known to ``_lock_fds``, or closed and forgotten,
#: and by a thread that forks: a child forked in between would keep a copy nobody closes (or
#: close a number reused meanwhile by another file). Reentrant: a signal handler that forks
#: while its thread is inside ``_open_lock`` waited for itself for ever (a cold review).
_lock_fds_guard = threading.RLock()


def _open_lock(path: str | Path, flags: int, mode: int = 0o644, dir_fd: int | None = None) -> int:
    """Open a lock file (``_open_made``'s way when not under ``dir_fd``), known to
    ``_lock_fds`` before any fork can copy it."""
    with _lock_fds_guard:
        if dir_fd is None:
            fd = _open_made(Path(path), flags, mode)
        else:
            fd = os.open(path, flags, mode, dir_fd=dir_fd)
        _lock_fds.add(fd)
        return fd


def _close_lock(fd: int) -> None:
    """Close a lock file (releasing its flock: no child keeps a copy) and forget it."""
    with _lock_fds_guard:
        _lock_fds.discard(fd)
        os.close(fd)


def _lock_fds_before_fork() -> None:
    _lock_fds_guard.acquire()


def _lock_fds_after_fork_in_parent() -> None:
    _lock_fds_guard.release()


def _lock_fds_after_fork_in_child() -> None:
    """Close the child's copies of the parent's lock files. Closing, not unlocking: an unlock
    would let go of the parent's lock too; a close drops only this copy."""
    global _lock_fds, _lock_fds_guard
    for fd in _lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _lock_fds = set()
    _lock_fds_guard = threading.RLock()  # held by the parent's forking thread (``before``)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_lock_fds_before_fork,
        after_in_parent=_lock_fds_after_fork_in_parent,
        after_in_child=_lock_fds_after_fork_in_child,
    )


def _remove_lock(sfd: int, name: str) -> int:
    """Remove the lock file ``name`` of the shard open as ``sfd`` if no lander holds it: 1 if
    it went. Never follows a symlink, never blocks on a FIFO."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = _open_lock(name, flags, dir_fd=sfd)
    except OSError:  # gone meanwhile, or not a file of ours
        return 0
    try:
        return _remove_if_free(fd, sfd, name)
    finally:
        _close_lock(fd)


def _remove_if_free(fd: int, sfd: int, name: str) -> int:
    """With ``name`` open as ``fd``: take its lock without waiting (a lander holding it: 0)
    and, if it is a regular file still at its name (another remover may have removed it and
    a lander made another since), unlink it while holding the lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if stat.S_ISREG(os.fstat(fd).st_mode) and _same_file(fd, name, sfd):
            os.unlink(name, dir_fd=sfd)  # under its lock: a lander waiting on it locks again
            return 1
    except OSError:  # held by a lander (BlockingIOError), or the disk's: next time
        pass
    return 0


def effects_of(sandbox: Sandbox) -> Effects:
    """The pending area of ``sandbox`` (one per sandbox object; a tool's staging view gives
    the area it stages into)."""
    if isinstance(sandbox, StagingSandbox):
        return sandbox._area
    found = _EFFECTS.get(sandbox)
    if found is None:
        found = _EFFECTS[sandbox] = Effects(sandbox)
    return found


class Effects:
    """The pending area of one sandbox: staging, landing, discarding, settling."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.state = sandbox.root / STATE_DIR
        self.pending_dir = self.state / "pending"
        self.paths_dir = self.state / "paths"
        self._next_shard = secrets.randbelow(256)  # of paths_dir: where sweep_locks goes on
        self._format_known = False

    def staging(self, scope: str, execution_id: str, lease: LeaseWatch | None) -> StagingSandbox:
        return StagingSandbox(self, scope, execution_id, lease)

    # ------------------------------------------------------------------ the pending area

    @contextlib.contextmanager
    def _pending(self) -> Iterator[int]:
        fd = _open_made(self.pending_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    def _scan(self, pfd: int) -> tuple[list[StageFile], set[str], dict[str, list[str]]]:
        """The stage files, the spooled results' execution ids, and the spools' temporary
        files by execution id, of one listing of the pending area."""
        files, spools, leftovers = [], set(), defaultdict(list)
        for name in os.listdir(pfd):
            if (f := StageFile.parse(name)) is not None:
                files.append(f)
            elif (m := _SPOOL.match(name)) is not None:
                spools.add(m["eid"])
            elif (m := _SPOOL_TMP.match(name)) is not None:
                leftovers[m["eid"]].append(name)
        return files, spools, leftovers

    def stage(
        self, scope: str, execution_id: str, n: int, kind: str, path: str, data: bytes
    ) -> Staged:
        """Write a stage file (fsynced). Its directory is fsynced once, by ``seal``."""
        f = StageFile(execution_id, n, path_hash(scope, path), kind)
        with self._pending() as pfd:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(f.name, flags, 0o644, dir_fd=pfd)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException:
                # Not staged (a full disk, say): its number is free again for the next stage,
                # and no commit can name the file (if it cannot go, it is set aside).
                try:
                    os.unlink(f.name, dir_fd=pfd)
                except FileNotFoundError:
                    pass
                except OSError:
                    with contextlib.suppress(OSError):
                        self._rename_aside(pfd, f)
                raise
        return Staged(n, kind, path, len(data), hashlib.sha256(data).hexdigest())

    def seal(self) -> None:
        """Make every stage's directory entry durable before the commit that refers to it."""
        with self._pending() as pfd:
            os.fsync(pfd)

    def discard(self, execution_id: str) -> int:
        """Drop the staged bytes of an execution that will never commit them. No lock: only
        its own commit could land them, and it did not happen."""
        dropped = 0
        with self._pending() as pfd:
            for f in self._scan(pfd)[0]:
                if f.execution_id == execution_id and f.kind in ("write", "append"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f.name, dir_fd=pfd)
                        dropped += 1
        return dropped

    # ------------------------------------------------------------------ landing

    def publish(self, commit: Commit, staged: list[Staged], book: Book) -> Landing:
        """Land the effects of an execution after its own commit, path by path."""
        landing = Landing()
        mine = (commit, {s.n: s for s in staged})
        for h in dict.fromkeys(path_hash(commit.scope, s.path) for s in staged):
            try:
                with self._path_lock(h) as locked:
                    self._land_path(h, book, mine, landing, locked)
            except PathBusy:
                log.info("path %s busy: %s lands later (settle)", h, commit.execution_id)
                landing.busy += 1
        return landing

    @contextlib.contextmanager
    def _path_lock(self, h: str) -> Iterator[Callable[[], bool]]:
        """The path's exclusive flock; PathBusy after the sandbox's ``lock_wait``. The kernel
        drops it when its holder dies; a frozen holder keeps it (that path waits). Yields
        whether the file locked is still the lock file at the path (``_land`` asks).

        A lock file no lander holds may be removed (``sweep_locks``, by a holder of its lock):
        a lander that opened it before then gets, once its lock comes, a file no longer at the
        path, sees so (the file there, if any, is another) and locks again. Whoever holds the
        lock holds the file at the path, so no two landers hold it at once. A symlink in the
        lock file's place is never followed (ELOOP), and the whole wait, locking again
        included, is bounded by ``lock_wait``. A child forked meanwhile closes its copy of the
        lock file at once (``_lock_fds``): it never keeps the path locked past its holder."""
        lock = self.paths_dir / h[:2] / f"{h}.lock"
        deadline = time.monotonic() + self.sandbox.lock_wait
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        again = 0
        while True:
            fd = _open_lock(lock, flags, 0o644)
            try:
                if not flock_by(fd, deadline):
                    raise PathBusy(h)
                if _same_file(fd, lock):
                    break
            except BaseException:
                _close_lock(fd)
                raise
            _close_lock(fd)  # removed meanwhile by a holder: lock the file there now
            again += 1
            if time.monotonic() >= deadline:
                log.warning("%s was not the file locked, %d times (a filesystem's?)", lock, again)
                raise PathBusy(h)
            if again > 3:  # a removal now and then is the rule; more is the filesystem's doing
                time.sleep(LOCK_POLL_SECONDS)
        try:
            yield lambda: _same_file(fd, lock)
        finally:
            _close_lock(fd)  # releases the flock (a forked child closed its copy at fork)

    def state_format(self) -> int:
        """The format of this sandbox's state (``FORMAT``): 1 until ``upgrade`` wrote 2."""
        try:  # (a FIFO there hung every process that lands: helper-101)
            text = _read_regular(self.state / "format", 4096, "the format file")
            return int(text.decode("ascii").split()[0])
        except FileNotFoundError:
            return 1
        except (ValueError, IndexError) as exc:
            raise OSError(f"{self.state / 'format'}: not a format number") from exc

    def check_format(self) -> None:
        """FormatTooNew if a later toolledger marked this state: read once per process (a
        sandbox is marked only once every lander of the earlier version has stopped). Every
        part that lands checks it before it claims or settles anything: the workers and the
        beat at start, each Executor (``execute``, the clients', ``serve``'s and MCP's
        read-only calls), a sweep pass."""
        if self._format_known:
            return
        found = self.state_format()
        if found > FORMAT:
            raise FormatTooNew(
                f"the sandbox {self.sandbox.root} is at format {found}, of a later toolledger "
                f"(this one knows {FORMAT}): run that version"
            )
        self._format_known = True

    def upgrade(self) -> None:
        """Mark the state as this version's format. Only once no process of an older version
        lands in this sandbox: those lock a removed file without seeing it, so the removal of
        lock files (which the new format allows) could let two of them land on one path at
        once. Durable before it returns; a state already at it (or later) stays as it is."""
        if self.state_format() >= FORMAT:
            return
        self.state.mkdir(parents=True, exist_ok=True)
        note = (
            f"{FORMAT}\n# toolledger sandbox format: lock files under paths/ may be removed;"
            " no process of a version before it may land here\n"
        )
        _replace_durably(self.state / "format", note.encode(), mode=0o644)

    def sweep_locks(self, limit: int | None = SWEEP_LOCKS_LIMIT) -> int:
        """Remove the lock files no lander holds, shard after shard of ``paths/`` from where
        the last call stopped, until ``limit`` files were looked at (None: every shard). On a
        sandbox of format 2 only (``upgrade``; a later format is an error), on a local
        filesystem (``folders.local_filesystem``: a network one may answer ``stat`` from a
        cache); returns how many went.

        A lock file is only needed while a lander holds it: the sweep removes the rest, so the
        sandbox does not keep an inode for every path ever written. Each removal holds the
        file's lock (a lander holding it: left), and removes it only if it is still the file
        at its path. No symlink is followed: to ``paths/``, to a shard or to a file."""
        from toolledger.folders import local_filesystem

        found = self.state_format()
        if found > FORMAT:
            raise OSError(f"{self.state / 'format'}: format {found}, of a later version")
        if found < FORMAT:
            return 0
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            pfd = os.open(self.paths_dir, flags)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            raise OSError(f"{self.paths_dir} is not a folder (a symlink?): none removed") from exc
        removed = looked = 0
        try:
            if not local_filesystem(pfd):
                return 0
            for _ in range(256):
                shard = f"{self._next_shard:02x}"
                self._next_shard = (self._next_shard + 1) % 256
                try:
                    sfd = os.open(shard, flags, dir_fd=pfd)
                except OSError:  # none yet, or not a folder of ours (a symlink: ELOOP, ENOTDIR)
                    sfd = -1
                if sfd >= 0:
                    try:
                        for name in os.listdir(sfd):
                            if _LOCK.match(name) is not None:
                                looked += 1
                                removed += _remove_lock(sfd, name)
                    finally:
                        os.close(sfd)
                if limit is not None and looked >= limit:
                    break
        finally:
            os.close(pfd)
        return removed

    def lock_file_count(self) -> int:
        """The lock files under ``paths/`` now."""
        if not self.paths_dir.is_dir():
            return 0
        count = 0
        for shard in self.paths_dir.iterdir():
            if shard.is_dir():
                with os.scandir(shard) as entries:
                    count += sum(
                        bool(_LOCK.match(e.name)) and e.is_file(follow_symlinks=False)
                        for e in entries
                    )
        return count

    def _land_path(
        self,
        h: str,
        book: Book,
        mine: tuple[Commit, dict[int, Staged]] | None,
        landing: Landing,
        locked: Callable[[], bool],
    ) -> None:
        """Under the path's lock (``locked``: still held): land, in commit order, every
        committed effect staged on it.

        Commits that touch one path take that path's advisory lock before their seq is drawn
        (``Ledger.finish``), so every commit on it older than ours is visible now, and any
        still running will commit with a newer seq: what is committed can land in seq order,
        and nothing older can turn up later. The listing must be taken after the ledger's
        answer for that: a stage made after an earlier listing may belong to a commit older
        than one the answer shows (so the area is listed again after it, below)."""
        with self._pending() as pfd:
            own_id = mine[0].execution_id if mine else None
            files = self._path_files(pfd, h)
            asked = sorted({f.execution_id for f in files} - {own_id})
            known = self._ask(book, h, asked)
            limit = math.inf
            # The listing came before the ledger's answer: an effect staged after it whose
            # commit came before the answer is missing from it, and its seq may be older than
            # one the answer found committed. Every commit before the answer has its stage
            # files here now (only a holder of this lock lands them): list again. (With no
            # one else's effect listed, nothing else lands now: no need.)
            if asked:
                files = self._path_files(pfd, h)
            if newcomers := {f.execution_id for f in files} - {own_id} - set(asked):
                # Asked again, all of them; what committed before the first answer (every seq
                # up to the newest it saw committed) is now all here and known, and anything
                # committed after it may follow an execution still unlisted then: those wait.
                limit = max(
                    [s.seq for s in known.values() if s.own_success] + [mine[0].seq if mine else 0]
                )
                asked = sorted(set(asked) | newcomers)
                known = self._ask(book, h, asked)
            steps, replaced = [], []
            for f in files:
                if f.kind == "replaced":
                    replaced.append(f)
                elif mine is not None and f.execution_id == own_id:
                    if step := _committed(f, mine, known):
                        steps.append(step)
                elif step := self._foreign_step(pfd, f, known.get(f.execution_id), landing, limit):
                    steps.append(step)
            held = self._replaced_steps(pfd, files, replaced, mine, known, landing)
            self._land_in_order(pfd, steps, held, book, landing, locked)

    def _replaced_steps(
        self,
        pfd: int,
        files: list[StageFile],
        replaced: list[StageFile],
        mine: tuple[Commit, dict[int, Staged]] | None,
        known: dict[str, EffectState],
        landing: Landing,
    ) -> list[_Step]:
        """The effects a write replaced, renamed ``replaced-<its seq>`` just before its rename,
        that a crash left (``_land``). The write still staged has not landed: they go with it
        (dropped once it lands, kept aside and flagged with it if it cannot). Its stage gone,
        it landed (the rename takes the stage): they are dropped, never landed over it."""
        if not replaced:
            return []
        writes = {
            step.seq
            for f in files
            if f.kind == "write" and (step := _committed(f, mine, known)) is not None
        }
        held = []
        for f in replaced:
            step = _committed(f, mine, known)
            if step is None:  # not this ledger's commit (cannot be: only commits are replaced)
                landing.strangers += 1
            elif f.by in writes:
                held.append(step)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f.name, dir_fd=pfd)
                    landing.discarded += 1
        return held

    def unlanded_on(self, book: Book, scope: str, path: str) -> str | None:
        """Why a read of this path now would not see what the ledger says happened, or None.

        Bytes committed for the path and not landed yet (its lander frozen holding the path's
        lock, a full disk, a crash before it landed them) are landed here first, under the
        path's lock; if they still wait, the read would return what they replace while the
        ledger's receipt says they were written (a cold review read the old bytes after a
        succeeded receipt). Bytes staged by a running execution, or by one this ledger does
        not know, do not stop a read: nothing of theirs is committed."""
        h = path_hash(scope, path)
        if not self.pending_dir.is_dir():
            return None
        for landed_once in (False, True):
            with self._pending() as pfd:
                ids = sorted({f.execution_id for f in self._path_files(pfd, h)})
            if not ids:
                return None
            try:
                states = book.effect_states(ids)
            except Exception as exc:  # noqa: BLE001 - the ledger away: cannot tell
                what = type(exc).__name__
                return f"the ledger cannot say if bytes staged for {path!r} are committed ({what})"
            if not any(s.own_success for s in states.values()):
                return None
            if landed_once:
                return f"bytes committed for {path!r} have not landed yet"
            try:
                with self._path_lock(h) as locked:
                    self._land_path(h, book, None, Landing(), locked)
            except PathBusy:
                return f"bytes committed for {path!r} have not landed: a lander holds the path"
            except OSError as exc:
                return f"bytes committed for {path!r} cannot land now ({exc})"
        return None  # not reached

    def pending_on(
        self,
        scope: str,
        path: str,
        states: Callable[[list[str]], dict[str, EffectState]] | None = None,
    ) -> bool:
        """Whether bytes for this path wait in the pending area: staged by a running
        execution, or committed and not landed yet. While they do, the file as it stands does
        not say what the path will hold: a reconciler that finds it missing cannot call the
        effect absent (an automatic retry would land after them, over a newer write).

        ``states``: the ledger's word on the executions that staged them (``effect_states``).
        With it, bytes of an execution neither running nor committed (revoked, failed, decided
        by a reconciler or a human) do not count: they never land (a settle drops them). A
        revoked attempt's executor, frozen between its lease check and its stage, staged
        after the sweep proved it absent, and its own automatic retry then ended
        ``superseded`` because of them, the file never written (a cold review). Bytes of an
        execution the ledger does not know, or a ledger that cannot answer, count (cannot
        tell). Without ``states`` every staged byte counts."""
        if not self.pending_dir.is_dir():
            return False
        with self._pending() as pfd:
            ids = sorted({f.execution_id for f in self._path_files(pfd, path_hash(scope, path))})
        if not ids or states is None:
            return bool(ids)
        try:
            known = states(ids)
        except Exception as exc:  # noqa: BLE001 - the ledger away: cannot tell
            log.warning("cannot ask the ledger about bytes staged for a path: %s", exc)
            return True
        return any(
            (s := known.get(eid)) is None or s.status is Status.RUNNING or s.own_success
            for eid in ids
        )

    def _path_files(self, pfd: int, h: str) -> list[StageFile]:
        return [f for f in self._scan(pfd)[0] if f.h == h and f.kind != "refused"]

    @staticmethod
    def _ask(book: Book, h: str, execution_ids: list[str]) -> dict[str, EffectState]:
        try:
            return book.effect_states(execution_ids) if execution_ids else {}
        except Exception as exc:
            log.warning(
                "cannot ask the ledger about %d staged effects: %s", len(execution_ids), exc
            )
            raise PathBusy(h) from exc

    def _foreign_step(
        self,
        pfd: int,
        f: StageFile,
        state: EffectState | None,
        landing: Landing,
        limit: float,
    ) -> _Step | None:
        if state is not None and state.own_success and state.seq > limit:
            landing.left += 1  # committed after an older commit may have been listed: later
            return None
        if state is not None and state.own_success:
            effect = state.effects[f.n] if f.n < len(state.effects) else None
            if effect is not None and _names(f, state.scope, effect["path"], effect["kind"]):
                return _Step(Commit.of(state), f, effect["path"], effect["sha256"])
            log.error("staged %s does not match its commit's effects: kept aside", f.name)
            self._aside(pfd, f, landing)
            return None
        if state is not None and state.status is Status.RUNNING:
            landing.left += 1  # if it commits, its seq will be newer than every one here
            return None
        if state is None:
            # Not this ledger's: every stage is made after its claim's commit, so another
            # ledger's (a process pointed at the right sandbox and another ledger, an unset
            # TOOLLEDGER_DB making the embedded one). It was removed as "never claimed": a
            # read through the wrong ledger deleted the committed bytes of the right one's
            # succeeded calls, which then never landed, unflagged (a cold review). Kept.
            landing.strangers += 1
            return None
        # revoked, failed, decided by a reconciler or a human: never lands
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f.name, dir_fd=pfd)
            landing.discarded += 1
        return None

    def _land_in_order(
        self,
        pfd: int,
        steps: list[_Step],
        held: list[_Step],
        book: Book,
        landing: Landing,
        locked: Callable[[], bool],
    ) -> None:
        """Land the path's committed effects in seq order. An effect older than the newest
        write (an older write, an append) never lands: the write replaces it. It is renamed
        ``replaced-<seq>`` once that write is about to land (every check passed, its rename
        next: a crash after the rename must not find an older write still staged, which would
        land over it) and dropped once it has. If the write cannot land (its target became a
        directory), the older ones it would have replaced are set aside and flagged, then the
        write (dropped before, a cold review found a succeeded append's bytes gone and its call
        unflagged); a write left for the next settle keeps them for it. ``held``: those a
        crash left renamed for a write still staged (``_replaced_steps``)."""
        redo = [s for s in steps if s.file.kind == "applying"]  # decided before a crash
        rest = sorted((s for s in steps if s.file.kind != "applying"), key=_order)
        writes = [s for s in rest if s.file.kind == "write"]
        newest = writes[-1] if writes else None
        cut = rest.index(newest) if newest is not None else 0
        landing_now = {s.seq for s in writes}  # a write left for later keeps its own
        older = [*rest[:cut], *(s for s in held if s.file.by in landing_now)]
        todo = [*redo, *rest[cut:]]
        for i, s in enumerate(todo):
            if self._land(pfd, s, book, landing, older if s is newest else [], locked) is None:
                landing.left += len(todo) - i - 1  # after it, in commit order: it goes first
                return

    def _land(
        self,
        pfd: int,
        s: _Step,
        book: Book,
        landing: Landing,
        replaced: list[_Step],
        locked: Callable[[], bool],
    ) -> str | None:
        """Land one effect (LANDED), or set it aside (ASIDE); None if it is left for the next
        settle (an error of a moment, or the path's lock file no longer the one ``locked``):
        then nothing newer on its path may land before it. ``replaced``: the older effects a
        write replaces, renamed just before it lands and dropped once it has, set aside and
        flagged before it if it cannot."""
        # under the names they have now; those renamed for another write first: renaming an
        # older write before what was renamed for it, a crash between the two left those named
        # for a write no longer staged, taken for landed by the next settle and dropped, and a
        # target made a folder then flagged the writes alone, an append's bytes gone (a cold
        # review)
        current = sorted(replaced, key=lambda old: old.file.kind != "replaced")

        def drop() -> None:
            _check_locked(locked)
            # Renamed, not removed: a crash between here and the write's rename left them
            # gone, and a target made a folder before the next settle then flagged the write
            # alone, a succeeded append's bytes lost unflagged (a cold review). The name says
            # which write replaces them: the next settle finds whether it landed.
            for i, old in enumerate(current):
                if old.file.kind == "replaced" and old.file.by == s.seq:
                    continue  # so named by a lander a crash cut short
                # (named for an older write this one replaces too, a crash cut short: named
                # for this one now, or that write's own renaming would leave them for dropped)
                to = old.file.replaced_by(s.seq)
                with contextlib.suppress(FileNotFoundError):
                    os.rename(old.file.name, to.name, src_dir_fd=pfd, dst_dir_fd=pfd)
                current[i] = dataclasses.replace(old, file=to)

        try:
            if s.file.kind == "write":
                self._land_write(pfd, s, drop)
            else:
                self._land_append(pfd, s, locked)
        except (PathRefused, OSError) as exc:
            if isinstance(exc, _NotLocked) or not _held(locked):
                # Its lock file was removed (by hand: the sweep removes only free ones) while
                # this lander held it, and another may have landed on the path since under a
                # file of its own: its stage gone, this one flagged the call not_landed, bytes
                # "kept aside" that did not exist, though they had landed (a cold review). It
                # moves and judges nothing more; the next settle, under the lock, does.
                problem = (
                    f"effect {s.file.name} on {s.path!r} left: its path's lock file was "
                    "removed while held"
                )
                log.warning("%s (the next settle lands it)", problem)
                landing.problems.append(problem)
                return None
            if _left_for_later(exc):
                problem = f"effect {s.file.name} on {s.path!r} not finished: {exc}"
                log.warning("%s (the next settle finishes it)", problem)
                landing.problems.append(problem)
                landing.unlanded.append(problem)
                return None  # what it replaces waits with it, renamed or not
            # Those it replaces first: a crash before the write is set aside leaves it
            # staged, and them with it, for the next settle to refuse again
            why = f"replaced by the write of seq {s.seq} on {s.path!r}, which could not land"
            for old in current:
                if self._set_aside(pfd, old, book, landing, why) is None:
                    return None
            return self._set_aside(pfd, s, book, landing, str(exc))
        for old in current:  # landed: what it replaced never lands
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old.file.name, dir_fd=pfd)
                landing.discarded += 1
        landing.landed += 1
        return LANDED

    def _set_aside(
        self, pfd: int, s: _Step, book: Book, landing: Landing, reason: str
    ) -> str | None:
        """Flag a committed effect that will not land, then keep its bytes aside: ASIDE, or
        None if the ledger could not be told (left where it was for the next settle).

        The flag first, then the bytes aside: a crash (or a ledger that cannot be told)
        between the two leaves the effect where it was, refused again by the next settle and
        flagged then; never bytes set aside that no flag names."""
        holder = self._holder(pfd, s.file)
        kept = _aside_name(pfd, holder)
        detail = {
            "path": s.path,
            "n": s.file.n,
            "seq": s.seq,
            "reason": reason,
            # for a human; the sweep removes them once the call is reviewed
            "kept": f"{STATE_DIR}/pending/{kept}",
        }
        try:
            book.record_not_landed(s.file.execution_id, detail)
        except Exception as flag_exc:  # noqa: BLE001 - the database: the next settle retries
            problem = f"effect {s.file.name} on {s.path!r} refused, not yet flagged: {flag_exc}"
            log.warning("%s (the next settle tries again)", problem)
            landing.problems.append(problem)
            return None
        log.error("effect %s on %r could not land (%s): kept aside", s.file.name, s.path, reason)
        with contextlib.suppress(FileNotFoundError):
            os.rename(holder.name, kept, src_dir_fd=pfd, dst_dir_fd=pfd)
        landing.refused += 1
        return ASIDE

    def _land_write(self, pfd: int, s: _Step, checked: Callable[[], None]) -> None:
        """Land a write; ``checked`` is called once its target passed every check, just
        before the rename."""
        eid = s.file.execution_id
        failpoints.hit("before_publish", eid)
        self._log_effect(s, redo=False)
        with self.sandbox.open_parent(s.scope, s.path, create=True) as (parent, name):
            assert parent is not None
            if self.sandbox.target_stat(parent, name, s.path) is None:  # a new name
                refuse_alias(parent, name, f"path {s.path!r}")
            checked()
            # rename replaces a symlink swapped in meanwhile, never follows it; on the
            # filesystems supported it leaves both directories in one journal transaction
            os.rename(s.file.name, name, src_dir_fd=pfd, dst_dir_fd=parent)
            try:
                os.fsync(parent)
            except OSError as exc:
                raise _Unfinished(exc.errno, f"landed, not yet durable: {exc.strerror}") from exc
        failpoints.hit("after_publish", eid)

    def _land_append(self, pfd: int, s: _Step, locked: Callable[[], bool]) -> None:
        eid, f = s.file.execution_id, s.file
        if f.kind == "append":
            _check_locked(locked)  # the offset is decided here: by the path's holder only
            # The intent: this append goes at this offset. Durable before the bytes, so doing
            # it again after a crash rewrites the same bytes at the same place.
            applying = StageFile(eid, f.n, f.h, "applying", self._size(s.scope, s.path))
            os.rename(f.name, applying.name, src_dir_fd=pfd, dst_dir_fd=pfd)
            f = applying
        if f is not s.file:
            os.fsync(pfd)
        failpoints.hit("before_publish", eid)
        _check_locked(locked)  # (a lander frozen here may wake to another's lock file)
        self._log_effect(s, redo=s.file.kind == "applying")
        # Refused before a byte was written (the target's kind, links or name, or no file in
        # the stage's place): ``_land`` sets the intent aside (``_holder`` finds it), so the
        # next settle does not redo it. An error of a moment leaves the intent, redone at its
        # offset next time.
        self._write_at(pfd, f, s.scope, s.path)
        failpoints.hit("after_publish", eid)
        try:
            os.unlink(f.name, dir_fd=pfd)
            os.fsync(pfd)  # an intent that came back after a power loss would rewrite old bytes
        except OSError as exc:  # its bytes are written: redoing the intent rewrites the same
            raise _Unfinished(exc.errno, f"landed, its intent left: {exc.strerror}") from exc

    def _size(self, scope: str, path: str) -> int:
        st = self.sandbox.stat(scope, path)
        return st.st_size if st is not None else 0

    def _write_at(self, pfd: int, f: StageFile, scope: str, path: str) -> None:
        data = _read_at(pfd, f.name)
        with self.sandbox.open_parent(scope, path, create=True) as (parent, name):
            assert parent is not None
            existed = self.sandbox.target_stat(parent, name, path) is not None
            if not existed:
                refuse_alias(parent, name, f"path {path!r}")
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(name, flags, 0o644, dir_fd=parent)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise PathRefused(f"path {path!r} is {kind_of(st.st_mode)}")
                # another name of a file elsewhere (outside the scope): checked on this fd
                refuse_hard_link(st, path, "append")
                offset = f.offset
                if st.st_size < offset:  # shortened behind the sandbox's back
                    log.warning("%r is shorter than its pending append expects", path)
                    offset = st.st_size
                view = memoryview(data)
                while view:
                    written = os.pwrite(fd, view, offset)
                    view, offset = view[written:], offset + written
                os.fsync(fd)
            finally:
                os.close(fd)
            if not existed:
                os.fsync(parent)

    def _aside(self, pfd: int, f: StageFile, landing: Landing) -> None:
        """An effect that cannot land keeps its bytes, renamed so nothing retries it."""
        self._rename_aside(pfd, f)
        landing.refused += 1

    def _holder(self, pfd: int, f: StageFile) -> StageFile:
        """The file holding a staged append's bytes now: its stage, or the intent it became
        (``<n>.<hash>.applying-<offset>``) when the landing began."""
        if f.kind != "append" or _exists(pfd, f.name):
            return f
        intents = [
            g
            for g in self._scan(pfd)[0]
            if (g.execution_id, g.n, g.h, g.kind) == (f.execution_id, f.n, f.h, "applying")
        ]
        return intents[0] if intents else f

    @staticmethod
    def _rename_aside(pfd: int, f: StageFile) -> None:
        """Under the path's lock (or the staging execution's own): a file set aside before
        under the same number keeps its bytes (a failed stage's leftover and the effect
        committed under that number can both end here); the second is named apart."""
        with contextlib.suppress(FileNotFoundError):
            os.rename(f.name, _aside_name(pfd, f), src_dir_fd=pfd, dst_dir_fd=pfd)

    # ------------------------------------------------------------------ the effects log

    def _log_effect(self, s: _Step, *, redo: bool) -> None:
        """Tests and chaos runs: one line per landing, written under the path's lock before
        the bytes move (a crash over-counts, never hides one), with the commit's seq."""
        if not self.sandbox.effects_log:
            return
        line = {
            "scope": s.scope,
            "key": s.commit.key,
            "attempt": s.commit.attempt,
            "path": s.path,
            "kind": "write" if s.file.kind == "write" else "append",
            "execution_id": s.file.execution_id,
            "n": s.file.n,
            "seq": s.seq,
            "sha256": s.sha256,
            "redo": redo,
            "pid": os.getpid(),
            "t": time.time(),
        }
        jsonlines.append(self.sandbox.effects_log, line)

    # ------------------------------------------------------------------ results spooled

    def spool(self, execution_id: str, record: dict[str, Any]) -> None:
        """Keep a result the ledger could not take (it holds the lease token: 0600)."""
        self.pending_dir.mkdir(parents=True, exist_ok=True)
        data = json.dumps(record, ensure_ascii=False).encode("utf-8")
        _replace_durably(self.pending_dir / f"{execution_id}.spool", data, mode=0o600)

    def _read_spool(self, execution_id: str) -> dict[str, Any] | None:
        try:
            raw = _read_regular(self.pending_dir / f"{execution_id}.spool", None, "a spool")
        except FileNotFoundError:
            return None
        except OSError as exc:
            if not _not_a_file(exc):
                raise
            # a FIFO at a spool's name blocked every settle for ever (the sweep, read-only
            # calls, a worker's start), a link was followed (helper-101): set aside
            raise BadSpool(f"not a spooled result: {exc.strerror}") from None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
            raise BadSpool(f"not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
        if not isinstance(data, dict) or not all(
            isinstance(data.get(name), str) for name in ("lease_token", "status")
        ):
            raise BadSpool("not a spooled result (no lease token or status)")
        _check_spool(data)
        return data

    def sweep_refused(self, ledger: Ledger) -> int:
        """Remove the kept bytes of effects that could not land once a human reviewed their
        flag (``toolledger resolve``: landed by hand, or left); the number removed. Only the
        files those flags name (bytes set aside with no flag stay for a human); listed before
        the ledger is asked, and a name set aside again can only be taken once it is free."""
        if not self.pending_dir.is_dir():
            return 0
        with self._pending() as pfd:
            names = [n for n in os.listdir(pfd) if n.endswith(".refused")]
            ids = sorted({n.split(".", 1)[0] for n in names})
            if not ids:
                return 0
            prefix = f"{STATE_DIR}/pending/"
            done = {k.removeprefix(prefix) for k in ledger.reviewed_not_landed(ids)}
            removed = 0
            for name in names:
                if name not in done:
                    continue
                try:
                    os.unlink(name, dir_fd=pfd)
                    removed += 1
                except FileNotFoundError:
                    continue
            if removed:
                os.fsync(pfd)
        return removed

    def _spool_aside(self, execution_id: str) -> None:
        """A spool that can never be read keeps its bytes for a human, out of every pass."""
        with contextlib.suppress(FileNotFoundError):
            spool = self.pending_dir / f"{execution_id}.spool"
            spool.rename(spool.with_name(f"{spool.name}.refused"))

    def _spool_age(self, execution_id: str) -> float:
        """Seconds since the spool was written (0 if it is gone)."""
        try:
            written = os.stat(self.pending_dir / f"{execution_id}.spool", follow_symlinks=False)
        except FileNotFoundError:
            return 0.0
        return time.time() - written.st_mtime

    def _drop_spool(self, execution_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.pending_dir / f"{execution_id}.spool").unlink()

    # ------------------------------------------------------------------ settling

    def has_pending(self) -> bool:
        """Anything staged or spooled that a settle could act on (one directory listing)."""
        try:
            with os.scandir(self.pending_dir) as entries:
                return any(not e.name.endswith(".refused") for e in entries)
        except FileNotFoundError:
            return False

    def settle(self, ledger: Ledger, *, actor: str = "settle") -> Landing:
        """Finish what crashes and freezes left: record spooled results, land committed
        effects, drop revoked ones. Leaves alone what is still running. Never runs a tool."""
        from billiard.exceptions import SoftTimeLimitExceeded  # not at import: the CLI's start

        summary = Landing()
        if not self.pending_dir.is_dir():
            return summary
        with self._pending() as pfd:
            files, spools, leftovers = self._scan(pfd)
        if leftovers:
            self._clear_spool_leftovers(ledger, leftovers, summary)
        for eid in sorted(spools):
            # one spool that cannot be settled now stops neither the others nor the landing
            try:
                self._settle_spool(ledger, eid, actor, summary)
            except BadSpool as exc:
                self._spool_aside(eid)
                self._spool_failed(summary, eid, f"unreadable, set aside: {exc}")
            except SoftTimeLimitExceeded:
                raise  # the sweep task's time is up: this pass ends here, the next goes on
            except Exception as exc:  # noqa: BLE001 - the database, the disk, or a case we missed
                self._spool_failed(summary, eid, f"{type(exc).__name__}: {exc}")
        by_path: dict[str, list[StageFile]] = defaultdict(list)
        for f in files:
            if f.kind != "refused":
                by_path[f.h].append(f)
        if not by_path:
            return summary
        states = ledger.effect_states(sorted({f.execution_id for f in files}))
        for h, on_path in sorted(by_path.items()):
            if all(_is_running(states.get(f.execution_id)) for f in on_path):
                summary.left += len(on_path)
                continue
            try:
                with self._path_lock(h) as locked:
                    self._land_path(h, ledger, None, summary, locked)
            except PathBusy:
                summary.busy += 1
            except OSError as exc:  # this path's (a folder named like a stage, say): not the rest's
                problem = f"path {h} not settled: {type(exc).__name__}: {exc}"
                log.error("%s", problem)
                summary.problems.append(problem)
        return summary

    def _clear_spool_leftovers(
        self, ledger: Ledger, leftovers: dict[str, list[str]], summary: Landing
    ) -> None:
        """Remove the temporary files of spools (``<eid>.spool.tmpPID``) that processes
        killed while writing them left: nothing else would, and they piled up. Such a file
        holds no effect; the result it was to keep is lost, and its execution stands as the
        ledger says (it ended unknown, or another settle recorded it). Removed only once its
        execution no longer runs and the file is ``SPOOL_LEFTOVER_AGE`` old; the writer's
        PID decides nothing (a sandbox shared by containers sees other PID namespaces)."""
        states = ledger.effect_states(sorted(leftovers))
        now = time.time()
        with self._pending() as pfd:
            for eid, names in sorted(leftovers.items()):
                state = states.get(eid)
                if state is not None and state.status is Status.RUNNING:
                    continue  # its writer may be at work
                # an execution this ledger does not know: an unsure claim's, which may never
                # have committed (kept for ever, helper-103), or another ledger's, whose writer
                # would have to be frozen a day to lose its spool
                age = SPOOL_LEFTOVER_AGE * (24 if state is None else 1)
                for name in names:
                    try:
                        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                        if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < age:
                            continue
                        os.unlink(name, dir_fd=pfd)
                    except FileNotFoundError:
                        continue  # another settle's
                    except OSError as exc:  # the disk's: a later settle tries again
                        log.warning("spool leftover %s not removed: %s", name, exc)
                        continue
                    summary.leftovers += 1
                    log.info("removed %s, a spool's temporary file its killed writer left", name)

    @staticmethod
    def _spool_failed(summary: Landing, eid: str, why: str) -> None:
        problem = f"spooled result of {eid} not settled: {why}"
        log.error("%s", problem)
        summary.problems.append(problem)

    def _settle_spool(self, ledger: Ledger, eid: str, actor: str, summary: Landing) -> None:
        from toolledger.ledger.errors import StaleFence

        record = self._read_spool(eid)
        if record is None:
            return
        state = ledger.effect_states([eid]).get(eid)
        if state is None and record.get("reason") == CLAIM_UNKNOWN:
            # a claim whose commit its executor could not learn, not (yet) committed: its
            # statement may still be at the server, committing later (dropped at once, it lost
            # the proof that ends the call not_applied by itself: helper-103); an hour on it
            # never committed, nothing ran (or it is another ledger's such claim)
            if self._spool_age(eid) >= SPOOL_LEFTOVER_AGE:
                self._drop_spool(eid)
            else:
                summary.left += 1
            return
        if state is None:
            # Not this ledger's execution (every other spool is written after its claim's
            # commit), as a stage may be another's: a settle through the wrong ledger (an
            # unset TOOLLEDGER_DB made the embedded one) deleted the right one's spooled
            # result, the proof a call succeeded, and the call ended unknown (helper-97). Kept.
            summary.strangers += 1
            return
        if state.status is Status.RUNNING:
            if state.lease_token != record["lease_token"]:
                return  # not ours to judge (cannot happen: tokens are per execution)
            try:
                if record["status"] in ("succeeded", "failed"):  # what commits effects
                    self._check_staged(eid, state.scope, record.get("effects") or [])
                _record_by_lease(ledger, eid, record, state.scope)
                summary.recorded += 1
                self._drop_spool(eid)
                return
            except StaleFence:
                state = ledger.effect_states([eid]).get(eid)
            except BadSpool:
                # its stages gone because another settle recorded it and landed them since?
                token = state.lease_token
                state = ledger.effect_states([eid]).get(eid)
                if _is_running(state) and state is not None and state.lease_token == token:
                    raise
        if state is None:  # (cannot happen, its rows are kept: a stranger's if it did)
            summary.strangers += 1
            return
        if record["status"] in ("succeeded", "failed") and state.holds_own_write(
            Status(record["status"])
        ):
            # recorded meanwhile by another settle, or before the spool by its executor's own
            # commit whose answer was lost: the spool is that commit, not a late result
            self._drop_spool(eid)
            return
        if record.get("late") is not None:
            marker = record["late"]["spool"]
            if not any(e.detail.get("spool") == marker for e in ledger.evidence_of(eid)):
                ledger.record_late_result(
                    eid,
                    record["late"],
                    actor=actor,
                    outcome=_status(record.get("proves")),
                    idempotent=bool(record["late"].get("idempotent")),
                )
            summary.evidence += 1
        self._drop_spool(eid)

    def _check_staged(self, eid: str, scope: str, effects: list[dict[str, Any]]) -> None:
        """BadSpool unless the effects a spool would commit are exactly the bytes staged for
        its execution (while it runs, nothing removes them): its stage files, no fewer and no
        more, each of the size and digest named. A commit names only what lands, and all of it."""
        with self._pending() as pfd:
            staged = {
                f.name for f in self._scan(pfd)[0]
                if f.execution_id == eid and f.kind in ("write", "append")
            }  # fmt: skip
            for e in effects:
                name = StageFile(eid, e["n"], path_hash(scope, e["path"]), e["kind"]).name
                if name not in staged:
                    what = f"{e['n']} ({e['kind']} {e['path']!r})"
                    raise BadSpool(f"its effect {what} was not staged")
                staged.discard(name)
                try:
                    data = _read_at(pfd, name)
                except FileNotFoundError:
                    raise BadSpool(f"its effect {e['n']} was not staged") from None
                except OSError as exc:
                    if not _not_a_file(exc):
                        raise  # of a moment (EMFILE, say): the next pass reads it again
                    raise BadSpool(f"its effect {e['n']} is not a file ({exc})") from None
                if len(data) != e["size"] or hashlib.sha256(data).hexdigest() != e["sha256"]:
                    raise BadSpool(f"its effect {e['n']} names other bytes than were staged")
        if staged:
            raise BadSpool(f"it does not name {len(staged)} effect(s) staged for it")


#: The fields of a staged effect as ``Staged.to_json`` writes them, and their types.
_EFFECT_FIELDS = {"n": int, "kind": str, "path": str, "size": int, "sha256": str}
_STATUSES = frozenset(s.value for s in Status)


def _check_spool(data: dict[str, Any]) -> None:
    """BadSpool unless every field settling reads has the shape the executor writes: a spool
    edited or damaged into other JSON would otherwise fail every pass (or, its effects
    recorded, fail the landing of its path)."""
    late = data.get("late")
    if late is not None and not (isinstance(late, dict) and isinstance(late.get("spool"), str)):
        raise BadSpool("its late result is not one the executor writes")
    for name in ("error", "reason"):
        if data.get(name) is not None and not (
            isinstance(data[name], str) and "\x00" not in data[name]
        ):
            raise BadSpool(f"its {name} is not text a ledger stores")
    proves = data.get("proves")
    if proves is not None and not (isinstance(proves, str) and proves in _STATUSES):
        raise BadSpool("what it proves is not a status")
    try:  # what the executor spools is storable: no NaN, no lone surrogate
        json.dumps(data, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except ValueError as exc:  # UnicodeEncodeError is one
        raise BadSpool(f"it holds what no ledger stores ({exc})") from None
    if data["status"] not in ("succeeded", "failed"):
        return
    if not isinstance(data.get("result"), dict):
        raise BadSpool("its result is not an object")
    effects = data.get("effects")
    if effects is None:
        return
    if not isinstance(effects, list) or not all(
        isinstance(e, dict)
        and all(type(e.get(k)) is t for k, t in _EFFECT_FIELDS.items())
        and (e["n"], e["kind"]) in ((i, "write"), (i, "append"))
        for i, e in enumerate(effects)
    ):
        raise BadSpool("its effects are not the ones the executor stages")


def _record_by_lease(ledger: Ledger, eid: str, record: dict[str, Any], scope: str) -> None:
    """The write the executor could not make, made now under its own lease token."""
    from toolledger.ledger.errors import StaleFence

    token, status = record["lease_token"], record["status"]
    if status not in ("succeeded", "failed", "unknown", "not_started"):
        raise StaleFence(eid, "spooled after its revocation")
    if status in ("succeeded", "failed"):
        ledger.finish(
            eid,
            token,
            Status(status),
            record["result"],
            error=record.get("error"),
            effects=record.get("effects"),
            lock_keys=lock_keys(scope, record.get("effects") or []),
        )
        return
    ledger.mark_unknown(
        eid, reason=record.get("reason") or status, actor="settle", lease_token=token
    )
    if record.get("late") is not None:
        # as the executor's own word: under the call's row, and a person's "succeeded" decided
        # since the line above goes back to the inbox against it (recorded as plain evidence,
        # it told no one: helper-102)
        ledger.record_late_result(eid, record["late"], actor="settle", outcome=None)


def _status(value: str | None) -> Status | None:
    return Status(value) if value else None


def _names(f: StageFile, scope: str, path: str, kind: str) -> bool:
    """Whether a committed effect (its path and kind) is the one staged as ``f`` (same
    number): a stage file left by a stage that failed is never taken for another effect."""
    staged_kind = {"applying": "append", "replaced": f.was}.get(f.kind, f.kind)
    return staged_kind == kind and path_hash(scope, path) == f.h


def _committed(
    f: StageFile, mine: tuple[Commit, dict[int, Staged]] | None, known: dict[str, EffectState]
) -> _Step | None:
    """``f`` as the step of its execution's own commit (this lander's, or one the ledger
    says succeeded), or None if its execution did not commit it."""
    if mine is not None and f.execution_id == mine[0].execution_id:
        st = mine[1].get(f.n)
        if st is not None and _names(f, mine[0].scope, st.path, st.kind):
            return _Step(mine[0], f, st.path, st.sha256)
        return None
    state = known.get(f.execution_id)
    if state is None or not state.own_success or f.n >= len(state.effects):
        return None
    effect = state.effects[f.n]
    if not _names(f, state.scope, effect["path"], effect["kind"]):
        return None
    return _Step(Commit.of(state), f, effect["path"], effect["sha256"])


def _is_running(state: EffectState | None) -> bool:
    return state is not None and state.status is Status.RUNNING


def _order(s: _Step) -> tuple[int, int]:
    return (s.seq, s.file.n)


def _read_at(pfd: int, name: str) -> bytes:
    """A stage file's bytes: a regular file's (a link, a FIFO or a folder in its place is
    refused, never followed or waited on)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(name, flags, dir_fd=pfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(errno.EINVAL, f"a stage file is {kind_of(st.st_mode)}", name)
        chunks, left = [], st.st_size
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _aside_name(pfd: int, f: StageFile) -> str:
    """The name ``f``'s bytes take when set aside: ``<n>.<hash>.refused``, or, if a file set
    aside before under that number holds it, one named apart."""
    aside = StageFile(f.execution_id, f.n, f.h, "refused").name
    while _exists(pfd, aside):
        aside = f"{f.execution_id}.{f.n}.{f.h}.{secrets.token_hex(4)}.refused"
    return aside


def _exists(pfd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _read_regular(path: Path, limit: int | None, what: str) -> bytes:
    """A state file's bytes: a regular file's, at most ``limit`` of them if given (a link, a
    FIFO or a device in its place is refused, never followed or waited on: ``NotAFile`` or
    ELOOP). A spool has no limit: it holds a tool's result, which nothing bounds (a 64 MiB
    cap set aside a real executor's spool of a 33 MiB result: helper-102)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(errno.EINVAL, f"{what} is {kind_of(st.st_mode)}", str(path))
        if limit is not None and st.st_size > limit:
            raise NotAFile(errno.EFBIG, f"{what} is over {limit} bytes", str(path))
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            if limit is not None and sum(map(len, chunks)) > limit:  # it grew while read
                raise NotAFile(errno.EFBIG, f"{what} is over {limit} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def _replace_durably(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write a small file by temp + fsync + rename + directory fsync. The temporary file is
    this write's own (two threads of one process shared one name, and the second removed
    the first's: helper-102), made anew and never followed (a link planted at its name sent
    the write, and a truncation, wherever it pointed: helper-101)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, mode)
    try:
        try:
            view = memoryview(data)
            while view:  # a short write is not the whole file
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        # a full disk left an empty <name>.tmpPID for good, which nothing removed (a cold
        # review); the file it was to replace is as it was
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class StagingSandbox(Sandbox):
    """The sandbox as one running execution's tool sees it (``ctx.sandbox``): reads see what
    has landed; writes are staged for this execution, in its scope only, and refused once
    this process no longer holds the lease. They land after the execution's own commit."""

    def __init__(
        self, effects: Effects, scope: str, execution_id: str, lease: LeaseWatch | None
    ) -> None:
        base = effects.sandbox
        super().__init__(base.root, base.max_content_bytes)
        self._area = effects
        self.scope, self.execution_id, self.lease = scope, execution_id, lease
        self.staged: list[Staged] = []
        # A tool may stage from several threads, and one it started may outlive the call:
        # each effect's number is drawn and kept under this lock, and none after the seal.
        self._lock = threading.Lock()
        self._sealed = False

    def write_atomic(self, scope: str, path: str, data: bytes) -> Staged:
        """Set the file's content to ``data``: all of it or none of it, after the commit."""
        return self._stage(scope, path, data, "write")

    def append(self, scope: str, path: str, data: bytes) -> Staged:
        """Append ``data`` after the commit, exactly once. Not idempotent across calls."""
        return self._stage(scope, path, data, "append")

    def _stage(self, scope: str, path: str, data: bytes, kind: str) -> Staged:
        if scope != self.scope:
            raise PathRefused(f"an execution in scope {self.scope!r} cannot write in {scope!r}")
        if not path.isascii():
            try:  # a name with an undecodable byte, as os.listdir gives it: no ledger stores it
                path.encode("utf-8")
            except UnicodeEncodeError:
                raise PathRefused(f"path {path!a} is not valid Unicode") from None
        self.check_content(data)
        if self.lease is not None:
            self.lease.check()
        # Safe now (links too, and a name that would be a case or normalisation twin of one
        # made since the submit: refused here, the call fails, rather than committed as
        # succeeded and its bytes refused at landing); checked again when it lands.
        self.check(scope, path, kind=kind)
        with self._lock:
            if self._sealed:
                raise LeaseLost(f"{self.execution_id} has returned: no more effects")
            n = len(self.staged)
            staged = self._area.stage(scope, self.execution_id, n, kind, path, data)
            self.staged.append(staged)
        failpoints.hit("after_stage", self.execution_id)
        return staged

    def seal(self) -> list[Staged]:
        """Before the commit: make the staged effects durable; what the commit will name.
        A stage under way finishes first; any later one is refused."""
        with self._lock:
            self._sealed = True
            if self.staged:
                self._area.seal()
            return list(self.staged)
