"""Every ledger session commits durably, whatever the server, the database or the role set.

Under ``synchronous_commit = off`` a commit is acknowledged before it is on disk: the executor's
terminal commit was acknowledged, its bytes landed, a server crash lost the commit, the sweep
found the execution running and revoked it, the fence proved it "not applied", and a retry with
no duplicate accepted wrote the effect twice, ``verify`` clean (a cold review, on a throwaway
cluster). ``off`` is now ``on`` in each session; a durable value the operator chose (``local``,
``remote_write``, ``remote_apply``) is kept. ``fsync`` is the server's alone: a worker warns."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from tests.conftest import fresh_pg_database
from toolledger.ledger.db import create_engine
from toolledger.ledger.lightreads import LightReads
from toolledger.worker.app import warn_if_not_durable

pytestmark = pytest.mark.postgres


@pytest.fixture
def database(pg_server: str, pg_template: str) -> Iterator[tuple[str, Any]]:
    """A fresh ledger database, and a function setting its default synchronous_commit."""
    with fresh_pg_database(pg_server, pg_template) as url:
        name = url.rsplit("/", 1)[1]

        def default(value: str) -> None:
            with psycopg.connect(pg_server.replace("+psycopg", ""), autocommit=True) as admin:
                admin.execute(f"ALTER DATABASE {name} SET synchronous_commit = {value}")

        yield url, default


def seen(url: str) -> tuple[str, str, str]:
    """synchronous_commit as the ledger's engine, its fast path's raw connection and its
    light reads see it."""
    engine = create_engine(url, timeout=5)
    try:
        with engine.connect() as conn:
            pooled = str(conn.exec_driver_sql("SHOW synchronous_commit").scalar_one())
        raw = engine.raw_connection()  # as the fast path takes its connections
        try:
            cursor = raw.cursor()
            cursor.execute("SHOW synchronous_commit")
            fast = str(cursor.fetchone()[0])
        finally:
            raw.close()
    finally:
        engine.dispose()
    reads = LightReads.open(url, 5)
    assert reads is not None
    try:
        row = reads._conn.execute("SHOW synchronous_commit", []).fetchall()[0]
        light = str(row["synchronous_commit"])  # rows are dicts
    finally:
        reads.close()
    return pooled, fast, light


@pytest.mark.parametrize(
    ("default", "expected"),
    [("off", "on"), ("on", "on"), ("local", "local"), ("remote_apply", "remote_apply")],
)
def test_session__synchronous_commit_off_is_on_and_a_durable_choice_is_kept(
    database, default, expected
):
    url, set_default = database
    set_default(default)
    assert seen(url) == (expected, expected, expected)


def test_session__pgoptions_cannot_turn_it_off(database, monkeypatch):
    url, _ = database
    monkeypatch.setenv("PGOPTIONS", "-c synchronous_commit=off")
    assert seen(url)[0] == "on"


def test_worker_start__warns_when_the_server_runs_without_fsync(pg_url, caplog):
    """fsync cannot be set per database, and the shared server's is on: its answer is
    rewritten for this engine alone, the worker's check reading it as it would read off."""
    engine = create_engine(pg_url, timeout=5)

    @sa.event.listens_for(engine, "before_cursor_execute", retval=True)
    def off(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> Any:
        if statement.strip().upper() == "SHOW FSYNC":
            return "SELECT 'off'", params
        return statement, params

    try:
        with caplog.at_level(logging.WARNING, logger="toolledger.worker"):
            said = warn_if_not_durable(engine)
        assert said is not None and "fsync off" in said
        assert any("fsync off" in r.getMessage() for r in caplog.records)
        sa.event.remove(engine, "before_cursor_execute", off)
        assert warn_if_not_durable(engine) is None  # the server's own answer: on
    finally:
        engine.dispose()
