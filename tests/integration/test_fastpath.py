"""The fast stores write exactly what the generic store writes: on Postgres one statement per
hot step (``PostgresStore``), on SQLite one BEGIN IMMEDIATE … COMMIT of prepared statements
(``SqliteStore``). Every comparison is also shown to fail against a fast store that was
broken on purpose (a forgotten event, a row not moved, a doorbell not rung)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa

from tests.conftest import fresh_pg_database, fresh_sqlite_database
from toolledger.ledger import doorbell, fastpath, fastpath_sqlite
from toolledger.ledger.fastpath import PostgresStore
from toolledger.ledger.fastpath_sqlite import SqliteStore
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.models import execution_events, executions, operations, tool_calls
from toolledger.ledger.records import Finished
from toolledger.ledger.store import Store
from toolledger.ledger.transitions import Status

FAST = {"postgresql": PostgresStore, "sqlite": SqliteStore}

VOLATILE = {
    "execution_id",
    "lease_token",
    "lease_expires_at",
    "heartbeat_at",
    "started_at",
    "finished_at",
    "created_at",
    "decided_at",
    "at",
    "seq",
    "scope",
    "enqueued_at",
}


def _flow(ledger: Ledger, scope: str) -> None:
    for cid, status in (("a", Status.SUCCEEDED), ("b", Status.FAILED), ("c", None)):
        ledger.submit(scope, cid, "write_file", {"path": cid, "content": "é"}, approved_by="al")
        claim = ledger.claim(scope, f"write_file:{cid}", 1, worker_id="w1")
        assert ledger.claim(scope, f"write_file:{cid}", 1, worker_id="w2") is None
        if status:
            ledger.finish(
                claim.execution_id,
                claim.lease_token,
                status,
                {"r": cid, "ü": [1]},
                error=None if status is Status.SUCCEEDED else "boom",
            )


#: Times an event's detail carries (when the lease was last renewed, when it expired).
DETAIL_VOLATILE = {"last_heartbeat_at", "lease_expired_at"}


def _stable(column: str, value: Any) -> Any:
    if column == "detail" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in DETAIL_VOLATILE}
    return value


def _state(ledger: Ledger, scope: str) -> dict[str, Any]:
    with ledger.engine.connect() as conn:

        def rows(table: sa.Table, *order: Any) -> list[dict[str, Any]]:
            q = sa.select(table).where(table.c.scope == scope).order_by(*order)
            return [
                {k: _stable(k, v) for k, v in r._mapping.items() if k not in VOLATILE}
                for r in conn.execute(q)
            ]

        return {
            "operations": rows(operations, operations.c.idempotency_key),
            "tool_calls": rows(tool_calls, tool_calls.c.tool_call_id),
            "executions": rows(executions, executions.c.idempotency_key, executions.c.attempt),
            "events": rows(execution_events, execution_events.c.seq),
        }


def test_fastpath__same_rows_and_events_as_the_generic_path(db_url):
    fast, generic = Ledger(db_url, fast_path=True), Ledger(db_url, fast_path=False)
    assert type(fast.store) is FAST[fast.dialect] and type(generic.store) is Store
    _flow(fast, "fast")
    _flow(generic, "generic")
    assert _state(fast, "fast") == _state(generic, "generic")
    assert fast.verify().ok
    fast.close()
    generic.close()


def _shape(name: str, value: Any, token: str | None) -> Any:
    """A record's field as two runs can share it: times by kind and zone, the lease token by
    whether it is the claim's, ids by presence; the rest as it is."""
    if isinstance(value, datetime):
        return ("datetime", value.tzinfo is UTC)
    if name == "lease_token":
        return ("token", value == token)
    if name == "execution_id":
        return ("id", bool(value))
    return value


def _outcome(fn: Any, token: str | None = None) -> Any:
    """What a step returned (its comparable part) or which error it raised; ``token``: the
    lease token a finish was given."""
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - the error class is the outcome
        return ("raised", type(exc).__name__)
    if out is None:
        return None
    if hasattr(out, "outcome"):  # Submitted
        return ("submitted", out.outcome, out.operation.status.value)
    if hasattr(out, "lease_token"):  # Claim
        return ("claimed", out.attempt, out.tool, out.args)
    if isinstance(out, Finished):  # the record as committed, built when read
        record = dataclasses.asdict(out.execution)
        return ("finished", {k: _shape(k, v, token) for k, v in record.items() if k != "scope"})
    return ("other", type(out).__name__)


