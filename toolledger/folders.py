"""The names in a folder, folded, kept current by inotify instead of listed at every check.

The alias check (``sandbox.refuse_alias``) compares a name about to be made with its folder's
siblings: at submit, and again where it is made (landing a write, making a directory). Listing
a folder is linear in its size, in the kernel: 0.89 ms for 2,000 names on ext4 here, paid twice
for every new file, and it decided a submit's cost in large folders.

``FolderNames`` lists a folder once, adds an inotify watch on it, and from then on applies the
kernel's events (created, deleted, moved in or out) to its folded names. It answers exactly what
a fresh listing would: the kernel queues the event of a name made or removed before that system
call returns, and every check first reads the whole queue; a name made concurrently with a
check is seen or not, as by a listing. An event adds a name; a removal is believed only once
the name is looked at (``_confirm``), because an exchange (renameat2 RENAME_EXCHANGE) reports
each of two names that stay as moved away. It steps aside (the caller lists) wherever it
cannot vouch for its answer:

- a folder on a filesystem where another machine or layer can change it (NFS, SMB, FUSE,
  overlay, ZFS's rollbacks …): only local filesystems whose changes all pass through this
  kernel are watched, asked folder by folder;
- the event queue overflowed, or applying events was interrupted: every folder is listed again;
- a folder deleted or unmounted: forgotten;
- inotify unavailable or out of watches or instances: the caller lists, as before;
- after a fork: the child starts with nothing (the parent's queue is not its own).

At most ``MAX_FOLDERS`` folders and ``MAX_NAMES`` names are kept, least recently used first out.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import struct
import threading
import unicodedata
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger("toolledger.folders")

#: Folders watched at most per process (each watch is one of fs.inotify.max_user_watches).
MAX_FOLDERS = 256
#: Names kept at most per process, all folders together (about 150 bytes each): a folder
#: larger than this is listed at every check, as before.
MAX_NAMES = 200_000

# inotify(7)
_IN_MOVED_FROM = 0x40
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_DELETE_SELF = 0x400
_IN_UNMOUNT = 0x2000
_IN_Q_OVERFLOW = 0x4000
_IN_IGNORED = 0x8000
_IN_ONLYDIR = 0x01000000
_WATCH = _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF | _IN_ONLYDIR
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name, NUL-padded

#: statfs(2) f_type of filesystems every change of which goes through this kernel's VFS (so
#: inotify sees it): ext2/3/4, XFS, Btrfs, tmpfs, F2FS. Not NFS, SMB, FUSE, overlay, 9p (another
#: machine or layer changes them), nor ZFS (a rollback or a receive rewrites folders silently).
LOCAL_FILESYSTEMS = frozenset({0xEF53, 0x58465342, 0x9123683E, 0x01021994, 0xF2F52010})


def local_filesystem(fd: int) -> bool:
    """Whether the folder open as ``fd`` is on one of ``LOCAL_FILESYSTEMS``."""
    return _libc().fs_type(fd) in LOCAL_FILESYSTEMS


@functools.cache
def _libc() -> _Libc:
    return _Libc()


def alias_key(name: str) -> str:
    """What a case-insensitive, normalisation-insensitive filesystem sees of ``name``: two
    names with one key are one file there (Unicode's canonical caseless match)."""
    return unicodedata.normalize("NFD", unicodedata.normalize("NFD", name).casefold())


def fold(name: str) -> str:
    """``alias_key``, cheaply for an ASCII name: its lower case (NFD leaves ASCII alone, and
    casefold is lower there)."""
    return name.lower() if name.isascii() else alias_key(name)


class _Libc:
    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.add_watch = libc.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.rm_watch = libc.inotify_rm_watch
        self.rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        self.fstatfs = libc.fstatfs
        self.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]

    def check(self, result: int) -> int:
        if result < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return result

    def fs_type(self, fd: int) -> int:
        buf = ctypes.create_string_buffer(256)  # struct statfs: f_type (a long) comes first
        self.check(self.fstatfs(fd, buf))
        return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


