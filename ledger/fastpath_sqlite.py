"""The executor's hot path on SQLite: one short transaction of prepared statements each.

SQLite has no data-modifying CTEs, so a claim, a terminal write and the submit of a new call
are each one ``BEGIN IMMEDIATE`` … ``COMMIT`` of a few statements, run straight on a sqlite3
connection that each thread keeps checked out of the engine's pool (``HeldConnectionStore``):
sqlite3 prepares each statement once per connection and keeps it in its cache. Profiling
the embedded protocol showed SQLAlchemy Core's per-execute work (building, compiling and
caching statements, processing rows) costing several times the statements themselves.

The connection is the engine's own, so it has the engine's pragmas (WAL, synchronous=FULL,
busy timeout, foreign keys): durability is exactly the generic path's. BEGIN IMMEDIATE takes
the write lock first, as the generic path's writes do, so the read that precedes a claim's
insert cannot go stale under it. Clock expressions are compiled from ``ledger.types``, and
values are converted by the columns' own SQLAlchemy types, so rows read and written here are
the generic store's byte for byte (``tests/integration/test_fastpath.py`` compares them).
Driver errors are raised as SQLAlchemy's exception classes, after a rollback.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite

from toolledger.ledger import doorbell, writers
from toolledger.ledger.errors import StaleFence
from toolledger.ledger.fastpath import HeldConnectionStore
from toolledger.ledger.models import execution_events, executions, operations
from toolledger.ledger.records import Claim, ExecutionRecord, Finished, OperationRecord
from toolledger.ledger.transitions import RECEIPT_STATUSES, Status
from toolledger.ledger.types import db_now, db_now_plus

if TYPE_CHECKING:
    from toolledger.ledger.base import LedgerBase

_NAMED = sqlite.dialect(paramstyle="named")
_NOW = str(db_now().compile(dialect=_NAMED))
_EXPIRY = str(db_now_plus(sa.bindparam("lease_seconds", type_=sa.Float)).compile(dialect=_NAMED))


def _columns(table: sa.Table) -> str:
    return ", ".join(c.name for c in table.c)


_CLAIM_READ = """
SELECT tool, args FROM operations
WHERE scope = :scope AND idempotency_key = :key AND status = :approved
  AND authorized_attempts = :attempt AND review IS NULL"""

_CLAIM_INSERT = f"""
INSERT INTO executions (execution_id, scope, idempotency_key, attempt, status, worker_id,
                        lease_token, lease_expires_at, heartbeat_at, started_at, reconciled,
                        fenced)
VALUES (:execution_id, :scope, :key, :attempt, :running, :worker_id, :lease_token, {_EXPIRY},
        {_NOW}, {_NOW}, :false, :true)
ON CONFLICT (scope, idempotency_key, attempt) DO NOTHING
RETURNING lease_expires_at"""

_MOVE = """
UPDATE operations SET status = :new
WHERE scope = :scope AND idempotency_key = :key AND status = :old
  AND authorized_attempts = :attempt"""

_EVENT = f"""
INSERT INTO execution_events (scope, idempotency_key, execution_id, kind, actor, at, detail)
VALUES (:scope, :key, :execution_id, :kind, :actor, {_NOW}, :detail)
RETURNING seq"""

_FINISH = f"""
UPDATE executions
SET status = :status, result = :result, error = :error, effects = :effects,
    finished_at = {_NOW}
WHERE execution_id = :execution_id AND status = :running AND lease_token = :lease_token
RETURNING {_columns(executions)}"""

_SUBMIT = f"""
INSERT INTO operations (scope, idempotency_key, tool, args, args_sha256, status,
                        authorized_attempts, decided_by, decided_at, reason, created_at,
                        enqueued_at)
VALUES (:scope, :key, :tool, :args, :sha, :status, :attempts, :decided_by,
        CASE WHEN :approved THEN {_NOW} END, :reason, {_NOW}, CASE WHEN :stamp THEN {_NOW} END)
