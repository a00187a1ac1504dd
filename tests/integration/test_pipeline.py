"""The execute pipeline in-process, on both backends, with tools written for each case."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from ledger.ledger import Ledger
from ledger.transitions import Status
from worker import failpoints
from worker.pipeline import Executor
from worker.sandbox import Sandbox
from worker.tools import OutcomeUnknown, Registry, ToolContext, ToolError, make_tool


class NoArgs(BaseModel):
    pass


class Sleep(BaseModel):
    seconds: float


def ok(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    return {"ok": True, "execution_id": ctx.execution_id}


def reports_failure(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise ToolError("the printer is on fire", code=451)


def crashes(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise ZeroDivisionError("boom")


def cannot_tell(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise OutcomeUnknown("the payment API timed out")


def sleeps(args: Sleep, ctx: ToolContext) -> dict[str, Any]:
    time.sleep(args.seconds)
    return {"slept": args.seconds}


def waits_for_lease_loss(args: Sleep, ctx: ToolContext) -> dict[str, Any]:
    lost = ctx.lease_lost.wait(args.seconds)
    return {"noticed_lease_loss": lost}


REGISTRY = Registry(
    [
        make_tool(f)
        for f in (ok, reports_failure, crashes, cannot_tell, sleeps, waits_for_lease_loss)
    ]
)


@pytest.fixture
def run(ledger, scope, tmp_path):
    def _run(
        tool: str,
        args: dict[str, Any] | None = None,
        lease: float = 30.0,
        executor_ledger: Ledger | None = None,
    ) -> tuple[Any, Any]:
        cid = f"c{time.monotonic_ns()}"
        ledger.submit(scope, cid, tool, args or {}, approved_by="al")
        executor = Executor(
            executor_ledger or ledger,
            REGISTRY,
            Sandbox(tmp_path),
            worker_id="w",
            lease_seconds=lease,
        )
        outcome = executor.execute(scope, f"{tool}:{cid}", 1)
        return outcome, ledger.get(scope, cid)

    return _run


def test_pipeline__success_records_result_and_receipt(run, ledger):
    outcome, view = run("ok")
    assert outcome.state == "finished" and view.operation.status is Status.SUCCEEDED
    assert view.current.result == {"ok": True, "execution_id": view.current.execution_id}
    assert ledger.receipt(view.scope, view.tool_call_id).content == view.current.result


def test_pipeline__tool_error_is_failed_with_its_detail(run):
    _, view = run("reports_failure")
    assert view.operation.status is Status.FAILED
    assert view.current.result == {
        "error": "tool_error",
        "message": "the printer is on fire",
        "code": 451,
    }
    assert view.current.error == "the printer is on fire"


def test_pipeline__unexpected_exception_is_failed(run):
    _, view = run("crashes")
    assert view.current.status is Status.FAILED
    assert view.current.result == {"error": "ZeroDivisionError", "message": "boom"}


def test_pipeline__outcome_unknown_is_declared_unknown_by_the_executor(run, ledger):
    outcome, view = run("cannot_tell")
    assert outcome.state == "unknown" and view.operation.status is Status.UNKNOWN
    assert view.current.result is None
    last = ledger.events(view.scope, view.tool_call_id)[-1]
    assert last.kind == "unknown" and "timed out" in last.detail["reason"]


def test_pipeline__arguments_invalid_at_execution_fail_refused(run):
    _, view = run("sleeps", {"seconds": "not a number"})
    assert view.current.status is Status.FAILED
    assert view.current.result["error"] == "refused"


def test_pipeline__unknown_tool_at_execution_fails_refused(ledger, scope, tmp_path):
    ledger.submit(scope, "c1", "vanished_tool", {}, approved_by="al")
    outcome = Executor(
        ledger, REGISTRY, Sandbox(tmp_path), worker_id="w", lease_seconds=30
    ).execute(scope, "vanished_tool:c1", 1)
    assert outcome.status is Status.FAILED and "unknown tool" in outcome.result["message"]


def test_pipeline__heartbeat_keeps_a_long_tool_alive(run, ledger):
    # lease 1.2 s, tool 2.5 s: without renewals the lease would expire mid-run.
    marked: list[Any] = []
    stop = threading.Event()

    def sweeper() -> None:
        while not stop.wait(0.2):
            marked.extend(ledger.mark_expired(grace_seconds=0))

    t = threading.Thread(target=sweeper)
    t.start()
    try:
        outcome, view = run("sleeps", {"seconds": 2.5}, lease=1.2)
    finally:
        stop.set()
        t.join()
    assert outcome.state == "finished" and view.operation.status is Status.SUCCEEDED
    assert view.current.execution_id not in {m.execution_id for m in marked}
    assert view.current.heartbeat_at > view.current.started_at


def test_pipeline__lease_lost_is_noticed_and_late_result_becomes_evidence(run, ledger, scope):
    def mark_when_running() -> None:
        for _ in range(100):
            rows = [c for c in ledger.list_calls(scope=scope, status=Status.RUNNING)]
            if rows:
                ledger.mark_unknown(rows[0].execution_id, reason="test", actor="t")
                return
            time.sleep(0.05)

    t = threading.Thread(target=mark_when_running)
    t.start()
    outcome, view = run("waits_for_lease_loss", {"seconds": 10}, lease=0.6)
    t.join()
    assert outcome.state == "stale"
    assert outcome.result == {"noticed_lease_loss": True}
    assert view.current.status is Status.UNKNOWN and view.current.result is None
    evidence = ledger.events(scope, view.tool_call_id)[-1]
    assert evidence.kind == "evidence"
    assert evidence.detail["late_result"] == {"noticed_lease_loss": True}


class CommitThenFail(Ledger):
    """The COMMIT succeeds on the server, the client sees an error (celery#10271)."""

    def finish(self, *args: Any, **kwargs: Any) -> Any:
        super().finish(*args, **kwargs)
        raise sa.exc.OperationalError("COMMIT", {}, Exception("connection reset after commit"))


def test_pipeline__ambiguous_commit_is_resolved_by_rereading(run, ledger, db_url):
    flaky = CommitThenFail(db_url)
    outcome, view = run("ok", executor_ledger=flaky)
    assert outcome.state == "finished"
    assert view.current.status is Status.SUCCEEDED
    kinds = [e.kind for e in ledger.events(view.scope, view.tool_call_id)]
    assert kinds.count("succeeded") == 1 and "evidence" not in kinds
    flaky.close()


class AlwaysFails(Ledger):
    def finish(self, *args: Any, **kwargs: Any) -> Any:
        raise sa.exc.OperationalError("UPDATE", {}, Exception("database is gone"))


def test_pipeline__terminal_write_impossible_leaves_running(run, db_url, monkeypatch):
    monkeypatch.setattr("worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.01)
    broken = AlwaysFails(db_url)
    outcome, view = run("ok", executor_ledger=broken)
    assert outcome.state == "unrecorded"
    assert view.current.status is Status.RUNNING  # for the sweep: unknown, then reconcile
    broken.close()


def test_pipeline__failpoint_after_claim_raise_leaves_running(run, monkeypatch):
    failpoints.configure("after_claim=1*raise")
    try:
        with pytest.raises(failpoints.FailpointError):
            run("ok")
    finally:
        failpoints.configure(None)


def test_pipeline__lost_claim_runs_nothing(ledger, scope, tmp_path):
    ledger.submit(scope, "c1", "ok", {}, approved_by="al")
    ex = Executor(ledger, REGISTRY, Sandbox(tmp_path), worker_id="w", lease_seconds=30)
    assert ex.execute(scope, "ok:c1", 1).state == "finished"
    assert ex.execute(scope, "ok:c1", 1).state == "lost"
    assert ex.execute(scope, "ok:c1", 2).state == "lost"  # not authorised
    assert len(ledger.get(scope, "c1").executions) == 1


class ClaimThenFail(Ledger):
    """The claim's COMMIT succeeds, the client sees the connection die."""

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        super().claim(*args, **kwargs)
        raise sa.exc.OperationalError("COMMIT", {}, Exception("terminating connection"))


def test_pipeline__ambiguous_claim_commit_is_recognised_as_ours(run, ledger, db_url, monkeypatch):
    monkeypatch.setattr("worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.01)
    flaky = ClaimThenFail(db_url)
    outcome, view = run("ok", executor_ledger=flaky)
    assert outcome.state == "finished"
    (ex,) = view.executions  # one claim, ours, carried through to the end
    assert ex.status is Status.SUCCEEDED
    flaky.close()
