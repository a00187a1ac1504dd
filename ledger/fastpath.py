"""The executor's hot path on Postgres: one statement, one round trip, one commit each.

Statuses in these statements' WHERE clauses are bound parameters, never literals. psycopg
prepares a statement after a few uses and Postgres may then cache a generic plan; a partial
index (running, unknown, approved) can only serve a predicate it can prove at plan time, so
with a parameter the cached plan can only find rows by their keys. With a literal, a plan
cached while no row was running found executions through the "running" index and, once
10,000 were in flight, scanned them all for every terminal write (629 -> 169 jobs/s).

A claim (execution row + operation status + event) and a terminal write (execution row +
result + operation status + event) are each a single data-modifying CTE run in autocommit:
a single statement is its own transaction, so invariants 1, 2 and 5 hold exactly as in the
generic store (ledger.store.Store), which tests compare row for row. Measured on this machine
class, ``BEGIN`` + four statements + ``COMMIT`` cost about twice the CPU of one statement.

The statements go straight to a psycopg connection that each thread keeps checked out of
the engine's pool (prepared server-side after a few uses): profiling showed SQLAlchemy's
per-execute work costing more than the round trip itself. Driver errors are raised as
SQLAlchemy's exception classes, so callers handle one family; a broken connection is
invalidated and replaced on the next call.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import threading
import weakref
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from toolledger.ledger.answers import WATCH, answer_wait
from toolledger.ledger.errors import StaleFence
from toolledger.ledger.models import execution_events, executions, operations
from toolledger.ledger.records import Claim, ExecutionRecord, Finished, OperationRecord, as_utc
from toolledger.ledger.store import Store
from toolledger.ledger.transitions import Status
from toolledger.ledger.types import dumps

if TYPE_CHECKING:
    from toolledger.ledger.base import LedgerBase

_CLAIM = sa.text(
    """
WITH op AS (
    SELECT tool, args FROM operations
    WHERE scope = :scope AND idempotency_key = :key
      AND status = :approved AND authorized_attempts = :attempt AND review IS NULL
    FOR UPDATE
), claimed AS (
    INSERT INTO executions (execution_id, scope, idempotency_key, attempt, status, worker_id,
                            lease_token, lease_expires_at, heartbeat_at, started_at, reconciled,
                            fenced)
    SELECT :execution_id, :scope, :key, :attempt, 'running', :worker_id, :lease_token,
           now() + make_interval(secs => :lease_seconds), now(), now(), false, true
    FROM op
    ON CONFLICT (scope, idempotency_key, attempt) DO NOTHING
    RETURNING lease_expires_at
), moved AS (
    UPDATE operations SET status = 'running'
    WHERE scope = :scope AND idempotency_key = :key AND status = :approved
      AND authorized_attempts = :attempt AND EXISTS (SELECT FROM claimed)
), logged AS (
    INSERT INTO execution_events (scope, idempotency_key, execution_id, kind, actor, at, detail)
    SELECT :scope, :key, :execution_id, 'running', :worker_id, now(), CAST(:detail AS json)
    FROM claimed
)
SELECT claimed.lease_expires_at, op.tool, op.args FROM claimed, op
"""
).columns(executions.c.lease_expires_at, operations.c.tool, operations.c.args)

#: Every column named, never ``*``: a migration that adds a column while workers of this code
#: still run (the documented upgrade order) must not change what these statements return, nor
#: the result type of the plans psycopg has prepared for them.
_EXECUTION_COLUMNS = ", ".join(c.name for c in executions.c)
_OPERATION_COLUMNS = ", ".join(c.name for c in operations.c)

#: The terminal write. Its event draws its seq only after the path locks (``locks``) and the
#: call's row (``moved``) are held: Postgres runs a data-modifying CTE nobody reads after the
#: main query, so the seq was drawn first, and a reconciliation of an earlier attempt that
#: committed before this write (holding the call's row) was listed after it (helper-98).
_FINISH = sa.text(
    f"""
