"""The receipt the model reads never hides proof that the action took effect, and a decision
(a person's or a reconciler's) contradicted by the executor's own late result goes back to a
person — the four scenarios of a cold review (/tmp/h-recovery: hidden_dispute,
proof_after_failure, dispute_on_success, recon_vs_late), at the ledger's level, on both
backends, each on a database of its own (``verify`` covers the whole ledger)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from toolledger.client import receipt_of
from toolledger.ledger.errors import InvalidTransition, StaleFence
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.lightreads import LightReads
from toolledger.ledger.receipts import DISPUTED_MESSAGE
from toolledger.ledger.transitions import Flag, Review, Status

SCOPE = "proof"
CALL = "c1"
KEY = "charge:c1"
NOTE = {"review": "contradicted", "message": DISPUTED_MESSAGE}


@pytest.fixture
def ledger(fresh_db_url: str) -> Iterator[Ledger]:
    led = Ledger(fresh_db_url)
    yield led
    led.close()


def late_success(result: dict[str, Any]) -> dict[str, Any]:
    """What a fenced-out executor records when its tool reported success (no sandbox)."""
    return {"late_result": result, "status": "succeeded", "proves": "succeeded", "staged": []}


def lost_attempt(ledger: Ledger, attempt: int) -> str:
    """Attempt ``attempt`` claimed, then declared unknown (its executor frozen, not gone)."""
    claim = ledger.claim(SCOPE, KEY, attempt, worker_id=f"w{attempt}")
    assert claim is not None
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    return claim.execution_id


def submitted(ledger: Ledger) -> None:
    ledger.submit(SCOPE, CALL, "charge", {"account": "acct"}, approved_by="alice")


def waiting(ledger: Ledger) -> set[tuple[str, str]]:
    return {(f.execution_id, f.reason) for f in ledger.get(SCOPE, CALL).flags}


def model_reads(ledger: Ledger, url: str) -> dict[str, Any]:
    """The content the model is handed, asked as the ledger and as the client (light reads)
    ask: both must say the same."""
    content = ledger.receipt(SCOPE, CALL).content
    light = LightReads.open(url, None)
    assert light is not None  # the light reads build the view from raw rows: flags included
    try:
        r = receipt_of(light.get(SCOPE, CALL))
    finally:
        light.close()
    assert r is not None and r.content == content
    return content


def test_hidden_dispute__a_contradiction_after_both_ran_still_marks_the_receipt(
    ledger: Ledger, fresh_db_url: str
) -> None:
    """(a) Attempt 1's late success raises ``both_ran`` first; then attempt 2, which carol
    resolved ``failed``, is contradicted by its own late success. ``operations.review`` keeps
    ``both_ran``: the receipt was carol's bare "failed" while both charges had landed."""
    submitted(ledger)
    first = lost_attempt(ledger, 1)
    ledger.authorize_retry(SCOPE, CALL, by="bob", accept_duplicate=True)
    second = lost_attempt(ledger, 2)
    ledger.resolve(second, Status.FAILED, by="carol", evidence="no second charge seen")
    ledger.record_late_result(
        first, late_success({"charged": True, "n": 1}), actor="w1", outcome=Status.SUCCEEDED
    )
    ledger.record_late_result(
        second, late_success({"charged": True, "n": 2}), actor="w2", outcome=Status.SUCCEEDED
    )
    carol = ledger.execution(second).result
    assert carol is not None and carol["resolved_by"] == "carol"
    assert model_reads(ledger, fresh_db_url) == {**carol, "toolledger": NOTE}
    view = ledger.get(SCOPE, CALL)
    assert (view.operation.status, view.operation.review) == (Status.FAILED, Review.BOTH_RAN)
    assert waiting(ledger) == {(first, "both_ran"), (second, "contradicted")}
    r = ledger.receipt(SCOPE, CALL)
    assert r.disputed and r.is_error
    assert ledger.verify().ok


