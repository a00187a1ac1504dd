"""Proof beats permission, contradictions go back to a human, and a human's review — on both
backends, through the ledger's API and the CLI."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pydantic
import pytest

from tests.helpers import run_cli
from toolledger.builtin_tools import ContentArgs
from toolledger.ledger.errors import InputError, InvalidTransition, StaleFence
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Review, Status
from toolledger.recovery.sweep import sweep
from toolledger.recovery.transcript import repair_transcript
from toolledger.registry import load_registry
from toolledger.sandbox import Sandbox

NOTIFY = {"to": "ops"}


def unknown_attempt(ledger: Ledger, scope: str, cid: str = "c1", tool: str = "notify") -> str:
    """Attempt 1 of a call, claimed, then declared unknown (its executor presumed gone)."""
    args = NOTIFY if tool == "notify" else {"path": f"{cid}.txt", "content": "x"}
    ledger.submit(scope, cid, tool, args, approved_by="al")
    claim = ledger.claim(scope, f"{tool}:{cid}", 1, worker_id="zombie")
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    return claim.execution_id


def kinds(ledger: Ledger, scope: str, cid: str = "c1") -> list[str]:
    return [e.kind for e in ledger.events(scope, cid)]


# ---------------------------------------------------------------------------- withdrawal


def test_withdrawal__proof_that_attempt_1_succeeded_withdraws_unclaimed_attempt_2(ledger, scope):
    # Given attempt 1 unknown and attempt 2 authorised by a human, not claimed yet
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    # When evidence proves attempt 1 succeeded
    proven = {"notified": "ops", "receipt": "r-1"}
    ledger.reconcile(first, Status.SUCCEEDED, proven, evidence={"kind": "t"}, actor="sweep")
    # Then attempt 2 is withdrawn: the call ends succeeded with the proven receipt
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.authorized_attempts) == (Status.SUCCEEDED, 1)
    assert view.current.execution_id == first
    assert ledger.receipt(scope, "c1").content == proven
    withdrawn = ledger.events(scope, "c1")[-1]
    assert withdrawn.kind == "withdrawn" and withdrawn.execution_id == first
    assert (withdrawn.detail["attempt"], withdrawn.detail["proven_attempt"]) == (2, 1)
    # and a message for attempt 2 still in the broker finds nothing to claim
    assert ledger.claim(scope, "notify:c1", 2, worker_id="w") is None
    assert len(ledger.get(scope, "c1").executions) == 1
    assert ledger.verify().ok


def test_withdrawal__attempt_2_already_claimed_both_stay_and_a_human_is_asked(ledger, scope):
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    second = ledger.claim(scope, "notify:c1", 2, worker_id="w2")
    ledger.finish(second.execution_id, second.lease_token, Status.SUCCEEDED, {"notified": 2})
    ledger.reconcile(first, Status.SUCCEEDED, {"notified": 1}, evidence={"k": 1}, actor="sweep")
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.review) == (Status.SUCCEEDED, "both_ran")
    assert [e.status for e in view.executions] == [Status.SUCCEEDED, Status.SUCCEEDED]
    flag = ledger.events(scope, "c1")[-1]
    assert flag.kind == "flagged" and flag.detail["reason"] == Review.BOTH_RAN
    assert flag.detail["later"]["execution_id"] == second.execution_id
    assert [c.tool_call_id for c in ledger.list_calls(scope=scope, review=True)] == ["c1"]
    report = ledger.verify()
    assert report.ok and report.flagged >= 1


def unknown_retry(ledger: Ledger, scope: str, attempt: int) -> str:
    """The authorised ``attempt`` of c1, claimed, then declared unknown."""
    claim = ledger.claim(scope, "notify:c1", attempt, worker_id="zombie")
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    return claim.execution_id


def test_withdrawal__a_claimed_attempt_between_the_proven_and_the_withdrawn_one_is_flagged(
    ledger, scope
):
    """Attempts 1 and 2 unknown, attempt 3 authorised, not claimed; attempt 1 proved: only
    the authorised attempt was looked at, and the call ended succeeded with attempt 2's
    possible second effect told to nobody (a cold review)."""
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    second = unknown_retry(ledger, scope, 2)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    ledger.reconcile(first, Status.SUCCEEDED, {"notified": 1}, evidence={"k": 1}, actor="sweep")
    view = ledger.get(scope, "c1")
    # attempt 3 withdrawn all the same (proof beats permission), and a human asked
    assert (view.operation.status, view.operation.authorized_attempts) == (Status.SUCCEEDED, 1)
    assert view.operation.review == Review.BOTH_RAN
    flag = next(e for e in ledger.events(scope, "c1") if e.kind == "flagged")
    assert flag.detail["later"] == {
        "execution_id": second,
        "attempt": 2,
        "status": "unknown",
    }
    assert ledger.events(scope, "c1")[-1].kind == "withdrawn"
    assert ledger.claim(scope, "notify:c1", 3, worker_id="w") is None
    assert [c.tool_call_id for c in ledger.list_calls(scope=scope, review=True)] == ["c1"]
    assert ledger.verify().ok


def test_withdrawal__an_idempotent_tools_attempt_between_flags_nothing(ledger, scope):
    """The withdrawal makes the call succeeded, which hides nothing for an idempotent tool
    (twice is once): its flag asked a human about nothing (a cold review)."""
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    unknown_retry(ledger, scope, 2)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    proven = {"notified": 1}
    ledger.reconcile(
        first, Status.SUCCEEDED, proven, evidence={"k": 1}, actor="sweep", flag_both_ran=False
    )
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.review) == (Status.SUCCEEDED, None)
    assert ledger.events(scope, "c1")[-1].kind == "withdrawn"
    assert ledger.verify().ok


def test_retry__after_a_withdrawal_the_next_attempt_is_numbered_past_every_claimed_one(
    ledger, scope
):
    """After the withdrawal above made attempt 1 current again, a retry (once a review made
    the call failed) authorised attempt 2 again, whose row was there: every claim of it lost,
    and the call stayed approved for good, re-published every pass (a cold review)."""
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    second = unknown_retry(ledger, scope, 2)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    ledger.resolve(first, Status.SUCCEEDED, by="dave", evidence="saw it in the ops channel")
    late = {"late_result": {"error": "boom"}, "proves": "failed"}
    ledger.record_late_result(first, late, actor="zombie", outcome=Status.FAILED)
    # attempt 2 first: no review of attempt 1 while it is unknown
    ledger.resolve(second, Status.FAILED, by="erin", evidence="nothing in the ops channel")
    ledger.resolve(
        first, Status.FAILED, by="erin", evidence="the late result shows it failed", review=True
    )
    assert ledger.get(scope, "c1").operation.status is Status.FAILED
    retried = ledger.authorize_retry(scope, "c1", by="erin", accept_duplicate=True)
    assert retried.authorized_attempts == 3
    claim = ledger.claim(scope, "notify:c1", 3, worker_id="w")
    assert claim is not None
    ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"notified": 3})
    assert ledger.receipt(scope, "c1").content == {"notified": 3}
    assert ledger.verify().ok


def test_retry__a_persons_retry_decided_on_attempts_since_outnumbered_is_refused(ledger, scope):
    """humans.retry decided "nothing landed, no duplicate to accept" on the call as it read
    it, and the ledger authorised the next attempt of whatever it found then: another
    person's retry and its attempt run meanwhile (failed part-way, an effect perhaps
    applied) gave a second attempt with no duplicate accepted (a cold review)."""
    from toolledger.ledger.errors import InvalidTransition
    from toolledger.recovery import humans
    from toolledger.recovery.reconcile import NOT_APPLIED

    registry = load_registry("tests.external_tools")
    ledger.submit(scope, "c1", "notify", NOTIFY, approved_by="al")
    first = ledger.claim(scope, "notify:c1", 1, worker_id="w1")
    ledger.mark_unknown(first.execution_id, reason="lease expired", actor="sweep")
    proof = {"kind": "not_started"}
    ledger.reconcile(first.execution_id, Status.FAILED, NOT_APPLIED, evidence=proof, actor="sweep")
    real = ledger.authorize_retry

    def meanwhile(*args: Any, **kwargs: Any) -> Any:
        ledger.authorize_retry = real  # alice's retry, and its attempt runs and fails
        humans.retry(ledger, registry, lambda *_: {}, scope, "c1", by="alice")
        second = ledger.claim(scope, "notify:c1", 2, worker_id="w2")
        failed = {"error": "timeout after sending"}
        ledger.finish(second.execution_id, second.lease_token, Status.FAILED, failed)
        return real(*args, **kwargs)

    ledger.authorize_retry = meanwhile
    with pytest.raises(InvalidTransition, match="decided on attempt 1"):
        humans.retry(ledger, registry, lambda *_: {}, scope, "c1", by="bob")
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.authorized_attempts) == (Status.FAILED, 2)
    with pytest.raises(humans.DuplicateNotAccepted):  # asked again, bob is told
        humans.retry(ledger, registry, lambda *_: {}, scope, "c1", by="bob")


@pytest.mark.parametrize("later", ["succeeded", "failed", "running"])
def test_withdrawal__an_idempotent_tools_proof_after_its_retry_ran_is_hidden_by_nothing(
    ledger, scope, later
):
    """Attempt 1 proven succeeded (its late result) after a human's retry was claimed: for an
    idempotent tool two runs are harmless, but the call's status is attempt 2's — a failed
    (or not yet ended) attempt 2 would tell the model 'failed' for an effect that is there,
    and nobody was told."""
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="carol")
    second = ledger.claim(scope, "notify:c1", 2, worker_id="w2")
    if later != "running":
        result = {"notified": 2} if later == "succeeded" else {"error": "409 duplicate"}
        ledger.finish(second.execution_id, second.lease_token, Status(later), result)
    late = {"late_result": {"notified": 1}, "proves": "succeeded"}
    ledger.record_late_result(
        first, late, actor="zombie", outcome=Status.SUCCEEDED, idempotent=True
    )
    view = ledger.get(scope, "c1")
    assert view.executions[0].status is Status.SUCCEEDED  # attempt 1, reconciled
    if later == "succeeded":  # the same end twice: nothing to tell
        assert view.operation.review is None
    else:
        assert view.operation.review == Review.BOTH_RAN
        flag = ledger.events(scope, "c1")[-1]
        assert flag.detail["later"] == {
            "execution_id": second.execution_id,
            "attempt": 2,
            "status": later,
        }
    assert ledger.verify().ok


def test_withdrawal__a_failed_proof_withdraws_nothing(ledger, scope):
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    ledger.reconcile(first, Status.FAILED, {"error": "x"}, evidence={}, actor="sweep")
    op = ledger.get(scope, "c1").operation
    assert (op.status, op.authorized_attempts, op.review) == (Status.APPROVED, 2, None)


@pytest.mark.parametrize("rounds", [30])
def test_withdrawal__racing_a_claim_never_lets_both_happen(ledger, scope, rounds):
    """A withdrawal and the claim of the attempt it withdraws, at the same instant, many
    times: either the claim won (both results stay, flagged) or the withdrawal did (no claim)."""
    outcomes = []
    for i in range(rounds):
        cid = f"r{i}"
        first = unknown_attempt(ledger, scope, cid)
        ledger.authorize_retry(scope, cid, by="carol", accept_duplicate=True)
        go = threading.Barrier(2)
        claimed: list[Any] = []

        def claim(cid: str, go: threading.Barrier, claimed: list[Any]) -> None:
            go.wait()
            claimed.append(ledger.claim(scope, f"notify:{cid}", 2, worker_id="w"))

        def prove(first: str, go: threading.Barrier) -> None:
            go.wait()
            ledger.reconcile(first, Status.SUCCEEDED, {"ok": 1}, evidence={}, actor="sweep")

        threads = [
            threading.Thread(target=claim, args=(cid, go, claimed)),
            threading.Thread(target=prove, args=(first, go)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        view = ledger.get(scope, cid)
        if claimed[0] is None:
            assert len(view.executions) == 1 and view.operation.status is Status.SUCCEEDED
            outcomes.append("withdrawn")
        else:
            assert len(view.executions) == 2 and view.operation.review == "both_ran"
            assert view.operation.status is Status.RUNNING  # attempt 2 runs on; a human looks
            outcomes.append("both")
    assert ledger.verify().ok
    print(
        f"\nwithdrawal vs claim: {outcomes.count('withdrawn')} withdrawn, {outcomes.count('both')} both"
    )


# ---------------------------------------------------------------------------- contradictions


@pytest.mark.parametrize(
    ("human", "late"),
    [(Status.FAILED, Status.SUCCEEDED), (Status.SUCCEEDED, Status.FAILED)],
    ids=["human-failed-late-succeeded", "human-succeeded-late-failed"],
)
def test_contradiction__late_result_against_a_human_goes_back_to_the_inbox(
    ledger, scope, human, late
):
    eid = unknown_attempt(ledger, scope)
    ledger.resolve(eid, human, by="dana", evidence="nothing in the outbox")
    late_result = {"notified": "ops"} if late is Status.SUCCEEDED else {"error": "smtp 550"}
    detail = {"late_result": late_result, "status": late.value, "proves": late.value}
    ledger.record_late_result(eid, detail, actor="zombie", outcome=late)
    view = ledger.get(scope, "c1")
    assert view.operation.review == Review.CONTRADICTED
    assert view.current.status is human  # nothing overwritten: a human decides again
    flag = ledger.events(scope, "c1")[-1]
    assert flag.kind == "flagged"
    assert flag.detail["human"] == {
        "status": human.value,
        "result": view.current.result,
        "by": "dana",
    }
    assert flag.detail["late"] == {"status": late.value, "result": late_result}
    assert ledger.verify().flagged >= 1


def test_contradiction__agreeing_or_refused_late_results_flag_nothing(ledger, scope):
    eid = unknown_attempt(ledger, scope)
    ledger.resolve(eid, Status.FAILED, by="dana", evidence="checked")
    ledger.record_late_result(eid, {"status": "failed"}, actor="z", outcome=Status.FAILED)
    # a late "succeeded" whose sandbox effects the fence refused proves nothing about the world
    refused = {"status": "succeeded", "staged": [{"n": 0}], "proves": None}
    ledger.record_late_result(eid, refused, actor="z", outcome=None)
    assert ledger.get(scope, "c1").operation.review is None
    assert kinds(ledger, scope)[-2:] == ["evidence", "evidence"]


def test_contradiction__a_human_success_against_effects_that_never_landed_is_flagged(ledger, scope):
    """A human resolved a revoked execution as succeeded; its executor then woke, and its
    commit was refused and its staged bytes dropped: the receipt said succeeded for an
    append that never happened, and nobody was told."""
    eid = unknown_attempt(ledger, scope, tool="append_file")
    ledger.resolve(eid, Status.SUCCEEDED, by="bob", evidence="I think it ran")
    refused = {"late_result": {"path": "c1.txt"}, "status": "succeeded", "landed": False,
               "staged": [{"n": 0, "path": "c1.txt"}], "proves": None}  # fmt: skip
    ledger.record_late_result(eid, refused, actor="zombie", outcome=None)
    view = ledger.get(scope, "c1")
    assert view.operation.review == Review.CONTRADICTED
    flag = ledger.events(scope, "c1")[-1]
    assert flag.kind == "flagged" and flag.detail["human"]["status"] == "succeeded"
    assert flag.detail["late"]["status"] == "not_applied"
    assert ledger.verify().ok


def test_contradiction__a_reconcilers_success_is_not_contradicted_by_a_late_failure(ledger, scope):
    # a reconciler proves the target state holds (DESIGN §6); its "failed" against the
    # executor's own late success is flagged: tests/integration/test_proof_receipts.py
    eid = unknown_attempt(ledger, scope)
    ledger.reconcile(eid, Status.SUCCEEDED, {"ok": 1}, evidence={"kind": "reconciler"}, actor="s")
    ledger.record_late_result(eid, {"status": "failed"}, actor="z", outcome=Status.FAILED)
    assert ledger.get(scope, "c1").operation.review is None


# ---------------------------------------------------------------------------- review


@pytest.fixture
def cli(db_url, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TOOLLEDGER_BROKER", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("TOOLLEDGER_SANDBOX", str(tmp_path / "sandbox"))
    monkeypatch.setenv("TOOLLEDGER_TOOLS", "tests.external_tools")
    return lambda *argv: run_cli(capsys, "--db", db_url, *argv)


def contradicted(ledger: Ledger, scope: str) -> str:
    eid = unknown_attempt(ledger, scope)
    ledger.resolve(eid, Status.FAILED, by="dana", evidence="nothing sent")
    detail = {"late_result": {"notified": "ops"}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(eid, detail, actor="zombie", outcome=Status.SUCCEEDED)
    return eid


def test_review__the_inbox_shows_both_versions_and_a_review_corrects_the_decision(
    cli, ledger, scope, tmp_path
):
    eid = contradicted(ledger, scope)
    # The inbox: list --review, and show with both versions side by side
    code, out, _ = cli("list", "--review", "--scope", scope, "--json")
    (row,) = json.loads(out)["calls"]
    assert code == 0 and (row["tool_call_id"], row["review"]) == ("c1", "contradicted")
    code, out, _ = cli("show", "--scope", scope, "--tool-call-id", "c1", "--json")
    shown = json.loads(out)
    assert shown["review"] == "contradicted"
    assert shown["review_detail"]["human"]["status"] == "failed"
    assert shown["review_detail"]["late"]["status"] == "succeeded"
    code, out, _ = cli("show", "--scope", scope, "--tool-call-id", "c1")
    assert "REVIEW: contradicted" in out
    # wait and repair say the flag with the receipt (they gave "failed" alone: a script
    # could not tell that the ledger holds proof it took effect, a cold review)
    code, out, _ = cli("wait", "--scope", scope, "--tool-call-id", "c1", "--timeout", "1",
                       "--json")  # fmt: skip
    said = json.loads(out)
    assert code == 0 and (said["status"], said["review"]) == ("failed", "contradicted")
    code, out, _ = cli("wait", "--scope", scope, "--tool-call-id", "c1", "--timeout", "1")
    assert "flagged contradicted" in out
    dangling = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "notify", "arguments": json.dumps(NOTIFY)},
                }
            ],
        }
    ]
    report = repair_transcript(json.dumps(dangling).encode(), ledger, scope, "openai")
    assert [(i["status"], i["review"]) for i in report.inserted] == [("failed", "contradicted")]
    transcript = tmp_path / "t.json"
    transcript.write_text(json.dumps(dangling))
    code, out, err = cli("repair", str(transcript), "--scope", scope)
    assert code == 0 and "c1 (notify): failed, flagged contradicted" in out, (out, err)
    # When the human looks again and finds the notification was sent after all
    code, out, err = cli(
        "resolve", "--execution-id", eid, "--as", "succeeded", "--by", "erin",
        "--evidence", "the ops channel has it at 10:02", "--review", "--json",
    )  # fmt: skip
    assert code == 0, err
    # Then the decision is corrected, the flag cleared, the history tells it all
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.review) == (Status.SUCCEEDED, None)
    assert view.current.result["corrects"]["resolved_by"] == "dana"
    assert kinds(ledger, scope)[-3:] == ["flagged", "succeeded", "reviewed"]
    assert ledger.receipt(scope, "c1").content["resolved_by"] == "erin"
    code, out, _ = cli("list", "--review", "--scope", scope, "--json")
    assert json.loads(out)["count"] == 0
    code, out, _ = cli("wait", "--scope", scope, "--tool-call-id", "c1", "--json")
    assert json.loads(out)["review"] is None
    code, out, _ = cli("verify", "--json")
    assert code == 0 and json.loads(out)["ok"]


def test_review__a_flag_the_review_itself_raises_is_not_settled_by_it(ledger, scope):
    """A review correcting attempt 1 to succeeded after attempt 2 ran flags both_ran; the
    review's own ``reviewed`` event, appended after, settled that flag with the one it
    answered: both ran, and nobody was asked (a cold review's repro). (While attempt 2 runs
    the review is refused: how it ends decides which receipt is the call's.)"""
    a = unknown_attempt(ledger, scope)  # notify: not idempotent
    ledger.resolve(a, Status.FAILED, by="bob", evidence="nothing sent")
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    b = ledger.claim(scope, "notify:c1", 2, worker_id="w2")
    late = {"late_result": {"sent": 1}}
    ledger.record_late_result(a, late, actor="zombie", outcome=Status.SUCCEEDED)
    assert ledger.get(scope, "c1").operation.review == Review.CONTRADICTED
    with pytest.raises(StaleFence, match="is running: review this one once it has ended"):
        ledger.review(a, Status.SUCCEEDED, by="bob", evidence="the late result is right")
    ledger.finish(b.execution_id, b.lease_token, Status.SUCCEEDED, {"sent": 2})
    ledger.review(a, Status.SUCCEEDED, by="bob", evidence="the late result is right")
    assert ledger.get(scope, "c1").operation.review == Review.BOTH_RAN
    assert kinds(ledger, scope)[-3:] == ["succeeded", "reviewed", "flagged"]
    assert ledger.events(scope, "c1")[-1].detail["later"]["execution_id"] == b.execution_id
    assert ledger.verify().ok


def test_review__confirming_keeps_the_status_and_clears_the_flag(ledger, scope):
    eid = contradicted(ledger, scope)
    ledger.resolve(eid, Status.FAILED, by="erin", evidence="really not sent: smtp log", review=True)
    view = ledger.get(scope, "c1")
    assert (view.current.status, view.operation.review) == (Status.FAILED, None)
    assert kinds(ledger, scope)[-2:] == ["flagged", "reviewed"]
    assert ledger.verify().ok


def test_review__an_executors_own_result_stands_and_unflagged_calls_are_refused(ledger, scope):
    ledger.submit(scope, "own", "notify", NOTIFY, approved_by="al")
    claim = ledger.claim(scope, "notify:own", 1, worker_id="w")
    ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"ok": 1})
    with pytest.raises(StaleFence, match="not flagged"):
        ledger.resolve(claim.execution_id, Status.FAILED, by="x", evidence="e")
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    second = ledger.claim(scope, "notify:c1", 2, worker_id="w2")
    ledger.finish(second.execution_id, second.lease_token, Status.SUCCEEDED, {"n": 2})
    ledger.reconcile(first, Status.SUCCEEDED, {"n": 1}, evidence={}, actor="sweep")  # both_ran
    with pytest.raises(StaleFence, match="own succeeded: that stands"):
        ledger.resolve(second.execution_id, Status.FAILED, by="x", evidence="e", review=True)
    ledger.resolve(
        first, Status.SUCCEEDED, by="erin", evidence="both charged; refunded one", review=True
    )
    assert ledger.get(scope, "c1").operation.review is None
    assert ledger.verify().ok