def _every_path(ledger: Ledger, scope: str) -> list[Any]:
    """Each path the fast statements take or hand over to the generic code: submit created /
    linked / existing / conflict (other args, and a call id bound to another key); claim won /
    lost / not approved / attempt not authorised / after a retry; finish succeeded / failed /
    stale token / after revocation, with effects and path locks."""
    args = {"path": "p", "content": "x"}
    steps: list[Any] = []
    out = steps.append
    out(
        _outcome(lambda: ledger.submit(scope, "c1", "write_file", args, key="k1", approved_by="al"))
    )
    out(_outcome(lambda: ledger.submit(scope, "c2", "write_file", args, key="k1")))  # linked
    out(_outcome(lambda: ledger.submit(scope, "c1", "write_file", args, key="k1")))  # existing
    other = {"path": "p", "content": "y"}
    out(_outcome(lambda: ledger.submit(scope, "c3", "write_file", other, key="k1")))  # conflict
    out(_outcome(lambda: ledger.submit(scope, "c1", "write_file", args, key="k9")))  # rebound
    out(_outcome(lambda: ledger.submit(scope, "p1", "write_file", args, key="k2")))  # pending
    out(_outcome(lambda: ledger.claim(scope, "k2", 1, worker_id="w")))  # not approved
    out(_outcome(lambda: ledger.claim(scope, "k1", 2, worker_id="w")))  # not authorised
    claim = ledger.claim(scope, "k1", 1, worker_id="w")
    assert claim is not None
    out(_outcome(lambda: claim))
    out(_outcome(lambda: ledger.claim(scope, "k1", 1, worker_id="w2")))  # lost
    out(_outcome(lambda: ledger.finish(claim.execution_id, "not-the-token", Status.SUCCEEDED, {})))
    effects = [{"path": "p", "kind": "write", "sha256": "0" * 64, "bytes": 1}]
    out(_outcome(lambda: ledger.finish(
        claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"ok": True},
        effects=effects, lock_keys=[7, 3],
    ), claim.lease_token))  # fmt: skip
    out(
        _outcome(
            lambda: ledger.finish(claim.execution_id, claim.lease_token, Status.FAILED, {}),
            claim.lease_token,
        )
    )
    # failed, then a human's retry: attempt 2 is claimed and revoked before it finishes
    out(
        _outcome(
            lambda: ledger.submit(scope, "c4", "append_file", args, key="k3", approved_by="al")
        )
    )
    c4 = ledger.claim(scope, "k3", 1, worker_id="w")
    assert c4 is not None
    out(
        _outcome(
            lambda: ledger.finish(c4.execution_id, c4.lease_token, Status.FAILED, {}, error="e"),
            c4.lease_token,
        )
    )
    out(_outcome(lambda: ledger.authorize_retry(scope, "c4", by="bo", accept_duplicate=True)))
    c4b = ledger.claim(scope, "k3", 2, worker_id="w")
    assert c4b is not None
    out(_outcome(lambda: c4b))
    ledger.mark_unknown(c4b.execution_id, reason="lease expired", actor="sweep")
    out(
        _outcome(
            lambda: ledger.finish(c4b.execution_id, c4b.lease_token, Status.SUCCEEDED, {}),
            c4b.lease_token,
        )
    )
    return steps


@contextmanager
def _rings(ledger: Ledger) -> Iterator[list[Any]]:
    """The receipts rung on the ledger file's doorbell while the block runs (SQLite; Postgres
    notifies from a trigger, whichever store wrote the row)."""
    heard: list[Any] = []
    database = ledger.engine.url.database
    if ledger.dialect != "sqlite" or not database:
        yield heard
        return
    with doorbell.Doorbell(doorbell.bell_dir(database)) as bell:
        yield heard
        heard.extend(json.loads(payload) for payload in bell.drain())


