"""A ledger reached through PgBouncer (session pooling), as deployments with many workers do.

PgBouncer refuses a connection whose startup packet carries libpq's ``options``, where the
ledger used to ask for its session settings: nothing could connect through one. The settings
now follow the connect as a statement, and hold there (session pooling keeps a client's
session: its settings, its prepared statements, its LISTEN).
"""

from __future__ import annotations

import json
import subprocess

import psycopg
import pytest
import sqlalchemy as sa

from tests.conftest import fresh_pg_database
from toolledger.harness.processes import service_env, stop_all, toolledger_argv, worker_process
from toolledger.ledger.ledger import Ledger

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

CALLS = 6


def test_pgbouncer__workers_cli_and_reads_through_session_pooling(
    pg_server, pg_template, pgbouncer, redis_server, redis_prefix, tmp_path
):
    with fresh_pg_database(pg_server, pg_template) as direct:
        name = sa.make_url(direct).database
        with psycopg.connect(direct.replace("+psycopg", ""), autocommit=True) as admin:
            # defaults that break the ledger's reads unless its own settings reach the server
            admin.execute(f"ALTER DATABASE {name} SET DateStyle = 'SQL, DMY'")
            admin.execute(f"ALTER DATABASE {name} SET default_transaction_isolation = serializable")
        url = sa.make_url(pgbouncer).set(database=name).render_as_string(hide_password=False)
        sandbox = tmp_path / "sandbox"
        settings = {
            "db": url,
            "broker": redis_server,
            "broker_prefix": redis_prefix,
            "sandbox": str(sandbox),
            "home": str(tmp_path / "home"),
            "metrics": "off",
        }
        env = service_env(**settings)

        def cli(*argv: str) -> dict:
            done = subprocess.run(
                [*toolledger_argv(), "--json", *argv],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout) if done.stdout.strip() else {}

        worker = worker_process("pgb", env, tmp_path / "logs", pool="threads", concurrency=2)
        worker.start()
        try:
            worker.wait_ready(60)
            for i in range(CALLS):
                made = cli(
                    "submit", "--scope", "pgb", "--tool-call-id", f"c{i}", "--tool",
                    "write_file", "--args", json.dumps({"path": f"f{i}", "content": f"x{i}"}),
                    "--approved-by", "al",
                )  # fmt: skip
                assert made["enqueued"] is True
            for i in range(CALLS):  # LISTEN through the bouncer, else its poll
                got = cli("wait", "--scope", "pgb", "--tool-call-id", f"c{i}", "--timeout", "60")
                assert got["status"] == "succeeded", got
            shown = cli("show", "--scope", "pgb", "--tool-call-id", "c0")
            assert shown["status"] == "succeeded" and shown["receipt"]["bytes_written"] == 2
            assert cli("list", "--scope", "pgb", "--status", "succeeded")["count"] == CALLS
            cli("verify")
        finally:
            stop_all([worker])
        assert [(sandbox / "pgb" / f"f{i}").read_text() for i in range(CALLS)] == [
            f"x{i}" for i in range(CALLS)
        ]
        ledger = Ledger(url, timeout=7)  # a worker's settings, in force through the bouncer
        try:
            with ledger.engine.connect() as conn:
                shown_settings = [
                    conn.exec_driver_sql(f"SHOW {s}").scalar()
                    for s in (
                        "statement_timeout",
                        "lock_timeout",
                        "DateStyle",
                        "transaction_isolation",
                    )
                ]
            assert shown_settings == ["7s", "7s", "ISO, YMD", "read committed"]
        finally:
            ledger.close()