# ---------------------------------------------------------------------------- through the sweep


def test_sweep__late_result_proves_success_and_withdraws_the_human_retry(ledger, scope, tmp_path):
    # Given an unfenced tool's attempt 1 unknown, a retry authorised, and then the zombie's
    # late result (nothing staged: its report stands for its effect outside the sandbox),
    # kept as plain evidence — as a worker of an older version, or one whose proof could not
    # be applied at once, leaves it for the sweep
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    late = {"late_result": {"notified": "ops"}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_evidence(first, late, actor="zombie")
    time.sleep(0.01)
    # When the sweep runs
    summary = sweep(
        ledger,
        load_registry("tests.external_tools"),
        Sandbox(tmp_path / "sandbox").prepare(),
        grace_seconds=0,
        requeue_after=3600,
        publish=None,
    )
    # Then attempt 1 is succeeded from its late result, and attempt 2 is withdrawn
    assert summary.from_late_result >= 1
    assert ledger.verify().ok
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.authorized_attempts) == (Status.SUCCEEDED, 1)
    assert kinds(ledger, scope)[-2:] == ["succeeded", "withdrawn"]
    assert ledger.claim(scope, "notify:c1", 2, worker_id="w") is None


def test_late_result__proof_counts_at_once_not_at_the_next_sweep(ledger, scope):
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    late = {"late_result": {"notified": "ops"}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(first, late, actor="zombie", outcome=Status.SUCCEEDED)
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.authorized_attempts) == (Status.SUCCEEDED, 1)
    assert kinds(ledger, scope)[-3:] == ["evidence", "succeeded", "withdrawn"]
    assert ledger.claim(scope, "notify:c1", 2, worker_id="w") is None
    # a late result that proves nothing (its sandbox effects refused) changes nothing
    second = unknown_attempt(ledger, scope, "c2")
    refused = {"late_result": {"ok": 1}, "status": "succeeded", "proves": None, "staged": [{}]}
    ledger.record_late_result(second, refused, actor="zombie", outcome=None)
    assert ledger.get(scope, "c2").operation.status is Status.UNKNOWN
    assert ledger.verify().ok


