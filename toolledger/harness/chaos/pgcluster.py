"""A Postgres cluster of the chaos run's own: initdb into the run's directory, its own port and
socket directory, started, crashed (SIGKILL of the postmaster) and started again by the
harness. The suite's shared server is never touched.

Postgres refuses to run as root: as root, the cluster belongs to the ``postgres`` user and its
programs run through ``runuser``. ``find_bin()`` looks for ``initdb`` on PATH and in Debian's
``/usr/lib/postgresql/<version>/bin``.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

OWNER = "postgres"


def find_bin() -> Path | None:
    """The directory holding initdb/pg_ctl, None if Postgres's programs are not installed."""
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    return Path(found[0]).parent if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PgCluster:
    """One throwaway cluster: ``start()``, ``crash()``, ``start()`` again, ``destroy()``."""

    root: Path
    bin: Path
    port: int = 0

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def sockets(self) -> Path:
        return self.root / "sock"

    @property
    def unix_socket(self) -> str:
        return str(self.sockets / f".s.PGSQL.{self.port}")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        prefix = ["runuser", "-u", OWNER, "--"] if os.geteuid() == 0 else []
        return subprocess.run(
            [*prefix, *argv], check=check, capture_output=True, text=True, timeout=120
        )

    def init(self) -> PgCluster:
        self.port = self.port or free_port()
        self.sockets.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, OWNER)
            shutil.chown(self.sockets, OWNER)
        self._run(
            str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
            "--no-instructions", "-E", "UTF8",
        )  # fmt: skip
        options = {
            "port": self.port,
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.sockets}'",
            "max_connections": 300,
            "fsync": "on",
            "synchronous_commit": "on",
            "shared_buffers": "'64MB'",
        }
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("".join(f"{k} = {v}\n" for k, v in options.items()))
        return self

    def start(self, timeout: float = 60) -> None:
        log = self.root / "postgres.log"
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(log), "-w",
            "-t", str(int(timeout)), "start",
        )  # fmt: skip

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def crash(self) -> int | None:
        """SIGKILL the postmaster: every backend goes with it, crash recovery at next start."""
        pid = self.postmaster_pid()
        if pid is None:
            return None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self._alive(pid):
            time.sleep(0.05)
        # the backends notice their postmaster died and exit; wait until the port is free
        while time.monotonic() < deadline and self._listening():
            time.sleep(0.05)
        return pid

    @staticmethod
    def _alive(pid: int) -> bool:
        """Until it is reaped: Postgres's own lock-file check takes a zombie for alive."""
        return psutil.pid_exists(pid)

    def _listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        if self.postmaster_pid() is not None:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w",
                      "stop", check=False)  # fmt: skip

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)
