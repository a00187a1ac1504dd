"""libpq itself, through ctypes: the light reads' Postgres connection (``lightreads``).

``import psycopg`` costs a CLI command ~95 ms on the bench machine (its adapters, its error
classes, asyncio and importlib.metadata), more than the whole of ``toolledger show`` besides;
``ctypes`` and the same libpq cost ~5 ms. These few calls are what psycopg's own pure-Python
implementation (``psycopg.pq._pq_ctypes``) makes, on the libpq psycopg ships with
(``psycopg_binary.libs``), else the system's. Only what the light reads use is here: connect
with the same parameters psycopg is given, one statement at a time with its values sent apart
from the text (``PQsendQueryParams``: never interpolated), text results converted as psycopg
converts the column types the ledger has. Anything this module cannot do raises ``Error``, and
the reads hand over to the ledger (SQLAlchemy on psycopg), which words every error as always.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import select
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

CONNECTION_OK, CONNECTION_BAD = 0, 1
POLLING_FAILED, POLLING_READING, POLLING_WRITING, POLLING_OK = 0, 1, 2, 3
PGRES_COMMAND_OK, PGRES_TUPLES_OK = 1, 2
TEXT = 0
#: Type OIDs (pg_type) converted from their text form; any other column stays text.
BOOL, INT8, INT2, INT4, TIMESTAMP, TIMESTAMPTZ = 16, 20, 21, 23, 1114, 1184

_lib: ctypes.CDLL | None = None


class Error(Exception):
    """libpq could not be loaded, could not connect, or a statement failed."""


def _candidates() -> list[str]:
    """psycopg's own libpq first (the one every other connection of toolledger uses)."""
    found: list[str] = []
    spec = importlib.util.find_spec("psycopg_binary")  # located, not imported
    if spec is not None and spec.origin:
        libs = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), "psycopg_binary.libs")
        found += sorted(glob.glob(os.path.join(glob.escape(libs), "libpq*.so*")))
    return [*found, "libpq.so.5", "libpq.5.dylib"]


def library() -> ctypes.CDLL:
    """libpq, loaded once, with the signatures of the functions used here."""
    global _lib
    if _lib is not None:
        return _lib
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise Error("no libpq to load")
    p, i, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
    signatures: dict[str, tuple[Any, list[Any]]] = {
        "PQconnectStartParams": (p, [ctypes.POINTER(s), ctypes.POINTER(s), i]),
        "PQconnectPoll": (i, [p]),
        "PQsocket": (i, [p]),
        "PQsendQueryParams": (i, [p, s, i, p, ctypes.POINTER(s), p, p, i]),
        "PQconsumeInput": (i, [p]),
        "PQisBusy": (i, [p]),
        "PQgetResult": (p, [p]),
        "PQstatus": (i, [p]),
        "PQerrorMessage": (s, [p]),
        "PQfinish": (None, [p]),
        "PQresultStatus": (i, [p]),
        "PQresultErrorMessage": (s, [p]),
        "PQntuples": (i, [p]),
        "PQnfields": (i, [p]),
        "PQfname": (s, [p, i]),
        "PQftype": (ctypes.c_uint, [p, i]),
        "PQgetisnull": (i, [p, i, i]),
        "PQgetvalue": (p, [p, i, i]),
        "PQgetlength": (i, [p, i, i]),
        "PQclear": (None, [p]),
    }
    for fn, (restype, argtypes) in signatures.items():
        getattr(lib, fn).restype = restype
        getattr(lib, fn).argtypes = argtypes
    lib.PQsetNoticeProcessor.restype = p
    lib.PQsetNoticeProcessor.argtypes = [p, _NOTICE, p]
    _lib = lib
    return lib


#: Server notices (a WARNING at connect, say) are dropped, as psycopg drops them: libpq's
#: default processor writes them to stderr, where a command's one error line or JSON goes.
_NOTICE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)
_DROP_NOTICE = _NOTICE(lambda _arg, _message: None)


def _text(value: Any) -> bytes:
    return str(value).encode("utf-8")


def _convert(oid: int, text: str) -> Any:
    """A value from its text form, as psycopg's default loaders give it."""
    if oid == BOOL:
        return text == "t"
    if oid in (INT2, INT4, INT8):
        return int(text)
    if oid in (TIMESTAMP, TIMESTAMPTZ):
        return datetime.fromisoformat(text)  # ISO: pg_session_settings asks for it
    return text