# --------------------------------------------------- what the sweep finds after a human decided


class To(pydantic.BaseModel):
    to: str


def _sweep_with(ledger: Ledger, tmp_path, *tools) -> Any:
    from toolledger.tools import Registry

    return sweep(
        ledger,
        Registry(list(tools)),
        Sandbox(tmp_path / "sandbox").prepare(),
        grace_seconds=0,
        requeue_after=3600,
        publish=None,
    )


def test_sweep__a_reconcilers_proof_against_a_human_decided_meanwhile_is_flagged(
    ledger, scope, tmp_path
):
    """The reconciler finds attempt 1 succeeded while a person, not waiting, resolved it
    failed and authorised a retry accepting a duplicate: the finding was dropped without a
    word (neither reconciled, still unknown nor an error) and the retry charged a second time
    (a cold review). The call is flagged contradicted: the retry cannot be claimed until a
    person has reviewed both versions."""
    from toolledger.tools import Evidence, make_tool

    first = unknown_attempt(ledger, scope)

    def slow_reconciler(_args: To, ctx: Any) -> Evidence | None:
        if ctx.execution_id != first:  # the module's other unknown calls
            return None
        ledger.resolve(first, Status.FAILED, by="bob", evidence="no mail in the outbox")
        ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True)
        return Evidence(Status.SUCCEEDED, {"notified": "ops"}, {"kind": "mail log"})

    def never(_args: To, _ctx: Any) -> dict[str, Any]:
        raise AssertionError("recovery executed a tool")

    summary = _sweep_with(
        ledger, tmp_path, make_tool(never, name="notify", reconcile=slow_reconciler)
    )
    assert summary.contradicted == 1
    view = ledger.get(scope, "c1")
    assert view.operation.review == Review.CONTRADICTED
    assert ledger.claim(scope, "notify:c1", 2, worker_id="w2") is None  # held for review
    flag = ledger.events(scope, "c1")[-1]
    assert flag.kind == "flagged" and flag.detail["human"]["status"] == "failed"
    assert flag.detail["late"]["status"] == "succeeded"
    assert ledger.verify().ok


