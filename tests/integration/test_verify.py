"""verify: current state rebuilt from events alone equals stored state; tampering is found."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from toolledger.cli import main
from toolledger.ledger.identity import args_sha256
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
        # equal to Python (true == 1 == 1.0), not to JSON, nor to the agent that reads it:
        # verify said ok (a cold review)
        (
            "UPDATE executions SET result = '{\"again\": 1}' "
            "WHERE scope = 'alpha' AND idempotency_key = 'lost-k' AND attempt = 2",
            "result",
        ),
        (
            "UPDATE executions SET result = '{\"same\": 1.0}' "
            "WHERE scope = 'alpha' AND idempotency_key = 'write_file:rec'",
            "result",
        ),
    ],
    ids=["result", "reconciled", "op-status", "args", "tool-call", "true-as-1", "1-as-1.0"],
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


@pytest.mark.parametrize(
    ("statement", "field"),
    [
        ("UPDATE executions SET fenced = NOT fenced WHERE execution_id = :eid", "fenced"),
        (
            'UPDATE executions SET effects = \'[{"path": "x"}]\' WHERE execution_id = :eid',
            "effects",
        ),
        ("UPDATE executions SET error = 'forged' WHERE execution_id = :eid", "error"),
        ("UPDATE executions SET attempt = 9 WHERE execution_id = :eid", "attempt"),
        (
            "UPDATE operations SET review = 'contradicted' WHERE idempotency_key = 'write_file:ok'",
            "review",
        ),
        (
            "UPDATE operations SET decided_by = 'mallory' WHERE idempotency_key = 'write_file:ok'",
            "decided_by",
        ),
        (
            "UPDATE operations SET authorized_attempts = 5 WHERE idempotency_key = 'write_file:ok'",
            "authorized_attempts",
        ),
        (
            "UPDATE operations SET reason = 'forged' WHERE idempotency_key = 'write_file:rejected'",
            "reason",
        ),
        # what no event records but a status requires of its row (a running one's lease, a
        # terminal one's end): running without a lease was never swept, and verify said ok
        (
            "UPDATE executions SET lease_expires_at = NULL "
            "WHERE scope = 'alpha' AND idempotency_key = 'write_file:run'",
            "lease_expires_at",
        ),
        (
            "UPDATE executions SET lease_token = NULL "
            "WHERE scope = 'alpha' AND idempotency_key = 'write_file:run'",
            "lease_token",
        ),
        ("UPDATE executions SET finished_at = NULL WHERE execution_id = :eid", "finished_at"),
    ],
    ids=[
        "fenced",
        "effects",
        "error",
        "attempt",
        "review",
        "decided_by",
        "authorized",
        "reason",
        "lease_expires_at",
        "lease_token",
        "finished_at",
    ],
)
def test_verify__every_compared_column_is_compared(fresh_db_url, statement, field):
    ledger = Ledger(fresh_db_url)
    ids = mixed_history(ledger)
    with ledger.engine.begin() as conn:
        conn.execute(sa.text(statement), {"eid": ids["alpha:ok"]})
    assert any(d.field.endswith(field) for d in ledger.verify().differences), field


def forge_event(ledger: Ledger, key: str, kind: str, detail: dict, execution_id=None, **extra):
    """An event inserted behind the ledger's back (the history refuses only updates and
    deletes), in scope alpha."""
    from toolledger.ledger.models import execution_events

    with ledger.engine.begin() as conn:
        conn.execute(
            execution_events.insert().values(
                scope="alpha", idempotency_key=key, execution_id=execution_id, kind=kind,
                actor="mallory", detail=detail, at=datetime.now(UTC), **extra,
            )
        )  # fmt: skip


def problems(ledger: Ledger) -> list[str]:
    return [d.field for d in ledger.verify().differences if d.table == "execution_events"]


def test_verify__an_event_the_transitions_refuse_is_reported(fresh_db_url):
    ledger = Ledger(fresh_db_url)
    mixed_history(ledger)
    forge_event(ledger, "write_file:ok", "approved", {"attempt": 2})  # succeeded -> approved
    assert any("approved" in p for p in problems(ledger)), problems(ledger)


def test_verify__an_event_naming_no_execution_of_its_call_is_reported(fresh_db_url):
    ledger = Ledger(fresh_db_url)
    ids = mixed_history(ledger)
    forge_event(ledger, "write_file:ok", "evidence", {"x": 1}, execution_id=ids["alpha:bad"])
    assert any("evidence" in p for p in problems(ledger)), problems(ledger)


def test_verify__an_event_before_the_call_was_submitted_is_reported(fresh_db_url):
    ledger = Ledger(fresh_db_url)
    mixed_history(ledger)
    forge_event(ledger, "write_file:ok", "evidence", {"x": 1}, seq=0)  # the first of its call
    assert any("before submitted" in p for p in problems(ledger)), problems(ledger)


def test_verify__a_call_submitted_again_over_its_history_is_reported(fresh_db_url):
    """A second ``submitted`` restarted the replay: a call that ran with some arguments,
    recorded again with others, and its execution row deleted verified clean."""
    ledger = Ledger(fresh_db_url)
    mixed_history(ledger)
    other = {"path": "ok", "content": "evil"}
    forge_event(ledger, "write_file:ok", "submitted",
                {"tool": "write_file", "args": other, "tool_call_id": "ok"})  # fmt: skip
    with ledger.engine.begin() as conn:
        conn.execute(sa.text(
            "UPDATE operations SET args = :args, args_sha256 = :sha, status = 'pending_approval',"
            " authorized_attempts = 0, decided_by = NULL "
            "WHERE scope = 'alpha' AND idempotency_key = 'write_file:ok'"),
            {"args": json.dumps(other), "sha": args_sha256(other)})  # fmt: skip
        conn.execute(sa.text("UPDATE tool_calls SET args_sha256 = :sha WHERE scope = 'alpha' "
                             "AND tool_call_id = 'ok'"), {"sha": args_sha256(other)})  # fmt: skip
        conn.execute(sa.text("DELETE FROM executions WHERE scope = 'alpha' AND "
                             "idempotency_key = 'write_file:ok'"))  # fmt: skip
    assert "seq" in " ".join(problems(ledger)) and any(
        "submitted again" in p for p in problems(ledger)
    ), ledger.verify().to_json()


@pytest.mark.parametrize(
    ("kind", "detail", "says"),
    [
        ("submitted", {}, "KeyError: 'tool'"),  # a submit that says nothing
        ("withdrawn", {"status": "bogus"}, "ValueError"),  # a status no call has
        ("approved", {"attempt": 2, "retry": True}, "approved"),  # (a transition refused)
    ],
)
def test_verify__a_malformed_event_is_a_difference_not_the_end_of_the_report(
    fresh_db_url, kind, detail, says, capsys
):
    """A ``submitted`` event with an empty detail stopped verify with "internal error:
    KeyError", a ``withdrawn`` one naming no status with a ValueError, listing nothing (a
    cold review): each is a difference now, and every other call is still checked."""
    ledger = Ledger(fresh_db_url)
    ids = mixed_history(ledger)
    forge_event(ledger, "write_file:ok", kind, detail, execution_id=ids["alpha:ok"])
    assert any(says in p for p in problems(ledger)), problems(ledger)
    assert main_exit(["--db", fresh_db_url, "verify", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["operations"] == 14 and report["differences"], report


def turn_over_to_failed(ledger: Ledger, key: str, eid: str) -> None:
    """A forged human correction of ``eid`` to failed, the rows made to match."""
    result = {"status": "failed"}
    forge_event(ledger, key, "failed", {"result": result, "reconciled": True,
                "evidence": {"kind": "human", "review": True}}, execution_id=eid)  # fmt: skip
    with ledger.engine.begin() as conn:
        conn.execute(sa.text("UPDATE executions SET status = 'failed', result = :r, reconciled ="
                             " true WHERE execution_id = :eid"),
                     {"r": json.dumps(result), "eid": eid})  # fmt: skip
        conn.execute(sa.text("UPDATE operations SET status = 'failed' WHERE scope = 'alpha' AND"
                             " idempotency_key = :key"), {"key": key})  # fmt: skip


def test_verify__an_executors_own_result_turned_over_without_a_review_is_reported(
    fresh_db_url,
):
    """succeeded -> failed is a human's correction of a reconciler's or a human's decision on
    a flagged call: an executor's own result turned over by a forged event (rows to match)
    verified clean."""
    ledger = Ledger(fresh_db_url)
    ids = mixed_history(ledger)
    turn_over_to_failed(ledger, "write_file:ok", ids["alpha:ok"])  # its executor's own success
    assert any("executor's own result" in p for p in problems(ledger)), problems(ledger)


def test_verify__a_reconciler_decision_turned_over_with_no_flag_waiting_is_reported(
    fresh_db_url,
):
    ledger = Ledger(fresh_db_url)
    ids = mixed_history(ledger)
    turn_over_to_failed(ledger, "write_file:rec", ids["alpha:unknown"])  # reconciled, no flag
    assert any("no flag waiting" in p for p in problems(ledger)), problems(ledger)


def test_verify__a_missing_embedded_ledger_is_refused_not_created(tmp_path, capsys):
    """A mistyped --db verified an empty ledger it had just created: ok, exit 0."""
    missing = tmp_path / "typo.db"
    assert main_exit(["--db", f"sqlite:///{missing}", "verify"]) == 1
    assert "no ledger at" in capsys.readouterr().err
    assert not missing.exists()
    made = tmp_path / "made.db"  # SQLite's URI form names its file its own way: not refused
    assert main_exit(["--db", f"sqlite:///{made}", "db", "upgrade"]) == 0
    assert main_exit(["--db", f"sqlite:///file:{made}?mode=ro&uri=true", "verify"]) == 0