WITH done AS (
    UPDATE executions
    SET status = :status, result = CAST(:result AS json), error = :error, finished_at = now(),
        effects = CAST(:effects AS json)
    WHERE execution_id = :execution_id AND status = :running AND lease_token = :lease_token
    RETURNING {_EXECUTION_COLUMNS}
), locks AS (
    SELECT pg_advisory_xact_lock(k)
    FROM (SELECT DISTINCT unnest(CAST(:lock_keys AS bigint[])) AS k FROM done) AS keys
    ORDER BY k
), moved AS (
    UPDATE operations o SET status = :status
    FROM done
    WHERE o.scope = done.scope AND o.idempotency_key = done.idempotency_key
      AND o.status = :running AND o.authorized_attempts = done.attempt
    RETURNING 1
), logged AS (
    INSERT INTO execution_events (scope, idempotency_key, execution_id, kind, actor, at, detail)
    SELECT scope, idempotency_key, execution_id, :status,
           coalesce(nullif(worker_id, ''), 'worker'), now(), CAST(:detail AS json)
    FROM done, (SELECT count(*) FROM locks) AS held, (SELECT count(*) FROM moved) AS taken
    RETURNING seq
)
SELECT {", ".join(f"done.{c.name}" for c in executions.c)}, logged.seq FROM done, logged
"""
).columns(*executions.c, execution_events.c.seq)


#: The statuses the statements compare with, always bound (see the module docstring).
_STATUSES = {"approved": "approved", "running": "running"}


def _psycopg_sql(statement: sa.TextualSelect) -> str:
    """``:name`` placeholders as psycopg's ``%(name)s``."""
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", str(statement))


_SUBMIT = sa.text(
    f"""
WITH op AS (
    INSERT INTO operations (scope, idempotency_key, tool, args, args_sha256, status,
                            authorized_attempts, decided_by, decided_at, reason, created_at,
                            enqueued_at)
    VALUES (:scope, :key, :tool, CAST(:args AS json), :sha, :status, :attempts, :decided_by,
            CASE WHEN :approved THEN now() END, :reason, now(),
            CASE WHEN :stamp THEN now() END)
    ON CONFLICT (scope, idempotency_key) DO NOTHING
    RETURNING {_OPERATION_COLUMNS}
), called AS (
    INSERT INTO tool_calls (scope, tool_call_id, idempotency_key, args_sha256, created_at)
    SELECT scope, :tool_call_id, idempotency_key, args_sha256, now() FROM op
), logged AS (
    INSERT INTO execution_events (scope, idempotency_key, execution_id, kind, actor, at, detail)
    SELECT op.scope, op.idempotency_key, NULL, v.kind, v.actor, now(), CAST(v.detail AS json)
    FROM op, (VALUES (1, 'submitted', :actor, :submitted),
                     (2, :status, :decider, :decision)) AS v(n, kind, actor, detail)
    ORDER BY v.n
)
SELECT {_OPERATION_COLUMNS} FROM op
"""
).columns(*operations.c)


def psycopg_statements() -> tuple[str, str, dict[str, str]]:
    """Claim, finish and the statuses they bind, as psycopg runs them (for the benchmark's
    framework-free baseline, which must run exactly these statements, not a copy)."""
    return _psycopg_sql(_CLAIM), _psycopg_sql(_FINISH), dict(_STATUSES)


#: Connections of a pool that threads may not keep for their life: room for the generic
#: path's reads and writes (a wait's reads, a worker's lease keeper and landings) and for the
#: statements of threads past the rest (``HeldConnectionStore.statement_connection``).
HOLD_RESERVE = 8

#: Every held-connection store of this process, for a fork's child to forget (below).
_STORES: weakref.WeakSet[HeldConnectionStore] = weakref.WeakSet()
#: What a forked child inherited and must neither use nor close: closing a psycopg connection
#: ends the parent's session (libpq sends Terminate on the shared socket), and a pooled one
#: garbage-collected would be reset on it. Kept referenced for the child's life.
_INHERITED: list[Any] = []


