"""Settings: one object, read from the environment at the edge (CLI, app factory) only."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pydantic
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from pydantic_settings import BaseSettings, SettingsConfigDict

from toolledger.ledger.db import DEFAULT_HOME
from toolledger.ledger.identity import MAX_ARGS_BYTES

PREFIX = "TOOLLEDGER_"


class ConfigError(ValueError):
    """A setting is missing, malformed or inconsistent with another."""


class Settings(BaseSettings):
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

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, env_ignore_empty=True, frozen=True, extra="forbid"
    )

    home: Path = DEFAULT_HOME
    db: str = ""
    broker: str = ""
    broker_prefix: str = ""
    sandbox: Path = Path()
    lease_seconds: PositiveFloat = 30.0
    soft_time_limit: NonNegativeFloat = 0.0  # 0: derived from the lease
    time_limit: NonNegativeFloat = 0.0  # 0: derived from the lease
    visibility_timeout: PositiveFloat = 3600.0
    max_args_bytes: PositiveInt = MAX_ARGS_BYTES
    max_content_bytes: PositiveInt = 512 * 1024
    sweep_interval: PositiveFloat = 10.0
    sweep_grace: NonNegativeFloat = 5.0
    requeue_after: PositiveFloat = 120.0
    tools: str = ""
    queue: str = "toolledger"
    failpoints: str = ""
    failpoint_log: str = ""
    db_timeout: NonNegativeFloat = 0.0  # 0: derived from the lease
    lock_wait: PositiveFloat = 2.0
    effects_log: str = ""
    max_auto_retries: NonNegativeInt = 3

    @pydantic.model_validator(mode="after")
    def _derive(self) -> Settings:
        """Defaults that follow from others, derived once (the model is frozen after)."""
        derived: dict[str, Any] = {}
        if not self.db:
            derived["db"] = f"sqlite:///{self.home / 'ledger.db'}"
        if not self.broker:
            derived["broker"] = f"embedded+sqlite:///{self.home / 'broker.db'}"
        if self.sandbox == Path():
            derived["sandbox"] = self.home / "sandbox"
        if not self.soft_time_limit:
            derived["soft_time_limit"] = round(self.lease_seconds * 2 / 3, 3)
        if not self.time_limit:
            derived["time_limit"] = round(self.lease_seconds * 5 / 6, 3)
        if not self.db_timeout:
            derived["db_timeout"] = round(max(1.0, self.lease_seconds / 4), 3)
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        return self

    @pydantic.field_validator("db", "broker")
    @classmethod
    def _url(cls, value: str, info: pydantic.ValidationInfo) -> str:
        """A URL that parses, with a known scheme and a numeric port, refused at start (exit
        2) rather than by the first connection. Never echoed: it may hold a password."""
        if not value:
            return value
        schemes = _DB_SCHEMES if info.field_name == "db" else _BROKER_SCHEMES
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError as exc:
            raise ValueError(f"not a URL: {exc}") from None
        if not parts.scheme.startswith(schemes):
            raise ValueError(f"scheme {parts.scheme!r} is not one of {', '.join(schemes)}")
        if "\x00" in value:
            raise ValueError("holds a NUL character")
        return value

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
        """A copy with ``changes`` (None: unchanged), validated like the original."""
        values = {**self.model_dump(), **{k: v for k, v in changes.items() if v is not None}}
        return _validated(type(self), values, "")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """From the TOOLLEDGER_* variables of ``env`` (default: the process's environment),
        then ``overrides`` (None: not given). A bad value is a ConfigError naming it."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if env is None:  # pydantic-settings reads the process's environment
            try:
                return cls(**given)
            except pydantic.ValidationError as exc:
                raise _config_error(exc, PREFIX) from None
        values = {
            name: env[PREFIX + name.upper()]
            for name in cls.model_fields
            if env.get(PREFIX + name.upper())
        }
        return _validated(cls, {**values, **given}, PREFIX)


_DB_SCHEMES = ("postgresql", "postgres", "sqlite")
_BROKER_SCHEMES = (
    "redis",
    "rediss",
    "embedded+",
    "sqla+",
    "filesystem",
    "amqp",
    "pyamqp",
    "memory",
)
#: Settings whose value is never echoed in an error (a URL may carry a password).
_SECRET = {"db", "broker"}


class _Given(Settings):
    """Settings validated from the values given and nothing else: no environment."""

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: Any, *_: Any, **__: Any
    ) -> tuple[Any, ...]:
        return (init_settings,)


def _validated(cls: type[Settings], values: dict[str, Any], prefix: str) -> Settings:
    """``values`` validated (and derived defaults filled) as ``cls``, reading nothing else.
    Errors become one line naming the setting."""
    try:
        checked = _Given(**values)
    except pydantic.ValidationError as exc:
        raise _config_error(exc, prefix) from None
    return cls.model_construct(**checked.model_dump())


def _config_error(exc: pydantic.ValidationError, prefix: str) -> ConfigError:
    first = exc.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else "settings"
    shown = f"{prefix}{name.upper()}" if prefix else name
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    given = "" if name in _SECRET else f"={first.get('input')!r}"
    msg = str(first["msg"]).removeprefix("Value error, ")
    return ConfigError(f"{shown}{given}: {msg}{more}")