ON CONFLICT (scope, idempotency_key) DO NOTHING
RETURNING {_columns(operations)}"""

# A call id bound to another key fails this insert (IntegrityError): the whole submit rolls
# back and the generic path explains (ConflictError), as on Postgres.
_SUBMIT_CALL = f"""
INSERT INTO tool_calls (scope, tool_call_id, idempotency_key, args_sha256, created_at)
VALUES (:scope, :tool_call_id, :key, :sha, {_NOW})"""

_Convert = Callable[[Any], Any]

#: The columns ``_FINISH`` returns, in order, and where the ones it reads at once are.
_EXECUTION_COLUMNS = [c.name for c in executions.c]
_OPERATION_COLUMNS = [c.name for c in operations.c]  # ``_SUBMIT``'s
_SCOPE, _KEY, _ATTEMPT, _WORKER = (
    _EXECUTION_COLUMNS.index(name) for name in ("scope", "idempotency_key", "attempt", "worker_id")
)


def _readers(table: sa.Table, dialect: sa.Dialect) -> dict[str, _Convert]:
    """How the generic path reads each column on this dialect (JSON, booleans, UTC times)."""
    readers = {
        c.name: c.type.dialect_impl(dialect).result_processor(dialect, None) for c in table.c
    }
    return {name: fn for name, fn in readers.items() if fn is not None}


def _writer(column: sa.Column[Any], dialect: sa.Dialect) -> _Convert:
    """How the generic path writes a column on this dialect."""
    fn = column.type.dialect_impl(dialect).bind_processor(dialect)
    assert fn is not None, column.name
    return fn


class SqliteStore(HeldConnectionStore):
    """Claim, finish and the submit of a new call, each one BEGIN IMMEDIATE … COMMIT."""

    creates = True

    def __init__(self, ledger: LedgerBase) -> None:
        super().__init__(ledger)
        dialect = self.engine.dialect
        self._read = {t.name: _readers(t, dialect) for t in (executions, operations)}
        # ``finish`` reads these as stored, before the row is converted
        assert not {"scope", "idempotency_key", "attempt", "worker_id"} & set(
            self._read["executions"]
        )
        self._result = _writer(executions.c.result, dialect)
        self._effects = _writer(executions.c.effects, dialect)
        self._detail = _writer(execution_events.c.detail, dialect)
        boolean = _writer(executions.c.fenced, dialect)
        self._bool = {"true": boolean(True), "false": boolean(False)}
        database = self.engine.url.database
        self._bells = doorbell.bell_dir(database) if database else None
        self._database = writers.database_file(self.engine.url)

    def _setup(self, dbapi: Any) -> None:
        dbapi.isolation_level = None  # BEGIN IMMEDIATE is ours (as the engine's connect hook)

    @staticmethod
    def fits(engine: sa.Engine) -> bool:
        """A database file: every thread's connection sees the same database (an in-memory
        one is a database per connection)."""
        url = engine.url
        return url.database not in (None, "", ":memory:") and url.query.get("mode") != "memory"

    def _row(self, table: str, names: list[str], values: tuple[Any, ...]) -> dict[str, Any]:
        convert = self._read[table]
        return {
            n: (convert[n](v) if n in convert else v) for n, v in zip(names, values, strict=True)
        }

    def _transaction(self, steps: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run ``steps`` between BEGIN IMMEDIATE and COMMIT; roll back if it returns None or
        raises (driver errors come out as SQLAlchemy's)."""
        pooled = self.connection()
        conn: sqlite3.Connection = pooled.dbapi_connection
        try:
            with writers.turn(self._database, lambda: conn) as waited:
                return self._run(conn, steps, waited)
        except sqlite3.Error as exc:
            if not isinstance(exc, sqlite3.IntegrityError):
                # A connection that failed otherwise (I/O, a closed handle) is not reused.
                self._drop(pooled)
            # hide_parameters: a lease token never reaches a log line through an error message
            raise sa.exc.DBAPIError.instance(
                "", None, exc, sqlite3.Error, hide_parameters=True
            ) from exc
        finally:
            self.release(pooled)  # one taken for this transaction alone (see connection)

    @staticmethod
    def _run(
        conn: sqlite3.Connection, steps: Callable[[sqlite3.Connection], Any], waited: float = 0.0
    ) -> Any:
        """BEGIN IMMEDIATE (waiting for the lock no longer than what is left of the busy
        timeout after ``waited`` seconds in the writers' queue), ``steps``, then COMMIT
        (ROLLBACK if it returned None or raised)."""
        try:
            with writers.within_budget(waited, lambda: conn):
                conn.execute("BEGIN IMMEDIATE")
            out = steps(conn)
            conn.execute("COMMIT" if out is not None else "ROLLBACK")
            return out
        except BaseException:
            # from BEGIN on: an exception between BEGIN and the first step (Celery's soft
            # time limit, raised anywhere) left the thread's kept connection holding the
            # write lock, every other writer waiting (helper-92, suspected; shown in a test)
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):  # the first error is the story
                    conn.execute("ROLLBACK")
            raise

    def _ring(self, scope: str, key: str) -> None:
        """Wake the receipt's waiters once it is committed (as ``db.write_transaction``)."""
        if self._bells is not None:
            payload = json.dumps([[scope, key]], ensure_ascii=False).encode("utf-8")
            doorbell.ring(self._bells, payload)

    def claim(
        self,
        scope: str,
        key: str,
        attempt: int,
        worker_id: str,
        lease_seconds: float,
        execution_id: str,
        token: str,
        detail: dict[str, Any],
    ) -> Claim | None:
        params = {
            "scope": scope,
            "key": key,
            "attempt": attempt,
            "approved": Status.APPROVED.value,
            "running": Status.RUNNING.value,
            "execution_id": execution_id,
            "worker_id": worker_id,
            "lease_token": token,
            "lease_seconds": float(lease_seconds),
            **self._bool,
        }

        # Everything but the statements is made before the write lock is taken: with several
        # processes on one file, the time it is held bounds the jobs per second.
        move = {**params, "new": Status.RUNNING.value, "old": Status.APPROVED.value}
        event = self._event(params, Status.RUNNING, worker_id, self._detail(detail))

        def steps(conn: sqlite3.Connection) -> tuple[Any, ...] | None:
            op = conn.execute(_CLAIM_READ, params).fetchone()
            if op is None:
                return None
            won = conn.execute(_CLAIM_INSERT, params).fetchone()
            if won is None:
                return None
            conn.execute(_MOVE, move)
            conn.execute(_EVENT, event)
            return (*op, *won)

        row = self._transaction(steps)
        if row is None:
            return None
        convert = self._read["operations"]
        return Claim(
            execution_id=execution_id,
            scope=scope,
            idempotency_key=key,
            attempt=attempt,
            lease_token=token,
            lease_expires_at=self._read["executions"]["lease_expires_at"](row[2]),
            worker_id=worker_id,
            tool=row[0],
            args=convert["args"](row[1]),
        )

    @staticmethod
    def _event(params: Mapping[str, Any], kind: Status, actor: str, detail: str) -> dict[str, Any]:
        """An event's parameters; ``detail`` as written (``_detail``)."""
        return {
            "scope": params["scope"],
            "key": params["key"],
            "execution_id": params["execution_id"],
            "kind": kind.value,
            "actor": actor,
            "detail": detail,
        }

    def finish(
        self,
        execution_id: str,
        lease_token: str,
        status: Status,
        result: dict[str, Any],
        error: str | None,
        effects: list[dict[str, Any]] | None,
        lock_keys: list[int],
        detail: dict[str, Any],
    ) -> Finished:
        # lock_keys: SQLite serialises every commit, so seq order is commit order already.
        params = {
            "execution_id": execution_id,
            "lease_token": lease_token,
            "status": status.value,
            "running": Status.RUNNING.value,
            "result": self._result(result),
            "error": error,
            "effects": self._effects(effects),
        }
        written = self._detail(detail)  # before the lock, as the claim's

        def steps(conn: sqlite3.Connection) -> tuple[tuple[Any, ...], int, bool] | None:
            values = conn.execute(_FINISH, params).fetchone()
            if values is None:
                return None
            # plain text and integer columns, read as stored: no conversion under the lock
            where = {"scope": values[_SCOPE], "key": values[_KEY]}
            move = {
                **where,
                "attempt": values[_ATTEMPT],
                "new": status.value,
                "old": params["running"],
            }
            moved = conn.execute(_MOVE, move).rowcount == 1
            actor = values[_WORKER] or "worker"
            ev = self._event({**where, "execution_id": execution_id}, status, actor, written)
            (seq,) = conn.execute(_EVENT, ev).fetchone()
            return values, seq, moved

        out = self._transaction(steps)
        if out is None:
            raise StaleFence(execution_id)
        values, seq, moved = out
        if moved and status in RECEIPT_STATUSES:
            self._ring(values[_SCOPE], values[_KEY])
        return Finished(
            lambda: ExecutionRecord.from_row(self._row("executions", _EXECUTION_COLUMNS, values)),
            int(seq),
        )

    def create(self, params: dict[str, Any]) -> OperationRecord | None:
        """The new operation, its tool call and its two events; None if the key exists (the
        generic path then tells existing, linked and conflict apart)."""
        where = {"scope": params["scope"], "key": params["key"], "execution_id": None}
        events = [
            {**where, "kind": kind, "actor": actor, "detail": detail}
            for kind, actor, detail in (
                ("submitted", params["actor"], params["submitted"]),
                (params["status"], params["decider"], params["decision"]),
            )
        ]

        def steps(conn: sqlite3.Connection) -> tuple[Any, ...] | None:
            values = conn.execute(_SUBMIT, params).fetchone()
            if values is None:
                return None
            conn.execute(_SUBMIT_CALL, params)
            for event in events:
                conn.execute(_EVENT, event)
            return tuple(values)

        values = self._transaction(steps)
        if values is None:
            return None
        return OperationRecord.from_row(self._row("operations", _OPERATION_COLUMNS, values))