def _differences(fast: Ledger, generic: Ledger, label: str) -> list[str]:
    """Every way the fast store's run of every path differs from the generic store's."""
    scopes = (f"{label}-fast", f"{label}-generic")
    with _rings(generic) as generic_rings:
        got_generic = _every_path(generic, scopes[1])
    found = []
    with _rings(fast) as fast_rings:
        try:
            got_fast = _every_path(fast, scopes[0])
        except AssertionError as exc:  # a step the generic path takes failed
            return [f"run: the fast run broke: {exc!r}"]
    if got_fast != got_generic:
        found.append(f"outcomes: {got_fast} != {got_generic}")
    fast_state, generic_state = _state(fast, scopes[0]), _state(generic, scopes[1])
    for table, rows in fast_state.items():
        if rows != generic_state[table]:
            found.append(f"{table}: {rows} != {generic_state[table]}")
    # the same receipts rung, in the same order, each in its own run's scope
    rung = [
        [[(s == scope, key) for s, key in ring] for ring in rings]
        for scope, rings in zip(scopes, (fast_rings, generic_rings), strict=True)
    ]
    if rung[0] != rung[1]:
        found.append(f"doorbell: {fast_rings} != {generic_rings}")
    report = fast.verify()
    if not report.ok:
        found.append(f"verify: {report.differences}")
    return found


def test_fastpath__every_path_ends_as_the_generic_one(db_url):
    """Same outcomes (returns and errors), the same rows and events and the same doorbell
    rings, path by path."""
    fast, generic = Ledger(db_url, fast_path=True), Ledger(db_url, fast_path=False)
    try:
        assert type(fast.store) is FAST[fast.dialect]
        with _rings(fast) as rings:
            got = _every_path(fast, "probe")
        assert ("raised", "ConflictError") in got and ("raised", "StaleFence") in got
        if fast.dialect == "sqlite":  # the check below is not empty: receipts were rung
            assert [["probe", "k1"]] in rings and [["probe", "k3"]] in rings
        assert _differences(fast, generic, "all") == []
    finally:
        fast.close()
        generic.close()


def _patched_sql(module: Any, name: str, edits: list[tuple[str, str]]) -> Any:
    statement = getattr(module, name)
    text = statement if isinstance(statement, str) else str(statement)
    for old, new in edits:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    if isinstance(statement, str):
        return text
    return sa.text(text).columns(*statement.selected_columns)


#: Fast stores broken on purpose, one fault each: dialect, the check that must see it (the
#: first word of a ``_differences`` line), module, statement, the statement's edits.
MUTANTS: dict[str, tuple[str, str, Any, str, list[tuple[str, str]]]] = {
    "pg-claim-forgets-its-event": ("postgresql", "events", fastpath, "_CLAIM", [(
        "INSERT INTO execution_events (scope, idempotency_key, execution_id, kind, actor, at, "
        "detail)\n    SELECT :scope, :key, :execution_id, 'running', :worker_id, now(), "
        "CAST(:detail AS json)\n    FROM claimed",
        "SELECT 1 FROM claimed",
    )]),
    "pg-claim-ignores-authorization": ("postgresql", "outcomes", fastpath, "_CLAIM", [
        ("AND authorized_attempts = :attempt AND review", "AND review")
    ]),
    "pg-claim-not-fenced": (
        "postgresql", "executions", fastpath, "_CLAIM", [("false, true", "false, false")]
    ),
    "pg-finish-leaves-operation-running": ("postgresql", "run", fastpath, "_FINISH", [
        ("UPDATE operations o SET status = :status", "UPDATE operations o SET status = o.status")
    ]),
    "pg-finish-drops-effects": ("postgresql", "executions", fastpath, "_FINISH", [
        ("effects = CAST(:effects AS json)", "effects = NULL")
    ]),
    "pg-submit-forgets-the-decider": (
        "postgresql", "operations", fastpath, "_SUBMIT", [(":attempts, :decided_by,", ":attempts, NULL,")]
    ),
    "pg-submit-forgets-decision-event": (
        "postgresql", "verify", fastpath, "_SUBMIT", [("ORDER BY v.n", "WHERE v.n = 1 ORDER BY v.n")]
    ),
    "sqlite-claim-forgets-its-event": ("sqlite", "events", fastpath_sqlite, "_EVENT", [
        ("VALUES (", "SELECT "), (":detail)", ":detail WHERE :kind <> 'running'")
    ]),
    "sqlite-claim-ignores-authorization": ("sqlite", "outcomes", fastpath_sqlite, "_CLAIM_READ", [
        ("AND authorized_attempts = :attempt", "")
    ]),
    "sqlite-claim-not-fenced": (
        "sqlite", "executions", fastpath_sqlite, "_CLAIM_INSERT", [(":false, :true)", ":false, :false)")]
    ),
    "sqlite-finish-leaves-operation-running": ("sqlite", "run", fastpath_sqlite, "_MOVE", [
        ("SET status = :new", "SET status = status")
    ]),
    "sqlite-finish-drops-effects": (
        "sqlite", "executions", fastpath_sqlite, "_FINISH", [("effects = :effects", "effects = NULL")]
    ),
    "sqlite-submit-forgets-the-decider": (
        "sqlite", "operations", fastpath_sqlite, "_SUBMIT", [(":attempts, :decided_by,", ":attempts, NULL,")]
    ),
    "sqlite-submit-binds-another-hash": (
        "sqlite", "tool_calls", fastpath_sqlite, "_SUBMIT_CALL", [(":key, :sha,", ":key, 'x',")]
    ),
    "sqlite-submit-forgets-the-call": ("sqlite", "run", fastpath_sqlite, "_SUBMIT_CALL", [
        ("VALUES (", "SELECT "), ("'000'))", "'000') WHERE 0")
    ]),
}  # fmt: skip
NO_RING = "sqlite-finish-rings-no-doorbell"
#: The record ``finish`` returns, built from its row only when read, built wrong.
WRONG_RECORD = {
    "sqlite-finish-returns-another-record": "sqlite",
    "pg-finish-returns-another-record": "postgresql",
    "sqlite-finish-returns-naive-times": "sqlite",
    "sqlite-finish-returns-another-token": "sqlite",
}


