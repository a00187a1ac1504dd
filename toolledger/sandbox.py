"""The sandbox (DESIGN §8): one directory per scope, no path leaves it, no symlink is followed.

Every path is checked lexically (relative, no NUL, no ``.``/``..``, no empty or over-long
component), then walked one component at a time with ``openat(dir_fd, …, O_NOFOLLOW)``, so a
symlink anywhere on the path is refused and a directory swapped for a symlink after the check
cannot redirect a write: the write happens through the file descriptors the walk opened.
Targets must be regular files or absent.

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
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from toolledger.ledger.errors import InputError
from toolledger.ledger.identity import check_scope

if TYPE_CHECKING:
    from toolledger.config import Settings
    from toolledger.effects import Staged

#: Limits on a path inside a scope.
MAX_COMPONENT_BYTES = 255
MAX_PATH_CHARS = 1024
MAX_DEPTH = 32

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SandboxError(InputError):
    """The sandbox refused the path or the content; nothing was written."""


class PathRefused(SandboxError):
    """The path is not a safe path inside the scope's directory."""


class ContentTooLarge(SandboxError):
    """The content is over the configured cap."""


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
    parts = path.split("/")
    if len(parts) > MAX_DEPTH:
        raise PathRefused(f"path {path!r} is deeper than {MAX_DEPTH} components")
    for part in parts:
        if part in ("", ".", ".."):
            raise PathRefused(f"path {path!r} has an empty, '.' or '..' component")
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT_BYTES:
            raise PathRefused(f"path {path!r} has a component over {MAX_COMPONENT_BYTES} bytes")
    return parts


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
        self, scope: str, path: str, *, create: bool
    ) -> Iterator[tuple[int | None, str]]:
        """The directory fd holding the path's last component (None if a parent is absent)."""
        parts = split_path(path)
        check_scope(scope)
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
            for name in [scope, *parts[:-1]]:
                fd = self._open_dir(fds[-1], name, path, create=create)
                if fd is None:
                    yield None, parts[-1]
                    return
                fds.append(fd)
            yield fds[-1], parts[-1]
        finally:
            for fd in reversed(fds):
                os.close(fd)

    @staticmethod
    def _open_dir(parent: int, name: str, path: str, *, create: bool) -> int | None:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=parent)
            return Sandbox._open_dir(parent, name, path, create=False)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                found = kind_of(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
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

    # -------------------------------------------------------------------- checks and reads

    def check(self, scope: str, path: str) -> None:
        """Refuse a path that is unsafe now (submit time); absent targets are fine."""
        with self.open_parent(scope, path, create=False) as (parent, name):
            if parent is not None:
                self.target_stat(parent, name, path)

    @contextlib.contextmanager
    def _open_regular(self, scope: str, path: str) -> Iterator[int | None]:
        """An fd of the regular file at ``path`` for reading, None if absent."""
        with self.open_parent(scope, path, create=False) as (parent, name):
            if parent is None or self.target_stat(parent, name, path) is None:
                yield None
                return
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fd = os.open(name, flags, dir_fd=parent)
            except FileNotFoundError:
                yield None
                return
            try:
                mode = os.fstat(fd).st_mode
                if not stat.S_ISREG(mode):  # swapped since the lstat
                    raise PathRefused(f"path {path!r} is {kind_of(mode)}")
                yield fd
            finally:
                os.close(fd)

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
