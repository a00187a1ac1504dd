"""Engines and schema migrations for both dialects.

SQLite (the embedded default) runs in WAL mode with synchronous=FULL, because invariant 1
asks that ``running`` be durable before the effect, and write transactions start with
BEGIN IMMEDIATE so two writers never deadlock upgrading a read lock (SQLITE_BUSY is not
retried by the busy timeout in that case). Postgres goes through psycopg 3.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from toolledger.ledger import doorbell
from toolledger.ledger.types import dumps

if TYPE_CHECKING:
    from alembic.config import Config

#: Where the embedded default keeps its files (the ledger, the broker, the sandbox).
DEFAULT_HOME = Path(".toolledger")
#: How long a SQLite writer waits for the lock before giving up.
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: Execution option that makes a SQLite transaction take the write lock at BEGIN.
WRITE = "toolledger_write"


def default_url(home: Path = DEFAULT_HOME) -> str:
    return f"sqlite:///{home / 'ledger.db'}"


def normalize_url(url: str) -> str:
    """Accept the spellings users paste (postgres://, postgresql://) and pick psycopg 3."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def create_engine(
    url: str, *, timeout: float | None = None, statement_timeout: bool = True, **kwargs: Any
) -> sa.Engine:
    """An engine configured for the ledger on either dialect.

    ``timeout`` (seconds) bounds every wait on the database: on Postgres the connect, each
    statement (unless ``statement_timeout=False``: a human's long read), each lock wait and
    each idle moment inside a transaction (server side: a frozen client cannot hold its
    locks longer), and an unanswered socket (client side: ``tcp_user_timeout`` and
    keepalives, since a black-holed connection never hears the server's timeout); on SQLite
    the wait for the write lock. Error messages never carry
    SQL parameters (lease tokens, arguments): ``hide_parameters``.
    """
    url = normalize_url(url)
    parsed = sa.make_url(url)
    kwargs.setdefault("hide_parameters", True)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, timeout=timeout, **kwargs)
    kwargs.setdefault("pool_size", 4)
    kwargs.setdefault("max_overflow", 8)
    if timeout is not None:
        # A worker: the fast path keeps one connection per thread out of this pool for the
        # thread's life (a threads pool: one per thread, for good), so leave room for the
        # lease keeper and the rest; and a checkout waits at most ``timeout``, never
        # SQLAlchemy's 30 s default, so no renewal waits past the lease for a connection.
        kwargs["max_overflow"] = max(kwargs["max_overflow"], 40)
        kwargs.setdefault("pool_timeout", timeout)
    # A connection the server killed (pg_terminate_backend, a restart) is noticed at checkout,
    # not by the statement that needed it; the hot path keeps its own connections (fastpath).
    kwargs.setdefault("pool_pre_ping", True)
    # Plan every statement with its values. psycopg prepares statements after a few uses,
    # and Postgres may then cache a generic plan chosen while, say, no row was running: a
    # plan that finds one execution through the partial "running" index instead of its
    # primary key is cheap then, and scans every running row once 10,000 are in flight
    # (measured: 629 -> 169 jobs/s). With values, the unique index always wins.
    connect_args = dict(kwargs.pop("connect_args", {}))
    options = [connect_args.get("options", ""), "-c plan_cache_mode=force_custom_plan"]
    if timeout is not None:
        ms = max(1, int(timeout * 1000))
        options += [f"-c statement_timeout={ms}"] if statement_timeout else []
        options += [f"-c lock_timeout={ms}"]
        options += [f"-c idle_in_transaction_session_timeout={ms}"]
        connect_args.setdefault("connect_timeout", max(1, math.ceil(timeout)))
        connect_args.setdefault("tcp_user_timeout", ms)
        connect_args.setdefault("keepalives", 1)
        connect_args.setdefault("keepalives_idle", max(1, int(timeout / 2)))
        connect_args.setdefault("keepalives_interval", 1)
        connect_args.setdefault("keepalives_count", 2)
    connect_args["options"] = " ".join(o for o in options if o)
    return sa.create_engine(parsed, json_serializer=dumps, connect_args=connect_args, **kwargs)


