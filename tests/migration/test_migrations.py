"""Migrations produce exactly the models, and go down to nothing and back."""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from tests.conftest import fresh_pg_database
from toolledger.ledger.db import create_engine, current_revision, downgrade, head_revision, upgrade
from toolledger.ledger.models import Base


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    server = request.getfixturevalue("pg_server")
    with fresh_pg_database(server, "template0") as url:
        yield url


def _diff(engine: sa.Engine) -> list:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(ctx, Base.metadata)


def _names(engine: sa.Engine) -> set[str]:
    insp = sa.inspect(engine)
    names: set[str] = set()
    for table in insp.get_table_names():
        names |= {i["name"] for i in insp.get_indexes(table)}
        names |= {c["name"] for c in insp.get_check_constraints(table)}
        names |= {c["name"] for c in insp.get_unique_constraints(table)}
        names |= {c["name"] for c in insp.get_foreign_keys(table)}
        pk = insp.get_pk_constraint(table)["name"]
        if pk:
            names.add(pk)
    return names


def test_migrations__upgrade_from_empty_gives_exactly_the_models(empty_url):
    engine = create_engine(empty_url)
    upgrade(engine)
    assert current_revision(engine) == head_revision()
    assert _diff(engine) == []
    engine.dispose()


def test_migrations__every_constraint_and_index_named_as_the_models_say(empty_url):
    engine = create_engine(empty_url)
    upgrade(engine)
    expected = {
        "ix_operations_approved_unclaimed",
        "ix_operations_waiting",
        "ix_tool_calls_operation",
        "ix_executions_running_lease",
        "ix_executions_unknown",
        "ix_execution_events_operation",
        "uq_executions_attempt",
        "ck_executions_terminal_has_result",
        "ck_executions_status",
        "ck_operations_status",
        "fk_executions_operation",
        "fk_tool_calls_operation",
    }
    found = _names(engine)
    assert expected <= found, expected - found
    assert not [n for n in found if n and n.count("ck_") > 1]  # no doubled conventions
    engine.dispose()


def test_migrations__downgrade_to_base_and_up_again(empty_url):
    engine = create_engine(empty_url)
    upgrade(engine)
    downgrade(engine, "base")
    assert current_revision(engine) is None
    assert set(sa.inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(engine)
    assert _diff(engine) == []
    engine.dispose()


def _row_counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one()
            for t in ("operations", "tool_calls", "executions", "execution_events")
        }


@pytest.mark.parametrize("where", ["behind", "ahead"])
def test_schema__the_client_refuses_another_schema_as_the_cli_does(
    empty_url, tmp_path, capsys, where
):
    """The Python Client (and what is built on it: the adapters, ``mcp serve``/``proxy``,
    ``wait``) never checked the schema: it wrote calls to a ledger the CLI and the workers
    refuse, and failed with a raw OperationalError on an old one (a cold review)."""
    from tests.helpers import run_cli
    from toolledger import Client
    from toolledger.config import Settings
    from toolledger.ledger.revision import SchemaError

    engine = create_engine(empty_url)
    upgrade(engine)
    if where == "behind":
        downgrade(engine, "0003")
    else:  # a newer toolledger migrated it
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE alembic_version SET version_num = '0099'"))
    before = _row_counts(engine)
    settings = Settings.from_env(
        {"TOOLLEDGER_DB": empty_url, "TOOLLEDGER_HOME": str(tmp_path / "home"),
         "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox")}
    )  # fmt: skip
    says = "newer than this code" if where == "ahead" else "toolledger db upgrade"
    with pytest.raises(SchemaError, match=says):
        Client(settings)
    code, _, err = run_cli(capsys, "--db", empty_url, "list")
    assert code == 1 and says in err
    code, _, err = run_cli(capsys, "--db", empty_url, "db", "upgrade")
    if where == "ahead":  # no migration of this code takes it anywhere: exit 1, said so
        assert code == 1 and says in err
        assert _row_counts(engine) == before
    else:  # the advice given works
        assert code == 0
        with Client(settings):
            pass
    engine.dispose()


