"""Doorbells: how one process wakes others on the same machine without anyone polling.

The embedded default has no LISTEN/NOTIFY (SQLite) and no broker push (kombu's SQLAlchemy
transport). A process that waits binds a Unix datagram socket and announces it in a *bell
directory* next to the database file it waits on (``ledger.db.bells/``); a process that has
just committed something worth waking for *rings*: one datagram to every socket announced
there. A waiter then looks at the database — the ring says "look", never what happened, so a
lost, duplicated or stale ring costs at most one read, and a waiter still re-reads on a slow
fallback timer in case a ring never comes (another network namespace, a full socket buffer).

Socket paths are limited to ~108 bytes, and bell directories live wherever the database does,
so the socket itself is bound in a short per-user directory under the system's temporary
folder, and the bell directory holds a symbolic link to it. Ringing costs one ``listdir``
plus one non-blocking ``sendto`` per waiter; a link whose socket refuses (its process died)
is removed by the ringer.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import secrets
import select
import socket
import tempfile
from pathlib import Path

_SUFFIX = ".bell"
#: Largest datagram a ring sends (a batch of keys is cut to this).
MAX_PAYLOAD = 16 * 1024


@functools.lru_cache(maxsize=64)  # a ring a commit: the path resolved once a process
def bell_dir(database_file: str | os.PathLike[str]) -> Path:
    """The bell directory of a database file: beside it, ``NAME.bells``, of the file's real
    name (symlinks resolved, as SQLite and the writers' queue resolve them): a waiter reaching
    the ledger through a symlinked home listened beside the link, every committer rang beside
    the file, and waits fell back to polling (helper-90)."""
    return Path(f"{os.path.realpath(os.fspath(database_file))}.bells")


def _socket_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"toolledger-bells-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


class Doorbell:
    """One waiter's socket, announced in ``directory`` until closed."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        name = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.socket_path = _socket_dir() / f"{name}.sock"
        self.link = directory / f"{name}{_SUFFIX}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.socket_path))
        self.sock.setblocking(False)
        os.symlink(self.socket_path, self.link)

    def fileno(self) -> int:
        return self.sock.fileno()

    def wait(self, timeout: float | None) -> list[bytes]:
        """Block until rung or ``timeout``; every datagram waiting, [] on timeout."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        return self.drain() if ready else []

    def drain(self) -> list[bytes]:
        out: list[bytes] = []
        while True:
            try:
                out.append(self.sock.recv(MAX_PAYLOAD))
            except (BlockingIOError, InterruptedError):
                return out
            except OSError:
                return out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.link.unlink()
        with contextlib.suppress(OSError):
            self.socket_path.unlink()
        self.sock.close()

    def __enter__(self) -> Doorbell:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def ring(directory: Path, payload: bytes = b"") -> int:
    """Wake every waiter announced in ``directory``; how many were reached. Never raises:
    a ring is a courtesy, the database is the truth."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    reached = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        for name in names:
            if not name.endswith(_SUFFIX):
                continue
            link = directory / name
            try:
                sock.sendto(payload[:MAX_PAYLOAD], os.readlink(link))
                reached += 1
            except BlockingIOError:
                reached += 1  # its queue is full: it has rings to read, it will look
            except OSError as exc:
                if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):  # its process is gone
                    with contextlib.suppress(OSError):
                        link.unlink()
    return reached