def _forget_in_child() -> None:
    """After a fork, in the child: the connections the threads held are the parent's (the same
    sockets); the child opens its own. The engine's pool is the parent's too: SQLAlchemy's
    recipe, ``dispose(close=False)``."""
    for store in list(_STORES):
        with contextlib.suppress(Exception):
            _INHERITED.extend(store._held)
            store._held = []
            store._opening = 0
            store._local = threading.local()
            store._lock = threading.Lock()
            store.engine.dispose(close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class HeldConnectionStore(Store):
    """A store whose statements go straight to a DB-API connection each thread keeps checked
    out of the engine's pool (``ledger.fastpath_sqlite`` shares this with Postgres). A forked
    child never uses its parent's (``_forget_in_child``)."""

    def __init__(self, ledger: LedgerBase) -> None:
        super().__init__(ledger)
        self.engine = ledger.engine
        self._local = threading.local()
        self._held: list[Any] = []
        self._opening = 0  # threads opening the connection they will keep (_room_to_hold)
        self._lock = threading.Lock()
        _STORES.add(self)

    def _setup(self, dbapi: Any) -> None:
        """Configure a connection once, when a thread first takes it."""

    def _room_to_hold(self) -> bool:
        """Whether this thread may keep a connection for its life, its place taken if so:
        while the pool keeps ``HOLD_RESERVE`` of its connections for everything else (a
        worker's pool is sized for its threads plus those: ``db.reserve_threads``). Every
        thread held one, and a process whose threads outnumbered the pool (an agent server's
        50 threads sharing one Client) starved: the threads past it failed their submits,
        and no read was left a connection, so every thread's wait failed (a cold review)."""
        pool = self.engine.pool
        room = None  # no bound to the pool (NullPool, StaticPool, max_overflow=-1)
        if isinstance(pool, sa.QueuePool) and pool._max_overflow >= 0:
            room = pool.size() + pool._max_overflow - HOLD_RESERVE
        with self._lock:
            # (places taken, not only connections held: threads opening theirs at once all
            # found room in a check made before any of them held one)
            if room is not None and len(self._held) + self._opening >= room:
                return False
            self._opening += 1
            return True

    def _configured(self) -> Any:
        pooled = self.engine.raw_connection()
        try:
            self._setup(pooled.dbapi_connection)
        except Exception:
            pooled.invalidate()
            raise
        return pooled

    def connection(self) -> Any:
        """This thread's connection (checked out of the engine's pool, kept); when the pool
        has no more room for one kept for good (``_room_to_hold``), one for the next
        statement alone, which ``release`` closes (configured for these statements, it never
        goes back to the pool: see ``_give_back``)."""
        pooled = getattr(self._local, "pooled", None)
        if pooled is None:
            if not self._room_to_hold():
                return self._configured()
            try:
                pooled = self._configured()
                self._local.pooled = pooled
                with self._lock:
                    self._held.append(pooled)
            finally:
                with self._lock:
                    self._opening -= 1
            # A thread that ends gives its connection back (threads that come and go, e.g.
            # one per request, would otherwise exhaust the pool).
            weakref.finalize(threading.current_thread(), self._give_back, pooled)
        return pooled

    def _give_back(self, pooled: Any) -> None:
        """Close a finished thread's connection rather than return it to the pool: ``_setup``
        configured it for these statements alone (on Postgres autocommit and cached generic
        plans), and the pool would hand it to the generic path, whose transactions would then
        commit statement by statement (a cold review: a refused submit's operation stayed)."""
        with self._lock:
            if pooled not in self._held:
                return
            self._held.remove(pooled)
        with contextlib.suppress(Exception):
            pooled.invalidate()

    def release(self, pooled: Any) -> None:
        """After a statement on ``pooled``: a connection taken for it alone is closed; this
        thread's own stays."""
        if pooled is getattr(self._local, "pooled", None) or pooled.dbapi_connection is None:
            return  # kept, or dropped already
        with contextlib.suppress(Exception):
            pooled.invalidate()

    def _drop(self, pooled: Any) -> None:
        """Forget a broken connection (the next call opens another)."""
        with self._lock:
            if pooled in self._held:
                self._held.remove(pooled)
        if getattr(self._local, "pooled", None) is pooled:  # (not one of a single statement)
            self._local.pooled = None
        pooled.invalidate()

    def close(self) -> None:
        """Give back (and close) every connection the threads held."""
        with self._lock:
            held, self._held = self._held, []
        for pooled in held:
            with contextlib.suppress(Exception):
                pooled.invalidate()
        self._local = threading.local()


def _closed_by_server(dbapi: Any) -> bool:
    """Whether the server ended this idle connection (``pg_terminate_backend``, a restart, an
    idle timeout): it then sent its last words and closed, so the socket reads while no
    statement runs. A held connection is checked by this, not by a pre-ping (a round trip a
    call): the call after such an end failed once (a cold review). A healthy idle connection
    is not readable (it LISTENs to nothing); if something else ever made it so, the cost is one
    new connection."""
    try:
        if dbapi.closed:
            return True
        fd = dbapi.pgconn.socket
    except Exception:  # noqa: BLE001 - no socket to ask: the session is gone
        return True
    # poll, not select: select refuses a descriptor past 1023 (a cold review: every call of a
    # process with many files open took a new connection)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class PostgresStore(HeldConnectionStore):
    """Claim, finish and the submit of a new call as single autocommit statements."""

    creates = True

    def __init__(self, ledger: LedgerBase) -> None:
        super().__init__(ledger)
        statements = (_CLAIM, _FINISH, _SUBMIT)
        self.answer_wait = answer_wait(ledger.timeout)
        self._sql = {id(s): _psycopg_sql(s) for s in statements}
        self._columns = {id(s): [c.name for c in s.selected_columns] for s in statements}

    def _setup(self, dbapi: Any) -> None:
        dbapi.autocommit = True
        # Cached generic plans are safe here (see above) and save planning each call.
        dbapi.execute("SET plan_cache_mode = auto")

    def _one(self, statement: sa.TextualSelect, params: dict[str, Any]) -> dict[str, Any] | None:
        import psycopg

        sql = self._sql[id(statement)]
        params = {**_STATUSES, **params}
        try:
            pooled = self.connection()
            if _closed_by_server(pooled.dbapi_connection):
                self._drop(pooled)
                pooled = self.connection()  # a new one: not asked again
        except psycopg.Error as exc:  # raw_connection() does not translate driver errors
            raise sa.exc.DBAPIError.instance(
                sql, params, exc, psycopg.Error, hide_parameters=True
            ) from exc
        try:
            return self._row(pooled, statement, sql, params)
        finally:
            self.release(pooled)

    def _row(
        self, pooled: Any, statement: sa.TextualSelect, sql: str, params: dict[str, Any]
    ) -> dict[str, Any] | None:
        import psycopg

        dbapi, wait = pooled.dbapi_connection, None
        try:
            with (
                contextlib.nullcontext(None)
                if self.answer_wait is None
                else WATCH.bounded(dbapi.pgconn.socket, self.answer_wait)  # answers.py
            ) as wait:
                row = dbapi.execute(sql, params).fetchone()
        except psycopg.Error as exc:
            if dbapi.closed or isinstance(exc, psycopg.OperationalError):
                self._drop(pooled)
            shown = exc
            if wait is not None and wait.cut:
                said = f"no answer in {self.answer_wait:g} s: the connection was cut"
                shown = psycopg.OperationalError(f"{said} (the statement may have committed)")
            # hide_parameters: a lease token never reaches a log line through an error message
            raise sa.exc.DBAPIError.instance(
                sql, params, shown, psycopg.Error, hide_parameters=True
            ) from exc
        except BaseException:
            # cut while the server had the statement (Celery's soft time limit raised in the
            # wait, a KeyboardInterrupt): the connection is mid-command, and its next user
            # failed "another command is already in progress" (helper-89). Never reused.
            self._drop(pooled)
            raise
        if row is None:
            return None
        return dict(zip(self._columns[id(statement)], row, strict=True))

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
        row = self._one(
            _CLAIM,
            {
                "scope": scope,
                "key": key,
                "attempt": attempt,
                "execution_id": execution_id,
                "worker_id": worker_id,
                "lease_token": token,
                "lease_seconds": float(lease_seconds),
                "detail": dumps(detail),
            },
        )
        if row is None:
            return None
        return Claim(
            execution_id=execution_id,
            scope=scope,
            idempotency_key=key,
            attempt=attempt,
            lease_token=token,
            lease_expires_at=row["lease_expires_at"].astimezone(UTC),
            worker_id=worker_id,
            tool=row["tool"],
            args=row["args"],
        )

    def create(self, params: dict[str, Any]) -> OperationRecord | None:
        """The new operation, its tool call and its events; None if the key exists (the
        caller then takes the generic path, which tells existing, linked and conflict apart).
        A tool_call_id bound to another key aborts the whole statement (IntegrityError)."""
        row = self._one(_SUBMIT, params)
        if row is None:
            return None
        for name in ("decided_at", "created_at", "enqueued_at"):
            row[name] = _utc(row[name])
        return OperationRecord.from_row(row)

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
        row = self._one(
            _FINISH,
            {
                "execution_id": execution_id,
                "lease_token": lease_token,
                "status": status.value,
                "result": dumps(result),
                "error": error,
                "effects": None if effects is None else dumps(effects),
                "lock_keys": lock_keys,
                "detail": dumps(detail),
            },
        )
        if row is None:
            raise StaleFence(execution_id)
        return Finished(lambda: _execution(row), int(row["seq"]))


def _execution(row: dict[str, Any]) -> ExecutionRecord:
    """The record of a row ``_FINISH`` returned (built only when someone reads it)."""
    times = ("lease_expires_at", "heartbeat_at", "started_at", "finished_at")
    return ExecutionRecord.from_row({**row, **{name: _utc(row[name]) for name in times}})


def _utc(value: datetime | None) -> datetime | None:
    return None if value is None else as_utc(value)
