"""A call read on the database driver alone (sqlite3, or libpq: ``pq``): ``show`` and ``events``.

Importing SQLAlchemy costs a CLI command 0.3 s here, several times the query it runs. These
reads ask what ``LedgerReads`` asks, with the same statements written out, and build the same
records from the rows: values are converted as the columns' SQLAlchemy types convert them
(timestamps to aware UTC datetimes, JSON text to objects, SQLite's integers to booleans).
``tests/integration/test_lightreads.py`` holds every record, field for field, to the
ledger's own on both dialects.

They serve only a ledger they can vouch for: a SQLite file that exists, or a Postgres URL
psycopg takes as it is, whose schema is at the revision of these files (``files_head``).
Anything else, and any driver error, is left to the ledger (``LightReads.open`` returns None,
``Fallback`` is raised): it creates the embedded schema, says why a revision is wrong and
words every error as it always has, so a command behaves the same on either path.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

from toolledger.ledger.errors import NotFound
from toolledger.ledger.identity import check_scope, check_text_id
from toolledger.ledger.records import (
    CallView,
    EventRecord,
    ExecutionRecord,
    OperationRecord,
    _field_names,
    as_utc,
)
from toolledger.ledger.revision import VERSION_TABLE, UnsupportedDatabase, files_head
from toolledger.ledger.transitions import Flag, fold_flags

#: Columns whose SQLAlchemy type converts what the driver returns (the models' types; a test
#: holds these sets to ``models``).
TIMESTAMPS = frozenset(
    {"decided_at", "created_at", "enqueued_at", "lease_expires_at", "heartbeat_at"}
    | {"started_at", "finished_at", "at"}
)
JSON_COLUMNS = frozenset({"args", "result", "effects", "detail"})
BOOLEANS = frozenset({"reconciled", "fenced"})

R = TypeVar("R", OperationRecord, ExecutionRecord, EventRecord)


class CallReads(Protocol):
    """What ``show`` and ``events`` read: the ledger's reads, or these."""

    def get(self, scope: str, tool_call_id: str) -> CallView: ...

    def events(
        self, scope: str, tool_call_id: str, *, after: int = 0, limit: int = 0
    ) -> list[EventRecord]: ...


def events_page(
    reads: CallReads, scope: str, tool_call_id: str, *, after: int = 0, limit: int = 0
) -> dict[str, Any]:
    """``events --json`` (the CLI's and the API's): the events past ``after`` (a ``seq``), at
    most ``limit`` of them (0: all), and ``more`` if some were left (ask again ``after`` the
    last ``seq``). Unpaged, a call whose key an agent linked thousands of ids to answered
    megabytes, and the console's page with it (a cold review: 23,000 links, 5.8 MB)."""
    history = reads.events(scope, tool_call_id, after=after, limit=limit + 1 if limit else 0)
    more = bool(limit) and len(history) > limit
    if more:
        history = history[:limit]
    # a page past the last event holds none to name the key: the call does
    key = history[0].idempotency_key if history else None
    if key is None:
        key = reads.get(scope, tool_call_id).operation.idempotency_key
    return {
        "scope": scope,
        "tool_call_id": tool_call_id,
        "idempotency_key": key,
        "events": [e.to_json() for e in history],
        "more": more,
    }


class Fallback(Exception):
    """The driver failed: the ledger's own reads should answer (and word any error)."""


#: The one server encoding the ledger runs on. Another cannot hold every character a call may
#: carry (LATIN1: a submit failed with an internal UnicodeEncodeError), or holds them as
#: bytes its ``varchar`` limits count (SQL_ASCII: a 65-emoji call id, within the 256
#: characters the ledger checks, failed as a database error; psycopg handed back bytes and a
#: migration failed with a TypeError before the connections sent UTF-8). Refused at connect.
ENCODINGS = ("UTF8",)