class FolderNames:
    """One process's watched folders: (st_dev, st_ino) -> {folded name: {names}}."""

    def __init__(self, list_names: Callable[[int], list[str]] = os.listdir) -> None:
        self._libc = _Libc()
        self._list = list_names
        self.fd = self._libc.check(self._libc.init1(os.O_NONBLOCK | os.O_CLOEXEC))
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._folders: OrderedDict[tuple[int, int], dict[str, set[str]]] = OrderedDict()
        self._wd_of: dict[tuple[int, int], int] = {}
        self._key_of: dict[int, tuple[int, int]] = {}
        self._sizes: dict[tuple[int, int], int] = {}  # names kept per folder
        # names an event said were removed, per folder and fold: looked at before answering
        self._doubts: dict[tuple[int, int], dict[str, set[str]]] = {}
        self.names = 0  # names kept, all folders together
        self.listed = 0  # folders listed (tests and the bench count them)
        self.closed = False

    def close(self) -> None:
        """Under the lock: no thread reads the fd once it is closed (its number may be reused
        by a file whose bytes would then be read as events)."""
        with self._lock:
            if not self.closed:
                self.closed = True
                os.close(self.fd)

    def siblings(self, parent: int, name: str) -> list[str] | None:
        """The names in the folder ``parent`` (an fd) that fold like ``name``, ``name``
        excluded — or None where this cannot vouch for them (the caller lists the folder)."""
        with self._lock:
            if self.closed:
                return None
            self._drain()
            st = os.fstat(parent)
            key = (st.st_dev, st.st_ino)
            names = self._folders.get(key)
            folded = fold(name)
            if names is None:
                names = self._watch(parent, key)
                if names is None:
                    return None
            else:
                self._folders.move_to_end(key)
                self._confirm(parent, key, folded)
            return sorted(n for n in names.get(folded, ()) if n != name)

    def _confirm(self, parent: int, key: tuple[int, int], folded: str) -> None:
        """Look at the names folding to ``folded`` that an event said were gone: a rename
        that exchanges two names (renameat2 RENAME_EXCHANGE) reports each name moved away
        and the other moved in, so one of the two names left in place comes last as removed.
        A name is only ever added by an event; its removal is believed once it is looked at."""
        doubts = self._doubts.get(key)
        if not doubts or folded not in doubts:
            return
        for n in doubts.pop(folded):
            self.names -= 1
            try:
                os.stat(n, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                continue
            self._add(key, folded, n)

    def _watch(self, parent: int, key: tuple[int, int]) -> dict[str, set[str]] | None:
        # asked for every folder, never cached by st_dev: a device number freed by an unmount
        # is handed to the next mount, which may be an overlay or a FUSE filesystem
        if self._libc.fs_type(parent) not in LOCAL_FILESYSTEMS:
            return None
        try:  # the watch first: a name made while listing is in the listing or the queue
            wd = self._libc.check(
                self._libc.add_watch(self.fd, f"/proc/self/fd/{parent}".encode(), _WATCH)
            )
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.ENOENT, errno.EACCES):
                return None  # out of watches (or no /proc): list, as before
            raise
        listing = self._list(parent)
        names: dict[str, set[str]] = {}
        for n in listing:
            names.setdefault(fold(n), set()).add(n)
        self.listed += 1
        old = self._key_of.get(wd)
        if old is not None and old != key:
            self._forget(old, remove_watch=False)
        if len(listing) > MAX_NAMES:  # too large to keep: this listing answers, once
            self._key_of.pop(wd, None)
            self._libc.rm_watch(self.fd, wd)
            return names
        self._folders[key], self._wd_of[key], self._key_of[wd] = names, wd, key
        self._sizes[key] = len(listing)
        self.names += len(listing)
        self._shrink(keep=key)
        return names

    def _shrink(self, keep: tuple[int, int] | None = None) -> None:
        """Drop the least recently used folders beyond MAX_FOLDERS or MAX_NAMES."""
        while len(self._folders) > MAX_FOLDERS or self.names > MAX_NAMES:
            oldest = next((k for k in self._folders if k != keep), None)
            if oldest is None:
                return
            self._forget(oldest, remove_watch=True)

    def _forget(self, key: tuple[int, int], *, remove_watch: bool) -> None:
        self._folders.pop(key, None)
        self.names -= self._sizes.pop(key, 0)
        self.names -= sum(len(d) for d in self._doubts.pop(key, {}).values())
        wd = self._wd_of.pop(key, None)
        if wd is not None:
            self._key_of.pop(wd, None)
            if remove_watch:
                self._libc.rm_watch(self.fd, wd)  # its IN_IGNORED arrives later: unknown wd

    def _drain(self) -> None:
        """Apply every queued event. Events read are gone from the kernel's queue: if applying
        them is interrupted (any exception, KeyboardInterrupt and timeouts included), every
        folder is forgotten, to be listed again, before the exception goes on."""
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                self._shrink()
                return
            if not data:
                raise OSError(errno.EBADF, "the inotify descriptor read as a file")
            try:
                at = 0
                while at < len(data):
                    wd, mask, _, size = _EVENT.unpack_from(data, at)
                    raw = data[at + _EVENT.size : at + _EVENT.size + size].rstrip(b"\0")
                    at += _EVENT.size + size
                    self._apply(wd, mask, os.fsdecode(raw))
            except BaseException:
                for watched in list(self._folders):
                    self._forget(watched, remove_watch=True)
                raise

    def _apply(self, wd: int, mask: int, name: str) -> None:
        if mask & _IN_Q_OVERFLOW:  # events were lost: list every folder again
            log.info("inotify queue overflowed: folders will be listed again")
            for watched in list(self._folders):
                self._forget(watched, remove_watch=True)
            return
        key = self._key_of.get(wd)
        if key is None:
            return
        if mask & (_IN_IGNORED | _IN_DELETE_SELF | _IN_UNMOUNT):
            self._forget(key, remove_watch=False)
            return
        folded = fold(name)
        present = self._folders[key].get(folded)
        doubts = self._doubts.setdefault(key, {})
        doubted = doubts.get(folded)
        if mask & (_IN_CREATE | _IN_MOVED_TO):
            if doubted is not None and name in doubted:
                doubted.discard(name)
                self.names -= 1
            self._add(key, folded, name)
        elif mask & (_IN_DELETE | _IN_MOVED_FROM):
            known = False
            if present is not None and name in present:
                present.discard(name)
                self._sizes[key] -= 1
                self.names -= 1
                if not present:
                    del self._folders[key][folded]
                known = True
            if known or (doubted is not None and name in doubted):
                # believed once looked at (_confirm): an exchange reports a name that stays
                doubts.setdefault(folded, set())
                if name not in doubts[folded]:
                    doubts[folded].add(name)
                    self.names += 1

    def _add(self, key: tuple[int, int], folded: str, name: str) -> None:
        same = self._folders[key].setdefault(folded, set())
        if name not in same:
            same.add(name)
            self._sizes[key] += 1
            self.names += 1