def _mutant(name: str) -> Any:
    dialect = MUTANTS[name][0] if name in MUTANTS else WRONG_RECORD.get(name, "sqlite")
    marks = [pytest.mark.postgres] if dialect == "postgresql" else []
    return pytest.param(name, dialect, marks=marks, id=name)


@pytest.mark.parametrize(
    ("mutant", "dialect"), [_mutant(m) for m in (*MUTANTS, NO_RING, *WRONG_RECORD)]
)
def test_fastpath__a_broken_fast_store_is_caught(request, mutant, dialect, monkeypatch, tmp_path):
    """Each comparison above can fail: a fast store with one fault differs from the generic,
    and the check meant for that fault is among those that see it. (A database of its own
    each: one mutant's rows must not make the next one's verify fail.)"""
    with _fresh_database(request, dialect, tmp_path) as url:
        expected = _break(mutant, monkeypatch)
        fast = Ledger(url, fast_path=True)  # built after the patch: it prepares what it runs
        generic = Ledger(url, fast_path=False)
        try:
            assert type(fast.store) is FAST[dialect]
            found = _differences(fast, generic, mutant)
            assert expected in {line.split(":")[0] for line in found}, found
        finally:
            fast.close()
            generic.close()


@contextmanager
def _fresh_database(request: Any, dialect: str, tmp_path: Any) -> Iterator[str]:
    if dialect == "postgresql":
        server, template = (request.getfixturevalue(f) for f in ("pg_server", "pg_template"))
        with fresh_pg_database(server, template) as url:
            yield url
    else:
        yield fresh_sqlite_database(request.getfixturevalue("sqlite_template"), tmp_path / "db")


