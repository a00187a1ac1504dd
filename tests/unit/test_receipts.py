from datetime import UTC, datetime

import pytest

from toolledger.ledger.errors import CorruptRecord, NoReceipt
from toolledger.ledger.receipts import receipt_for
from toolledger.ledger.records import ExecutionRecord, OperationRecord
from toolledger.ledger.transitions import Status

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def op(status, reason=None):
    return OperationRecord(
        scope="s",
        idempotency_key="write_file:c1",
        tool="write_file",
        args={},
        args_sha256="0" * 64,
        status=status,
        authorized_attempts=1,
        decided_by="alice",
        decided_at=NOW,
        reason=reason,
        created_at=NOW,
        enqueued_at=None,
    )


def ex(status, result=None):
    return ExecutionRecord(
        execution_id="e1",
        scope="s",
        idempotency_key="write_file:c1",
        attempt=1,
        status=status,
        worker_id="w",
        lease_token="t",
        lease_expires_at=NOW,
        heartbeat_at=NOW,
        started_at=NOW,
        finished_at=None,
        result=result,
        reconciled=False,
        error=None,
    )


def test_receipt__rejected():
    r = receipt_for(op(Status.REJECTED, reason="not today"), None, flags=())
    assert r.content == {"status": "rejected", "reason": "not today"}
    assert r.is_error


@pytest.mark.parametrize("status", [Status.SUCCEEDED, Status.FAILED])
def test_receipt__terminal_replays_exactly_the_saved_result(status):
    saved = {"path": "diagnosis.txt", "bytes_written": 4, "nested": {"b": 1, "a": [2]}}
    r = receipt_for(op(status), ex(status, saved), flags=())
    assert r.content == saved
    assert list(r.content) == list(saved)  # key order too
    assert r.execution_id == "e1"


@pytest.mark.parametrize("status", [Status.SUCCEEDED, Status.FAILED])
def test_receipt__terminal_without_result_is_an_error(status):
    with pytest.raises(CorruptRecord):
        receipt_for(op(status), ex(status, None), flags=())
    with pytest.raises(CorruptRecord):
        receipt_for(op(status), None, flags=())


@pytest.mark.parametrize("status", [Status.PENDING_APPROVAL, Status.APPROVED, Status.RUNNING])
def test_receipt__not_yet(status):
    with pytest.raises(NoReceipt):
        receipt_for(op(status), ex(Status.RUNNING) if status is Status.RUNNING else None, flags=())


def test_receipt__unknown_names_the_execution():
    r = receipt_for(op(Status.UNKNOWN), ex(Status.UNKNOWN), flags=())
    assert r.content["status"] == "unknown"
    assert r.content["execution_id"] == "e1"
    assert "not run again" in r.content["message"]
    assert r.is_error  # DESIGN §6: marked as an error, so the model never reads it as success
    assert r.to_anthropic()["is_error"] is True


@pytest.mark.parametrize("status", [Status.SUCCEEDED, Status.FAILED])
def test_receipt__a_contradicted_outcome_says_so_to_the_model(status):
    """A person's ``failed`` against a late proof the call took effect reached the model as a
    plain failure (it reads the content, not the flag): an invitation to do it again under a
    new id (a cold review). The saved result stays, the dispute is said beside it."""
    from dataclasses import replace

    from toolledger.ledger.receipts import DISPUTED_MESSAGE
    from toolledger.ledger.transitions import Flag

    note = {"review": "contradicted", "message": DISPUTED_MESSAGE}
    flagged = replace(op(status), review="contradicted")
    on_it = [Flag("e1", "contradicted")]
    # the tool's own keys stay whole: a first version wrote its message over the tool's
    saved = {"error": "tool_error", "message": "quota exceeded", "review": "the tool's"}
    r = receipt_for(flagged, ex(status, saved), flags=on_it)
    assert r.content == {**saved, "toolledger": note}
    assert "do not repeat" in r.to_openai()["content"]
    assert r.review == "contradicted" and r.disputed
    ours = {"toolledger": "a tool's own key of that name"}
    r = receipt_for(flagged, ex(status, ours), flags=on_it)
    assert r.content == {"result": ours, "toolledger": note}
    # a contradiction about another attempt leaves this one's receipt as it was
    r = receipt_for(flagged, ex(status, saved), flags=[Flag("e0", "contradicted")])
    assert (r.content, r.disputed) == (saved, False)
    for other in (None, "not_landed"):  # not a dispute of the outcome
        reason = [] if other is None else [Flag("e1", other)]
        r = replace(op(status), review=other)
        assert receipt_for(r, ex(status, saved), flags=reason).content == saved


def test_receipt__every_flag_waiting_counts_not_only_the_first():
    """``operations.review`` keeps the first reason; a ``contradicted`` raised after it on the
    receipt's own execution still disputes it (a cold review: after ``both_ran``, the
    person's bare ``failed`` while two charges had landed). Here the first flag alone
    (``not_landed``, then a ``both_ran`` beside a success) would mark nothing."""
    from dataclasses import replace

    from toolledger.ledger.transitions import Flag

    saved = {"status": "succeeded", "resolved_by": "carol"}
    flags = [Flag("e1", "not_landed", "k"), Flag("e0", "both_ran"), Flag("e1", "contradicted")]
    flagged = replace(op(Status.SUCCEEDED), review="not_landed")
    r = receipt_for(flagged, ex(Status.SUCCEEDED, saved), flags=flags)
    assert r.disputed and r.content["toolledger"]["review"] == "contradicted"
    r = receipt_for(flagged, ex(Status.SUCCEEDED, saved), flags=flags[:2])
    assert not r.disputed and r.content == saved


@pytest.mark.parametrize("status", [Status.SUCCEEDED, Status.FAILED])
def test_receipt__both_ran_disputes_a_failure_only(status):
    """An attempt proven succeeded while the receipt says ``failed`` is proof the action
    took effect: the failure is said disputed; beside a success it hides nothing."""
    from dataclasses import replace

    from toolledger.ledger.transitions import Flag

    saved = {"error": "declined", "message": "duplicate charge declined"}
    flagged = replace(op(status), review="both_ran")
    r = receipt_for(flagged, ex(status, saved), flags=[Flag("e0", "both_ran")])
    assert r.disputed is (status is Status.FAILED)
    assert ("toolledger" in r.content) is (status is Status.FAILED)