def _sqlite_engine(url: sa.URL, *, timeout: float | None, **kwargs: Any) -> sa.Engine:
    busy_ms = SQLITE_BUSY_TIMEOUT_MS if timeout is None else max(1, int(timeout * 1000))
    engine = sa.create_engine(url, json_serializer=dumps, **kwargs)

    @sa.event.listens_for(engine, "do_connect")
    def _make_home(_dialect: Any, _record: Any, _cargs: Any, _cparams: Any) -> None:
        # At first connect, not at engine creation: refused input leaves no files behind.
        if url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves, below
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = FULL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        write = conn.get_execution_options().get(WRITE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


@contextmanager
def write_transaction(engine: sa.Engine) -> Iterator[sa.Connection]:
    """One transaction that will write: on SQLite it holds the write lock from BEGIN.

    Receipts written in it (``receipt_written``) wake their waiters once it has committed:
    on SQLite by ringing the ledger file's doorbells (Postgres notifies from a trigger, in
    the transaction itself)."""
    with engine.connect() as conn:
        conn = conn.execution_options(**{WRITE: True})
        conn.info.pop(_RECEIPTS, None)  # a rolled-back transaction's receipts never happened
        with conn.begin():
            yield conn
        written = conn.info.pop(_RECEIPTS, None)
        if written and engine.dialect.name == "sqlite" and engine.url.database:
            payload = json.dumps(written, ensure_ascii=False).encode("utf-8")
            doorbell.ring(doorbell.bell_dir(engine.url.database), payload)


_RECEIPTS = "toolledger_receipts_written"


def receipt_written(conn: sa.Connection, scope: str, key: str) -> None:
    """Note that this transaction gave ``(scope, key)`` a receipt, to wake its waiters."""
    conn.info.setdefault(_RECEIPTS, []).append([scope, key])


# Alembic is imported by the functions that migrate, never at module level: importing it costs
# a CLI command more than its whole query, and a ledger at head needs none of it (ensure_schema).
MIGRATIONS = Path(__file__).parent / "migrations"
#: Alembic's table of the revision a database is at (its default name, which env.py keeps).
VERSION_TABLE = "alembic_version"


def alembic_config(engine: sa.Engine | None = None) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if engine is not None:
        config.attributes["engine"] = engine
    return config


def upgrade(engine: sa.Engine, revision: str = "head") -> None:
    """Create or migrate the schema (``toolledger db upgrade``)."""
    from alembic import command

    command.upgrade(alembic_config(engine), revision)


def downgrade(engine: sa.Engine, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(engine), revision)


def current_revision(engine: sa.Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def stored_revision(engine: sa.Engine) -> str | None:
    """The revision the database says it is at, read without Alembic (None: no version table,
    or not exactly one row: Alembic's ``current_revision`` then says what that means)."""
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(VERSION_TABLE):
            return None
        rows = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).all()
    return str(rows[0][0]) if len(rows) == 1 else None


_REVISION = re.compile(r"""^revision(?:\s*:[^=\n]*)?\s*=\s*["']([^"'\n]+)["']\s*$""", re.M)
_DOWN = re.compile(
    r"""^down_revision(?:\s*:[^=\n]*)?\s*=\s*(?:None|["']([^"'\n]+)["'])\s*$""", re.M
)


def files_head(versions: Path = MIGRATIONS / "versions") -> str | None:
    """The head revision, read from the migration files as text (no Alembic); None unless
    they form one straight line, each with one plain ``revision`` and ``down_revision``
    (a merge, a branch or any other spelling is left to Alembic's ``head_revision``)."""
    revisions: set[str] = set()
    parents: set[str | None] = set()
    for path in versions.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        found, down = _REVISION.findall(text), _DOWN.findall(text)
        if not found and not down:
            continue  # not a revision (__init__.py)
        if len(found) != 1 or len(down) != 1 or found[0] in revisions:
            return None
        revisions.add(found[0])
        parents.add(down[0] or None)
    heads = revisions - parents
    if len(heads) != 1 or len(parents) != len(revisions) or not parents <= revisions | {None}:
        return None
    return heads.pop()


class SchemaError(RuntimeError):
    """The ledger's schema is missing or not at the revision this code needs."""


def ensure_schema(engine: sa.Engine, *, create_embedded: bool = True) -> None:
    """Check the schema is at head. An empty embedded SQLite ledger is created on the spot;
    anything else (Postgres, or an older revision) must be migrated on purpose."""
    stored = stored_revision(engine)
    if stored is not None and stored == files_head():
        return  # the usual case, settled without importing Alembic
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    if current is None and create_embedded and engine.dialect.name == "sqlite":
        upgrade(engine)
        return
    raise SchemaError(
        f"the ledger schema is at revision {current or 'none'}, this code needs {head}: "
        "run 'toolledger db upgrade'"
    )