def test_sweep__the_fences_proof_against_a_human_success_decided_meanwhile_is_flagged(
    ledger, scope, tmp_path
):
    """A sandboxed append revoked before its commit provably did nothing; a person resolved
    it succeeded while the sweep asked its reconciler: the fence's proof was dropped, and the
    receipt said succeeded for a line that never landed (a cold review). Flagged now."""
    from toolledger.tools import make_tool

    eid = unknown_attempt(ledger, scope, tool="append_file")

    def asks_too_long(_args: ContentArgs, ctx: Any) -> None:
        if ctx.execution_id != eid:  # the module's other unknown calls
            return None
        ledger.resolve(eid, Status.SUCCEEDED, by="bob", evidence="I think it ran")
        return None  # it cannot tell: the fence's proof is what is left

    def never(_args: ContentArgs, _ctx: Any) -> dict[str, Any]:
        raise AssertionError("recovery executed a tool")

    tool = make_tool(never, name="append_file", reconcile=asks_too_long, sandboxed=True)
    summary = _sweep_with(ledger, tmp_path, tool)
    assert summary.contradicted == 1
    view = ledger.get(scope, "c1")
    assert view.operation.review == Review.CONTRADICTED
    assert view.current.status is Status.SUCCEEDED  # nothing overwritten: a person decides
    flag = ledger.events(scope, "c1")[-1]
    assert flag.detail["late"]["status"] == "failed"
    assert flag.detail["late"]["evidence"]["kind"] == "fence"
    assert ledger.verify().ok