def test_proof_after_failure__the_receipt_is_marked_and_the_review_makes_it_succeeded(
    ledger: Ledger, fresh_db_url: str
) -> None:
    """(b) Attempt 2 failed on its own ("duplicate charge declined"); attempt 1 is then
    proven succeeded by its executor's late result. The receipt was a plain failure, and
    stayed one for good after a reviewer confirmed attempt 1 had charged."""
    submitted(ledger)
    first = lost_attempt(ledger, 1)
    ledger.authorize_retry(SCOPE, CALL, by="bob", accept_duplicate=True)
    c2 = ledger.claim(SCOPE, KEY, 2, worker_id="w2")
    assert c2 is not None
    declined = {"error": "declined", "message": "duplicate charge declined"}
    ledger.finish(c2.execution_id, c2.lease_token, Status.FAILED, declined)
    assert model_reads(ledger, fresh_db_url) == declined  # nothing known against it yet
    charged = {"charged": True, "charge_id": "ch_1"}
    ledger.record_late_result(first, late_success(charged), actor="w1", outcome=Status.SUCCEEDED)
    # proof the action took effect: the failure the model reads is said disputed
    assert model_reads(ledger, fresh_db_url) == {**declined, "toolledger": NOTE}
    assert waiting(ledger) == {(first, "both_ran")}
    # a reviewer confirms attempt 1 succeeded: the call's receipt is that success
    ledger.resolve(
        first, Status.SUCCEEDED, by="rev", evidence="the first charge went through", review=True
    )
    assert model_reads(ledger, fresh_db_url) == charged
    view = ledger.get(SCOPE, CALL)
    assert (view.operation.status, view.operation.authorized_attempts) == (Status.SUCCEEDED, 1)
    assert view.operation.review is None and not ledger.receipt(SCOPE, CALL).is_error
    assert ledger.execution(c2.execution_id).status is Status.FAILED  # its own word stands
    set_aside = ledger.events(SCOPE, CALL)[-1]
    assert set_aside.kind == "withdrawn" and set_aside.execution_id == first
    assert (set_aside.detail["attempt"], set_aside.detail["set_aside"]) == (2, "failed")
    # and nothing runs again: the call is succeeded
    assert ledger.claim(SCOPE, KEY, 3, worker_id="w3") is None
    assert ledger.verify().ok


def test_dispute_on_success__a_contradiction_about_attempt_1_leaves_attempt_2s_success(
    ledger: Ledger, fresh_db_url: str
) -> None:
    """(c) bob resolved attempt 1 ``failed``; attempt 2 succeeded on its own, and the agent
    holds that receipt. Attempt 1's late success rewrote it "disputed… possibly applied"
    while the ledger's fact is that it was applied (twice). The contradiction goes to a
    person; the receipt of attempt 2's success stays what it was; the review that finds
    attempt 1 succeeded flags ``both_ran``."""
    submitted(ledger)
    first = lost_attempt(ledger, 1)
    ledger.resolve(first, Status.FAILED, by="bob", evidence="no charge seen")
    ledger.authorize_retry(SCOPE, CALL, by="bob", accept_duplicate=True)
    c2 = ledger.claim(SCOPE, KEY, 2, worker_id="w2")
    assert c2 is not None
    second = {"charged": True, "charge_id": "ch_2"}
    ledger.finish(c2.execution_id, c2.lease_token, Status.SUCCEEDED, second)
    charged = late_success({"charged": True, "charge_id": "ch_1"})
    ledger.record_late_result(first, charged, actor="w1", outcome=Status.SUCCEEDED)
    assert model_reads(ledger, fresh_db_url) == second
    assert not ledger.receipt(SCOPE, CALL).disputed
    assert waiting(ledger) == {(first, "contradicted")}  # back to a person, with both versions
    ledger.resolve(
        first, Status.SUCCEEDED, by="rev", evidence="ch_1 is on the statement", review=True
    )
    assert waiting(ledger) == {(first, "both_ran")}  # a person is told both charged
    assert model_reads(ledger, fresh_db_url) == second
    assert ledger.verify().ok


def test_dispute_on_failure__a_contradiction_about_attempt_1_marks_attempt_2s_failure(
    ledger: Ledger, fresh_db_url: str
) -> None:
    """(c)'s other side: attempt 2 failed on its own; attempt 1's late success against bob's
    ``failed`` is proof the action took effect: the failure the model reads is disputed, and
    the review that finds attempt 1 succeeded makes the call succeeded."""
    submitted(ledger)
    first = lost_attempt(ledger, 1)
    ledger.resolve(first, Status.FAILED, by="bob", evidence="no charge seen")
    ledger.authorize_retry(SCOPE, CALL, by="bob", accept_duplicate=True)
    c2 = ledger.claim(SCOPE, KEY, 2, worker_id="w2")
    assert c2 is not None
    declined = {"error": "declined"}
    ledger.finish(c2.execution_id, c2.lease_token, Status.FAILED, declined)
    charged = late_success({"charged": True, "charge_id": "ch_1"})
    ledger.record_late_result(first, charged, actor="w1", outcome=Status.SUCCEEDED)
    assert model_reads(ledger, fresh_db_url) == {**declined, "toolledger": NOTE}
    ledger.resolve(
        first, Status.SUCCEEDED, by="rev", evidence="ch_1 is on the statement", review=True
    )
    view = ledger.get(SCOPE, CALL)
    assert (view.operation.status, view.current and view.current.execution_id) == (
        Status.SUCCEEDED,
        first,
    )
    assert model_reads(ledger, fresh_db_url) == ledger.execution(first).result
    assert waiting(ledger) == {(first, "both_ran")}
    assert ledger.verify().ok


