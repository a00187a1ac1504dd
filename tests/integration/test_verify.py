"""verify: current state rebuilt from events alone equals stored state; tampering is found."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from toolledger.cli import main
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status


def mixed_history(ledger: Ledger) -> dict[str, str]:
    """Every kind of event at least once, across two scopes; returns some execution ids."""
    ids: dict[str, str] = {}
    for scope in ("alpha", "beta"):
        ledger.submit(scope, "pending", "write_file", {"path": "p", "content": "1"})
        ledger.submit(scope, "rejected", "write_file", {"path": "r", "content": "2"})
        ledger.reject(scope, "rejected", by="bob", reason="no")
        for cid, status in (("ok", Status.SUCCEEDED), ("bad", Status.FAILED)):
            ledger.submit(scope, cid, "write_file", {"path": cid, "content": cid}, approved_by="al")
            c = ledger.claim(scope, f"write_file:{cid}", 1, worker_id="w1")
            ledger.finish(c.execution_id, c.lease_token, status, {"status": status.value})
            ids[f"{scope}:{cid}"] = c.execution_id
        ledger.submit(scope, "lost", "append_file", {"path": "l", "content": "x"}, key="lost-k")
        ledger.submit(
            scope, "lost-again", "append_file", {"path": "l", "content": "x"}, key="lost-k"
        )
        ledger.approve(scope, "lost", by="al")
        c = ledger.claim(scope, "lost-k", 1, worker_id="w2")
        ledger.mark_unknown(c.execution_id, reason="lease expired", actor="sweep")
        ledger.record_evidence(c.execution_id, {"late_result": {"x": 1}}, actor="w2")
        ledger.authorize_retry(scope, "lost", by="carol", accept_duplicate=True)
        c2 = ledger.claim(scope, "lost-k", 2, worker_id="w3")
        ledger.finish(c2.execution_id, c2.lease_token, Status.SUCCEEDED, {"again": True})
        ledger.submit(scope, "rec", "write_file", {"path": "q", "content": "q"}, approved_by="al")
        c = ledger.claim(scope, "write_file:rec", 1, worker_id="w4")
        ledger.mark_unknown(c.execution_id, reason="t", actor="sweep")
        ledger.reconcile(
            c.execution_id, Status.SUCCEEDED, {"same": 1}, evidence={"sha": 1}, actor="s"
        )
        ledger.submit(scope, "run", "write_file", {"path": "z", "content": "z"}, approved_by="al")
        ledger.claim(scope, "write_file:run", 1, worker_id="w5")
        ids[f"{scope}:unknown"] = c.execution_id
    return ids


def test_verify__mixed_history_rebuilds_exactly(fresh_db_url):
    ledger = Ledger(fresh_db_url)
    mixed_history(ledger)
    report = ledger.verify(page_size=3)  # several pages
    assert report.ok, report.to_json()
    assert (report.operations, report.executions) == (14, 12)
    assert main_exit(["--db", fresh_db_url, "verify"]) == 0


def main_exit(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return int(exit_.value.code or 0)


@pytest.mark.parametrize(
    ("statement", "field"),
    [
        ("UPDATE executions SET result = '{\"forged\": true}' WHERE execution_id = :eid", "result"),
        (
            "UPDATE executions SET reconciled = NOT reconciled WHERE execution_id = :eid",
            "reconciled",
        ),
        (
            "UPDATE operations SET status = 'approved' WHERE idempotency_key = 'write_file:ok'",
            "status",
        ),
        (
            'UPDATE operations SET args = \'{"path": "ok", "content": "evil"}\' '
            "WHERE scope = 'alpha' AND idempotency_key = 'write_file:ok'",
            "args",
        ),
        ("DELETE FROM tool_calls WHERE tool_call_id = 'lost-again'", "calls"),
    ],
    ids=["result", "reconciled", "op-status", "args", "tool-call"],
)
def test_verify__tampered_row_is_reported(fresh_db_url, statement, field, capsys):
    ledger = Ledger(fresh_db_url)
    ids = mixed_history(ledger)
    with ledger.engine.begin() as conn:
        conn.execute(sa.text(statement), {"eid": ids["alpha:ok"]})
    report = ledger.verify()
    assert not report.ok
    assert any(field in d.field for d in report.differences), report.to_json()
    assert main_exit(["--db", fresh_db_url, "verify", "--json"]) == 1
    assert '"ok": false' in capsys.readouterr().out


def test_verify__deleted_operation_is_reported(fresh_db_url):
    ledger = Ledger(fresh_db_url)
    ledger.submit("s", "c1", "write_file", {"path": "a", "content": "b"})
    with ledger.engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM tool_calls")
        conn.exec_driver_sql("DELETE FROM operations")
    report = ledger.verify()
    assert [(d.table, d.field, d.rebuilt) for d in report.differences] == [
        ("operations", "row", "present")
    ]


@pytest.mark.parametrize(
    "statement", ["UPDATE execution_events SET actor = 'mallory'", "DELETE FROM execution_events"]
)
def test_events__append_only(fresh_db_url, statement):
    ledger = Ledger(fresh_db_url)
    mixed_history(ledger)
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), ledger.engine.begin() as conn:
        conn.exec_driver_sql(statement)
    assert ledger.verify().ok