def test_sweep__a_finding_that_agrees_with_the_decision_made_meanwhile_flags_nothing(
    ledger, scope, tmp_path
):
    from toolledger.tools import Evidence, make_tool

    first = unknown_attempt(ledger, scope)

    def agrees(_args: To, ctx: Any) -> Evidence | None:
        if ctx.execution_id != first:  # the module's other unknown calls
            return None
        ledger.resolve(first, Status.SUCCEEDED, by="bob", evidence="saw the mail")
        return Evidence(Status.SUCCEEDED, {"notified": "ops"}, {"kind": "mail log"})

    def never(_args: To, _ctx: Any) -> dict[str, Any]:
        raise AssertionError("recovery executed a tool")

    summary = _sweep_with(ledger, tmp_path, make_tool(never, name="notify", reconcile=agrees))
    assert summary.contradicted == 0
    assert ledger.get(scope, "c1").operation.review is None
    assert kinds(ledger, scope)[-1] == "succeeded"


def test_contradiction__never_started_against_a_human_success_is_flagged(ledger, scope):
    """A person resolved an unknown execution succeeded; its executor then woke before the
    tool and recorded that it never started it: nothing applied, and nothing was flagged (a
    staged effect refused was; a cold review)."""
    eid = unknown_attempt(ledger, scope)
    ledger.resolve(eid, Status.SUCCEEDED, by="bob", evidence="probably sent")
    late = {"not_started": True, "absent": True, "worker_id": "zombie", "reason": "LeaseLost"}
    ledger.record_late_result(eid, late, actor="zombie", outcome=None)
    view = ledger.get(scope, "c1")
    assert view.operation.review == Review.CONTRADICTED
    flag = ledger.events(scope, "c1")[-1]
    assert flag.detail["late"] == {"status": "not_applied", "not_started": True}
    assert ledger.verify().ok


def test_resolve__the_same_resolution_again_is_its_replay_never_a_review(ledger, scope):
    """A person's resolution sent twice (a script retried) after a late result flagged it
    contradicted in between: the second was taken as a review, settling a flag nobody had
    seen (a cold review). It changes nothing and says the flag waits (exit 5); without a flag
    it is the first one's replay (exit 0). A review says something new, and its evidence may
    run over several lines as a resolution's does."""
    eid = unknown_attempt(ledger, scope)
    first = ledger.resolve(eid, Status.FAILED, by="bob", evidence="no mail")
    late = {"late_result": {"notified": "ops"}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(eid, late, actor="zombie", outcome=Status.SUCCEEDED)
    with pytest.raises(StaleFence, match="flagged contradicted since"):  # said, exit 5
        ledger.resolve(eid, Status.FAILED, by="bob", evidence="no mail")
    assert ledger.execution(eid).result == first.result
    assert ledger.get(scope, "c1").operation.review == Review.CONTRADICTED  # still waiting
    ledger.resolve(
        eid, Status.SUCCEEDED, by="bob", evidence="the late result:\n\tit was sent", review=True
    )
    view = ledger.get(scope, "c1")
    assert view.operation.review is None and view.current.status is Status.SUCCEEDED
    replay = ledger.resolve(
        eid, Status.SUCCEEDED, by="bob", evidence="the late result:\n\tit was sent"
    )
    assert replay == ledger.execution(eid)  # no flag waits: the replay, nothing recorded
    assert ledger.verify().ok


def stale_scene(ledger: Ledger, scope: str) -> str:
    """The cold review's scene: bob resolved attempt 1 failed and authorised attempt 2,
    accepting a duplicate; attempt 1's executor woke and its late result proves it succeeded:
    the call is flagged contradicted and attempt 2 is held. Attempt 1's execution id."""
    eid = unknown_attempt(ledger, scope)
    ledger.resolve(eid, Status.FAILED, by="bob", evidence="no charge in the console")
    ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True)
    late = {"late_result": {"charged": "acct-7"}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(eid, late, actor="zombie", outcome=Status.SUCCEEDED)
    assert ledger.get(scope, "c1").operation.review == Review.CONTRADICTED
    assert ledger.claim(scope, "notify:c1", 2, worker_id="w2") is None
    return eid


def test_resolve__a_stale_resolution_never_settles_a_flag_its_sender_did_not_see(ledger, scope):
    """Carol, who had decided on the unknown execution, sent her resolution after the flag
    was raised: it was taken as the flag's review (she never saw it), the flag cleared, and
    attempt 2 ran: two charges (a cold review). It is refused, saying what happened and what
    to do; nothing changes. A review asked for (``review=True``) settles it as before."""
    eid = stale_scene(ledger, scope)
    before = kinds(ledger, scope)
    # When carol sends the resolution she decided on the unknown execution
    with pytest.raises(StaleFence) as refused:
        ledger.resolve(eid, Status.FAILED, by="carol", evidence="payments console: nothing")
    # Then it is refused: the flag stays, attempt 2 is still held, nothing is recorded
    said = str(refused.value)
    assert f"execution {eid} was resolved failed by bob" in said
    assert "flagged contradicted since" in said and "resolve again as its review (--review" in said
    assert f"toolledger show --scope {scope} --tool-call-id c1" in said
    assert kinds(ledger, scope) == before
    assert ledger.get(scope, "c1").operation.review == Review.CONTRADICTED
    assert ledger.claim(scope, "notify:c1", 2, worker_id="w2") is None
    # When she has looked at both versions and reviews it
    ledger.resolve(
        eid, Status.SUCCEEDED, by="carol", evidence="the late result: charged", review=True
    )
    # Then the flag is settled as a review settles it: proven, attempt 2 withdrawn
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.review) == (Status.SUCCEEDED, None)
    assert [e.attempt for e in view.executions] == [1]
    assert ledger.claim(scope, "notify:c1", 2, worker_id="w2") is None
    assert kinds(ledger, scope)[-3:] == ["succeeded", "reviewed", "withdrawn"]
    assert ledger.verify().ok