def _break(mutant: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Apply the mutant; the check that must see it."""
    if mutant == NO_RING:
        monkeypatch.setattr(SqliteStore, "_ring", lambda self, scope, key: None)
        return "doorbell"
    if mutant in WRONG_RECORD:
        edit = {
            "sqlite-finish-returns-naive-times": {"started_at": datetime(2026, 1, 1)},
            "sqlite-finish-returns-another-token": {"lease_token": "f" * 32},
        }.get(mutant)
        if edit is not None:
            row = SqliteStore._row

            def wrong(self: SqliteStore, table: str, names: Any, values: Any) -> Any:
                return {
                    **row(self, table, names, values),
                    **(edit if table == "executions" else {}),
                }

            monkeypatch.setattr(SqliteStore, "_row", wrong)
        elif WRONG_RECORD[mutant] == "sqlite":  # two columns read into each other's fields
            names = list(fastpath_sqlite._EXECUTION_COLUMNS)
            i, j = names.index("result"), names.index("effects")
            names[i], names[j] = names[j], names[i]
            monkeypatch.setattr(fastpath_sqlite, "_EXECUTION_COLUMNS", names)
        else:
            built = fastpath._execution
            monkeypatch.setattr(
                fastpath, "_execution", lambda row: dataclasses.replace(built(row), error="x")
            )
        return "outcomes"
    _, expected, module, name, edits = MUTANTS[mutant]
    monkeypatch.setattr(module, name, _patched_sql(module, name, edits))
    return expected


def test_fastpath__the_comparison_sees_a_difference(db_url):
    """The state comparison is not blind: one differing event detail is found."""
    ledger = Ledger(db_url, fast_path=False)
    try:
        _every_path(ledger, "same-a")
        _every_path(ledger, "same-b")
        assert _state(ledger, "same-a") == _state(ledger, "same-b")
        with ledger.engine.begin() as conn:
            conn.execute(
                sa.update(operations)
                .where(operations.c.scope == "same-b", operations.c.idempotency_key == "k2")
                .values(reason="tampered")
            )
        assert _state(ledger, "same-a") != _state(ledger, "same-b")
        assert not ledger.verify().ok  # verify sees it too
        with ledger.engine.begin() as conn:  # the module's database is verified after this
            conn.execute(
                sa.update(operations)
                .where(operations.c.scope == "same-b", operations.c.idempotency_key == "k2")
                .values(reason=None)
            )
    finally:
        ledger.close()


def test_fastpath__plans_cannot_flip_to_a_partial_index(pg_url):
    """Engine connections plan every statement with its values; the fast path keeps generic
    plans, safe because its statuses are bound parameters (a partial index can only serve a
    predicate proven at plan time)."""
    from toolledger.ledger.fastpath import _CLAIM, _FINISH, _psycopg_sql

    ledger = Ledger(pg_url)
    with ledger.engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW plan_cache_mode").scalar() == "force_custom_plan"
    assert isinstance(ledger.store, PostgresStore)
    fast = ledger.store.connection().dbapi_connection
    assert fast.execute("SHOW plan_cache_mode").fetchone() == ("auto",)
    for statement in (_CLAIM, _FINISH):
        sql = _psycopg_sql(statement)
        assert not re.search(r"(WHERE|AND)\s+(\w+\.)?status = '", sql)  # no literal predicate
        assert re.search(r"(WHERE|AND)\s+(\w+\.)?status = %\(", sql)
    ledger.close()


PRAGMAS = ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")


def test_fastpath__sqlite_cut_just_after_begin_leaves_no_write_lock_held(sqlite_url, monkeypatch):
    """helper-92 (suspected): an exception between BEGIN IMMEDIATE and the transaction's
    first step (Celery's soft time limit is raised wherever the thread is) left the thread's
    kept connection holding SQLite's write lock: every other writer waited on it."""
    from billiard.exceptions import SoftTimeLimitExceeded

    ledger, other = Ledger(sqlite_url), Ledger(sqlite_url, timeout=1)
    try:
        assert isinstance(ledger.store, SqliteStore)
        ledger.submit("cut", "c1", "t", {}, approved_by="al")

        @contextmanager
        def cut_after_begin(waited: float, connection: Any) -> Iterator[None]:
            yield
            raise SoftTimeLimitExceeded()

        monkeypatch.setattr(fastpath_sqlite.writers, "within_budget", cut_after_begin)
        with pytest.raises(SoftTimeLimitExceeded):
            ledger.claim("cut", "t:c1", 1, worker_id="w")
        monkeypatch.undo()
        assert not ledger.store.connection().dbapi_connection.in_transaction
        other.submit("cut", "c2", "t", {}, approved_by="al")  # "database is locked" before
    finally:
        other.close()
        ledger.close()


def test_fastpath__sqlite_store_and_bench_baseline_run_with_the_ledgers_pragmas(sqlite_url):
    """Durability is not traded for speed: the fast store's connections are the engine's
    (WAL, synchronous=FULL), and the benchmark's hand-written sqlite3 loop runs with the same."""
    from toolledger.harness.bench.protocol import _sqlite_connect

    ledger = Ledger(sqlite_url)
    try:
        assert isinstance(ledger.store, SqliteStore)
        with ledger.engine.connect() as conn:
            engine = {p: conn.exec_driver_sql(f"PRAGMA {p}").scalar() for p in PRAGMAS}
        fast = ledger.store.connection().dbapi_connection
        store = {p: fast.execute(f"PRAGMA {p}").fetchone()[0] for p in PRAGMAS}
        baseline = _sqlite_connect(sa.make_url(sqlite_url).database or "")
        bench = {p: baseline.execute(f"PRAGMA {p}").fetchone()[0] for p in PRAGMAS}
        baseline.close()
        assert engine == {"journal_mode": "wal", "synchronous": 2, "foreign_keys": 1,
                          "busy_timeout": 30_000}  # fmt: skip
        assert store == engine and bench == engine
    finally:
        ledger.close()


@pytest.mark.postgres
def test_fastpath__a_finished_threads_connection_never_reaches_the_generic_path(pg_url):
    """A thread that used the Postgres fast path ends: its connection (autocommit, cached
    generic plans) went back to the pool, and the generic path's next transaction on it
    committed statement by statement — a submit refused for a key conflict left its operation
    behind, which the sweep re-published and a worker ran (a cold review)."""
    import gc
    import threading

    from toolledger.ledger.errors import ConflictError

    ledger = Ledger(pg_url)
    args = {"path": "p", "content": "x"}
    for n in range(3):  # threads that come and go, one per request (serve, the MCP proxy)
        thread = threading.Thread(
            target=ledger.submit, args=("s", f"c{n}", "write_file", args), kwargs={"key": f"k{n}"}
        )
        thread.start()
        thread.join()
        del thread
        gc.collect()
        with ledger._write() as conn:
            assert conn.connection.dbapi_connection.autocommit is False
            assert conn.exec_driver_sql("SHOW plan_cache_mode").scalar() != "auto"
    count = sa.select(sa.func.count()).select_from(operations)
    with ledger.engine.connect() as conn:
        before = conn.execute(count).scalar_one()
    with pytest.raises(ConflictError):  # c1 already names k1: nothing of k9 may stay
        ledger.submit("s", "c1", "write_file", args, key="k9")
    with ledger.engine.connect() as conn:
        assert conn.execute(count).scalar_one() == before
    assert ledger.verify().ok
    ledger.close()


@pytest.mark.postgres
def test_fastpath__a_column_added_while_this_code_runs_changes_nothing(pg_server, pg_template):
    """The documented upgrade runs ``db upgrade`` before the new workers start, so this code
    meets a schema with more columns. ``RETURNING *`` then returned them: a prepared statement
    failed ("cached plan must not change result type"), a fresh one raised ValueError after
    its commit (a call that succeeded told it failed; a cold review). Every column is named."""
    with fresh_pg_database(pg_server, pg_template) as url:
        ledger = Ledger(url)
        assert isinstance(ledger.store, PostgresStore)
        args = {"path": "p", "content": "x"}
        for n in range(6):  # past psycopg's prepare threshold: the plans are cached
            ledger.submit("s", f"c{n}", "write_file", args, key=f"k{n}", approved_by="al")
            claim = ledger.claim("s", f"k{n}", 1, worker_id="w")
            assert claim is not None
            ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"n": n})
        with ledger.engine.begin() as conn:  # a newer toolledger's migration
            for table in ("operations", "executions", "execution_events"):
                conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN newer integer")
        ledger.submit("s", "c9", "write_file", args, key="k9", approved_by="al")
        claim = ledger.claim("s", "k9", 1, worker_id="w")
        assert claim is not None
        done = ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"n": 9})
        assert done.execution.status == Status.SUCCEEDED
        assert ledger.get("s", "c9").operation.status == Status.SUCCEEDED
        ledger.close()


