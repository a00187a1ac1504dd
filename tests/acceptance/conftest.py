"""Acceptance fixtures: real Postgres, real Redis, real ``celery worker`` processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from toolledger import jsonlines
from toolledger.config import Settings
from toolledger.harness.processes import ManagedProcess, service_env, worker_process
from toolledger.ledger.ledger import Ledger
from toolledger.worker.submit import Submitter


def wait_until(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")


def landed(path: Path, timeout: float = 30.0) -> str:
    """The text of a file an effect lands in. A call's receipt is its commit; its bytes land
    just after it (DESIGN §5), so a test that reads the world right after a receipt waits for
    them (a read-after-receipt through the ledger sees them at once: ``read_file``)."""
    wait_until(path.exists, timeout, f"{path} to land")
    return path.read_text()


@dataclass
class Stack:
    """One test's world: its database, broker prefix, sandbox, effects log and workers."""

    db: str
    broker: str
    prefix: str
    root: Path
    settings_env: dict[str, str]
    workers: list[ManagedProcess] = field(default_factory=list)

    @property
    def sandbox(self) -> Path:
        return self.root / "sandbox"

    @property
    def effects_log(self) -> Path:
        return self.root / "effects.log"

    def env(self, **overrides: str) -> dict[str, str]:
        return service_env(**{**self.settings_env, **overrides})

    def settings(self, **overrides: Any) -> Settings:
        env = {f"TOOLLEDGER_{k.upper()}": v for k, v in self.settings_env.items()}
        return Settings.from_env(env, **overrides)

    def submitter(self, **overrides: Any) -> Submitter:
        return Submitter(self.settings(**overrides))

    def ledger(self) -> Ledger:
        return Ledger(self.db)

    def worker(
        self, name: str = "w1", concurrency: int = 2, pool: str = "prefork", **env: str
    ) -> ManagedProcess:
        log_dir = self.root / "logs"
        proc = worker_process(name, self.env(**env), log_dir, concurrency=concurrency, pool=pool)
        self.workers.append(proc)
        return proc.start().wait_ready()

    def effects(self) -> list[dict[str, Any]]:
        if not self.effects_log.exists():
            return []
        return jsonlines.read(self.effects_log)


@pytest.fixture
def stack(pg_url: str, redis_server: str, redis_prefix: str, tmp_path: Path) -> Iterator[Stack]:
    settings_env = {
        "db": pg_url,
        "broker": redis_server,
        "broker_prefix": redis_prefix,
        "sandbox": str(tmp_path / "sandbox"),
        "tools": "toolledger.harness.probe",
        "effects_log": str(tmp_path / "effects.log"),
        "home": str(tmp_path / "home"),
    }
    s = Stack(pg_url, redis_server, redis_prefix, tmp_path, settings_env)
    yield s
    for proc in s.workers:
        proc.stop(warm=False)  # every check is done: no warm shutdown to wait for


def toolledger(stack: Stack, *argv: str, **env: str) -> tuple[int, str, str]:
    """The real CLI in a subprocess, against this stack."""
    import subprocess

    from toolledger.harness.processes import toolledger_argv

    proc = subprocess.run(
        [*toolledger_argv(), *argv],
        env=stack.env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(params=["postgres", "embedded"])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    """A stack with one real worker, on each backend in turn: Postgres + Redis, and the
    embedded default (SQLite + the embedded broker)."""
    if request.param == "postgres":
        pg_url = request.getfixturevalue("pg_url")
        broker = request.getfixturevalue("redis_server")
        prefix = request.getfixturevalue("redis_prefix")
    else:
        pg_url = f"sqlite:///{tmp_path / 'ledger.db'}"
        broker, prefix = f"embedded+sqlite:///{tmp_path / 'broker.db'}", ""
    env = {
        "db": pg_url,
        "broker": broker,
        "broker_prefix": prefix,
        "sandbox": str(tmp_path / "sandbox"),
        "tools": "toolledger.harness.probe",
        "home": str(tmp_path / "home"),
    }
    s = Stack(pg_url, broker, prefix, tmp_path, env)
    s.worker("w1", concurrency=2)
    yield s
    for proc in s.workers:
        proc.stop(warm=False)  # every check is done: no warm shutdown to wait for
