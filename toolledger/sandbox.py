"""The sandbox (DESIGN §8): one directory per scope, no path leaves it, no symlink is followed.

Every path is checked lexically (relative, no NUL, no ``.``/``..``, no empty or over-long
component), then walked one component at a time with ``openat(dir_fd, …, O_NOFOLLOW)``, so a
symlink anywhere on the path is refused and a directory swapped for a symlink after the check
cannot redirect a write: the write happens through the file descriptors the walk opened.
Targets must be regular files or absent.

Hard links. A regular file with more than one link may be another name of a file outside the
scope (``/etc/…``, a neighbour scope's file): what is read or appended through it leaves the
sandbox. So a file is read, hashed or appended to only if the descriptor opened on it
(``O_NOFOLLOW``) says ``st_nlink == 1`` — checked by ``fstat`` on that descriptor, never by a
``stat`` before the open, so the link cannot be swapped in between. A write needs no such
check: it lands by ``rename``, which replaces the link and leaves the other file alone.

Names other filesystems alias. A sandbox is one directory tree, but it may be copied to, or
mounted from, a filesystem with other rules (Windows, macOS's default case-insensitive APFS),
where two names this one keeps apart are one file. Refused in every path component and scope:
a backslash and the other characters Windows forbids or reinterprets (``: * ? " < > |``), a
component ending in a dot or a space (Windows strips them), and the Windows device names
(``CON``, ``PRN``, ``AUX``, ``NUL``, ``CONIN$``, ``CONOUT$``, ``COM0``-``COM9``,
``LPT0``-``LPT9`` and their superscript-digit forms) in any case, with or without an
extension. Names that differ only by letter case (or Unicode normalisation: NFC and NFD of one
name) are **refused, not normalised** — a normalised name would no longer be the one the
caller asked for and its receipt names: when the sandbox is about to create a name (at submit,
and again where it lands) it compares it with its directory's entries (one ``listdir``, only
for a name that does not exist yet), and the first time a process uses a scope it compares the
scope with the root's entries; a match that is not equal is refused, naming both.

This class reads and checks. Writes belong to running executions only, and are fenced by
the ledger (DESIGN invariant 10): a tool's ``ctx.sandbox`` stages its bytes, and they land —
atomically, durably — only after the execution's own terminal commit (``worker.effects``).
Outside a running execution (submit-time checks, reconcilers) every write is refused.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from toolledger import folders
from toolledger.folders import alias_key
from toolledger.ledger.errors import InputError
from toolledger.ledger.identity import check_scope
from toolledger.ledger.inputs import INVISIBLE

if TYPE_CHECKING:
    from toolledger.config import Settings
    from toolledger.effects import Staged

#: Limits on a path inside a scope.
MAX_COMPONENT_BYTES = 255
MAX_PATH_CHARS = 1024
MAX_DEPTH = 32

#: Characters Windows forbids in a name or reads as syntax (a separator, a stream, a wildcard).
WINDOWS_FORBIDDEN = frozenset('\\:*?"<>|')
#: Names Windows reads as devices, in any case, with or without an extension.
WINDOWS_DEVICES = frozenset(
    ["CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$"]
    + [f"{port}{n}" for port in ("COM", "LPT") for n in "0123456789\u00b9\u00b2\u00b3"]
)
#: What may be done at a path: a write replaces the file, the others go through it.
KINDS = ("write", "append", "read")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Opening a file only to fstat it: O_PATH where there is one (no read permission needed, no
#: side effect of opening a device); the kind is checked on the descriptor either way.
_PROBE_FLAGS = getattr(os, "O_PATH", os.O_RDONLY | os.O_NONBLOCK) | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: (root, scope) pairs this process has compared with the root's other entries (``Sandbox``).
_SCOPES_COMPARED: set[tuple[str, str]] = set()


class SandboxError(InputError):
    """The sandbox refused the path or the content; nothing was written."""


class PathRefused(SandboxError):
    """The path is not a safe path inside the scope's directory."""


class ContentTooLarge(SandboxError):
    """The content is over the configured cap."""


class HardLinkRefused(PathRefused):
    """The file has more than one hard link: reading or appending through it may leave the
    sandbox."""


class AliasRefused(PathRefused):
    """The name differs from an existing sibling only by case (or Unicode normalisation):
    one file where names fold case."""


def check_name(name: str, what: str) -> None:
    """Refuse a component (or a scope) that Windows would read differently: a trailing dot or
    space (stripped), a device name (``NUL.txt`` is the null device). ``what`` names the
    caller's path or scope in the message."""
    if name[-1] in ". ":
        raise PathRefused(f"{what} has a component ending in a dot or a space ({name!r})")
    if name.split(".", 1)[0].rstrip(" ").upper() in WINDOWS_DEVICES:
        raise PathRefused(f"{what} has a component named after a Windows device ({name!r})")