_index: FolderNames | None = None
_index_lock = threading.Lock()
_disabled = False


def index() -> FolderNames | None:
    """This process's ``FolderNames``, made on first use; None where inotify is not there
    (TOOLLEDGER_FOLDER_WATCH=off turns it off)."""
    global _index, _disabled
    if _disabled:
        return None
    found = _index
    if found is not None and found.pid == os.getpid():
        return found
    with _index_lock:
        if _index is None or _index.pid != os.getpid():
            from toolledger.config import switch

            if not switch(os.environ, "TOOLLEDGER_FOLDER_WATCH"):
                _disabled = True
                return None
            try:
                _index = FolderNames()
            except (OSError, AttributeError) as exc:  # no inotify (not Linux), no instances
                log.info("folder names are listed at every check: %s", exc)
                _disabled = True
                return None
        return _index


def siblings(parent: int, name: str) -> list[str] | None:
    """``FolderNames.siblings`` of this process's index; None (list the folder) without one,
    or if it failed — then it is dropped for good in this process, and listing takes over."""
    global _index, _disabled
    found = index()
    if found is None:
        return None
    try:
        return found.siblings(parent, name)
    except BaseException as exc:  # never let the index decide on a state it lost track of
        if not isinstance(exc, _ITS_OWN):  # an interrupt, a (soft) time limit: not its fault
            raise  # (what it had read is forgotten: _drain)
        log.exception("the folder index failed: folders are listed at every check from now on")
        with _index_lock:
            _disabled, _index = True, None
        with contextlib.suppress(OSError):
            found.close()
        return None


#: What a broken index raises (a system call refused, a bug): it is then dropped, and the
#: alias check lists folders. Anything else (KeyboardInterrupt, Celery's SoftTimeLimitExceeded)
#: is the caller's and goes on.
_ITS_OWN = (
    OSError,
    LookupError,
    ValueError,
    TypeError,
    AttributeError,
    RuntimeError,
    struct.error,
)


def _after_fork_in_child() -> None:
    """The child starts with no index: the parent's event queue is not its own."""
    global _index, _index_lock
    _index_lock = threading.Lock()  # another thread may have held it at the fork
    if _index is not None:
        inherited, _index = _index, None
        with contextlib.suppress(OSError):
            os.close(inherited.fd)


os.register_at_fork(after_in_child=_after_fork_in_child)