@pytest.mark.parametrize(
    "dialect", [pytest.param("postgresql", marks=pytest.mark.postgres), "sqlite"]
)
def test_fastpath__an_empty_worker_id_is_logged_as_the_generic_path_logs_it(
    request, dialect, tmp_path
):
    """The generic finish logs ``worker_id or 'worker'``; the Postgres one logged ''."""
    if dialect == "postgresql":
        url_cm = fresh_pg_database(request.getfixturevalue("pg_server"),
                                   request.getfixturevalue("pg_template"))  # fmt: skip
    else:
        url_cm = contextlib.nullcontext(
            fresh_sqlite_database(request.getfixturevalue("sqlite_template"), tmp_path / "db")
        )
    with url_cm as url:
        ledger = Ledger(url)
        assert isinstance(ledger.store, FAST[dialect])
        ledger.submit("s", "c", "write_file", {"path": "p", "content": "x"}, approved_by="al")
        claim = ledger.claim("s", "write_file:c", 1, worker_id="")
        assert claim is not None
        ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"ok": 1})
        assert ledger.events("s", "c")[-1].actor == "worker"
        ledger.close()


def test_fastpath__a_threads_pool_of_twenty_leaves_connections_for_the_rest(sqlite_url):
    """Each thread keeps its own connection out of the pool for good; with SQLite's default
    pool (5 + 10) a sixteenth thread, or the lease keeper, waited 30 s for one (a cold
    review). A worker's engine (``timeout`` given) leaves room, as on Postgres."""
    import threading

    ledger = Ledger(sqlite_url, timeout=2)
    held = threading.Barrier(21)
    done = threading.Event()
    errors: list[BaseException] = []

    def worker_thread() -> None:
        try:
            ledger.store.connection()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        held.wait(60)
        done.wait(60)

    threads = [threading.Thread(target=worker_thread) for _ in range(20)]
    for t in threads:
        t.start()
    held.wait(60)
    try:
        assert errors == []
        ledger.submit("s", "c", "write_file", {"path": "p", "content": "x"})  # the rest's turn
        assert ledger.get("s", "c").operation.status == Status.PENDING_APPROVAL
    finally:
        done.set()
        for t in threads:
            t.join()
        ledger.close()