def test_resolve__cli_a_stale_resolution_is_exit_5_and_review_settles_it(cli, ledger, scope):
    """The same through the CLI: one line, exit 5, the flag waits; ``--review`` settles it
    (here confirming failed: the person's word releases attempt 2, as a review did)."""
    eid = stale_scene(ledger, scope)
    argv = ["resolve", "--execution-id", eid, "--as", "failed", "--by", "carol",
            "--evidence", "payments console: nothing for acct-7"]  # fmt: skip
    code, out, err = cli(*argv)
    assert (code, out) == (5, "")
    assert err.count("\n") == 1 and "flagged contradicted since" in err, err
    assert "--review" in err and f"toolledger show --scope {scope} --tool-call-id c1" in err
    assert ledger.get(scope, "c1").operation.review == Review.CONTRADICTED
    assert ledger.claim(scope, "notify:c1", 2, worker_id="w2") is None
    code, out, err = cli(*argv, "--review")
    assert code == 0 and out.strip() == f"failed: {eid} resolved by carol", (out, err)
    assert ledger.get(scope, "c1").operation.review is None
    assert kinds(ledger, scope)[-1] == "reviewed"
    assert ledger.claim(scope, "notify:c1", 2, worker_id="w2") is not None
    assert ledger.verify().ok


def test_sweep__a_tools_own_resolved_by_is_not_a_persons_decision(ledger, scope, tmp_path):
    """A late result settled the execution with the tool's own result, which happens to hold
    a ``resolved_by`` key; the reconciler then said otherwise: the call was flagged
    contradicted, naming the tool's ``resolved_by`` as the person (a cold review). Only the
    event that decided it says whether a person did."""
    from toolledger.tools import Evidence, make_tool

    first = unknown_attempt(ledger, scope)

    def says_failed(_args: To, ctx: Any) -> Evidence | None:
        if ctx.execution_id != first:  # the module's other unknown calls
            return None
        own = {"late_result": {"ticket": 7, "resolved_by": "helpdesk-bot"}, "proves": "succeeded"}
        ledger.record_late_result(first, own, actor="zombie", outcome=Status.SUCCEEDED)
        return Evidence(Status.FAILED, {"error": "no ticket"}, {"kind": "ticket api"})

    def never(_args: To, _ctx: Any) -> dict[str, Any]:
        raise AssertionError("recovery executed a tool")

    summary = _sweep_with(ledger, tmp_path, make_tool(never, name="notify", reconcile=says_failed))
    assert summary.contradicted == 0
    assert ledger.get(scope, "c1").operation.review is None


def test_contradiction__one_fact_flags_once(ledger, scope):
    """The executor's record that it never started the tool flags a person's 'succeeded';
    the sweep's proof from that same record, found after, flagged it again (a cold review)."""
    eid = unknown_attempt(ledger, scope)
    ledger.resolve(eid, Status.SUCCEEDED, by="bob", evidence="probably sent")
    late = {"not_started": True, "absent": True, "worker_id": "zombie"}
    ledger.record_late_result(eid, late, actor="zombie", outcome=None)
    proof = {"kind": "executor", "not_started": True}
    again = ledger.record_finding_after_decision(
        eid, Status.FAILED, {"error": "not_applied"}, evidence=proof, actor="sweep"
    )
    assert again is False
    assert [e.kind for e in ledger.events(scope, "c1")].count("flagged") == 1
    assert ledger.verify().ok


# ---------------------------------------------------------------------------- retry of a flagged call


def both_ran_then_failed(ledger: Ledger, scope: str) -> tuple[str, str]:
    """Attempt 1 unknown, attempt 2 claimed; attempt 1's late result proves it succeeded
    (both_ran), then attempt 2 fails: the call reads failed, flagged both_ran."""
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True)
    second = ledger.claim(scope, "notify:c1", 2, worker_id="w2")
    assert second is not None
    late = {"late_result": {"notified": "ops"}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(first, late, actor="zombie", outcome=Status.SUCCEEDED)
    ledger.finish(second.execution_id, second.lease_token, Status.FAILED, {"error": "declined"})
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.review) == (Status.FAILED, Review.BOTH_RAN)
    return first, second.execution_id


def test_retry__a_flagged_call_is_refused_until_a_person_reviews_it(cli, ledger, scope):
    """Attempt 1 proven succeeded, attempt 2 failed: erin read "failed" and authorised attempt
    3, accepting a duplicate; the review confirming attempt 1 then left attempt 3 approved,
    and it ran: a second charge (a cold review). A retry waits for the flag's review."""
    first, _ = both_ran_then_failed(ledger, scope)
    before = kinds(ledger, scope)
    with pytest.raises(InvalidTransition, match=r"flagged both_ran.*review it first"):
        ledger.authorize_retry(scope, "c1", by="erin", accept_duplicate=True)
    code, out, err = cli("retry", "--scope", scope, "--tool-call-id", "c1", "--by", "erin",
                         "--accept-duplicate", "--attempt", "2")  # fmt: skip
    assert (code, out) == (5, "") and err.count("\n") == 1, (code, out, err)
    assert "flagged both_ran" in err and "resolve --review" in err, err
    assert kinds(ledger, scope) == before  # nothing changed
    # the review: attempt 1 did succeed; the call is succeeded with it, nothing left to run
    ledger.review(first, Status.SUCCEEDED, by="dave", evidence="the processor shows it")
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.review) == (Status.SUCCEEDED, None)
    assert ledger.claim(scope, "notify:c1", 3, worker_id="w3") is None
    assert ledger.verify().ok


def test_sweep__no_automatic_retry_of_a_flagged_call(ledger, scope):
    """Attempt 1 proven succeeded while attempt 2, claimed, was unknown (both_ran); the
    sweep then proved attempt 2 never applied and authorised attempt 3 automatically; the
    review confirming attempt 1 released it and it ran, authorised by nobody (a cold
    review). The call stays as it is, for the person."""
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True)
    second = unknown_retry(ledger, scope, 2)
    late = {"late_result": {"notified": "ops"}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(first, late, actor="zombie", outcome=Status.SUCCEEDED)
    assert ledger.get(scope, "c1").operation.review == Review.BOTH_RAN
    absent = {"kind": "fence", "reconciler": {"absent": True}}
    ledger.reconcile(second, Status.FAILED, {"applied": False}, evidence=absent, actor="sweep",
                     retry=True)  # fmt: skip
    op = ledger.get(scope, "c1").operation
    assert (op.status, op.authorized_attempts) == (Status.FAILED, 2)
    assert "approved" not in kinds(ledger, scope)[-2:]
    ledger.review(first, Status.SUCCEEDED, by="dave", evidence="attempt 1 charged")
    assert ledger.get(scope, "c1").operation.status is Status.SUCCEEDED
    assert ledger.claim(scope, "notify:c1", 3, worker_id="w3") is None
    assert ledger.verify().ok


def test_review__confirming_success_withdraws_a_later_attempt_not_claimed(ledger, scope):
    """A ledger written before a flagged call's retry was refused: attempt 3 authorised on
    the call flagged both_ran. The review confirming attempt 1 succeeded is proof as the
    late result was: attempt 3, unclaimed, is withdrawn, the call succeeded with attempt 1
    (it stayed approved, and attempt 3 ran: a second charge)."""
    first, _ = both_ran_then_failed(ledger, scope)
    with ledger._write() as conn:  # what an earlier version let a person do
        op = ledger._operation(conn, scope, "notify:c1")
        ledger._authorize_next(conn, op, "erin", {"retry": True, "accept_duplicate": True})
    assert ledger.get(scope, "c1").operation.status is Status.APPROVED
    ledger.review(first, Status.SUCCEEDED, by="dave", evidence="attempt 1 charged")
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.review) == (Status.SUCCEEDED, None)
    assert (view.operation.authorized_attempts, kinds(ledger, scope)[-1]) == (1, "withdrawn")
    assert ledger.claim(scope, "notify:c1", 3, worker_id="w3") is None
    assert ledger.receipt(scope, "c1").content == {"notified": "ops"}
    assert ledger.verify().ok


