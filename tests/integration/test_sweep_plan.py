"""The sweep's cost follows the rows it touches: every statement it sends to Postgres is
planned through an index (the partial ones for running, unknown and approved-unclaimed), never
a sequential scan of the ledger's tables. Shown by EXPLAIN on a ledger of 20,000 finished calls."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import sqlalchemy as sa

from toolledger.ledger.ledger import Ledger
from toolledger.recovery.sweep import sweep
from toolledger.registry import load_registry
from toolledger.sandbox import Sandbox

pytestmark = pytest.mark.postgres

FINISHED = 20_000
LEDGER_TABLES = {"operations", "executions", "execution_events", "tool_calls"}


def populate(ledger: Ledger) -> None:
    """20,000 finished calls by bulk SQL, then a few of each kind the sweep looks for."""
    with ledger.engine.begin() as conn:
        conn.execute(
            sa.text("""
            INSERT INTO operations (scope, idempotency_key, tool, args, args_sha256, status,
                                    authorized_attempts, created_at)
            SELECT 'bulk', 'k' || g, 'write_file', '{"path":"p","content":"c"}', md5(g::text),
                   'succeeded', 1, now() FROM generate_series(1, :n) g"""),
            {"n": FINISHED},
        )
        conn.execute(
            sa.text("""
            INSERT INTO executions (execution_id, scope, idempotency_key, attempt, status,
                                    started_at, finished_at, result, reconciled)
            SELECT gen_random_uuid()::text, 'bulk', 'k' || g, 1, 'succeeded', now(), now(),
                   '{"ok": true}', false FROM generate_series(1, :n) g"""),
            {"n": FINISHED},
        )
        conn.execute(
            sa.text("""
            INSERT INTO execution_events (scope, idempotency_key, kind, actor, at, detail)
            SELECT 'bulk', 'k' || g, 'succeeded', 'w', now(), '{}'
            FROM generate_series(1, :n) g"""),
            {"n": FINISHED},
        )
    for i in range(20):
        ledger.submit(
            "s", f"stale{i}", "append_file", {"path": f"{i}", "content": "x"}, approved_by="al"
        )
        ledger.claim("s", f"append_file:stale{i}", 1, worker_id="dead", lease_seconds=0.01)
        ledger.submit(
            "s", f"lost{i}", "write_file", {"path": f"l{i}", "content": "x"}, approved_by="al"
        )
    with ledger.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE")


def plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes.extend(plan_nodes(child))
    return nodes


def test_sweep_plan__every_statement_uses_an_index(pg_url, tmp_path, record_property):
    ledger = Ledger(pg_url)
    populate(ledger)
    time.sleep(0.1)
    captured: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "UPDATE", "WITH", "INSERT")):
            captured.append((statement, parameters))

    sa.event.listen(ledger.engine, "before_cursor_execute", capture)
    summary = sweep(
        ledger,
        load_registry(),
        Sandbox(tmp_path),
        grace_seconds=0,
        requeue_after=0,
        publish=lambda *a: None,
    )
    sa.event.remove(ledger.engine, "before_cursor_execute", capture)
    # 20 stale appends: marked unknown, then (fenced, sandboxed) failed "not applied"
    assert (summary.marked_unknown, summary.not_applied, summary.requeued) == (20, 20, 20)

    indexes, report = set(), []
    with ledger.engine.connect() as conn:
        for statement, params in captured:
            if isinstance(params, list):  # executemany: one set is enough for the plan
                params = params[0]
            plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", params).scalar()
            nodes = plan_nodes((plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"])
            seq = [
                n["Relation Name"]
                for n in nodes
                if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in LEDGER_TABLES
            ]
            assert not seq, f"sequential scan of {seq} in:\n{statement}"
            used = {n["Index Name"] for n in nodes if "Index Name" in n}
            indexes |= used
            report.append(f"{statement.split()[0]} {sorted(used)}")
        conn.rollback()
    assert {
        "ix_executions_running_lease",
        "ix_executions_unknown",
        "ix_operations_approved_unclaimed",
    } <= indexes, indexes
    record_property("sweep_plan", "; ".join(report))
    print("\n" + "\n".join(report))
    ledger.close()