@pytest.mark.postgres
def test_fastpath__a_forked_child_opens_its_own_connections(pg_server, pg_template):
    """A process that used the ledger forks (a preloading server, a user's process pool): the
    connection its thread held was shared with the child, outside the pool that SQLAlchemy's
    fork recipe resets — both talked on one socket, and submits that failed had committed (a
    cold review). The child now forgets its parent's connections and opens its own."""
    import os

    with fresh_pg_database(pg_server, pg_template) as url:
        ledger = Ledger(url)
        assert isinstance(ledger.store, PostgresStore)
        args = {"path": "p", "content": "x"}
        ledger.submit("s", "warm", "write_file", args)
        parent_backend = ledger.store.connection().dbapi_connection.info.backend_pid
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never raise into pytest
            os.close(r)
            try:
                backend = ledger.store.connection().dbapi_connection.info.backend_pid
                failed = _failed_submits(ledger, "child", args)
                os.write(w, json.dumps({"backend": backend, "failed": failed}).encode())
            finally:
                os._exit(0)
        os.close(w)
        failed = _failed_submits(ledger, "parent", args)
        os.waitpid(pid, 0)
        child = json.loads(os.read(r, 10_000) or b"{}")
        os.close(r)
        assert child.get("backend") not in (None, parent_backend), child
        assert (failed, child["failed"]) == (0, 0)
        with ledger.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(operations)).scalar() == 201
        assert ledger.verify().ok
        ledger.close()


def _failed_submits(ledger: Ledger, who: str, args: dict[str, Any]) -> int:
    """Submit 100 calls named after ``who``; how many raised."""
    failed = 0
    for i in range(100):
        try:
            ledger.submit("s", f"{who}{i}", "write_file", args)
        except Exception:  # noqa: BLE001 - counted
            failed += 1
    return failed