def pg_connect_args(timeout: float | None, *, given: Mapping[str, Any] = {}) -> dict[str, Any]:
    """libpq's own connect parameters for a ledger connection (``db.create_engine`` passes
    them through SQLAlchemy; these reads pass them to libpq or psycopg themselves): with a
    ``timeout`` (seconds), a bounded connect and an unanswered socket noticed (client side:
    ``tcp_user_timeout`` and keepalives, since a black-holed connection never hears the
    server's timeout). The server settings are ``pg_session_settings``."""
    args = dict(given)
    args.setdefault("client_encoding", "UTF8")  # whatever PGCLIENTENCODING or the server says
    if timeout is not None:
        args.setdefault("connect_timeout", max(1, math.ceil(timeout)))
        args.setdefault("tcp_user_timeout", max(1, int(timeout * 1000)))
        args.setdefault("keepalives", 1)
        args.setdefault("keepalives_idle", max(1, int(timeout / 2)))
        args.setdefault("keepalives_interval", 1)
        args.setdefault("keepalives_count", 2)
    return args


def pg_session_settings(timeout: float | None, *, statement_timeout: bool = True) -> dict[str, str]:
    """The server settings every ledger session is given once, just after it connects
    (``set_session_statement``), whatever the server's, the database's or the role's defaults.

    Sent as statements, not as libpq's startup ``options``: PgBouncer refuses a connection
    whose startup packet carries ``options`` ("unsupported startup parameter"), so no ledger
    could be reached through one (in its session pooling mode, which keeps a client's session
    settings and prepared statements, these hold as on a direct connection).

    Every statement planned with its values: psycopg prepares statements after a few uses,
    and Postgres may then cache a generic plan chosen while, say, no row was running: a
    plan that finds one execution through the partial "running" index instead of its
    primary key is cheap then, and scans every running row once 10,000 are in flight
    (measured: 629 -> 169 jobs/s). With values, the unique index always wins.

    Timestamps are read in the ISO DateStyle (psycopg parses no other for ``timestamptz``: a
    database set to, say, ``SQL, DMY`` made every read of a row fail, a submit after its
    commit) and transactions are READ COMMITTED, which the protocol's statements are written
    for (a database defaulting to SERIALIZABLE failed 136 of 1,200 racing claims with
    serialization errors).

    A commit is durable before it is acknowledged: ``synchronous_commit`` is kept as the
    server, the database or the role sets it unless that is ``off`` (then ``on``;
    :data:`DURABLE_COMMIT`). Under ``off`` the executor's terminal commit was acknowledged,
    its bytes landed, and a server crash lost the commit: the sweep then found the execution
    running, revoked it, proved it "not applied" by the fence, and a retry without a
    duplicate accepted wrote the effect twice, ``verify`` clean (a cold review). ``fsync``
    is the server's alone: a worker warns at start when it is off.

    ``timeout`` (seconds) bounds each statement (unless ``statement_timeout`` is False: a
    human's long read), each lock wait and each idle moment in a transaction (server side: a
    frozen client cannot hold its locks longer)."""
    settings = {
        "plan_cache_mode": "force_custom_plan",
        "DateStyle": "ISO, YMD",
        "default_transaction_isolation": "read committed",
        "synchronous_commit": DURABLE_COMMIT,
    }
    if timeout is not None:
        ms = str(max(1, int(timeout * 1000)))
        settings.update({"statement_timeout": ms} if statement_timeout else {})
        settings.update({"lock_timeout": ms, "idle_in_transaction_session_timeout": ms})
    return settings


#: A setting's value in ``pg_session_settings`` meaning "as the server says, unless off": the
#: session's own value, or ``on`` where that is ``off`` (``synchronous_commit``'s other values,
#: ``local``, ``remote_write``, ``remote_apply``, are durable on this server at least).
DURABLE_COMMIT = "<as set, unless off>"


def set_session_statement(settings: Mapping[str, str]) -> tuple[str, list[str]]:
    """One statement that gives a session ``settings`` (``set_config``, not transaction-local:
    they hold once its transaction commits), with psycopg's placeholders and its values."""
    calls, params = [], []
    for name, value in settings.items():
        if value == DURABLE_COMMIT:
            calls.append(
                "set_config(%s, CASE current_setting(%s) WHEN 'off' THEN 'on' "
                "ELSE current_setting(%s) END, false)"
            )
            params += [name, name, name]
        else:
            calls.append("set_config(%s, %s, false)")
            params += [name, value]
    return "SELECT " + ", ".join(calls), params


