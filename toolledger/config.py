"""Settings: one object, read from the environment at the edge (CLI, app factory) only."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from toolledger.ledger.db import DEFAULT_HOME
from toolledger.ledger.identity import MAX_ARGS_BYTES

PREFIX = "TOOLLEDGER_"


class ConfigError(ValueError):
    """A setting is missing, malformed or inconsistent with another."""


@dataclass(frozen=True)
class Settings:
    """Everything toolledger can be told, with its default.

    home                where the embedded default keeps its files (TOOLLEDGER_HOME, ./.toolledger)
    db                  ledger URL (TOOLLEDGER_DB; default SQLite at HOME/ledger.db)
    broker              Celery broker URL (TOOLLEDGER_BROKER; default: embedded, under HOME)
    broker_prefix       prefix for every broker key on Redis (TOOLLEDGER_BROKER_PREFIX, none)
    sandbox             sandbox root, one directory per scope (TOOLLEDGER_SANDBOX; HOME/sandbox)
    lease_seconds       a claim's lease, renewed every lease/3 (TOOLLEDGER_LEASE_SECONDS, 30)
    soft_time_limit     a tool's soft limit, seconds (TOOLLEDGER_SOFT_TIME_LIMIT, 2/3 lease)
    time_limit          a tool's hard limit, seconds (TOOLLEDGER_TIME_LIMIT, 5/6 lease)
    visibility_timeout  Redis redelivers unacked messages after this (TOOLLEDGER_VISIBILITY_TIMEOUT,
                        3600); must exceed lease + hard limit
    max_args_bytes      cap on a call's canonical arguments (TOOLLEDGER_MAX_ARGS_BYTES, 1 MiB)
    max_content_bytes   cap on file content a tool writes (TOOLLEDGER_MAX_CONTENT_BYTES, 512 KiB)
    sweep_interval      seconds between beat sweeps (TOOLLEDGER_SWEEP_INTERVAL, 10)
    sweep_grace         extra seconds past lease expiry before unknown (TOOLLEDGER_SWEEP_GRACE, 5)
    requeue_after       re-publish approved work unclaimed this long (TOOLLEDGER_REQUEUE_AFTER, 120)
    tools               module with user tools to import (TOOLLEDGER_TOOLS, none)
    queue               the queue tool jobs travel on (TOOLLEDGER_QUEUE, "toolledger")
    failpoints          crash windows to open, DESIGN §5 (TOOLLEDGER_FAILPOINTS, none)
    failpoint_log       where each firing is logged, JSON lines (TOOLLEDGER_FAILPOINT_LOG, none)
    db_timeout          seconds a worker's database statement, connect or lock wait may take
                        (TOOLLEDGER_DB_TIMEOUT, lease/4): a hung connection cannot stall a
                        lease renewal past the lease
    lock_wait           seconds a landing waits for a path's lock before leaving it to the next
                        settle (TOOLLEDGER_LOCK_WAIT, 2)
    effects_log         tests and chaos: one JSON line per effect landed (TOOLLEDGER_EFFECTS_LOG)
    max_auto_retries    automatic retries of one call at most, for tools whose contract allows
                        them (TOOLLEDGER_MAX_AUTO_RETRIES, 3; 0 turns them off)
    """

    home: Path = DEFAULT_HOME
    db: str = ""
    broker: str = ""
    broker_prefix: str = ""
    sandbox: Path = Path()
    lease_seconds: float = 30.0
    soft_time_limit: float = 0.0
    time_limit: float = 0.0
    visibility_timeout: float = 3600.0
    max_args_bytes: int = MAX_ARGS_BYTES
    max_content_bytes: int = 512 * 1024
    sweep_interval: float = 10.0
    sweep_grace: float = 5.0
    requeue_after: float = 120.0
    tools: str = ""
    queue: str = "toolledger"
    failpoints: str = ""
    failpoint_log: str = ""
    db_timeout: float = 0.0
    lock_wait: float = 2.0
    effects_log: str = ""
    max_auto_retries: int = 3
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: derive defaults once, here
        home = Path(self.home)
        set_(self, "home", home)
        if not self.db:
            set_(self, "db", f"sqlite:///{home / 'ledger.db'}")
        if not self.broker:
            set_(self, "broker", f"embedded+sqlite:///{home / 'broker.db'}")
        if self.sandbox == Path():
            set_(self, "sandbox", home / "sandbox")
        if not self.soft_time_limit:
            set_(self, "soft_time_limit", round(self.lease_seconds * 2 / 3, 3))
        if not self.time_limit:
            set_(self, "time_limit", round(self.lease_seconds * 5 / 6, 3))
        if not self.db_timeout:
            set_(self, "db_timeout", round(max(1.0, self.lease_seconds / 4), 3))

    @property
    def sweep_queue(self) -> str:
        return f"{self.queue}.sweep"

    @property
    def embedded_broker(self) -> bool:
        return self.broker.startswith(("embedded+", "sqla+", "filesystem:"))

    def check(self) -> None:
        """Refuse inconsistent limits (DESIGN §7): soft < hard < lease < visibility timeout."""
        if not 0 < self.soft_time_limit < self.time_limit < self.lease_seconds:
            raise ConfigError(
                f"need 0 < soft_time_limit ({self.soft_time_limit}) < time_limit "
                f"({self.time_limit}) < lease_seconds ({self.lease_seconds})"
            )
        if self.visibility_timeout <= self.lease_seconds + self.time_limit:
            raise ConfigError(
                f"visibility_timeout ({self.visibility_timeout}) must exceed lease_seconds + "
                f"time_limit ({self.lease_seconds + self.time_limit}): Redis would redeliver "
                "a task that is still running"
            )
        if self.db_timeout * 2 > self.lease_seconds:
            raise ConfigError(
                f"db_timeout ({self.db_timeout}) must be at most half of lease_seconds "
                f"({self.lease_seconds}): a hung renewal must leave time for another"
            )

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(PREFIX + f.name.upper())
            if raw is None or raw == "" or f.name == "extra":
                continue
            values[f.name] = _parse(f.name, raw, f.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse(name: str, raw: str, kind: Any) -> Any:
    kind = str(kind)
    try:
        if kind == "float":
            value: Any = float(raw)
        elif kind == "int":
            value = int(raw)
        elif kind == "Path":
            return Path(raw)
        else:
            return raw
    except ValueError:
        raise ConfigError(f"{PREFIX}{name.upper()}={raw!r} is not a number") from None
    if value < 0 or (value == 0 and name not in ("sweep_grace", "max_auto_retries")):
        raise ConfigError(f"{PREFIX}{name.upper()} must be positive, not {raw!r}")
    return value
