"""A replayed submit of a call approved, stamped as published and never claimed publishes it
again: its first publish may have died with the process that stamped it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from toolledger.config import Settings
from toolledger.ledger.transitions import Status
from toolledger.worker import submit as submitting
from toolledger.worker.submit import Submitter

ARGS = {"path": "a.txt", "content": "x"}


def settings_of(db: str, tmp_path: Path, **more: str) -> Settings:
    """A Submitter's settings whose broker is never reached: its enqueue is counted."""
    return Settings.from_env(
        {
            "TOOLLEDGER_DB": db,
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
            "TOOLLEDGER_HOME": str(tmp_path / "home"),
            **more,
        }
    )


def test_replay__an_approved_call_stamped_long_ago_and_unclaimed_is_published_again(
    fresh_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent killed between the submit's commit (approved, stamped) and its publish, then
    run again: the replay published nothing, and the call waited for the sweep's re-publish
    (120 s) past run_turn's timeout (a cold review)."""
    settings = settings_of(fresh_db_url, tmp_path)
    published: list[tuple[str, str, int]] = []

    def enqueue(_self: Any, scope: str, key: str, attempt: int, **_kw: Any) -> dict[str, Any]:
        published.append((scope, key, attempt))
        return {"enqueued": True}

    monkeypatch.setattr(Submitter, "enqueue", enqueue)
    sub = Submitter(settings)
    try:
        call = sub.prepare("s", "c1", "write_file", ARGS)
        # the commit that approved and stamped it; the process died before its publish
        sub.ledger.submit("s", "c1", "write_file", ARGS, approved_by="ann", stamp_enqueued=True)
        monkeypatch.setattr(submitting, "REPUBLISH_AFTER", 3600.0)
        sub.submit(call, approved_by="ann")  # a replay at once: its publish may be in flight
        assert published == []
        monkeypatch.setattr(submitting, "REPUBLISH_AFTER", 0.0)
        out = sub.submit(call, approved_by="ann")  # stamped long ago, still unclaimed
        assert published == [("s", "write_file:c1", 1)] and out["enqueued"] is True
        assert sub.ledger.claim("s", "write_file:c1", 1, worker_id="w") is not None
        sub.submit(call, approved_by="ann")  # claimed: never published again
        assert published == [("s", "write_file:c1", 1)]
    finally:
        sub.close()


def test_replay__an_upstream_call_the_proxy_recorded_is_never_published_for_a_worker(
    fresh_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call the MCP proxy recorded (approved, never stamped: the proxy sends it itself),
    replayed through a Submitter, was published: a worker handed it ended it failed, the
    upstream never asked (a cold review)."""
    settings = settings_of(fresh_db_url, tmp_path)
    published: list[str] = []
    monkeypatch.setattr(
        Submitter, "enqueue", lambda _s, _scope, key, *_a, **_k: published.append(key) or {}
    )
    monkeypatch.setattr(submitting, "REPUBLISH_AFTER", 0.0)
    sub = Submitter(settings)
    try:
        args = {"to": "ann"}
        sub.ledger.submit("s", "p1", "mcp.send_email", args, approved_by="mcp")  # the proxy's
        out = sub.submit(sub.prepare("s", "p1", "mcp.send_email", args), approved_by="mcp")
        assert out["outcome"] == "existing" and published == []
    finally:
        sub.close()


def test_replay__a_call_flagged_for_review_is_not_published(
    fresh_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call whose retry waits behind a flag (a late result contradicted a person's decision)
    cannot be claimed until a person has reviewed it: a replay published it anyway, a message
    every claim refuses (a cold review), as the sweep's re-publish never does."""

    settings = settings_of(fresh_db_url, tmp_path, TOOLLEDGER_TOOLS="tests.external_tools")
    published: list[str] = []
    monkeypatch.setattr(
        Submitter, "enqueue", lambda _s, _scope, key, *_a, **_k: published.append(key) or {}
    )
    monkeypatch.setattr(submitting, "REPUBLISH_AFTER", 0.0)
    sub = Submitter(settings)
    ledger = sub.ledger
    try:
        args = {"to": "ann"}
        ledger.submit("s", "f1", "notify", args, approved_by="al", stamp_enqueued=True)
        claim = ledger.claim("s", "notify:f1", 1, worker_id="zombie")
        assert claim is not None
        ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
        ledger.resolve(claim.execution_id, Status.FAILED, by="bob", evidence="nothing sent")
        ledger.authorize_retry("s", "f1", by="carol", accept_duplicate=True)
        late = {"late_result": {"sent": 1}}  # the zombie wakes: it did send
        ledger.record_late_result(
            claim.execution_id, late, actor="zombie", outcome=Status.SUCCEEDED
        )
        op = ledger.get("s", "f1").operation
        assert op.status is Status.APPROVED and op.review is not None  # flagged, its retry waits
        out = sub.submit(sub.prepare("s", "f1", "notify", args), approved_by="al")
        assert out["outcome"] == "existing" and published == []
    finally:
        sub.close()