def test_recon_vs_late__a_reconcilers_failed_contradicted_by_its_executor_goes_to_a_person(
    ledger: Ledger, fresh_db_url: str
) -> None:
    """(d) The sweep's reconciler decided ``failed``; the executor, frozen meanwhile, records
    its own late success. It was kept as evidence only: the call failed, its receipt a
    plain failure, a retry allowed and claimable."""
    submitted(ledger)
    first = lost_attempt(ledger, 1)
    declined = {"error": "declined", "by": "downstream"}
    said = {"kind": "reconciler", "tool": "charge", "method": "downstream says declined"}
    ledger.reconcile(first, Status.FAILED, declined, evidence=said, actor="sweep")
    ledger.record_late_result(
        first, late_success({"charged": True}), actor="w1", outcome=Status.SUCCEEDED
    )
    assert model_reads(ledger, fresh_db_url) == {**declined, "toolledger": NOTE}
    assert waiting(ledger) == {(first, "contradicted")}
    flag = [e for e in ledger.events(SCOPE, CALL) if e.kind == "flagged"][-1]
    assert flag.detail["reconciler"]["status"] == "failed"
    assert flag.detail["reconciler"]["evidence"] == said
    assert flag.detail["late"] == {"status": "succeeded", "result": {"charged": True}}
    # no retry is authorised until a person has reviewed the call: nothing to claim
    with pytest.raises(InvalidTransition, match="flagged contradicted"):
        ledger.authorize_retry(SCOPE, CALL, by="bob", accept_duplicate=True)
    assert ledger.claim(SCOPE, KEY, 2, worker_id="w2") is None
    assert ledger.verify().ok


def test_recon_vs_late__the_executors_own_word_and_a_reconcilers_success_flag_nothing(
    ledger: Ledger,
) -> None:
    """What is not a contradiction of a decision: a reconciler's success against the
    executor's failure (a reconciler proves the target state holds, DESIGN §6)."""
    submitted(ledger)
    first = lost_attempt(ledger, 1)
    said = {"kind": "reconciler", "tool": "charge"}
    ledger.reconcile(first, Status.SUCCEEDED, {"charged": True}, evidence=said, actor="sweep")
    late = {"late_result": {"error": "timeout"}, "status": "failed", "proves": "failed"}
    ledger.record_late_result(first, late, actor="w1", outcome=Status.FAILED)
    assert ledger.get(SCOPE, CALL).operation.review is None
    assert ledger.receipt(SCOPE, CALL).content == {"charged": True}
    assert ledger.verify().ok


def test_flags__a_contradicted_flag_records_what_its_late_version_claims() -> None:
    """``fold_flags`` keeps the status a contradiction's late version claims (the receipt of
    a later attempt's failure follows it); a flag recorded without one claims nothing."""
    from toolledger.ledger.transitions import fold_flags

    events = [
        ("flagged", "e1", {"reason": "contradicted", "late": {"status": "succeeded"}}),
        ("flagged", "e1", {"reason": "both_ran"}),
    ]
    assert fold_flags(events)[0] == [
        Flag("e1", "contradicted", None, "succeeded"),
        Flag("e1", "both_ran"),
    ]


