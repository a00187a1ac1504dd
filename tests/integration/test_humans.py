"""Humans: the unknown inbox, resolve with evidence, retry authorised by a named person."""

from __future__ import annotations

import json

import pytest

from tests.helpers import row_counts, run_cli
from toolledger.ledger.errors import StaleFence
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


def test_retry__decided_on_an_attempt_no_longer_the_last_is_refused(cli, ledger, scope):
    """helper-91: the check that no attempt came meanwhile compared against the command's own
    fresh read, not what the person saw: ``--attempt`` says what they saw."""
    unknown_call(ledger, scope, "notify")
    before = row_counts(ledger.engine)
    argv = ["retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol",
            "--accept-duplicate"]  # fmt: skip
    code, _, err = cli(*argv, "--attempt", "2")
    assert code == 5 and "decided on attempt 2: it is attempt 1 (unknown) now" in err, err
    # a retry of an unknown call is allowed: only the attempt it was decided on is stale (it
    # said "cannot go from unknown to approved", a cold review of the CLI)
    assert "cannot go from" not in err, err
    assert row_counts(ledger.engine) == before
    code, _, err = cli(*argv, "--attempt", "0")
    assert code == 2 and row_counts(ledger.engine) == before
    code, out, err = cli(*argv, "--attempt", "1", "--json")
    assert code == 0 and json.loads(out)["attempt"] == 2, err


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


@pytest.mark.parametrize("decided", ["sweep-proved-not-applied", "a-person-said-failed"])
def test_retry__an_attempt_the_sweep_proved_not_applied_needs_no_acceptance(
    cli, ledger, scope, decided
):
    """A non-sandboxed attempt the sweep proved not applied (its reconciler's word, or its
    executor never started the tool) left nothing: a retry is no duplicate, and the log
    said a person accepted one (a cold review). A person's own "failed" is their word, not
    a proof: a duplicate must still be accepted."""
    from toolledger.recovery.reconcile import NOT_APPLIED

    eid = unknown_call(ledger, scope, "notify")
    if decided == "sweep-proved-not-applied":
        proof = {"kind": "executor", "not_started": True}
        ledger.reconcile(eid, Status.FAILED, NOT_APPLIED, evidence=proof, actor="sweep")
    else:
        ledger.resolve(eid, Status.FAILED, by="bob", evidence="no mail went out")
    code, out, err = cli(
        "retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol", "--json"
    )
    if decided == "sweep-proved-not-applied":
        data = json.loads(out)
        assert code == 0 and data["attempt"] == 2 and "warning" not in data, err
    else:
        assert code == 5 and "--accept-duplicate" in err


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


@pytest.mark.parametrize("status", ["rejected", "succeeded", "approved"])
def test_retry__a_call_no_retry_can_follow_says_so_not_to_accept_a_duplicate(
    cli, ledger, scope, status
):
    """A non-idempotent call that cannot be retried at all: the advice was to pass
    --accept-duplicate, which then failed with "cannot go from rejected" (a cold review)."""
    ledger.submit(scope, "c1", "append_file", {"path": "a", "content": "x"})
    if status == "rejected":
        ledger.reject(scope, "c1", by="bob", reason="no")
    else:
        ledger.approve(scope, "c1", by="al")
    if status == "succeeded":
        claim = ledger.claim(scope, "append_file:c1", 1, worker_id="w")
        ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"ok": 1})
    code, _, err = cli("retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol")
    assert code == 5 and f"cannot go from {status}" in err and "accept" not in err, err


def not_landed_call(ledger: Ledger, scope: str) -> str:
    """An append whose own success committed and whose bytes could not land (kept aside)."""
    ledger.submit(scope, "c1", "append_file", {"path": "a.txt", "content": "x"}, approved_by="al")
    claim = ledger.claim(scope, "append_file:c1", 1, worker_id="w")
    ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"appended": 1})
    detail = {"path": "a.txt", "n": 0, "seq": 9, "reason": "a directory", "kept": "k.refused"}
    ledger.record_not_landed(claim.execution_id, detail)
    return claim.execution_id


def test_review__a_not_landed_call_is_confirmed_never_changed_and_its_flag_cleared(
    cli, ledger, scope
):
    eid = not_landed_call(ledger, scope)
    assert ledger.get(scope, "c1").operation.review == "not_landed"
    assert ledger.reviewed_not_landed([eid]) == set()
    argv = ["resolve", "--execution-id", eid, "--by", "dana", "--evidence", "landed a.txt by hand"]
    code, _, err = cli(*argv, "--as", "succeeded")  # a resolution, not asked as a review
    assert code == 5 and "flagged not_landed since" in err and "--review" in err
    assert ledger.get(scope, "c1").operation.review == "not_landed"
    argv.append("--review")
    code, _, err = cli(*argv, "--as", "failed")  # the executor's own success stands
    assert code == 5 and "its effect did not land: --as succeeded once you landed it" in err
    assert ledger.get(scope, "c1").operation.review == "not_landed"
    code, out, err = cli(*argv, "--as", "succeeded", "--json")
    assert code == 0, err
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.review) == (Status.SUCCEEDED, None)
    assert (view.current.status, view.current.reconciled) == (Status.SUCCEEDED, False)
    last = ledger.events(scope, "c1")[-1]
    assert (last.kind, last.actor, last.detail["reason"]) == ("reviewed", "dana", "not_landed")
    assert ledger.reviewed_not_landed([eid, "e-none"]) == {"k.refused"}
    code, _, err = cli(*argv, "--as", "succeeded")  # once: nothing left to review
    assert code == 5 and "not flagged for review" in err
    code, out, err = cli("verify", "--json")  # the history rebuilds to the same rows
    assert code == 0, out + err


