"""The light reads (``show`` and ``events`` on the bare driver) give the ledger's own records,
field for field and type for type, on both dialects; and they step aside, for the ledger,
wherever they cannot vouch for what they read. The comparison is shown failing against light
reads broken on purpose (a timestamp left as the driver gives it, a boolean left an integer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from toolledger.cli.common import Context
from toolledger.config import Settings
from toolledger.ledger import lightreads, pq
from toolledger.ledger.errors import LedgerError
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.lightreads import CallReads, Fallback, LightReads, events_page
from toolledger.ledger.models import execution_events, executions, operations
from toolledger.ledger.receipts import receipt_for
from toolledger.ledger.records import (
    EventRecord,
    ExecutionRecord,
    OperationRecord,
    Receipt,
    _field_names,
)
from toolledger.ledger.transitions import Status
from toolledger.ledger.types import JSONType, UTCDateTime

ARGS = {"path": "notes/é.txt", "content": "ü\n", "n": 2**53 + 1, "f": 0.1, "deep": [{"a": None}]}
CALLS = (
    "pending",
    "rejected",
    "approved",
    "running",
    "succeeded",
    "failed",
    "unknown",
    "reconciled",
    "retried",
    "contradicted",
)


def _calls(ledger: Ledger, scope: str) -> None:
    """One call in each state ``show`` can meet, with every kind of column filled in."""

    def claim(cid: str, attempt: int = 1) -> Any:
        claim = ledger.claim(scope, f"append_file:{cid}", attempt, worker_id="w-1")
        assert claim is not None
        return claim

    for cid in CALLS:
        approve = cid not in ("pending", "rejected")
        ledger.submit(scope, cid, "append_file", ARGS, approved_by="al" if approve else None)
    ledger.reject(scope, "rejected", by="bob", reason="not today")
    claim("running")
    c = claim("succeeded")
    effects = [{"path": "notes/é.txt", "sha256": "ab" * 32, "bytes": 3}]
    ledger.finish(c.execution_id, c.lease_token, Status.SUCCEEDED, {"ok": "ü"}, effects=effects)
    c = claim("failed")
    ledger.finish(c.execution_id, c.lease_token, Status.FAILED, {"e": 1}, error="boom")
    for cid in ("unknown", "reconciled", "retried", "contradicted"):
        c = claim(cid)
        ledger.mark_unknown(c.execution_id, reason="lost", actor="sweep")
    eid = ledger.get(scope, "reconciled").executions[0].execution_id
    ledger.reconcile(eid, Status.SUCCEEDED, {"found": True}, evidence={"stat": 1}, actor="r")
    ledger.authorize_retry(scope, "retried", by="bob", accept_duplicate=True)
    c = claim("retried", 2)
    ledger.finish(c.execution_id, c.lease_token, Status.SUCCEEDED, {"second": 2})
    eid = ledger.get(scope, "contradicted").executions[0].execution_id
    ledger.resolve(eid, Status.FAILED, by="dana", evidence="nothing sent")
    late = {"late_result": {"notified": "ops"}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(eid, late, actor="zombie", outcome=Status.SUCCEEDED)
    assert ledger.get(scope, "contradicted").operation.review == "contradicted"


def _receipt(reads: CallReads, scope: str, cid: str) -> Receipt:
    """The receipt ``show`` prints: from the view the reads give (``Ledger.receipt``'s way)."""
    view = reads.get(scope, cid)
    return receipt_for(view.operation, view.current, flags=view.flags)


def _answers(reads: CallReads, scope: str) -> list[str]:
    """Everything the reads say about every call, as repr: types count (0 is not False)."""
    out: list[str] = []
    for cid in (*CALLS, "no-such-call"):
        pages = [partial(events_page, reads, after=a, limit=n) for a in (0, 3) for n in (0, 1, 2)]
        for read in (reads.get, partial(_receipt, reads), reads.events, *pages):
            try:
                out.append(repr(read(scope, cid)))
            except LedgerError as exc:
                out.append(f"{type(exc).__name__}: {exc}")
    return out


@pytest.fixture
def light(ledger: Ledger) -> Iterator[LightReads]:
    reads = LightReads.open(str(ledger.engine.url.render_as_string(hide_password=False)), 5.0)
    assert reads is not None, "a ledger at head is served by the light reads"
    yield reads
    reads.close()


def test_lightreads__every_record_is_the_ledgers(ledger: Ledger, light: LightReads, scope):
    _calls(ledger, scope)
    expected = _answers(ledger, scope)
    assert _answers(light, scope) == expected
    assert sum("NoReceipt" in a for a in expected) == 3  # pending, approved, running
    assert sum("NotFound" in a for a in expected) == 9  # the call that is not there, each read
    view = light.get(scope, "contradicted")  # what show prints, built from the light rows
    assert view.to_json(None) == ledger.get(scope, "contradicted").to_json(None)


def _utc_as_given(m: pytest.MonkeyPatch) -> None:
    m.setattr(lightreads, "as_utc", lambda v: v)


def _booleans_as_stored(m: pytest.MonkeyPatch) -> None:
    m.setattr(lightreads, "BOOLEANS", frozenset())


def _libpq_booleans_as_text(m: pytest.MonkeyPatch) -> None:
    """'f' is a true string: a boolean left as libpq's text reads as True."""
    convert = pq._convert
    m.setattr(pq, "_convert", lambda oid, text: text if oid == pq.BOOL else convert(oid, text))


def _open(ledger: Ledger) -> LightReads:
    reads = LightReads.open(str(ledger.engine.url.render_as_string(hide_password=False)), 5.0)
    assert reads is not None
    return reads


def test_lightreads__comparison_fails_on_reads_broken_on_purpose(
    ledger: Ledger, scope, backend, monkeypatch
):
    """Each conversion is seen to matter. On Postgres the session's time zone is not UTC
    (PGTZ), so a timestamp left as the server gives it differs from the ledger's."""
    _calls(ledger, scope)
    expected = _answers(ledger, scope)
    monkeypatch.setenv("PGTZ", "Asia/Kolkata")
    breaks: dict[str, Callable[[pytest.MonkeyPatch], None]] = {"timestamp": _utc_as_given}
    if backend == "sqlite":  # psycopg gives booleans already: nothing to break there
        breaks["boolean"] = _booleans_as_stored
    else:  # libpq gives text: booleans are converted from it
        breaks["libpq boolean"] = _libpq_booleans_as_text
    for name, break_it in breaks.items():
        with pytest.MonkeyPatch.context() as m:
            break_it(m)
            light = _open(ledger)
            assert _answers(light, scope) != expected, name
            light.close()
    light = _open(ledger)
    assert _answers(light, scope) == expected  # and mended, they agree again
    light.close()


@pytest.mark.postgres
@pytest.mark.parametrize("driver", ["libpq", "psycopg"])
def test_lightreads__on_postgres_either_driver_gives_the_ledgers_records(
    pg_url: str, scope, monkeypatch, driver
):
    """Postgres is read on libpq itself (``pq``) where one loads, else on psycopg; both give
    the ledger's records, in a session whose time zone is not UTC too."""
    ledger = Ledger(pg_url)
    _calls(ledger, scope)
    expected = _answers(ledger, scope)
    if driver == "psycopg":
        monkeypatch.setattr(pq, "library", partial(_no_libpq))
    for tz in ("UTC", "America/St_Johns"):
        monkeypatch.setenv("PGTZ", tz)
        light = _open(ledger)
        assert type(light._conn).__module__.startswith(
            "toolledger.ledger.pq" if driver == "libpq" else "psycopg"
        )
        assert _answers(light, scope) == expected, tz
        light.close()
    ledger.close()


def _no_libpq() -> Any:
    raise pq.Error("no libpq to load")


@pytest.mark.postgres
def test_lightreads__libpq_sends_values_apart_from_the_statement(pg_url: str, scope):
    """A call id full of quotes and placeholders is a value, never statement text."""
    ledger = Ledger(pg_url)
    hostile = "a'; DROP TABLE operations; -- %s $1 ? é"
    ledger.submit(scope, hostile, "write_file", {"path": "p", "content": "x"})
    light = _open(ledger)
    assert type(light._conn).__module__ == "toolledger.ledger.pq"
    assert light.get(scope, hostile).tool_call_id == hostile
    with pytest.raises(LedgerError):
        light.get(scope, hostile + "x")
    light.close()
    assert ledger.get(scope, hostile).tool_call_id == hostile
    ledger.close()


def test_lightreads__column_sets_are_the_models_types():
    """The conversions follow the tables' own types, for every column the records read."""
    tables = {
        OperationRecord: operations,
        ExecutionRecord: executions,
        EventRecord: execution_events,
    }
    kinds: dict[str, set[str]] = {"time": set(), "json": set(), "bool": set()}
    for record, table in tables.items():
        for name in _field_names(record):
            type_ = table.c[name].type
            if isinstance(type_, UTCDateTime):
                kinds["time"].add(name)
            elif isinstance(type_, type(JSONType)):
                kinds["json"].add(name)
            elif isinstance(type_, sa.Boolean):
                kinds["bool"].add(name)
    assert kinds["time"] == lightreads.TIMESTAMPS
    assert kinds["json"] == lightreads.JSON_COLUMNS
    assert kinds["bool"] == lightreads.BOOLEANS


# ---------------------------------------------------------------- where they step aside


def test_lightreads__step_aside_where_they_cannot_vouch(tmp_path: Path, sqlite_template: Path):
    missing = tmp_path / "none" / "ledger.db"
    assert LightReads.open(f"sqlite:///{missing}", 1) is None
    assert not missing.parent.exists()  # nothing made: the ledger creates the embedded one
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database" * 100)
    assert LightReads.open(f"sqlite:///{junk}", 1) is None
    good = tmp_path / "ledger.db"
    good.write_bytes(sqlite_template.read_bytes())
    url = f"sqlite:///{good}"
    for other in (
        url + "?timeout=3",  # options: SQLAlchemy's to read
        "mysql://h/db",
        "postgresql+psycopg2://h/db",
        "sqlite://",
        f"sqlite://host{good}",  # a host part: the ledger refuses it, so must these reads
        "postgresql://u:p%40ss@%2Fvar%2Frun%2Fpostgresql/db",  # a host libpq would decode
    ):
        assert LightReads.open(other, 1) is None, other
    reads = LightReads.open(url, 1)
    assert reads is not None
    reads.close()
    engine = sa.create_engine(url)
    with engine.begin() as conn:  # a schema behind this code: the ledger says so, not us
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0003'")
    assert LightReads.open(url, 1) is None
    with engine.begin() as conn:  # no version table at all
        conn.exec_driver_sql("DROP TABLE alembic_version")
    assert LightReads.open(url, 1) is None
    engine.dispose()


def test_lightreads__a_driver_error_hands_the_read_to_the_ledger(ledger: Ledger, scope):
    _calls(ledger, scope)
    url = ledger.engine.url.render_as_string(hide_password=False)
    context = Context(Settings.from_env({}, db=url))
    light = context.light_reads
    assert light is not None
    light._conn.close()  # the connection lost under the light reads
    with pytest.raises(Fallback):
        light.get(scope, "succeeded")
    got = context.reading(lambda reads: reads.get(scope, "succeeded"))
    assert got == ledger.get(scope, "succeeded")
    assert context.light_reads is None  # and the ledger answers from now on
    context.close()


@pytest.mark.postgres
def test_lightreads__libpq_drops_server_notices_and_hands_bad_text_to_the_ledger(
    pg_server: str, pg_template: str, scope, monkeypatch
):
    """libpq's default notice processor wrote a server WARNING to stderr, under ``--json``
    too (psycopg drops notices); and a value libpq's text does not convert escaped as
    ValueError instead of handing the read to the ledger (a cold review). ``PGDATESTYLE``
    was such a value's cause, while the ISO style was asked in the startup packet, which it
    overrides; the style is now set after the connect, and it reads right."""
    import subprocess
    import sys

    from tests.conftest import fresh_pg_database

    with fresh_pg_database(pg_server, pg_template) as url:
        ledger = Ledger(url)
        _calls(ledger, scope)
        name = ledger.engine.url.database
        plain = ledger.engine.url.render_as_string(hide_password=False)
        import psycopg

        # every connection now gets a WARNING (set on a session that never loaded plpgsql)
        with psycopg.connect(plain.replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute(f"ALTER DATABASE \"{name}\" SET plpgsql.bogus = '1'")
            conn.execute(f"ALTER DATABASE \"{name}\" SET session_preload_libraries = 'plpgsql'")
        argv = [sys.executable, "-m", "toolledger", "--db", plain, "--json", "show"]
        done = subprocess.run(
            [*argv, "--scope", scope, "--tool-call-id", "succeeded"], capture_output=True, text=True
        )
        assert done.returncode == 0 and done.stderr == "", done.stderr
        monkeypatch.setenv("PGDATESTYLE", "SQL, DMY")
        light = LightReads.open(plain, 5.0)
        assert light is not None
        assert light.get(scope, "succeeded") == ledger.get(scope, "succeeded")
        light.close()
        with ledger.engine.begin() as conn:  # a time no datetime holds
            conn.exec_driver_sql("UPDATE executions SET finished_at = 'infinity'")
        light = LightReads.open(plain, 5.0)
        assert light is not None
        with pytest.raises(Fallback):
            light.get(scope, "succeeded")
        light.close()
        ledger.close()


def test_reads__a_read_sees_one_snapshot(ledger: Ledger, light: LightReads, scope: str) -> None:
    """``show`` read the operation and then its executions under read committed on Postgres:
    a review's correction committed between the two made a receipt ``succeeded`` with the
    corrected ``failed`` content (a cold review: 110 of 400). Each read is one snapshot now,
    on the ledger's reads and the light ones, as SQLite's read transaction always was."""
    import sqlalchemy as sa

    ledger.submit(scope, "snap", "append_file", ARGS)
    where = {"s": scope}
    reason = "SELECT reason FROM operations WHERE scope = :s"

    def change(to: str) -> None:  # another process's commit, between a read's statements
        with ledger.engine.begin() as conn:
            conn.execute(sa.text("UPDATE operations SET reason = :r WHERE scope = :s"),
                         {"r": to, **where})  # fmt: skip

    with ledger._read() as conn:
        before = conn.execute(sa.text(reason), where).scalar_one()
        change("first")
        assert conn.execute(sa.text(reason), where).scalar_one() == before
    with light._read():
        light_sql = reason.replace(":s", "?")
        before = light._all(light_sql, (scope,))[0]["reason"]
        change("second")
        assert light._all(light_sql, (scope,))[0]["reason"] == before
    with light._read():  # the next read sees the commit
        assert light._all(light_sql, (scope,))[0]["reason"] == "second"
