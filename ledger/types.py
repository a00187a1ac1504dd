"""Column types and SQL expressions that behave the same on Postgres and SQLite.

Leases are judged by the database clock, never the caller's: ``db_now()`` and
``db_now_plus(seconds)`` compile to ``now()`` on Postgres and to SQLite's own clock,
written in the same text format SQLAlchemy uses for SQLite datetimes, so that
comparisons in SQL and values read back agree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from toolledger.ledger.records import as_utc

# SQLite keeps text; %f gives milliseconds, padded to the microseconds SQLAlchemy writes.
_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now'{modifier}) || '000'"


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes; naive text on SQLite, timestamptz on Postgres."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are refused: pass an aware UTC datetime")
        if dialect.name == "sqlite":
            return value.astimezone(UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else as_utc(value)


def dumps(value: Any) -> str:
    """How JSON columns are written: compact, non-ASCII kept, key order as given."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


#: JSON stored as text on both dialects (not JSONB): a saved result replays byte for byte.
JSONType = sa.JSON(none_as_null=True)


class db_now(FunctionElement[datetime]):  # reads like the SQL function it is
    """The database's current time."""

    type = UTCDateTime()
    inherit_cache = True


class db_now_plus(FunctionElement[datetime]):
    """The database's current time plus ``seconds`` (negative for the past)."""

    type = UTCDateTime()
    inherit_cache = True

    def __init__(self, seconds: float | sa.ColumnElement[Any]) -> None:
        if not isinstance(seconds, sa.ColumnElement):
            seconds = sa.bindparam("seconds", float(seconds), type_=sa.Float)
        super().__init__(seconds)


@compiles(db_now, "postgresql")
def _pg_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "now()"


@compiles(db_now, "sqlite")
def _sqlite_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "(" + _SQLITE_NOW.format(modifier="") + ")"


@compiles(db_now_plus, "postgresql")
def _pg_now_plus(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    return f"(now() + make_interval(secs => {compiler.process(element.clauses, **kw)}))"


@compiles(db_now_plus, "sqlite")
def _sqlite_now_plus(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    return "(" + _SQLITE_NOW.format(modifier=f", printf('%+.6f seconds', {seconds})") + ")"


def materialized(cte: sa.CTE) -> sa.CTE:
    """A batch ``SELECT … LIMIT n FOR UPDATE SKIP LOCKED`` an UPDATE takes its rows from, run
    once by Postgres (``AS MATERIALIZED``): see ``in_batch``."""
    return cte.prefix_with("MATERIALIZED", dialect="postgresql")


def in_batch(
    dialect: str, columns: Sequence[sa.Column[Any]], batch: sa.CTE
) -> sa.ColumnElement[bool]:
    """The rows of ``batch`` (a ``materialized`` CTE of the same key ``columns``), as an
    UPDATE's condition. On Postgres a join (``UPDATE … FROM batch``), which it plans from the
    batch's rows through the key's index. As ``IN (SELECT … LIMIT n FOR UPDATE SKIP
    LOCKED)``, the planner ran the batch again for every candidate row when its statistics
    said the rows were few (a nested loop): each run skipped the rows the UPDATE had already
    changed and took the next ones, so one statement took every row, not ``n``, in time
    quadratic in their number (8,000 lost calls: 16 s holding all their rows); and ``IN`` over
    the materialized batch still compared every candidate with every row of it (3.6 s).
    SQLite (whose ``UPDATE … FROM`` needs 3.33) runs an uncorrelated ``IN`` once."""
    keys = [batch.c[c.name] for c in columns]
    if dialect == "postgresql":
        return sa.and_(*(c == k for c, k in zip(columns, keys, strict=True)))
    return sa.tuple_(*columns).in_(sa.select(*keys))