def test_review__confirms_only_the_execution_whose_effect_did_not_land(cli, ledger, scope):
    # an earlier attempt (failed, its own) of a call whose later success did not land
    ledger.submit(scope, "c1", "append_file", {"path": "a.txt", "content": "x"}, approved_by="al")
    first = ledger.claim(scope, "append_file:c1", 1, worker_id="w")
    ledger.finish(first.execution_id, first.lease_token, Status.FAILED, {"error": "boom"})
    ledger.authorize_retry(scope, "c1", by="al", accept_duplicate=True)
    second = ledger.claim(scope, "append_file:c1", 2, worker_id="w")
    ledger.finish(second.execution_id, second.lease_token, Status.SUCCEEDED, {"appended": 1})
    ledger.record_not_landed(second.execution_id, {"path": "a.txt", "n": 0, "reason": "x"})
    code, _, err = cli(
        "resolve", "--execution-id", first.execution_id, "--as", "failed",
        "--by", "dana", "--evidence", "looked", "--review",
    )  # fmt: skip
    assert code == 5 and "that stands" in err
    assert ledger.get(scope, "c1").operation.review == "not_landed"


def test_review__settles_only_the_bytes_its_flag_named(ledger, scope):
    eid = not_landed_call(ledger, scope)  # kept at k.refused
    ledger.record_not_landed(eid, {"path": "b.txt", "n": 1, "reason": "a directory", "kept": "b"})
    ledger.record_not_landed(eid, {"path": "c.txt", "n": 2, "reason": "unrecorded: no kept"})
    assert ledger.reviewed_not_landed([eid]) == set()
    ledger.review(eid, Status.SUCCEEDED, by="dana", evidence="left them")
    assert ledger.reviewed_not_landed([eid]) == {"k.refused", "b"}
    ledger.record_not_landed(eid, {"path": "d.txt", "n": 3, "reason": "later", "kept": "d"})
    assert ledger.get(scope, "c1").operation.review == "not_landed"  # flagged again
    assert ledger.reviewed_not_landed([eid]) == {"k.refused", "b"}  # d waits for its review


def test_review__confirming_not_landed_leaves_a_flag_raised_on_another_execution(ledger, scope):
    # attempt 1 unknown, attempt 2 succeeds and does not land; then attempt 1 is proven to
    # have succeeded too (both_ran, raised on attempt 1): confirming attempt 2's status must
    # leave the call flagged for both_ran, which only a review of attempt 1 settles
    ledger.submit(scope, "c1", "append_file", {"path": "a.txt", "content": "x"}, approved_by="al")
    first = ledger.claim(scope, "append_file:c1", 1, worker_id="w")
    ledger.mark_unknown(first.execution_id, reason="lease expired", actor="sweep")
    ledger.authorize_retry(scope, "c1", by="al", accept_duplicate=True)
    second = ledger.claim(scope, "append_file:c1", 2, worker_id="w")
    ledger.finish(second.execution_id, second.lease_token, Status.SUCCEEDED, {"appended": 1})
    ledger.record_not_landed(second.execution_id, {"path": "a.txt", "n": 0, "kept": "k2"})
    ledger.reconcile(first.execution_id, Status.SUCCEEDED, {"n": 1}, evidence={}, actor="sweep")
    assert ledger.events(scope, "c1")[-1].detail["reason"] == "both_ran"
    ledger.review(second.execution_id, Status.SUCCEEDED, by="dana", evidence="landed by hand")
    assert ledger.get(scope, "c1").operation.review == "both_ran"
    assert ledger.events(scope, "c1")[-1].detail["review_after"] == "both_ran"
    assert ledger.verify().ok  # the history rebuilds the flag that still waits
    with pytest.raises(StaleFence, match="own succeeded: that stands"):
        ledger.review(second.execution_id, Status.SUCCEEDED, by="dana", evidence="again")
    ledger.review(first.execution_id, Status.SUCCEEDED, by="dana", evidence="both appended")
    assert ledger.get(scope, "c1").operation.review is None
    assert ledger.reviewed_not_landed([second.execution_id]) == {"k2"}
    assert ledger.verify().ok


def test_resolve__review_of_an_unknown_call_not_flagged_warns_of_no_flag(cli, ledger, scope):
    """``resolve --review`` of an unknown execution whose call is flagged for nothing is a
    resolution; it warned that the review "settles every flag waiting on this execution,
    including any raised after you looked", of a call no flag waited on (a cold review of the
    CLI). Resolved, exit 0, and no such warning, in the JSON or on stderr."""
    eid = unknown_call(ledger, scope)
    argv = ["resolve", "--execution-id", eid, "--as", "succeeded", "--by", "dana"]
    code, out, err = cli(*argv, "--evidence", "one line in a.txt", "--review", "--json")
    assert code == 0 and err == "", err
    data = json.loads(out)
    assert data["status"] == "succeeded" and "warning" not in data
    assert ledger.get(scope, "c1").operation.review is None
