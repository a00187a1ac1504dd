"""What a process needs to execute calls: ledger, registry, sandbox — one set per process.

Prefork children must not share the parent's database connections, so the runtime is built
lazily in the process that uses it and rebuilt if the pid changes (after a fork).
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

from toolledger import failpoints
from toolledger.config import Settings
from toolledger.ledger.ledger import Ledger
from toolledger.registry import load_registry
from toolledger.sandbox import Sandbox
from toolledger.tools import Registry
from toolledger.worker.pipeline import Executor, LeaseKeeper


@dataclass
class Runtime:
    settings: Settings
    ledger: Ledger
    registry: Registry
    sandbox: Sandbox
    leases: LeaseKeeper | None = None

    @classmethod
    def build(cls, settings: Settings, *, ledger: Ledger | None = None) -> Runtime:
        """What a worker process (or ``toolledger execute``) runs calls with: its failpoints
        armed, a ledger whose every wait is bounded by ``db_timeout``, the fenced sandbox."""
        failpoints.configure(settings.failpoints, settings.failpoint_log)
        return cls(
            settings=settings,
            ledger=ledger
            or Ledger(
                settings.db, max_args_bytes=settings.max_args_bytes, timeout=settings.db_timeout
            ),
            registry=load_registry(settings.tools),
            sandbox=Sandbox.configured(settings).prepare(),
        )

    def executor(self, worker_id: str | None = None) -> Executor:
        with _build_lock:  # one renewal thread per process, shared by its executions
            if self.leases is None:
                self.leases = LeaseKeeper(
                    self.ledger, self.settings.lease_seconds, self.settings.time_limit
                )
        return Executor(
            self.ledger,
            self.registry,
            self.sandbox,
            worker_id=worker_id or default_worker_id(),
            lease_seconds=self.settings.lease_seconds,
            leases=self.leases,
            tool_wait=self.settings.tool_wait,
        )

    def close(self) -> None:
        self.ledger.close()


def default_worker_id(prefix: str = "") -> str:
    return f"{prefix or socket.gethostname()}:{os.getpid()}"


_runtime: tuple[int, Runtime] | None = None
_build_lock = threading.Lock()


def runtime(settings: Settings) -> Runtime:
    """This process's runtime (built on first use, and again after a fork). Once, under a
    lock: a threads pool's first tasks arrive together."""
    global _runtime
    built = _runtime
    if built is None or built[0] != os.getpid():
        with _build_lock:
            built = _runtime
            if built is None or built[0] != os.getpid():
                built = _runtime = (os.getpid(), Runtime.build(settings))
    return built[1]