def refuse_hard_linked(path: str) -> None:
    """UnsupportedDatabase (exit 2) if the ledger's file has another name (a hard link):
    SQLite keeps the write-ahead log and the lock of each name apart (``NAME-wal``), and so
    does the writers' queue, so two names are two ledgers over one file, each losing the
    other's commits
    (helper-90: both claimed one attempt, a charge ran twice, ``verify`` ok). A symlink is
    one name (SQLite resolves it)."""
    try:
        links = os.stat(path).st_nlink
    except FileNotFoundError:
        return  # not made yet: SQLite makes it with this name alone
    if links > 1:
        raise UnsupportedDatabase(
            f"the ledger file {path} has {links} hard links: SQLite keeps a log per name, so "
            "two names are two ledgers that lose each other's commits; keep one name (a "
            "symlink is fine)"
        )


class LightReads:
    """``get`` and ``events`` of ``LedgerReads``, on one driver connection (the receipt
    follows from ``get`` by ``receipts.receipt_for``, as the ledger's does)."""

    def __init__(self, conn: Any, dialect: str, driver_error: type[Exception]) -> None:
        self._conn = conn
        self.dialect = dialect
        self._error = driver_error

    @classmethod
    def open(cls, url: str, timeout: float | None) -> LightReads | None:
        """Reads on ``url``, or None where the ledger should read (see the module)."""
        try:
            reads = cls._connect(url, timeout)
        except Exception:  # noqa: BLE001 - the ledger connects again and words the error
            return None
        if reads is None:
            return None
        try:
            with reads._read():
                rows = reads._all(f"SELECT version_num FROM {VERSION_TABLE}", ())
            at_head = len(rows) == 1 and rows[0]["version_num"] == files_head()
        except Fallback:  # no version table: the ledger creates or refuses the schema
            at_head = False
        if not at_head:
            reads.close()
            return None
        return reads

    @classmethod
    def _connect(cls, url: str, timeout: float | None) -> LightReads | None:
        scheme, sep, rest = url.partition("://")
        if not sep or "?" in rest or "#" in rest:
            return None  # options in the URL: what SQLAlchemy makes of them is its own
        if scheme == "sqlite":
            if not rest.startswith("/"):  # a host part (sqlite://host/x.db), refused there
                return None
            path = rest[1:]
            if not path or path == ":memory:" or "%" in path or not Path(path).is_file():
                return None  # a ledger the ledger creates (or an unusual spelling)
            import sqlite3

            refuse_hard_linked(path)
            busy = 30.0 if timeout is None else timeout
            conn = sqlite3.connect(path, timeout=busy, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA query_only = ON")
            return cls(conn, "sqlite", sqlite3.Error)
        if scheme in ("postgres", "postgresql", "postgresql+psycopg"):
            if "%" in rest.rpartition("@")[2]:
                return None  # libpq decodes a host or a database name, SQLAlchemy may not
            settings = pg_session_settings(timeout, statement_timeout=False)
            # one snapshot a read, as on SQLite: under read committed the operation and its
            # executions were read at two moments, and a receipt could be torn between two
            # states (a review correction: status succeeded, content failed; a cold review)
            settings["default_transaction_isolation"] = "repeatable read"
            return cls._pg_connect("postgresql://" + rest, pg_connect_args(timeout), settings)
        return None

    @classmethod
    def _pg_connect(
        cls, url: str, connect_args: dict[str, Any], settings: Mapping[str, str]
    ) -> LightReads:
        """On libpq itself (``pq``: psycopg's import is most of a CLI command's time), else
        on psycopg, where no libpq can be loaded; given ``settings`` before the first read."""
        from toolledger.ledger import pq

        try:
            pq.library()
        except pq.Error:
            import psycopg
            from psycopg.rows import dict_row

            pg: Any = psycopg.connect(url, row_factory=dict_row, **connect_args)
            reads = cls(pg, "postgresql", psycopg.Error)
        else:
            reads = cls(pq.connect(url, **connect_args), "postgresql", pq.Error)
        sql, params = set_session_statement(settings)
        try:
            row = reads._conn.execute(
                sql + ", current_setting('server_encoding') AS server_encoding", params
            ).fetchall()[0]
            reads._conn.commit()
            if row["server_encoding"] not in ENCODINGS:  # the ledger refuses it, in its words
                raise Fallback(f"server encoding {row['server_encoding']}")
        except BaseException:
            reads.close()
            raise
        return reads

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def _read(self) -> Iterator[None]:
        """One read transaction, one snapshot (SQLite's, Postgres's repeatable read: the
        session's default here), as the ledger's reads take; ended at once, so no
        connection idles in a transaction."""
        sqlite = self.dialect == "sqlite"
        try:
            if sqlite:
                self._all("BEGIN", ())
            yield
        finally:
            with suppress(self._error):
                self._conn.execute("ROLLBACK") if sqlite else self._conn.rollback()

    def _all(self, sql: str, params: Sequence[Any]) -> list[Mapping[str, Any]]:
        if self.dialect != "sqlite":
            sql = sql.replace("?", "%s")
        try:
            return list(self._conn.execute(sql, params).fetchall())
        except self._error as exc:
            raise Fallback(str(exc)) from exc

    def _records(
        self, cls: type[R], table: str, where: str, order: str, params: Any, limit: int = 0
    ) -> list[R]:
        names = _field_names(cls)
        sql = f"SELECT {', '.join(names)} FROM {table} WHERE {where} ORDER BY {order}"
        if limit:
            sql += f" LIMIT {int(limit)}"
        return [cls.from_row(self._values(row, names)) for row in self._all(sql, params)]

    def _values(self, row: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
        sqlite = self.dialect == "sqlite"
        out: dict[str, Any] = {}
        for name in names:
            value = row[name]
            if value is not None:
                if name in TIMESTAMPS:
                    value = as_utc(datetime.fromisoformat(value) if sqlite else value)
                elif name in JSON_COLUMNS and isinstance(value, str | bytes):
                    value = json.loads(value)
                elif name in BOOLEANS:
                    value = bool(value)
            out[name] = value
        return out

    def _key_for(self, scope: str, tool_call_id: str) -> str:
        check_scope(scope)  # a NUL or a surrogate must be refused here, not by the driver
        check_text_id(tool_call_id, "tool_call_id", 256)
        rows = self._all(
            "SELECT idempotency_key FROM tool_calls WHERE scope = ? AND tool_call_id = ?",
            (scope, tool_call_id),
        )
        if not rows:
            raise NotFound(f"no call {tool_call_id!r} in scope {scope!r}")
        return str(rows[0]["idempotency_key"])

    def _view(self, scope: str, tool_call_id: str, key: str) -> CallView:
        ops = self._records(
            OperationRecord,
            "operations",
            "scope = ? AND idempotency_key = ?",
            "scope",
            (scope, key),
        )
        if not ops:
            raise NotFound(f"no operation {key!r} in scope {scope!r}")
        runs = self._records(
            ExecutionRecord,
            "executions",
            "scope = ? AND idempotency_key = ?",
            "attempt",
            (scope, key),
        )
        return CallView(scope, tool_call_id, ops[0], tuple(runs), self._waiting(ops[0]))

    def _waiting(self, op: OperationRecord) -> tuple[Flag, ...]:
        """``reads.waiting_flags``: a flagged call's flags still waiting, from its history
        (the receipt follows them all, not only the one ``operations.review`` keeps)."""
        if op.review is None:
            return ()
        flagged = self._records(
            EventRecord,
            "execution_events",
            "scope = ? AND idempotency_key = ? AND kind IN ('flagged', 'reviewed')",
            "seq",
            (op.scope, op.idempotency_key),
        )
        return tuple(fold_flags((e.kind, e.execution_id or "", e.detail) for e in flagged)[0])

    def get(self, scope: str, tool_call_id: str) -> CallView:
        """The call, its action and every attempt at it."""
        with self._read():
            return self._view(scope, tool_call_id, self._key_for(scope, tool_call_id))

    def events(
        self, scope: str, tool_call_id: str, *, after: int = 0, limit: int = 0
    ) -> list[EventRecord]:
        """The history of the call's action, in order (``after`` and ``limit``: as the
        ledger's ``events``)."""
        with self._read():
            key = self._key_for(scope, tool_call_id)
            return self._records(
                EventRecord,
                "execution_events",
                "scope = ? AND idempotency_key = ? AND seq > ?",
                "seq",
                (scope, key, after),
                limit=limit,
            )