# ---------------------------------------------------------------------------- back to attempt 1


def back_to_attempt_1(ledger: Ledger, scope: str) -> tuple[str, str]:
    """Attempts 1 and 2 unknown, attempt 3 authorised; carol resolves attempt 1 succeeded
    (attempt 3 withdrawn, the call succeeded at attempt 1, both_ran about attempt 2); attempt
    1's executor then says it failed: contradicted."""
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True)
    second = unknown_retry(ledger, scope, 2)
    ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True)
    ledger.resolve(first, Status.SUCCEEDED, by="carol", evidence="dashboard shows it")
    late = {"late_result": {"error": "declined"}, "status": "failed", "proves": "failed"}
    ledger.record_late_result(first, late, actor="zombie", outcome=Status.FAILED)
    op = ledger.get(scope, "c1").operation
    assert (op.status, op.authorized_attempts) == (Status.SUCCEEDED, 1)
    return first, second


def test_review__refused_while_a_later_attempt_is_unknown_whatever_it_decides(cli, ledger, scope):
    """dave corrected attempt 1 to failed while attempt 2 was unknown: the call was failed
    at attempt 1, no flag, a plain failure for a call whose attempt 2 may have taken effect,
    in no list and no inbox (a cold review). Every review waits for attempt 2's end; its
    resolution is never refused for it."""
    first, second = back_to_attempt_1(ledger, scope)
    before = kinds(ledger, scope)
    for status in (Status.FAILED, Status.SUCCEEDED):
        with pytest.raises(StaleFence, match=f"attempt 2 \\({second}\\) is unknown: resolve it"):
            ledger.review(first, status, by="dave", evidence="attempt 1 says declined")
    code, out, err = cli("resolve", "--execution-id", first, "--as", "failed", "--by", "dave",
                         "--evidence", "declined", "--review")  # fmt: skip
    assert (code, out) == (5, "") and "resolve it" in err and err.count("error:") == 1, err
    assert kinds(ledger, scope) == before
    # attempt 2 resolved (never blocked), then the review is given
    ledger.resolve(second, Status.FAILED, by="erin", evidence="nothing for attempt 2")
    ledger.review(first, Status.FAILED, by="dave", evidence="attempt 1 says declined")
    view = ledger.get(scope, "c1")
    assert [e.status for e in view.executions] == [Status.FAILED, Status.FAILED]
    assert ledger.verify().ok


def test_retry__a_page_read_before_a_withdrawal_is_stale(cli, ledger, scope):
    """frank's page showed attempt 1 (unknown) at the start; attempts 2 and 3 came, attempt
    3 was withdrawn, a review made the call failed at attempt 1 again: his retry with
    ``--attempt 1`` was accepted, a duplicate of an attempt 2 he never saw (a cold review).
    The guard compares against the last attempt, which a withdrawal does not lower."""
    first, second = back_to_attempt_1(ledger, scope)
    ledger.resolve(second, Status.FAILED, by="erin", evidence="nothing for attempt 2")
    ledger.review(first, Status.FAILED, by="dave", evidence="attempt 1 says declined")
    view = ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.authorized_attempts) == (Status.FAILED, 1)
    retry = ["retry", "--scope", scope, "--tool-call-id", "c1", "--by", "frank",
             "--accept-duplicate"]  # fmt: skip
    before = kinds(ledger, scope)
    code, out, err = cli(*retry, "--attempt", "1")
    assert (code, out) == (5, "") and "look again" in err, (code, out, err)
    assert "decided on attempt 1: it is attempt 2 (failed) now" in err, err
    assert kinds(ledger, scope) == before
    # what a person (or a script) reads to pass --attempt: show's last_attempt
    code, out, _ = cli("show", "--scope", scope, "--tool-call-id", "c1", "--json")
    assert json.loads(out)["last_attempt"] == 2
    code, out, err = cli(*retry, "--attempt", "2")
    assert code == 0, err
    assert ledger.get(scope, "c1").operation.authorized_attempts == 3


# ---------------------------------------------------------------------------- what a review saw


def both_ran_attempt_2_failed(ledger: Ledger, scope: str) -> str:
    """carol resolves attempt 1 succeeded while attempt 2 runs (both_ran); attempt 2 fails."""
    first = unknown_attempt(ledger, scope)
    ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True)
    second = ledger.claim(scope, "notify:c1", 2, worker_id="w2")
    assert second is not None
    ledger.resolve(first, Status.SUCCEEDED, by="carol", evidence="dashboard shows a charge")
    ledger.finish(second.execution_id, second.lease_token, Status.FAILED, {"error": "declined"})
    assert ledger.get(scope, "c1").operation.review == Review.BOTH_RAN
    return first