def test_schema__serve_on_a_schema_behind_says_one_line(empty_url, tmp_path):
    """``serve`` on a ledger one migration behind: its one-line error, and no line of the
    schema check's migration context before it (nine INFO lines of Alembic's: a cold
    review)."""
    import os
    import socket
    import subprocess

    from toolledger.harness.processes import toolledger_argv

    engine = create_engine(empty_url)
    upgrade(engine)
    downgrade(engine, "0005")
    engine.dispose()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    env = {**os.environ, "TOOLLEDGER_DB": empty_url, "TOOLLEDGER_HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [*toolledger_argv(), "serve", "--insecure-local", "--port", port],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "alembic" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].endswith("run 'toolledger db upgrade'"), proc.stderr


def test_downgrade__below_0002_refuses_to_drop_what_only_0002_holds(empty_url, capsys):
    """A downgrade to 0001 dropped ``fenced`` and ``effects``: upgraded again, every execution
    was unfenced with no effects, ``verify`` differed ever after and the sweep treated fenced
    executions as unfenced (a cold review). It now refuses, exit 1, one line, nothing changed."""
    from tests.helpers import run_cli
    from toolledger.ledger.ledger import Ledger
    from toolledger.ledger.transitions import Status

    engine = create_engine(empty_url)
    upgrade(engine)
    ledger = Ledger(empty_url)
    ledger.submit("s", "ran", "write_file", {"path": "p", "content": "1"}, approved_by="al")
    claimed = ledger.claim("s", "write_file:ran", 1, worker_id="w1")
    ledger.finish(claimed.execution_id, claimed.lease_token, Status.SUCCEEDED, {"ok": True})
    before = _row_counts(engine)
    code, out, err = run_cli(capsys, "--db", empty_url, "db", "downgrade", "--revision", "0001")
    assert code == 5, (out, err)  # the ledger's state does not allow it
    assert "downgrade below 0002 refused" in err and "1 executions that ran fenced" in err
    assert len(err.strip().splitlines()) == 1
    assert current_revision(engine) == head_revision()
    assert _row_counts(engine) == before
    assert ledger.verify().ok
    assert _diff(engine) == []
    ledger.close()
    engine.dispose()


def test_downgrade__below_0002_goes_when_nothing_ran(empty_url):
    """Calls recorded but never run hold nothing of 0002's: down to 0001 and up again, the
    ledger rebuilds clean."""
    from toolledger.ledger.ledger import Ledger

    engine = create_engine(empty_url)
    upgrade(engine)
    ledger = Ledger(empty_url)
    ledger.submit("s", "waits", "write_file", {"path": "p", "content": "1"})
    ledger.close()
    downgrade(engine, "0001")
    assert current_revision(engine) == "0001"
    upgrade(engine)
    ledger = Ledger(empty_url)
    assert ledger.verify().ok
    assert _diff(engine) == []
    ledger.close()
    engine.dispose()


@pytest.mark.postgres
def test_downgrade__from_0002_a_fence_committed_meanwhile_is_counted_not_dropped(pg_server):
    """From exactly 0002, the downgrade counted what only 0002 holds, then dropped it: an
    execution fenced by a transaction still open at the count (invisible to it) committed
    before the drop, and its fence was dropped uncounted. The count and the drop are under
    one lock now: the downgrade waits for that transaction, sees its fence, and refuses."""
    import threading
    import time

    from toolledger.ledger.revision import DowngradeRefused

    with fresh_pg_database(pg_server, "template0") as url:
        engine = create_engine(url)
        upgrade(engine, "0002")
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO operations (scope, idempotency_key, tool, args, args_sha256, "
                    "status, authorized_attempts, created_at) VALUES ('s', 'k', 'write_file', "
                    "'{}', repeat('0', 64), 'running', 1, now())"
                )
            )
            conn.execute(
                sa.text(
                    "INSERT INTO executions (execution_id, scope, idempotency_key, attempt, "
                    "status, started_at, reconciled) VALUES ('e1', 's', 'k', 1, 'running', "
                    "now(), false)"
                )
            )
        outcome: list[BaseException | None] = []

        def go_down() -> None:
            try:
                downgrade(engine, "0001")
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                outcome.append(exc)

        fencer = engine.connect()
        fencing = fencer.begin()
        fencer.execute(sa.text("UPDATE executions SET fenced = true WHERE execution_id = 'e1'"))
        down = threading.Thread(target=go_down)
        down.start()
        time.sleep(1.5)  # the downgrade is under way, waiting for the fencer
        fencing.commit()
        fencer.close()
        down.join(60)
        try:
            assert len(outcome) == 1 and isinstance(outcome[0], DowngradeRefused), outcome
            assert current_revision(engine) == "0002"
            with engine.connect() as conn:
                assert conn.execute(sa.text("SELECT fenced FROM executions")).scalar_one()
        finally:
            engine.dispose()


