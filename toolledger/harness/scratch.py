"""Scratch Postgres databases for the tests, the benchmarks and the chaos run: created on a
server (optionally cloned from a template, optionally migrated), dropped with FORCE after."""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator

import sqlalchemy as sa

from toolledger.ledger.db import create_engine, normalize_url, upgrade

_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def _checked(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"not a plain database name: {name!r}")
    return name


def _admin(server: str) -> sa.Engine:
    return create_engine(
        normalize_url(server), isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0
    )


def url_of(server: str, name: str) -> str:
    """The URL of database ``name`` on the server of ``server``."""
    return sa.make_url(normalize_url(server)).set(database=name).render_as_string(False)


def new_name(prefix: str) -> str:
    return _checked(f"{prefix}_{uuid.uuid4().hex[:10]}")


def create_database(
    server: str,
    name: str,
    *,
    template: str | None = None,
    migrate: bool = False,
    encoding: str | None = None,
) -> str:
    """Create ``name`` (a copy of ``template`` if given; of ``encoding``, under the C locale,
    which takes any), migrate it if asked; its URL."""
    admin = _admin(server)
    try:
        with admin.connect() as conn:
            clone = f" TEMPLATE {_checked(template)}" if template else ""
            if encoding is not None:
                if not re.fullmatch(r"[A-Za-z0-9_]{1,32}", encoding):
                    raise ValueError(f"not an encoding's name: {encoding!r}")
                clone = f" ENCODING '{encoding}' TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'"
            conn.exec_driver_sql(f"CREATE DATABASE {_checked(name)}{clone}")
    finally:
        admin.dispose()
    url = url_of(server, name)
    if migrate:
        engine = create_engine(url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
    return url


def drop_database(server: str, name: str) -> None:
    """Drop ``name`` even with sessions still connected (its workers may be frozen)."""
    admin = _admin(server)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {_checked(name)} WITH (FORCE)")
    finally:
        admin.dispose()


@contextlib.contextmanager
def scratch_database(
    server: str,
    prefix: str,
    *,
    template: str | None = None,
    migrate: bool = False,
    encoding: str | None = None,
) -> Iterator[str]:
    """A database of its own for the duration of the block; its URL."""
    name = new_name(prefix)
    url = create_database(server, name, template=template, migrate=migrate, encoding=encoding)
    try:
        yield url
    finally:
        drop_database(server, name)