def test_review__seen_refuses_a_flag_raised_after_the_reviewer_looked(cli, ledger, scope):
    """dave looked at the call flagged both_ran; attempt 1's executor then said it failed
    (contradicted); his review, decided on the page he saw, settled both flags, and nobody
    saw the executor's word (a cold review). With --seen it is refused: look again."""
    first = both_ran_attempt_2_failed(ledger, scope)
    code, out, _ = cli("show", "--scope", scope, "--tool-call-id", "c1", "--json")
    looked = json.loads(out)["last_seq"]
    assert looked == ledger.events(scope, "c1")[-1].seq
    late = {"late_result": {"error": "declined"}, "status": "failed", "proves": "failed"}
    ledger.record_late_result(first, late, actor="zombie", outcome=Status.FAILED)
    before = kinds(ledger, scope)
    argv = ["resolve", "--execution-id", first, "--as", "succeeded", "--by", "dave",
            "--evidence", "both ran: carol saw the charge", "--review"]  # fmt: skip
    code, out, err = cli(*argv, "--seen", str(looked))
    assert (code, out) == (5, "") and err.count("\n") == 1, (code, out, err)
    assert "flagged contradicted since" in err and "look again" in err, err
    assert kinds(ledger, scope) == before
    with pytest.raises(StaleFence, match="flagged contradicted since"):
        ledger.review(first, Status.SUCCEEDED, by="dave", evidence="e", seen=looked)
    # looked again: the review is given
    code, out, _ = cli("show", "--scope", scope, "--tool-call-id", "c1", "--json")
    code, out, err = cli(*argv, "--seen", str(json.loads(out)["last_seq"]))
    assert code == 0 and "warning" not in err, err
    assert ledger.get(scope, "c1").operation.review is None
    # without --seen: today's behaviour, and a one-line warning that it settles every flag
    ledger.record_late_result(first, late, actor="zombie2", outcome=Status.FAILED)
    assert ledger.get(scope, "c1").operation.review == Review.CONTRADICTED
    code, out, err = cli(*argv)
    assert code == 0 and err.count("\n") == 1 and "without --seen settles every flag" in err
    # refused, it is one line on stderr, the error alone: the warning comes once it is given
    # (it came first, and a script reading one JSON line of stderr read the warning: a cold
    # review); under --json it is the output's "warning"
    code, out, err = cli(*argv, "--json")
    assert code == 5 and out == "" and err.count("\n") == 1 and "warning" not in err, err
    ledger.record_late_result(first, late, actor="zombie3", outcome=Status.FAILED)
    code, out, err = cli(*argv, "--json")
    assert code == 0 and err == "", err
    assert "without --seen settles every flag" in json.loads(out)["warning"]
    code, _, err = cli("resolve", "--execution-id", first, "--as", "failed", "--by", "dave",
                       "--evidence", "e", "--seen", "1")  # fmt: skip
    assert code == 2 and "--seen goes with --review" in err, err
    assert ledger.verify().ok


def test_review__the_python_clients_take_seen_as_the_cli_does(ledger, db_url, scope, tmp_path):
    """The README says ``client.approve / reject / retry / resolve`` do what the CLI's
    commands do, and ``resolve --review --seen SEQ`` refuses a review decided before a flag
    it would settle was raised; ``Client.resolve`` and ``AsyncClient.resolve`` took no
    ``seen``, so a review desk in Python could only settle every flag, seen or not (a cold
    review of the README)."""
    import asyncio

    from toolledger.client import AsyncClient, Client
    from toolledger.config import Settings
    from toolledger.tools import Registry

    first = unknown_attempt(ledger, scope)
    ledger.resolve(first, Status.FAILED, by="carol", evidence="no charge")
    looked = ledger.events(scope, "c1")[-1].seq  # dave's page: carol's failed, no flag
    late = {"late_result": {"charged": 100}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(first, late, actor="zombie", outcome=Status.SUCCEEDED)
    assert ledger.get(scope, "c1").operation.review == Review.CONTRADICTED
    settings = Settings(db=db_url, home=str(tmp_path / "home"), sandbox=str(tmp_path / "sb"))
    with Client(settings, registry=Registry()) as client:
        before = kinds(ledger, scope)
        with pytest.raises(StaleFence, match="look again"):
            client.resolve(first, "failed", by="dave", evidence="e", review=True, seen=looked)
        with pytest.raises(InputError, match="seen goes with review"):
            client.resolve(first, "failed", by="dave", evidence="e", seen=looked)
        assert kinds(ledger, scope) == before
        newest = ledger.events(scope, "c1")[-1].seq
        done = asyncio.run(
            AsyncClient.of(client).resolve(
                first, "succeeded", by="dave", evidence="the charge", review=True, seen=newest
            )
        )
    assert done["status"] == "succeeded"
    assert ledger.get(scope, "c1").operation.review is None
    assert ledger.verify().ok


def test_review__two_reviewers_of_one_page_the_second_is_refused(ledger, scope):
    """r1 and r2 looked at the same page (contradicted); r1 corrected attempt 1 to succeeded
    (both_ran: attempt 2 had run); r2's review, decided on the page before, was taken as a
    correction of r1's and settled the both_ran flag r2 never saw (a cold review)."""
    first = unknown_attempt(ledger, scope)
    ledger.resolve(first, Status.FAILED, by="carol", evidence="no charge")
    ledger.authorize_retry(scope, "c1", by="bob", accept_duplicate=True)
    second = ledger.claim(scope, "notify:c1", 2, worker_id="w2")
    assert second is not None
    ledger.finish(second.execution_id, second.lease_token, Status.FAILED, {"error": "declined"})
    late = {"late_result": {"charged": 100}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(first, late, actor="zombie", outcome=Status.SUCCEEDED)
    page = ledger.events(scope, "c1")[-1].seq  # both load the page now
    ledger.review(first, Status.SUCCEEDED, by="r1", evidence="receipt is real", seen=page)
    assert ledger.get(scope, "c1").operation.review == Review.BOTH_RAN
    before = kinds(ledger, scope)
    with pytest.raises(StaleFence, match="look again"):
        ledger.review(first, Status.FAILED, by="r2", evidence="I trust carol", seen=page)
    assert kinds(ledger, scope) == before
    assert ledger.get(scope, "c1").operation.review == Review.BOTH_RAN
    assert ledger.verify().ok


def test_show__last_seq_covers_nothing_the_page_does_not_show(ledger, scope):
    """``show`` read the call, then its events: a correction committed between the two reads
    was in ``last_seq`` but not on the page (contradicted, attempt 1 failed), and a review
    ``--seen`` that seq settled the both_ran flag the correction raised (a cold review of the
    day's diff). The history is read first now: the page holds everything ``last_seq``
    covers."""
    from toolledger.cli.calls import _shown

    ledger.submit(scope, "c1", "append_file", {"path": "a.txt", "content": "l\n"},
                  approved_by="al")  # fmt: skip
    a = ledger.claim(scope, "append_file:c1", 1, worker_id="z").execution_id
    ledger.mark_unknown(a, reason="lease expired", actor="sweep")
    ledger.resolve(a, Status.FAILED, by="bob", evidence="nothing sent")
    ledger.authorize_retry(scope, "c1", by="carol", accept_duplicate=True)
    b = ledger.claim(scope, "append_file:c1", 2, worker_id="w2")
    late = {"late_result": {"sent": 1}}
    ledger.record_late_result(a, late, actor="zombie", outcome=Status.SUCCEEDED)
    ledger.finish(b.execution_id, b.lease_token, Status.SUCCEEDED, {"sent": 2})
    assert ledger.get(scope, "c1").operation.review == Review.CONTRADICTED

    class Reads:  # what the CLI hands _shown; alice's correction commits after its first read
        corrected = False

        def get(self, s: str, c: str) -> Any:
            view = ledger.get(s, c)
            if not self.corrected:
                self.corrected = True
                ledger.review(a, Status.SUCCEEDED, by="alice", evidence="the late result holds")
            return view

        def events(self, s: str, c: str) -> Any:
            return ledger.events(s, c)

    page = _shown(Reads(), scope, "c1")  # type: ignore[arg-type]
    now = ledger.get(scope, "c1")
    assert page["last_seq"] == ledger.events(scope, "c1")[-1].seq
    assert page["review"] == now.operation.review
    assert [e["status"] for e in page["executions"]] == [e.status.value for e in now.executions]