def test_downgrade__below_0006_keeps_a_long_tool_name_or_refuses(empty_url, capsys):
    """0006 widened the tool column (``mcp.`` and 128 characters). Back to 0005 on Postgres,
    a call naming a longer tool than 64 could not be kept: refused, exit 5, nothing changed
    (with none, it goes: the downgrade to base and up again). SQLite holds any length: it
    goes, the call kept."""
    from tests.helpers import run_cli
    from toolledger.ledger.ledger import Ledger

    long_tool = "mcp." + "n" * 128
    engine = create_engine(empty_url)
    upgrade(engine)
    ledger = Ledger(empty_url)
    ledger.submit("s", "long", long_tool, {"amount": 1})
    ledger.close()
    assert _read(engine, "SELECT tool FROM operations") == [long_tool]
    code, out, err = run_cli(capsys, "--db", empty_url, "db", "downgrade", "--revision", "0005")
    if engine.dialect.name == "sqlite":
        assert code == 0, err
        assert current_revision(engine) == "0005"
        assert _read(engine, "SELECT tool FROM operations") == [long_tool]
        engine.dispose()
        return
    assert code == 5, (out, err)
    assert "downgrade below 0006 refused: 1 calls name a tool of more than 64" in err
    assert len(err.strip().splitlines()) == 1
    assert current_revision(engine) == head_revision()
    assert _read(engine, "SELECT tool FROM operations") == [long_tool]
    engine.dispose()


def _read(engine: sa.Engine, sql: str) -> list:
    with engine.connect() as conn:
        return list(conn.exec_driver_sql(sql).scalars())


def test_downgrade__to_base_refuses_while_the_ledger_holds_a_call(empty_url, capsys):
    """``db downgrade`` (its default revision is ``base``) dropped every table of a ledger
    holding a pending call and a rejected one and exited 0; upgraded again, a call that had
    been decided could be submitted and run afresh (a cold review). Refused now, exit 5, one
    line, nothing changed; an empty ledger still goes down to nothing."""
    from tests.helpers import run_cli
    from toolledger.ledger.ledger import Ledger

    engine = create_engine(empty_url)
    upgrade(engine)
    ledger = Ledger(empty_url)
    ledger.submit("s", "waits", "write_file", {"path": "p", "content": "1"})
    ledger.submit("s", "no", "write_file", {"path": "q", "content": "1"})
    ledger.reject("s", "no", by="bob", reason="no")
    ledger.close()
    before = _row_counts(engine)
    code, out, err = run_cli(capsys, "--db", empty_url, "db", "downgrade")
    assert code == 5, (out, err)
    assert "downgrade to base refused" in err and "2 in operations" in err
    assert len(err.strip().splitlines()) == 1
    assert current_revision(engine) == head_revision() and _row_counts(engine) == before
    engine.dispose()


def test_downgrade__below_0005_refuses_while_a_logout_is_in_force(empty_url, capsys):
    """Dropping ``ended_sessions`` made the copies of logged-out sessions' cookies good again
    for the rest of their lifetime once upgraded again (a cold review): refused while one
    has not expired; expired ones hold nothing and go."""
    from datetime import UTC, datetime, timedelta

    from tests.helpers import run_cli
    from toolledger.ledger.ledger import Ledger

    engine = create_engine(empty_url)
    upgrade(engine)
    ledger = Ledger(empty_url)
    ledger.end_session("sid1", "tok", datetime.now(UTC) + timedelta(hours=8))
    code, out, err = run_cli(capsys, "--db", empty_url, "db", "downgrade", "--revision", "0004")
    assert code == 5, (out, err)
    assert "1 ended console sessions" in err and len(err.strip().splitlines()) == 1
    assert current_revision(engine) == head_revision() and ledger.session_ended("sid1")
    from toolledger.ledger.types import UTCDateTime

    sessions = sa.table("ended_sessions", sa.column("expires_at", UTCDateTime()))
    with engine.begin() as conn:  # its cookie has expired: nothing left to hold
        conn.execute(sessions.update().values(expires_at=datetime.now(UTC) - timedelta(minutes=1)))
    ledger.close()
    downgrade(engine, "0004")
    assert current_revision(engine) == "0004"
    engine.dispose()


