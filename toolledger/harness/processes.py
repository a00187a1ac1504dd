"""Real worker and beat processes, started, signalled and restarted as a supervisor would.

Used by ``toolledger demo`` and ``toolledger chaos`` and by the acceptance tests: each
process runs in its own session (so a whole worker — main process and pool children — can
be stopped together) and logs to its own file, which is how readiness is detected.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

READY_MARKERS = {"worker": " ready.", "beat": "beat: Starting...", "peer": "bench-peer ready"}


def toolledger_argv() -> list[str]:
    return [sys.executable, "-m", "toolledger"]


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    try:
        return sorted(c.pid for c in psutil.Process(pid).children())
    except psutil.Error:  # gone
        return []


def process_state(pid: int) -> str | None:
    """psutil's status of ``pid`` (``psutil.STATUS_STOPPED`` once SIGSTOPped), None if gone."""
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return None


@dataclass
class ManagedProcess:
    name: str
    kind: str  # "worker" | "beat"
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cwd: Path | None = None  # where to run it (a checkout of another version, in chaos)
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    _log_offset: int = field(default=0, repr=False)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        return self

    def log_text(self, since_start: bool = True) -> str:
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(self._log_offset if since_start else 0)
            return f.read().decode("utf-8", "replace")

    def wait_ready(self, timeout: float = 60.0) -> ManagedProcess:
        marker, deadline = READY_MARKERS[self.kind], time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker in self.log_text():
                return self
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited ({self.proc and self.proc.returncode}):\n"
                    f"{self.log_text()[-3000:]}"
                )
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log_text()[-3000:]}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def children(self) -> list[int]:
        return children_of(self.pid) if self.alive() else []

    def signal(self, sig: int, *, group: bool = False) -> None:
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the main process and everything in its session (a host crash)."""
        self.signal(signal.SIGKILL, group=True)
        self.wait(10)

    def stop(self, timeout: float = 20.0, *, warm: bool = True) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL whatever is left. ``warm=False`` goes
        straight to SIGKILL: for a teardown that has nothing left to read (Celery's warm
        shutdown of an idle prefork worker takes ~2.5 s, most of it its pool's joins)."""
        if self.alive():
            if not warm:
                self.kill()
            else:
                self.signal(signal.SIGCONT, group=True)
                self.signal(signal.SIGTERM)
                if not self.wait(timeout):
                    self.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # orphaned pool children, if any

    def wait(self, timeout: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def restart(self) -> ManagedProcess:
        self.stop()
        self.restarts += 1
        return self.start()


def stop_all(procs: list[ManagedProcess], timeout: float = 20.0) -> None:
    """Warm-stop several processes at once (each waits for its running task)."""
    for p in procs:
        if p.alive():
            p.signal(signal.SIGCONT, group=True)
            p.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(max(0.0, deadline - time.monotonic()))
    for p in procs:
        p.stop(timeout=1.0)


def worker_process(
    name: str,
    env: dict[str, str],
    log_dir: Path,
    *,
    concurrency: int = 2,
    pool: str = "prefork",
    extra: tuple[str, ...] = (),
) -> ManagedProcess:
    argv = [
        *toolledger_argv(),
        "worker",
        "--pool",
        pool,
        "--concurrency",
        str(concurrency),
        "--hostname",
        f"{name}@%h",
        "--without-gossip",
        "--without-mingle",
        *extra,
    ]
    return ManagedProcess(name, "worker", argv, env, log_dir / f"{name}.log")


def beat_process(name: str, env: dict[str, str], log_dir: Path, *extra: str) -> ManagedProcess:
    argv = [*toolledger_argv(), "beat", *extra]
    return ManagedProcess(name, "beat", argv, env, log_dir / f"{name}.log")


def service_env(base: dict[str, str] | None = None, **settings: str) -> dict[str, str]:
    """The current environment without TOOLLEDGER_* settings, plus ``settings``."""
    env = {k: v for k, v in (base or os.environ).items() if not k.startswith("TOOLLEDGER_")}
    env.update({f"TOOLLEDGER_{k.upper()}": v for k, v in settings.items()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