def _folds_to(other: str, key: str) -> bool:
    """``alias_key(other) == key``, cheaply for the common case: an ASCII name's key is its
    lower case (NFD leaves ASCII alone; casefold is lower there), and it can only equal an
    ASCII key of its length. A name with any other character (a ligature, the Kelvin sign
    fold onto ASCII letters) takes the whole fold. The sandbox lists a folder for every name
    it is about to make: with thousands of siblings this decided a job's cost."""
    if other.isascii() and len(other) != len(key):
        return False
    return folders.fold(other) == key


def refuse_hard_link(st: os.stat_result, path: str, verb: str) -> None:
    """HardLinkRefused if ``st`` (an fstat of the opened file) counts more than one link."""
    if st.st_nlink > 1:
        raise HardLinkRefused(
            f"path {path!r} has {st.st_nlink} hard links; refusing to {verb} through a hard link"
        )


def split_path(path: str) -> list[str]:
    """The components of a safe relative path, or PathRefused saying why not."""
    if not isinstance(path, str) or not path:
        raise PathRefused("path must be a non-empty string")
    if "\x00" in path:
        raise PathRefused(f"path {path!r} contains a NUL byte")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in path):
        raise PathRefused(f"path {path!r} contains a control character")
    if path.startswith("/"):
        raise PathRefused(f"path {path!r} is absolute; paths are relative to the scope")
    if len(path) > MAX_PATH_CHARS:
        raise PathRefused(f"path is longer than {MAX_PATH_CHARS} characters")
    if "\\" in path:
        raise PathRefused(f"path {path!r} contains a backslash; components are separated by '/'")
    if forbidden := sorted(WINDOWS_FORBIDDEN.intersection(path)):
        raise PathRefused(f"path {path!r} contains {''.join(forbidden)!r}, which Windows forbids")
    try:  # a name os.listdir gave (an undecodable byte, escaped) is one; a lone surrogate is not
        path.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise PathRefused(f"path {path!a} is not valid Unicode (a lone surrogate)") from None
    parts = path.split("/")
    if len(parts) > MAX_DEPTH:
        raise PathRefused(f"path {path!r} is deeper than {MAX_DEPTH} components")
    for part in parts:
        if part in ("", ".", ".."):
            raise PathRefused(f"path {path!r} has an empty, '.' or '..' component")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT_BYTES:
            raise PathRefused(f"path {path!r} has a component over {MAX_COMPONENT_BYTES} bytes")
        check_name(part, f"path {path!r}")
    return parts


def refuse_invisible(path: str) -> None:
    """PathRefused for a path holding a character that does not show as itself (a control,
    format, line or paragraph separator character, Cc Cf Zl Zp: a bidirectional override, a
    zero-width space; or a mark drawn as nothing; a space separator, Zs, is accepted):
    ``invoice<U+202E>fdp.sh`` looked like ``invoicehs.pdf`` to the person approving it (a cold
    review). The built-in tools call it at submit only: a call recorded before runs as it was
    approved."""
    split_path(path)  # its own refusals first (a NUL, a control character, "..")
    if bad := INVISIBLE.search(path):
        ch = bad.group()
        kind = (
            "a mark drawn as nothing (a variation selector or its kin)"
            if unicodedata.category(ch) == "Mn"
            else "a control, format, line or paragraph separator character"
        )
        raise PathRefused(
            f"path {path!r} contains U+{ord(ch):04X}, {kind} that does not show as itself"
        )


def alias_among(names: list[str], name: str) -> str | None:
    """The first of ``names`` (a directory's listing) other than ``name`` that is one file
    with it where names fold case, or None. A listing of ASCII names, the common case, is
    folded in one pass (its lower case, searched as one string, in C): a folder of ten
    thousand files is one ``lower`` and one ``count``, not ten thousand comparisons; each
    landing of a new name lists its folder, so this decided a write's cost as folders grew."""
    key = alias_key(name)
    # each name between separators of its own: count() does not overlap its matches
    joined = "\0" + "\0\0".join(names) + "\0"
    if joined.isascii():
        if not key.isascii():  # an ASCII name's key is ASCII: none of these can match
            return None
        found = joined.lower().count(f"\0{key}\0")
        if found == 0 or (found == 1 and f"\0{name}\0" in joined):
            return None
    for other in names:
        if other != name and _folds_to(other, key):
            return other
    return None


