"""A person's decision given again — a script's approve retried after its answer was lost, a
console form posted twice — is answered with the call as it stands when it is the same
decision, by the same person, for the same reason; any other decision on a decided call is
refused, as ever. Nothing is written by a replay, and it publishes only what a replayed
submit would (a call approved whose publish may have died with the process that decided)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_cli
from tests.integration.test_server import bearer, pending, serving
from tests.integration.test_submit_replay import settings_of
from toolledger.ledger.errors import InvalidTransition
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.worker import submit as submitting
from toolledger.worker.submit import Submitter

ARGS = {"path": "a.txt", "content": "x"}


def history(ledger: Ledger, scope: str, call: str = "c1") -> list[str]:
    return [e.kind for e in ledger.events(scope, call)]


def test_ledger__the_same_decision_again_is_the_call_as_it_stands_and_writes_nothing(
    ledger: Ledger, scope: str
) -> None:
    ledger.submit(scope, "c1", "write_file", ARGS)
    first = ledger.decide(scope, "c1", Status.APPROVED, "ann", "looks right")
    assert first.outcome == "decided"
    before = history(ledger, scope)
    again = ledger.decide(scope, "c1", Status.APPROVED, "ann", "looks right")
    assert again.outcome == "existing" and again.operation.status is Status.APPROVED
    assert again.operation.decided_by == "ann" and history(ledger, scope) == before
    # the call ran and ended since: the approval still stands, the call as it is now
    claim = ledger.claim(scope, first.operation.idempotency_key, 1, worker_id="w")
    assert claim is not None
    ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"ok": True})
    later = ledger.approve(scope, "c1", by="ann", reason="looks right")
    assert later.status is Status.SUCCEEDED
    # rejected by the same person, the same reason: the same answer
    ledger.submit(scope, "c2", "write_file", {"path": "b.txt", "content": "y"})
    assert ledger.decide(scope, "c2", Status.REJECTED, "ann", None).outcome == "decided"
    assert ledger.decide(scope, "c2", Status.REJECTED, "ann", None).outcome == "existing"


@pytest.mark.parametrize(
    ("decision", "by", "reason"),
    [
        (Status.APPROVED, "bob", "looks right"),  # another person
        (Status.APPROVED, "ann", "another reason"),  # another reason
        (Status.APPROVED, "ann", None),
        (Status.REJECTED, "ann", "looks right"),  # the contrary decision
    ],
    ids=["other-person", "other-reason", "no-reason", "contrary"],
)
def test_ledger__any_other_decision_on_a_decided_call_is_refused(
    ledger: Ledger, scope: str, decision: Status, by: str, reason: str | None
) -> None:
    ledger.submit(scope, "c1", "write_file", ARGS, approved_by="ann", reason="looks right")
    before = history(ledger, scope)
    with pytest.raises(InvalidTransition):
        ledger.decide(scope, "c1", decision, by, reason)
    assert history(ledger, scope) == before


def test_ledger__approve_of_a_call_rejected_by_the_same_person_is_refused(
    ledger: Ledger, scope: str
) -> None:
    ledger.submit(scope, "c1", "write_file", ARGS)
    ledger.reject(scope, "c1", by="ann")
    with pytest.raises(InvalidTransition):
        ledger.approve(scope, "c1", by="ann")
    assert ledger.get(scope, "c1").operation.status is Status.REJECTED


def test_submitter__a_replayed_approval_publishes_only_a_call_whose_publish_was_lost(
    fresh_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    published: list[tuple[str, str, int]] = []

    def enqueue(_self: Any, scope: str, key: str, attempt: int, **_kw: Any) -> dict[str, Any]:
        published.append((scope, key, attempt))
        return {"enqueued": True}

    monkeypatch.setattr(Submitter, "enqueue", enqueue)
    sub = Submitter(settings_of(fresh_db_url, tmp_path))
    try:
        sub.ledger.submit("s", "c1", "write_file", ARGS)
        out = sub.decide("s", "c1", "ann", None, approve=True)
        assert out["outcome"] == "decided" and published == [("s", "write_file:c1", 1)]
        monkeypatch.setattr(submitting, "REPUBLISH_AFTER", 3600.0)
        out = sub.decide("s", "c1", "ann", None, approve=True)  # its publish may be in flight
        assert out["outcome"] == "existing" and out["status"] == "approved"
        assert len(published) == 1
        monkeypatch.setattr(submitting, "REPUBLISH_AFTER", 0.0)
        out = sub.decide("s", "c1", "ann", None, approve=True)  # stamped long ago, unclaimed
        assert out["outcome"] == "existing" and len(published) == 2
        assert sub.ledger.claim("s", "write_file:c1", 1, worker_id="w") is not None
        sub.decide("s", "c1", "ann", None, approve=True)  # claimed: never published again
        assert len(published) == 2
        sub.ledger.submit("s", "c2", "write_file", {"path": "b.txt", "content": "y"})
        sub.decide("s", "c2", "ann", None, approve=False)
        assert sub.decide("s", "c2", "ann", None, approve=False)["outcome"] == "existing"
        assert len(published) == 2  # a rejection publishes nothing
    finally:
        sub.close()


def test_cli__approve_given_again_exits_0_another_persons_exits_5(
    db_url: str, capsys: pytest.CaptureFixture[str], ledger: Ledger, scope: str
) -> None:
    ledger.submit(scope, "c1", "write_file", ARGS)
    call = ("--scope", scope, "--tool-call-id", "c1")
    # no broker reachable here: the approval's publish is reported, never the decision's end
    broker = ("--broker", "redis://127.0.0.1:1/0")
    code, out, err = run_cli(
        capsys, "--db", db_url, *broker, "approve", *call, "--by", "ann", "--json"
    )
    assert code == 0 and json.loads(out)["outcome"] == "decided", err
    before = history(ledger, scope)
    code, out, err = run_cli(
        capsys, "--db", db_url, *broker, "approve", *call, "--by", "ann", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["outcome"] == "existing" and json.loads(out)["status"] == "approved"
    code, out, err = run_cli(capsys, "--db", db_url, *broker, "approve", *call, "--by", "ann")
    assert code == 0 and out.startswith("existing: "), (out, err)
    code, _, err = run_cli(capsys, "--db", db_url, *broker, "approve", *call, "--by", "bob")
    assert code == 5 and "approved to approved" in err
    code, _, err = run_cli(capsys, "--db", db_url, "reject", *call, "--by", "ann")
    assert code == 5
    assert history(ledger, scope) == before


def test_api__a_decision_posted_twice_is_200_existing_and_one_event(
    fresh_db_url: str, tmp_path: Path, scope: str
) -> None:
    for client, ledger in serving(fresh_db_url, tmp_path):
        pending(ledger, scope, "a")
        url = f"/api/calls/{scope}/a/approve"
        r = client.post(url, json={"reason": "fine"}, headers=bearer("ann"))
        assert r.status_code == 200 and r.json()["outcome"] == "decided"
        r = client.post(url, json={"reason": "fine"}, headers=bearer("ann"))
        assert r.status_code == 200, r.text
        assert r.json()["outcome"] == "existing" and r.json()["status"] == "approved"
        r = client.post(url, json={"reason": "fine"}, headers=bearer("otto"))
        assert r.status_code == 409 and r.json()["kind"] == "state"
        assert history(ledger, scope, "a").count("approved") == 1


# ---------------------------------------------------------------------------- retry


def unknown_notify(ledger: Ledger, scope: str) -> None:
    """Attempt 1 of a call of a tool that is not idempotent, claimed, then declared unknown."""
    ledger.submit(scope, "c1", "notify", {"to": "ops"}, approved_by="al")
    claim = ledger.claim(scope, "notify:c1", 1, worker_id="w")
    assert claim is not None
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")


@pytest.fixture
def retry_cli(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("TOOLLEDGER_BROKER", "redis://127.0.0.1:1/0")  # enqueue fails visibly
    monkeypatch.setenv("TOOLLEDGER_SANDBOX", str(tmp_path / "sandbox"))
    monkeypatch.setenv("TOOLLEDGER_TOOLS", "tests.external_tools")
    return lambda *argv: run_cli(capsys, "--db", db_url, *argv)


def test_cli__a_retry_given_again_by_its_person_is_its_attempt_as_it_stands(
    retry_cli: Any, ledger: Ledger, scope: str
) -> None:
    """A script's retry whose answer was lost, sent again: it was refused, exit 5, "it is
    attempt 2 (approved) now; look again", as anyone else's retry."""
    unknown_notify(ledger, scope)
    argv = ["retry", "--scope", scope, "--tool-call-id", "c1", "--accept-duplicate", "--json"]
    code, out, err = retry_cli(*argv, "--by", "carol", "--attempt", "1", "--reason", "r")
    assert code == 0 and json.loads(out)["attempt"] == 2, err
    assert json.loads(out)["outcome"] == "decided"
    before = history(ledger, scope)
    code, out, err = retry_cli(*argv, "--by", "carol", "--attempt", "1", "--reason", "r")
    assert code == 0, err
    again = json.loads(out)
    assert (again["outcome"], again["attempt"], again["status"]) == ("existing", 2, "approved")
    assert again["authorized_by"] == "carol" and again["duplicate_effect_accepted"] is True
    code, out, err = retry_cli(*argv, "--by", "carol", "--reason", "r")  # no --attempt: the same
    assert code == 0 and json.loads(out)["outcome"] == "existing", err
    # anything else is refused as ever: another person, reason, acceptance, or attempt seen
    for other in (
        ["--by", "dan", "--attempt", "1", "--reason", "r"],
        ["--by", "carol", "--attempt", "1", "--reason", "other"],
        ["--by", "carol", "--attempt", "1"],
        ["--by", "carol", "--attempt", "2", "--reason", "r"],
    ):
        code, _, err = retry_cli(*argv, *other)
        assert code == 5, (other, err)
    code, _, err = retry_cli(
        "retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol", "--attempt", "1",
        "--reason", "r",
    )  # fmt: skip
    assert code == 5, err  # it accepted a duplicate; this one does not
    assert history(ledger, scope) == before
    # attempt 2 ran and ended unknown meanwhile: the retry decided on attempt 1 still stands
    claim = ledger.claim(scope, "notify:c1", 2, worker_id="w")
    assert claim is not None
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    code, out, err = retry_cli(*argv, "--by", "carol", "--attempt", "1", "--reason", "r")
    assert code == 0 and json.loads(out)["outcome"] == "existing", err
    assert json.loads(out)["status"] == "unknown"
    assert ledger.get(scope, "c1").operation.authorized_attempts == 2


def test_retry__given_again_publishes_only_an_attempt_never_stamped(
    ledger: Ledger, scope: str
) -> None:
    from toolledger.recovery import humans
    from toolledger.registry import load_registry

    registry = load_registry("tests.external_tools")
    published: list[int] = []

    def enqueue(scope_: str, key: str, attempt: int) -> dict[str, Any]:
        published.append(attempt)
        return {"enqueued": True}

    unknown_notify(ledger, scope)
    kw: dict[str, Any] = {"by": "carol", "accept_duplicate": True, "attempt": 1}
    humans.retry(ledger, registry, enqueue, scope, "c1", **kw)
    assert published == [2]
    # the process that retried was killed before its publish stamped the call: published
    out = humans.retry(ledger, registry, enqueue, scope, "c1", **kw)
    assert out["outcome"] == "existing" and published == [2, 2]
    ledger.mark_enqueued(scope, "notify:c1", 2)  # published and stamped: the sweep's, now
    humans.retry(ledger, registry, enqueue, scope, "c1", **kw)
    assert published == [2, 2]
