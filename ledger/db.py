"""Engines and schema migrations for both dialects.

SQLite (the embedded default) runs in WAL mode with synchronous=FULL, because invariant 1
asks that ``running`` be durable before the effect, and write transactions start with
BEGIN IMMEDIATE so two writers never deadlock upgrading a read lock (SQLITE_BUSY is not
retried by the busy timeout in that case). Postgres goes through psycopg 3.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from toolledger.ledger import doorbell, writers
from toolledger.ledger.lightreads import (
    ENCODINGS,
    pg_connect_args,
    pg_session_settings,
    refuse_hard_linked,
    set_session_statement,
)
from toolledger.ledger.revision import (
    MIGRATIONS,
    VERSION_TABLE,
    SchemaError,
    UnsupportedDatabase,
    files_head,
    files_revisions,
)
from toolledger.ledger.types import dumps

if TYPE_CHECKING:
    from alembic.config import Config

#: How long a SQLite writer waits for the lock before giving up.
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: Execution option that makes a SQLite transaction take the write lock at BEGIN.
WRITE = "toolledger_write"


def normalize_url(url: str) -> str:
    """Accept the spellings users paste (postgres://, postgresql://) and pick psycopg 3."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


_MISCONFIGURED = re.compile(
    r"invalid connection option \"|invalid \w+ value: |missing \"=\" after \""
    # the server's refusal, at connect, of a setting the URL sends (?options=-c foo=bar): not
    # an ERROR of a statement, which names no setting of the user's
    r"|FATAL:\s+(?:unrecognized configuration parameter|invalid value for parameter) \""
)


def misconfigured(exc: BaseException) -> str | None:
    """libpq's word that the URL's own options are wrong (``sslmode=bogus``, an unknown
    option), said before any connection is tried, or the server's at connect that a setting
    the URL sends is (``?options=-c foo=bar``: it was "database unavailable", exit 1, and a
    worker waited on it): a setting to mend (exit 2), not a database to wait for. It was
    "database unavailable", exit 1, and workers waited on it for ever (a review). The message
    quotes the bad value, never the URL."""
    text = str(getattr(exc, "orig", exc)).strip()
    first = text.splitlines()[0] if text else ""
    return first if _MISCONFIGURED.search(first) else None


def create_engine(
    url: str, *, timeout: float | None = None, statement_timeout: bool = True, **kwargs: Any
) -> sa.Engine:
    """An engine configured for the ledger on either dialect.

    ``timeout`` (seconds) bounds every wait on the database: on Postgres as
    ``lightreads.pg_connect_args`` and ``pg_session_settings`` say (the settings given to
    each new connection, before the pool hands it out), on SQLite the wait for the write
    lock. Error messages never carry SQL parameters (lease tokens, arguments):
    ``hide_parameters``.
    """
    url = normalize_url(url)
    parsed = sa.make_url(url)
    kwargs.setdefault("hide_parameters", True)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, timeout=timeout, **kwargs)
    # The fast path keeps one connection per thread out of this pool for the thread's life (a
    # worker's threads pool, or a user's threads submitting through one Client: one each, for
    # good), so leave room for the rest: with 4 + 8 a thirteenth thread waited 30 s and
    # failed (a cold review). Overflow connections close when given back: none idle.
    kwargs.setdefault("pool_size", 4)
    kwargs.setdefault("max_overflow", _overflow)  # a caller's own choice stands (the API's reader)
    if timeout is not None:
        # A worker: a checkout waits at most ``timeout``, never SQLAlchemy's 30 s default,
        # so no renewal waits past the lease for a connection.
        kwargs.setdefault("pool_timeout", timeout)
    # A connection the server killed (pg_terminate_backend, a restart) is noticed at checkout,
    # not by the statement that needed it; the hot path keeps its own connections (fastpath).
    kwargs.setdefault("pool_pre_ping", True)
    # Explicit, not the session's default: SQLAlchemy reads that default once, at the first
    # connect (before the settings below), and gives it back to every connection a
    # ``verify`` (REPEATABLE READ) returns: a database defaulting to SERIALIZABLE made its
    # later transactions SERIALIZABLE (a cold review). A caller's own choice stands.
    kwargs.setdefault("isolation_level", "READ COMMITTED")
    # libpq's parameters here; the URL's own (``?options=-c search_path=agents``) pass through
    # SQLAlchemy to psycopg beside them. The server settings follow each connect (below).
    connect_args = pg_connect_args(timeout, given=kwargs.pop("connect_args", {}))
    engine = sa.create_engine(parsed, json_serializer=dumps, connect_args=connect_args, **kwargs)
    settings = set_session_statement(
        pg_session_settings(timeout, statement_timeout=statement_timeout)
    )

    @sa.event.listens_for(engine, "connect")
    def _session(dbapi: Any, _record: Any) -> None:
        encoding = dbapi.info.parameter_status("server_encoding")  # told at connect
        if encoding not in ENCODINGS:
            dbapi.close()
            raise UnsupportedDatabase(
                f"the ledger's database has the encoding {encoding}; the ledger needs UTF8 "
                "(CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)"
            )
        dbapi.execute(*settings)
        dbapi.commit()

    return engine