class Rows:
    """What ``execute`` returns: ``fetchall()``, as psycopg's cursor with ``dict_row``."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self._rows = rows

    def fetchall(self) -> list[dict[str, Any]]:
        return self._rows


class Connection:
    """One libpq connection; a transaction begins with the first statement and ends at
    ``rollback`` (psycopg's default, which the light reads relied on)."""

    def __init__(self, url: str, params: Mapping[str, Any]) -> None:
        lib = library()
        # The URL is expanded as a conninfo (``expand_dbname``); the parameters after it win,
        # as psycopg's keyword arguments win over its conninfo.
        settings = {k: v for k, v in params.items() if v is not None}
        settings["client_encoding"] = "UTF8"
        keys = [b"dbname", *(_text(k) for k in settings)]
        values = [_text(url), *(_text(v) for v in settings.values())]
        kw = (ctypes.c_char_p * (len(keys) + 1))(*keys, None)
        vals = (ctypes.c_char_p * (len(values) + 1))(*values, None)
        # Started, then polled from Python: the notice processor is set before the server's
        # startup messages arrive, and every wait is a select() that Ctrl-C interrupts (one
        # blocking libpq call held SIGINT until it returned).
        conn = lib.PQconnectStartParams(kw, vals, 1)
        if not conn:
            raise Error("libpq: out of memory")
        lib.PQsetNoticeProcessor(conn, _DROP_NOTICE, None)
        self._conn: int | None = conn
        self._in_transaction = False
        timeout = float(settings.get("connect_timeout", 0) or 0)
        deadline = time.monotonic() + timeout if timeout > 0 else None
        polled = POLLING_WRITING
        try:
            while polled != POLLING_OK:
                if polled == POLLING_FAILED or lib.PQstatus(conn) == CONNECTION_BAD:
                    raise Error(self._message() or "connection failed")
                self._wait(polled == POLLING_READING, deadline)
                polled = lib.PQconnectPoll(conn)
        except BaseException:
            self.close()
            raise

    def _message(self) -> str:
        return (library().PQerrorMessage(self._conn) or b"").decode("utf-8", "replace").strip()

    def _wait(self, reading: bool, deadline: float | None) -> None:
        """Until the socket is ready (or ``deadline``, monotonic): interruptible."""
        sock = library().PQsocket(self._conn)
        if sock < 0:
            raise Error(self._message() or "no socket")
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise Error("timeout expired")
        ready = (
            select.select([sock], [], [], left) if reading else select.select([], [sock], [], left)
        )
        if not any(ready):
            raise Error("timeout expired")

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        """``sql`` with psycopg's ``%s`` placeholders, its values sent as parameters."""
        if not self._in_transaction:
            self._run("BEGIN", ())
            self._in_transaction = True
        return self._run(sql, params)

    def rollback(self) -> None:
        if self._in_transaction:
            self._in_transaction = False
            self._run("ROLLBACK", ())

    def commit(self) -> None:
        if self._in_transaction:
            self._in_transaction = False
            self._run("COMMIT", ())

    def close(self) -> None:
        if self._conn is not None:
            library().PQfinish(self._conn)
            self._conn = None

    def _run(self, sql: str, params: Sequence[Any]) -> Rows:
        if self._conn is None:
            raise Error("the connection is closed")
        lib = library()
        parts = sql.split("%s")
        if len(parts) != len(params) + 1:
            raise Error(f"{len(parts) - 1} placeholders for {len(params)} values")
        text = "".join(f"{part}${n}" for n, part in enumerate(parts[:-1], 1)) + parts[-1]
        values = (ctypes.c_char_p * max(1, len(params)))(
            *(None if v is None else _text(v) for v in params)
        )
        if not lib.PQsendQueryParams(
            self._conn, _text(text), len(params), None, values, None, None, TEXT
        ):
            raise Error(self._message() or "cannot send the statement")
        res = None
        while True:  # every result of the statement; the last non-null one is kept
            while lib.PQisBusy(self._conn):
                self._wait(True, None)
                if not lib.PQconsumeInput(self._conn):
                    raise Error(self._message() or "connection lost")
            got = lib.PQgetResult(self._conn)
            if not got:
                break
            if res:
                lib.PQclear(res)
            res = got
        if not res:
            raise Error(self._message() or "no result")
        try:
            status = lib.PQresultStatus(res)
            if status not in (PGRES_COMMAND_OK, PGRES_TUPLES_OK):
                message = lib.PQresultErrorMessage(res) or b""
                raise Error(message.decode("utf-8", "replace").strip() or f"status {status}")
            fields = range(lib.PQnfields(res))
            names = [lib.PQfname(res, f).decode("utf-8") for f in fields]
            oids = [lib.PQftype(res, f) for f in fields]
            rows = []
            for r in range(lib.PQntuples(res)):
                row: dict[str, Any] = {}
                for f in fields:
                    if lib.PQgetisnull(res, r, f):
                        row[names[f]] = None
                        continue
                    raw = ctypes.string_at(lib.PQgetvalue(res, r, f), lib.PQgetlength(res, r, f))
                    try:
                        row[names[f]] = _convert(oids[f], raw.decode("utf-8"))
                    except ValueError as exc:  # PGDATESTYLE, an encoding: the ledger words it
                        raise Error(f"column {names[f]}: {exc}") from None
                rows.append(row)
            return Rows(rows)
        finally:
            lib.PQclear(res)


def connect(url: str, **params: Any) -> Connection:
    return Connection(url, params)