def test_verify__a_failed_call_set_aside_without_a_review_is_reported(ledger: Ledger) -> None:
    """failed -> succeeded on the call is a review's to take (``_proof_beats_failure``): a
    ``withdrawn`` event that does so on anything else's word is a difference."""
    from datetime import UTC, datetime

    import sqlalchemy as sa

    from toolledger.ledger.models import execution_events

    submitted(ledger)
    first = lost_attempt(ledger, 1)
    ledger.authorize_retry(SCOPE, CALL, by="bob", accept_duplicate=True)
    c2 = ledger.claim(SCOPE, KEY, 2, worker_id="w2")
    assert c2 is not None
    ledger.finish(c2.execution_id, c2.lease_token, Status.FAILED, {"error": "declined"})
    ledger.record_late_result(first, late_success({"n": 1}), actor="w1", outcome=Status.SUCCEEDED)
    assert ledger.verify().ok
    detail = {"attempt": 2, "proven_attempt": 1, "status": "succeeded", "set_aside": "failed",
              "evidence": {"kind": "reconciler"}}  # fmt: skip
    with ledger.engine.begin() as conn:  # behind the ledger's back, the rows made to match
        conn.execute(
            execution_events.insert().values(
                scope=SCOPE, idempotency_key=KEY, execution_id=first, kind="withdrawn",
                actor="mallory", detail=detail, at=datetime.now(UTC),
            )
        )  # fmt: skip
        conn.execute(
            sa.text(
                "UPDATE operations SET status = 'succeeded', authorized_attempts = 1 "
                "WHERE scope = :s AND idempotency_key = :k"
            ),
            {"s": SCOPE, "k": KEY},
        )
    found = [d.field for d in ledger.verify().differences]
    assert any("set aside by something not a review" in f for f in found), found


def test_early_review__attempt_1_is_not_confirmed_while_attempt_2_has_not_ended(
    ledger: Ledger, fresh_db_url: str
) -> None:
    """A reviewer confirmed attempt 1 succeeded (``both_ran``) while attempt 2 still ran;
    attempt 2 then failed, and the call was ``failed``, its receipt a plain failure with no
    flag waiting, though attempt 1 had charged (a cold review). The review is refused until
    attempt 2 has ended; then it makes the call succeeded."""
    submitted(ledger)
    first = lost_attempt(ledger, 1)
    ledger.authorize_retry(SCOPE, CALL, by="bob", accept_duplicate=True)
    c2 = ledger.claim(SCOPE, KEY, 2, worker_id="w2")
    assert c2 is not None
    charged = {"charged": True, "charge_id": "ch_1"}
    ledger.record_late_result(first, late_success(charged), actor="w1", outcome=Status.SUCCEEDED)
    assert waiting(ledger) == {(first, "both_ran")}
    before = len(ledger.events(SCOPE, CALL))
    with pytest.raises(StaleFence, match=r"attempt 2 .* is running: .*once it has ended"):
        ledger.resolve(first, Status.SUCCEEDED, by="rev", evidence="charged", review=True)
    assert len(ledger.events(SCOPE, CALL)) == before and waiting(ledger) == {(first, "both_ran")}
    declined = {"error": "declined", "message": "duplicate charge declined"}
    ledger.finish(c2.execution_id, c2.lease_token, Status.FAILED, declined)
    # the flag still waits: the failure the model reads is said disputed
    assert model_reads(ledger, fresh_db_url) == {**declined, "toolledger": NOTE}
    ledger.resolve(first, Status.SUCCEEDED, by="rev", evidence="charged", review=True)
    assert model_reads(ledger, fresh_db_url) == charged
    assert ledger.get(SCOPE, CALL).operation.status is Status.SUCCEEDED
    assert ledger.verify().ok


def test_early_review__attempt_2_unknown_is_resolved_first(ledger: Ledger) -> None:
    """The same with attempt 2 lost too: resolve it first, then review attempt 1."""
    submitted(ledger)
    first = lost_attempt(ledger, 1)
    ledger.authorize_retry(SCOPE, CALL, by="bob", accept_duplicate=True)
    second = lost_attempt(ledger, 2)
    ledger.record_late_result(
        first, late_success({"charged": True}), actor="w1", outcome=Status.SUCCEEDED
    )
    assert waiting(ledger) == {(first, "both_ran")}
    with pytest.raises(StaleFence, match=f"attempt 2 \\({second}\\) is unknown: resolve it"):
        ledger.resolve(first, Status.SUCCEEDED, by="rev", evidence="charged", review=True)
    ledger.resolve(second, Status.FAILED, by="carol", evidence="no second charge")
    ledger.resolve(first, Status.SUCCEEDED, by="rev", evidence="charged", review=True)
    assert ledger.get(SCOPE, CALL).operation.status is Status.SUCCEEDED
    assert ledger.verify().ok
