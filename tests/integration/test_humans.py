"""Humans: the unknown inbox, resolve with evidence, retry authorised by a named person."""

from __future__ import annotations

import json

import pytest

from tests.helpers import row_counts, run_cli
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status


@pytest.fixture
def cli(db_url, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TOOLLEDGER_BROKER", "redis://127.0.0.1:1/0")  # enqueue fails visibly
    monkeypatch.setenv("TOOLLEDGER_SANDBOX", str(tmp_path / "sandbox"))
    monkeypatch.setenv("TOOLLEDGER_TOOLS", "tests.external_tools")
    return lambda *argv: run_cli(capsys, "--db", db_url, *argv)


def unknown_call(ledger: Ledger, scope: str, tool: str = "append_file") -> str:
    args = {"to": "ops"} if tool == "notify" else {"path": "a.txt", "content": "x"}
    ledger.submit(scope, "c1", tool, args, approved_by="al")
    claim = ledger.claim(scope, f"{tool}:c1", 1, worker_id="w")
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    return claim.execution_id


def test_inbox__list_status_unknown(cli, ledger, scope):
    eid = unknown_call(ledger, scope)
    code, out, _ = cli("list", "--status", "unknown", "--scope", scope, "--json")
    (row,) = json.loads(out)["calls"]
    assert code == 0 and (row["tool_call_id"], row["execution_id"]) == ("c1", eid)


def test_resolve__records_who_and_the_evidence(cli, ledger, scope):
    eid = unknown_call(ledger, scope)
    code, out, _ = cli(
        "resolve",
        "--execution-id",
        eid,
        "--as",
        "succeeded",
        "--by",
        "dana",
        "--evidence",
        "checked a.txt: one line, as requested",
        "--json",
    )
    assert code == 0 and json.loads(out)["status"] == "succeeded"
    view = ledger.get(scope, "c1")
    assert (view.current.execution_id, view.current.status, view.current.reconciled) == (
        eid,
        Status.SUCCEEDED,
        True,
    )
    last = ledger.events(scope, "c1")[-1]
    assert last.actor == "dana" and last.detail["evidence"]["text"].startswith("checked a.txt")
    assert ledger.receipt(scope, "c1").content["resolved_by"] == "dana"
    code, _, err = cli(
        "resolve", "--execution-id", eid, "--as", "failed", "--by", "eve", "--evidence", "x"
    )
    assert code == 5 and "not unknown" in err


def test_resolve__refuses_a_status_outside_succeeded_failed(cli, ledger, scope):
    eid = unknown_call(ledger, scope)
    before = row_counts(ledger.engine)
    code, _, err = cli(
        "resolve", "--execution-id", eid, "--as", "running", "--by", "x", "--evidence", "e"
    )
    assert code == 2 and "running" in err
    assert row_counts(ledger.engine) == before


def test_retry__not_idempotent_needs_explicit_acceptance(cli, ledger, scope):
    unknown_call(ledger, scope, "notify")  # its effect is outside the sandbox: unfenced
    before = row_counts(ledger.engine)
    code, _, err = cli("retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol")
    assert code == 5 and "not idempotent" in err and "--accept-duplicate" in err
    assert row_counts(ledger.engine) == before
    code, out, _ = cli(
        "retry",
        "--scope",
        scope,
        "--tool-call-id",
        "c1",
        "--by",
        "carol",
        "--accept-duplicate",
        "--json",
    )
    data = json.loads(out)
    assert code == 0 and data["attempt"] == 2 and data["duplicate_effect_accepted"] is True
    assert "may take effect twice" in data["warning"]
    retry_event = ledger.events(scope, "c1")[-1]
    assert (retry_event.kind, retry_event.actor) == ("approved", "carol")
    assert retry_event.detail["accept_duplicate"] is True
    assert ledger.get(scope, "c1").operation.status is Status.APPROVED


def test_retry__sandboxed_tool_whose_attempts_left_nothing_needs_no_acceptance(cli, ledger, scope):
    # append_file is not idempotent, but its revoked attempt provably left nothing (the fence)
    unknown_call(ledger, scope, "append_file")
    code, out, err = cli(
        "retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol", "--json"
    )
    data = json.loads(out)
    assert code == 0, err
    assert data["attempt"] == 2 and "warning" not in data
    assert data["duplicate_effect_accepted"] is False


def test_retry__idempotent_tool_needs_no_acceptance(cli, ledger, scope):
    unknown_call(ledger, scope, "write_file")
    code, out, _ = cli("retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol", "--json")
    data = json.loads(out)
    assert code == 0 and data["attempt"] == 2 and "warning" not in data
    assert data["enqueued"] is False  # the broker is down: recorded, the sweep publishes it


def test_retry__a_succeeded_call_cannot_be_retried(cli, ledger, scope):
    ledger.submit(scope, "c1", "write_file", {"path": "a", "content": "x"}, approved_by="al")
    claim = ledger.claim(scope, "write_file:c1", 1, worker_id="w")
    ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"ok": 1})
    code, _, err = cli("retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol")
    assert code == 5 and "succeeded" in err