#: Connections a ledger's pool may open past its size: each thread of a worker's threads pool
#: keeps one for its life, so a worker raises it to its thread count (``reserve_threads``).
_overflow = 40


def reserve_threads(threads: int) -> None:
    """Let every ledger this process makes from now on hold a connection for each of
    ``threads`` threads, and a few for its lease keeper and landings: past 44, the threads
    beyond found no connection, their claims failed after the timeout and their calls waited
    for the sweep to re-publish them (helper-90: 15 of 60)."""
    global _overflow
    _overflow = max(_overflow, threads + 4)


def _sqlite_engine(url: sa.URL, *, timeout: float | None, **kwargs: Any) -> sa.Engine:
    busy_ms = SQLITE_BUSY_TIMEOUT_MS if timeout is None else max(1, int(timeout * 1000))
    on_file = url.database not in (None, "", ":memory:") and url.query.get("mode") != "memory"
    if timeout is not None and on_file:
        # A worker, as on Postgres: the fast path keeps a connection per thread for the
        # thread's life, so a threads pool of 15 took the default pool's 5 + 10 and the lease
        # keeper waited SQLAlchemy's 30 s for one, its leases expiring (a cold review).
        kwargs.setdefault("pool_size", 5)
        kwargs["max_overflow"] = max(kwargs.get("max_overflow", 10), _overflow)
        kwargs.setdefault("pool_timeout", timeout)
    engine = sa.create_engine(url, json_serializer=dumps, **kwargs)

    @sa.event.listens_for(engine, "do_connect")
    def _make_home(_dialect: Any, _record: Any, _cargs: Any, _cparams: Any) -> None:
        # At first connect, not at engine creation: refused input leaves no files behind.
        if url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        if on_file:
            refuse_hard_linked(str(url.database))
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves, below
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
        if _may_turn_wal(cursor):
            cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = FULL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        write = conn.get_execution_options().get(WRITE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _may_turn_wal(cursor: Any) -> bool:
    """Whether this connection may switch the file to WAL (a mode the file keeps): not when it
    is already, nor when the file holds another application's tables and no ledger's (a
    mistyped ``--db``: the command refuses it, and it was left in WAL mode, which its own
    application may not read, on a read-only or network mount). A ledger is told by its own
    tables: Alembic's version table alone is any Alembic-managed application's too (a cold
    review)."""
    if cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
        return False
    tables = {
        row[0] for row in cursor.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
    }
    return not tables or tables >= LEDGER_TABLES


#: Tables every revision of the ledger has had: what tells a ledger's SQLite file.
LEDGER_TABLES = frozenset({"operations", "executions", "execution_events"})


#: SQLSTATEs of a wait that ran out or a conflict to try again: lock and statement timeouts,
#: a deadlock, a serialization failure, an idle session ended.
_BUSY = frozenset({"55P03", "57014", "40P01", "40001", "57P05"})
#: SQLSTATEs of a server out of reach for now: shutting down or starting, out of connections
#: (and class 08, the connection's).
_UNREACHABLE = frozenset({"57P01", "57P02", "57P03", "53300"})
#: A connection refused by a server that is there, in words that mean "for good" (every other
#: refusal: starting up, shutting down, too many connections... is for now).
_FOR_GOOD = ("does not exist", "authentication failed", "pg_hba.conf", "permission denied")


def busy(orig: BaseException | None) -> bool:
    """Whether a driver's error is a wait that ran out or a conflict to try again (a lock
    another holds, a statement timeout, a deadlock): SQLite's "database is locked" too."""
    if getattr(orig, "sqlstate", None) in _BUSY:
        return True
    return type(orig).__module__ == "sqlite3" and "is locked" in str(orig)


def unreachable(orig: BaseException | None) -> bool:
    """Whether a driver's error is a database out of reach for now: no connection (psycopg
    gives no SQLSTATE), a connection lost or refused (class 08), a server shutting down or
    starting (57P01-57P03), out of connections (53300); SQLite's file that cannot be opened.
    Anything else (a missing table, a read-only file) is no matter of trying again."""
    if type(orig).__module__ == "sqlite3":
        return "unable to open" in str(orig)
    if orig is None or not hasattr(orig, "sqlstate"):  # psycopg's errors all have one
        return False
    state = orig.sqlstate
    if state is None:  # no server's answer, or the server's FATAL at connect, in words only
        said = str(orig)
        return "FATAL" not in said or not any(words in said for words in _FOR_GOOD)
    return state.startswith("08") or state in _UNREACHABLE


@contextmanager
def write_transaction(engine: sa.Engine) -> Iterator[sa.Connection]:
    """One transaction that will write: on SQLite it holds the write lock from BEGIN, taken
    in turn (``ledger.writers``).

    Receipts written in it (``receipt_written``) wake their waiters once it has committed:
    on SQLite by ringing the ledger file's doorbells (Postgres notifies from a trigger, in
    the transaction itself)."""
    with engine.connect() as conn:
        conn = conn.execution_options(**{WRITE: True})
        conn.info.pop(_RECEIPTS, None)  # a rolled-back transaction's receipts never happened
        # on a SQLite file, in turn with the ledger's other writers (ledger.writers), and
        # BEGIN waits for SQLite's lock only what is left of the timeout after the turn's wait
        dbapi = lambda: conn.connection.dbapi_connection  # noqa: E731
        with writers.turn(writers.database_file(engine.url), dbapi) as waited:
            with writers.within_budget(waited, dbapi):
                transaction = conn.begin()
            with transaction:
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


def behind(engine: sa.Engine, revision: str) -> str | None:
    """The ledger's revision if ``revision`` names one older than it (an upgrade to it would
    do nothing and say so in no way: Alembic's ``upgrade`` only goes up), else None. A
    revision Alembic cannot name this way (relative, a range, unknown) is left to it."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    current = current_revision(engine)
    if current is None:
        return None
    script = ScriptDirectory.from_config(alembic_config())
    order = [r.revision for r in script.walk_revisions("base", "heads")][::-1]  # base first
    if current not in order:
        return None
    try:
        at = _position(script, order, revision.strip(), current)
    except (CommandError, ValueError):
        return None  # Alembic's to say
    return current if at is not None and at < order.index(current) else None


#: A relative revision: ``head-1``, ``base+2``, ``0003+1``, ``-1`` (from the current one).
_RELATIVE = re.compile(r"(?P<anchor>.*?)(?P<sign>[+-])(?P<steps>\d+)")


def _position(script: Any, order: list[str], revision: str, current: str) -> int | None:
    """Where ``revision`` is in ``order`` (-1: ``base``, before them all), relative forms
    included (``head-1`` and ``base+1`` did nothing and said "schema at 0006", exit 0, as
    ``0003`` had: a cold review); None if it names no single place there."""
    relative = _RELATIVE.fullmatch(revision)
    anchor = relative["anchor"] if relative else revision
    if anchor == "":
        at = order.index(current)
    elif anchor == "base":
        at = -1
    elif anchor in ("head", "heads"):
        at = len(order) - 1
    else:
        found = script.get_revision(anchor)
        if found is None or found.revision not in order:
            return None
        at = order.index(found.revision)
    if relative:
        steps = int(relative["steps"])
        at += steps if relative["sign"] == "+" else -steps
    return at if -1 <= at < len(order) else None


def refuse_grant(engine: sa.Engine, role: str) -> None:
    """ValueError if ``grant(engine, role)`` cannot be done: asked before the upgrade, so that
    a refused ``db upgrade --grant`` changes nothing."""
    if engine.dialect.name != "postgresql":
        raise ValueError("roles are Postgres's: the embedded ledger is a file")
    with engine.connect() as conn:
        known = conn.execute(
            sa.text("SELECT 1 FROM pg_roles WHERE rolname = :role"), {"role": role}
        ).first()
    if known is None:
        raise ValueError(f"role {role!r} does not exist (CREATE ROLE it first)")


def grant(engine: sa.Engine, role: str) -> list[str]:
    """Let ``role`` read and write the ledger's rows, and nothing else: every other part
    (workers, beat, ``serve``, the CLI, agents' clients) runs under such a role, and only
    ``db upgrade`` needs to own the tables. SELECT, INSERT, UPDATE, DELETE on the ledger's
    tables at this revision, USAGE on their sequences, SELECT on Alembic's version (the
    schema check); USAGE on the schema if it lacks it. Postgres only; one transaction.
    Returns the tables granted."""
    from toolledger.ledger.models import metadata

    refuse_grant(engine, role)
    with engine.begin() as conn:
        quote = conn.dialect.identifier_preparer.quote
        schema = conn.exec_driver_sql("SELECT current_schema()").scalar_one()
        present = set(sa.inspect(conn).get_table_names())
        tables = sorted(t.name for t in metadata.sorted_tables if t.name in present)
        who = quote(role)
        if not conn.execute(
            sa.text("SELECT has_schema_privilege(:role, :schema, 'USAGE')"),
            {"role": role, "schema": schema},
        ).scalar_one():
            conn.exec_driver_sql(f"GRANT USAGE ON SCHEMA {quote(schema)} TO {who}")
        names = ", ".join(quote(t) for t in tables)
        conn.exec_driver_sql(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {names} TO {who}")
        conn.exec_driver_sql(f"GRANT SELECT ON {quote(VERSION_TABLE)} TO {who}")
        sequences = (
            conn.execute(
                sa.text(
                    "SELECT DISTINCT s.oid::regclass::text FROM pg_class s"
                    " JOIN pg_depend d ON d.objid = s.oid AND d.deptype IN ('a', 'i')"
                    " WHERE s.relkind = 'S' AND d.refobjid = ANY(CAST(:tables AS regclass[]))"
                ),
                {"tables": [f"{quote(schema)}.{quote(t)}" for t in tables]},
            )
            .scalars()
            .all()
        )
        if sequences:
            conn.exec_driver_sql(f"GRANT USAGE ON SEQUENCE {', '.join(sequences)} TO {who}")
    return tables


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


def refuse_newer(engine: sa.Engine, stored: str | None = None) -> None:
    """SchemaError if the ledger is at a revision this code does not know: a newer toolledger
    migrated it, and no migration of this code can take it anywhere."""
    stored = stored if stored is not None else stored_revision(engine)
    if stored is not None and stored not in files_revisions():
        with engine.connect() as conn:
            names = set(sa.inspect(conn).get_table_names())
        if not names >= LEDGER_TABLES:  # an Alembic-managed application's: never "newer"
            raise _not_a_ledger(sorted(names - {VERSION_TABLE}), f"Alembic revision {stored}")
        raise SchemaError(
            f"the ledger schema is at revision {stored}, newer than this code knows "
            f"(its newest is {files_head()}): upgrade toolledger itself"
        )


def _not_a_ledger(tables: list[str], also: str | None = None) -> SchemaError:
    """Another application's database (a mistyped ``--db``), named by its first tables."""
    named = ", ".join(tables[:3]) + (", …" if len(tables) > 3 else "") or "none"
    return SchemaError(
        f"the database holds tables that are not a toolledger ledger's ({named}"
        f"{f'; {also}' if also else ''}): no ledger is there (is --db or TOOLLEDGER_DB right?)"
    )


def _sqlite_state(engine: sa.Engine) -> tuple[str | None, list[str]]:
    """The revision a SQLite database holds and its tables but Alembic's, read in one
    transaction (one snapshot). Read apart, a ledger another process made between the two
    reads looked like another application's tables: the second of ``make demo``'s workers,
    starting beside the first on a fresh ledger, refused it under load."""
    with engine.connect() as conn:
        names = sa.inspect(conn).get_table_names()
        made = None
        if VERSION_TABLE in names:
            rows = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).all()
            made = str(rows[0][0]) if len(rows) == 1 else None
    return made, [t for t in names if t != VERSION_TABLE]


def ensure_schema(engine: sa.Engine, *, create_embedded: bool = True) -> None:
    """Check the schema is at head. An empty embedded SQLite ledger is created on the spot;
    anything else (Postgres, or an older revision) must be migrated on purpose."""
    stored = stored_revision(engine)
    if stored is not None and stored == files_head():
        return  # the usual case, settled without importing Alembic
    refuse_newer(engine, stored)
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    if current is None and engine.dialect.name == "sqlite":
        made, others = _sqlite_state(engine)
        if made == head:  # another process made the ledger since the revision was read
            return
        if made is not None:  # made meanwhile by another version of toolledger
            refuse_newer(engine, made)
            current = made
        if made is None and others:  # (alembic_version alone: downgraded to base, made again)
            # another application's database (a mistyped --db): made a ledger in silence
            # by any command, ``show`` included, until a cold review
            raise _not_a_ledger(others)
        if made is None and create_embedded:
            upgrade(engine)
            return
    raise SchemaError(
        f"the ledger schema is at revision {current or 'none'}, this code needs {head}: "
        "run 'toolledger db upgrade'"
    )