def test_fastpath__sixteen_threads_submitting_through_one_client_get_a_connection_each(pg_url):
    """A Client's engine (no timeout: the agent's side) had 4 + 8 connections; each thread
    keeps one for its life, so a thirteenth thread submitting at once waited 30 s and failed
    (a cold review). It leaves room as a worker's does."""
    import threading

    ledger = Ledger(pg_url)
    submitted = threading.Barrier(17)
    done = threading.Event()
    errors: list[BaseException] = []

    def agent_thread(n: int) -> None:
        try:
            ledger.submit("sixteen", f"c{n}", "write_file", {"path": f"p{n}", "content": "x"})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        submitted.wait(90)
        done.wait(90)

    threads = [threading.Thread(target=agent_thread, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    submitted.wait(90)
    try:
        assert errors == []
        assert {ledger.get("sixteen", f"c{n}").operation.status for n in range(16)} == {
            Status.PENDING_APPROVAL
        }
    finally:
        done.set()
        for t in threads:
            t.join()
        ledger.close()


def test_fastpath__a_held_connection_the_server_ended_is_replaced_before_the_next_call(pg_url):
    """pg_terminate_backend (a restart, an idle timeout) ends a thread's held connection while
    it idles; the next call failed once before it was replaced (a cold review). It is noticed
    before the statement is sent now, and the call goes through."""
    ledger = Ledger(pg_url)
    try:
        ledger.submit("ended", "c1", "write_file", {"path": "p", "content": "x"})
        pid = ledger.store.connection().dbapi_connection.info.backend_pid
        with sa.create_engine(
            pg_url.replace("postgresql://", "postgresql+psycopg://", 1)
        ).connect() as admin:
            assert admin.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
        time.sleep(0.5)  # its last words reach the socket
        ledger.submit("ended", "c2", "write_file", {"path": "p", "content": "y"})
        assert ledger.get("ended", "c2").operation.status == Status.PENDING_APPROVAL
        assert ledger.store.connection().dbapi_connection.info.backend_pid != pid
    finally:
        ledger.close()


def test_fastpath__a_process_with_many_files_open_keeps_its_connection(pg_url):
    """The check above used select(), which refuses a descriptor past 1023: in a process with
    that many files open every call took a new connection (a cold review)."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1500, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    ledger = Ledger(pg_url)
    try:
        ledger.submit("many", "c0", "write_file", {"path": "p", "content": "x"})
        conn = ledger.store.connection().dbapi_connection
        assert conn.pgconn.socket > 1023
        pid = conn.info.backend_pid
        for n in range(1, 6):
            ledger.submit("many", f"c{n}", "write_file", {"path": "p", "content": "x"})
        assert ledger.store.connection().dbapi_connection.info.backend_pid == pid
    finally:
        ledger.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_fastpath__more_threads_than_the_pool_holds_still_submit_and_read(db_url):
    """Each thread kept a connection of the pool for its life, so a process whose threads
    outnumber the pool (an agent server's 50 threads sharing one Client; the pool holds
    4 + 40) starved: the threads past it failed their submits after the pool's timeout, and
    with every connection held no read was left a connection, so every wait of every thread
    failed too (a cold review: 44 threads, 44 waits failed). Threads past the pool's room now
    take a connection for one statement; the rest of the pool stays for the reads."""
    import threading

    from toolledger.ledger.db import create_engine

    engine = create_engine(db_url, timeout=2, pool_size=4, max_overflow=8)  # SQLite: 5 + 40
    ledger = Ledger(engine)
    assert isinstance(ledger.store, PostgresStore | SqliteStore)
    threads_n = engine.pool.size() + engine.pool._max_overflow + 4  # type: ignore[attr-defined]
    submitted = threading.Barrier(threads_n + 1)
    done = threading.Event()
    errors: list[BaseException] = []
    statuses: list[Status] = []
    scope = f"crowd-{engine.dialect.name}"

    def agent_thread(n: int) -> None:
        try:  # submitted, then read, while every other thread lives on
            ledger.submit(scope, f"c{n}", "write_file", {"path": f"p{n}", "content": "x"})
            submitted.wait(90)
            statuses.append(ledger.get(scope, f"c{n}").operation.status)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            with contextlib.suppress(threading.BrokenBarrierError):
                submitted.abort()
        done.wait(90)

    threads = [threading.Thread(target=agent_thread, args=(n,)) for n in range(threads_n)]
    for t in threads:
        t.start()
    try:
        with contextlib.suppress(threading.BrokenBarrierError):
            submitted.wait(90)
        deadline = time.monotonic() + 90
        while len(statuses) + len(errors) < threads_n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert errors == []
        assert statuses == [Status.PENDING_APPROVAL] * threads_n
    finally:
        done.set()
        for t in threads:
            t.join()
        ledger.close()