def refuse_alias(parent: int, name: str, what: str) -> None:
    """AliasRefused if a sibling of ``name`` in the directory ``parent`` differs from it only
    by case or Unicode normalisation. Called only for names about to be made. The folder's
    names come from ``folders`` (listed once, then kept current by inotify) where it can
    vouch for them, else from a listing."""
    found = folders.siblings(parent, name)
    other = (
        (found[0] if found else None)
        if found is not None
        else alias_among(os.listdir(parent), name)
    )
    if other is not None:
        raise AliasRefused(
            f"{what}: {name!r} and the existing {other!r} differ only by letter case or "
            "Unicode normalisation (one name where names fold case); refusing it"
        )


def kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


class Sandbox:
    """Files of each scope under ``root/<scope>/``, reached only through safe paths."""

    def __init__(
        self,
        root: Path,
        max_content_bytes: int = 512 * 1024,
        *,
        effects_log: str = "",
        lock_wait: float = 2.0,
    ) -> None:
        self.root = Path(root)
        self.max_content_bytes = max_content_bytes
        self.effects_log = effects_log  # tests and chaos: one JSON line per effect landed
        self.lock_wait = lock_wait  # seconds a publisher waits for a path's lock

    @classmethod
    def configured(cls, settings: Settings) -> Sandbox:
        """The sandbox as ``settings`` describe it (root, content cap, lock wait, effects log)."""
        return cls(
            settings.sandbox,
            settings.max_content_bytes,
            effects_log=settings.effects_log,
            lock_wait=settings.lock_wait,
        )

    def prepare(self) -> Sandbox:
        """Create the root and its state directory (a worker does, at start)."""
        (self.root / ".toolledger").mkdir(parents=True, exist_ok=True)
        return self

    @property
    def attached(self) -> bool:
        """This process sees the sandbox the workers write (not an empty or absent directory
        on another machine): only then can a look at its files prove anything."""
        return (self.root / ".toolledger").is_dir()

    def scope_dir(self, scope: str) -> Path:
        return self.root / check_scope(scope)

    def check_content(self, data: bytes) -> None:
        if len(data) > self.max_content_bytes:
            raise ContentTooLarge(
                f"content is {len(data)} bytes, over the cap of {self.max_content_bytes}"
            )

    # -------------------------------------------------------------------- walking

    @contextlib.contextmanager
    def open_parent(
        self, scope: str, path: str, *, create: bool, compare: bool | None = None
    ) -> Iterator[tuple[int | None, str]]:
        """The directory fd holding the path's last component (None if a parent is absent).

        ``create``: make the missing directories. ``compare`` (default: ``create``): a missing
        directory is compared with its siblings (``refuse_alias``) — after it is made, so that
        of two processes making aliasing names at once at least one sees the other."""
        parts = split_path(path)
        check_scope(scope)
        check_name(scope, f"scope {scope!r}")
        compare = create if compare is None else compare
        fds: list[int] = []
        try:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
            try:
                fds.append(os.open(self.root, flags))
            except FileNotFoundError:
                if not create:
                    yield None, parts[-1]
                    return
                self.root.mkdir(parents=True, exist_ok=True)
                fds.append(os.open(self.root, flags))
            for i, name in enumerate([scope, *parts[:-1]]):
                what = f"scope {scope!r}" if i == 0 else f"path {path!r}"
                fd = self._open_dir(fds[-1], name, path, what, create=create, compare=compare)
                if fd is None:
                    yield None, parts[-1]
                    return
                fds.append(fd)
                if i == 0:
                    self._compare_scope(fds[0], scope)
            yield fds[-1], parts[-1]
        finally:
            for fd in reversed(fds):
                os.close(fd)

    def _compare_scope(self, root: int, scope: str) -> None:
        """Once per process and scope: refuse a scope whose directory another scope's aliases
        (on a case-insensitive filesystem ``conv`` opens ``Conv``'s directory)."""
        seen = (os.fspath(self.root), scope)
        if seen not in _SCOPES_COMPARED:
            refuse_alias(root, scope, f"scope {scope!r}")
            _SCOPES_COMPARED.add(seen)

    @staticmethod
    def _open_dir(
        parent: int, name: str, path: str, what: str, *, create: bool, compare: bool
    ) -> int | None:
        """The directory ``name`` in ``parent`` (None if absent and not ``create``); a
        symlink or anything but a directory there is refused. ``what`` names it in errors."""
        again = (parent, name, path, what)
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                if compare:  # it would be made: refuse now (at submit) what landing would
                    refuse_alias(parent, name, what)
                return None
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:  # someone else made it: they compared it
                return Sandbox._open_dir(*again, create=False, compare=False)
            fd = Sandbox._open_dir(*again, create=False, compare=False)
            try:
                refuse_alias(parent, name, what)
            except AliasRefused:
                if fd is not None:
                    os.close(fd)
                with contextlib.suppress(OSError):  # ours and empty: leave nothing behind
                    os.rmdir(name, dir_fd=parent)
                raise
            return fd
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
                # a file where a folder should be is one: it said "not a regular file"
                found = "a regular file" if stat.S_ISREG(mode) else kind_of(mode)
                raise PathRefused(f"path {path!r} goes through {name!r}, {found}") from None
            raise

    @staticmethod
    def target_stat(parent: int, name: str, path: str) -> os.stat_result | None:
        """The target's lstat, None if absent; PathRefused unless it is a regular file."""
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise PathRefused(f"path {path!r} is {kind_of(st.st_mode)}, not a regular file")
        return st

    @staticmethod
    @contextlib.contextmanager
    def open_target(
        parent: int, name: str, path: str, flags: int, verb: str | None
    ) -> Iterator[int | None]:
        """An fd of the regular file ``name`` opened with ``flags`` (which hold O_NOFOLLOW),
        None if absent. Its kind, and unless ``verb`` is None its link count, are checked on
        the fd itself: what was swapped in after an lstat is what gets refused."""
        try:
            fd = os.open(name, flags, dir_fd=parent)
        except FileNotFoundError:
            yield None
            return
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink swapped in since the lstat
                raise PathRefused(f"path {path!r} is a symlink") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise PathRefused(f"path {path!r} is {kind_of(st.st_mode)}")
            if verb is not None:
                refuse_hard_link(st, path, verb)
            yield fd
        finally:
            os.close(fd)

    # -------------------------------------------------------------------- checks and reads

    def check(self, scope: str, path: str, *, kind: str = "write", compare: bool = True) -> None:
        """Refuse a path that is unsafe now for ``kind`` (submit time); absent targets are
        fine. ``append`` and ``read`` also refuse a hard-linked target; ``write`` and
        ``append``, which may create names, compare the ones that do not exist yet with their
        siblings unless ``compare`` is False."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        compare = compare and kind != "read"
        with self.open_parent(scope, path, create=False, compare=compare) as (parent, name):
            if parent is None:
                return
            if self.target_stat(parent, name, path) is None:
                if compare:
                    refuse_alias(parent, name, f"path {path!r}")
                return
            if kind != "write":
                with self.open_target(parent, name, path, _PROBE_FLAGS, kind):
                    pass

    @contextlib.contextmanager
    def _open_regular(self, scope: str, path: str) -> Iterator[int | None]:
        """An fd of the regular, singly linked file at ``path`` for reading, None if absent."""
        with self.open_parent(scope, path, create=False) as (parent, name):
            if parent is None or self.target_stat(parent, name, path) is None:
                yield None
                return
            with self.open_target(parent, name, path, _READ_FLAGS, "read") as fd:
                yield fd

    @contextlib.contextmanager
    def open_regular(self, scope: str, path: str) -> Iterator[int | None]:
        """An fd of the regular, singly linked file at ``path`` to ``fstat`` and read (never
        a symlink, never blocking on a FIFO), None if absent: a reader that keeps what it
        learnt of a file by its identity and times (the console's file check) reads only the
        file it stated."""
        with self._open_regular(scope, path) as fd:
            yield fd

    def read(self, scope: str, path: str, max_bytes: int | None = None) -> bytes | None:
        """The file's bytes, or None if absent. Never follows a symlink, never blocks on a FIFO."""
        limit = self.max_content_bytes if max_bytes is None else max_bytes
        with self._open_regular(scope, path) as fd:
            if fd is None:
                return None
            size = os.fstat(fd).st_size
            if size > limit:
                raise ContentTooLarge(f"{path!r} is {size} bytes, over the cap of {limit}")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(limit)

    def sha256(self, scope: str, path: str) -> str | None:
        """SHA-256 of the file's bytes, None if absent (for reconcilers; changes nothing)."""
        with self._open_regular(scope, path) as fd:
            if fd is None:
                return None
            digest = hashlib.sha256()
            with os.fdopen(fd, "rb", closefd=False) as f:
                for block in iter(lambda: f.read(1 << 16), b""):
                    digest.update(block)
            return digest.hexdigest()

    def stat(self, scope: str, path: str) -> os.stat_result | None:
        with self.open_parent(scope, path, create=False) as (parent, name):
            return None if parent is None else self.target_stat(parent, name, path)

    def write_atomic(self, scope: str, path: str, data: bytes) -> Staged:
        """Only a running execution writes: through ``staging()``, fenced by the ledger."""
        raise SandboxError("the sandbox is written only by a running execution (ctx.sandbox)")

    def append(self, scope: str, path: str, data: bytes) -> Staged:
        """Only a running execution appends: through ``staging()``, fenced by the ledger."""
        raise SandboxError("the sandbox is written only by a running execution (ctx.sandbox)")