@pytest.mark.postgres
def test_upgrade__waits_for_another_migrator_past_its_lock_timeout(pg_server, capsys, monkeypatch):
    """A second `db upgrade` gave up after the CLI's lock timeout (7.5 s by default) behind
    a migration holding the migration lock, "database unavailable" (a cold review): it waits
    for the lock, then finds the schema at head. Here the timeout is 0.5 s, the lock 2 s."""
    import threading
    import time

    from tests.helpers import run_cli

    with fresh_pg_database(pg_server, "template0") as url:
        holder = create_engine(url)
        held = threading.Event()

        def hold() -> None:
            with holder.begin() as conn:
                conn.exec_driver_sql("SELECT pg_advisory_xact_lock(1953262951)")
                held.set()
                time.sleep(2.0)

        t = threading.Thread(target=hold)
        t.start()
        held.wait(10)
        try:
            monkeypatch.setenv("TOOLLEDGER_DB_TIMEOUT", "0.5")
            code, out, err = run_cli(capsys, "--db", url, "db", "upgrade")
        finally:
            t.join()
        holder.dispose()
        assert code == 0, (out, err)
        engine = create_engine(url)
        assert current_revision(engine) == head_revision()
        engine.dispose()


def test_ensure_schema__a_ledger_another_process_made_meanwhile_is_taken(tmp_path, monkeypatch):
    """Two processes start on a fresh embedded ledger (``make demo``'s two workers): one reads
    no revision, the other makes the ledger, then the first lists the tables. It found the
    ledger's own tables and refused them as another application's (CI, under load)."""
    from toolledger.ledger import db

    engine = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    real, made = db.current_revision, []

    def read_then_another_makes_it(e: sa.Engine) -> str | None:
        revision = real(e)  # none yet
        if not made:
            made.append(upgrade(e))  # the other process, between this read and the next
        return revision

    monkeypatch.setattr(db, "current_revision", read_then_another_makes_it)
    try:
        db.ensure_schema(engine)  # no SchemaError
        assert made and db.stored_revision(engine) == head_revision()
        # and another application's database is still refused
        other = create_engine(f"sqlite:///{tmp_path / 'other.db'}")
        with other.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE customers (id INTEGER)")
        monkeypatch.setattr(db, "current_revision", real)
        with pytest.raises(db.SchemaError, match="not a toolledger ledger's"):
            db.ensure_schema(other)
        other.dispose()
    finally:
        engine.dispose()


@pytest.mark.parametrize("stamped", ["0001", "0099"])
def test_ensure_schema__made_meanwhile_at_another_revision_is_said_as_it_is(
    tmp_path, monkeypatch, stamped
):
    """A ledger made meanwhile by another toolledger (an older one, or a newer): its own
    revision in the message (it said "none"), a newer one refused as newer, never migrated
    here on the spot (an older ledger is migrated on purpose)."""
    from toolledger.ledger import db

    engine = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")

    def another_made_it(e: sa.Engine) -> str | None:
        upgrade(e, "0001")
        with e.begin() as conn:
            conn.exec_driver_sql(f"UPDATE alembic_version SET version_num = '{stamped}'")
        return None  # read before it was made

    monkeypatch.setattr(db, "current_revision", another_made_it)
    try:
        expected = "newer" if stamped == "0099" else "at revision 0001"
        with pytest.raises(db.SchemaError, match=expected):
            db.ensure_schema(engine)
        with engine.connect() as conn:  # nothing migrated here
            assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").all() == [
                (stamped,)
            ]
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_upgrade__a_pause_between_its_statements_past_the_db_timeout_is_no_failure(
    pg_server, capsys, monkeypatch
):
    """CI, 12-06: a loaded machine paused `db upgrade` between two statements past the
    TOOLLEDGER_DB_TIMEOUT of 0.5 s, which is also the session's idle-in-transaction limit:
    "terminating connection due to idle-in-transaction timeout". A migration's transaction
    is given a minute at least."""
    from tests.helpers import run_cli

    real = MigrationContext.run_migrations

    def slow(self: Any, **kwargs: Any) -> Any:
        time.sleep(1.2)  # Alembic loading its scripts on a loaded machine
        return real(self, **kwargs)

    monkeypatch.setattr(MigrationContext, "run_migrations", slow)
    monkeypatch.setenv("TOOLLEDGER_DB_TIMEOUT", "0.5")
    with fresh_pg_database(pg_server, "template0") as url:
        code, out, err = run_cli(capsys, "--db", url, "db", "upgrade")
        assert code == 0, (out, err)
        engine = create_engine(url)
        assert current_revision(engine) == head_revision()
        engine.dispose()
