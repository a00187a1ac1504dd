"""Real prefork workers on real Redis and Postgres; physical effects counted by the probe."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import psutil
import pytest

from tests.acceptance.conftest import Stack, landed, toolledger, wait_until
from tests.helpers import pending_files
from toolledger.harness.processes import process_state
from toolledger.ledger.errors import ConflictError
from toolledger.ledger.transitions import Status
from toolledger.sandbox import Sandbox
from toolledger.worker.tasks import publish

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def probe_args(i: int | str) -> dict[str, str]:
    return {"path": f"out/{i}.txt", "content": f"content of {i} — é"}


def statuses(ledger, scope: str) -> Counter:
    return Counter(c.status for c in ledger.list_calls(scope=scope, limit=0))


def test_workers__500_calls_over_2_workers_each_exactly_once(stack, scope, record_property):
    # Given 2 prefork workers (concurrency 2) and 500 approved calls
    stack.worker("w1")
    stack.worker("w2")
    sub = stack.submitter()
    began = time.monotonic()
    for i in range(500):
        call = sub.prepare(scope, f"call_{i}", "probe_write", probe_args(i))
        assert sub.submit(call, approved_by="alice")["enqueued"] is True
    ledger = stack.ledger()
    # When they have all run
    wait_until(lambda: statuses(ledger, scope)[Status.SUCCEEDED] == 500, 180, "500 succeeded")
    elapsed = time.monotonic() - began
    # Then every file is exact and the effects log counts exactly 500 effects, one per key
    assert statuses(ledger, scope) == {Status.SUCCEEDED: 500}
    for i in range(500):
        assert landed(stack.sandbox / scope / f"out/{i}.txt") == probe_args(i)["content"]
    effects = [e for e in stack.effects() if e["scope"] == scope]
    assert len(effects) == 500
    assert len({(e["key"], e["attempt"]) for e in effects}) == 500
    pids = Counter(e["pid"] for e in effects)
    assert len(pids) >= 2  # both workers' children took work
    assert ledger.verify().ok
    record_property("calls_per_s", round(500 / elapsed, 1))
    print(
        f"\n500 calls over 2 workers x 2: {elapsed:.1f}s, {500 / elapsed:.0f} calls/s "
        f"submit-to-done, effects by pid {dict(pids)}"
    )
    sub.close()


def test_workers__same_message_thrice_and_same_call_thrice_one_effect(stack, scope):
    stack.worker("w1")
    sub = stack.submitter()
    # The same call submitted 3 times: recorded once, enqueued once.
    outs = [
        sub.submit(sub.prepare(scope, "c1", "probe_write", probe_args(1)), approved_by="al")
        for _ in range(3)
    ]
    assert [o["outcome"] for o in outs] == ["created", "existing", "existing"]
    # The same message published 3 more times (a duplicating broker, a retrying producer).
    for _ in range(3):
        publish(sub.app, sub.settings, scope, "probe_write:c1", 1)
    ledger = stack.ledger()
    wait_until(lambda: ledger.get(scope, "c1").operation.status is Status.SUCCEEDED, 60)
    # Let every duplicate be consumed: 4 deliveries, 3 lost claims.
    wait_until(lambda: stack.workers[0].log_text().count("not claimed") >= 3, 60, "3 lost claims")
    assert len(ledger.get(scope, "c1").executions) == 1
    assert len([e for e in stack.effects() if e["scope"] == scope]) == 1
    sub.close()


def test_workers__exit_before_commit_stays_running_nothing_lands_not_reexecuted(stack, scope):
    # Given a worker whose pool children die after the tool staged its bytes, before the commit
    w = stack.worker("w1", failpoints="after_effect=exit(23)")
    sub = stack.submitter()
    sub.submit(sub.prepare(scope, "c1", "probe_write", probe_args(1)), approved_by="alice")
    # When the child dies, reject_on_worker_lost requeues the message and it is redelivered
    wait_until(lambda: "not claimed" in w.log_text(), 60, "the redelivered message")
    # Then nothing landed: the bytes wait in the pending area, the execution stays running
    assert not (stack.sandbox / scope / "out/1.txt").exists()
    assert stack.effects() == []
    assert [f for f in pending_files(Sandbox(stack.sandbox)) if f.endswith(".write")]
    ledger = stack.ledger()
    view = ledger.get(scope, "c1")
    (ex,) = view.executions
    assert (ex.status, ex.result) == (Status.RUNNING, None)
    assert [e.kind for e in ledger.events(scope, "c1")] == ["submitted", "approved", "running"]
    assert "exited with 'exitcode 23'" in w.log_text() or "exitcode 23" in w.log_text()


def test_workers__rejected_never_runs_pending_runs_after_approval_conflict_refused(stack, scope):
    stack.worker("w1")
    sub = stack.submitter()
    ledger = stack.ledger()
    sub.submit(sub.prepare(scope, "pending", "probe_write", probe_args("p")))
    sub.submit(sub.prepare(scope, "rejected", "probe_write", probe_args("r")))
    sub.decide(scope, "rejected", "bob", "no", approve=False)
    # Even a message published by mistake for these runs nothing.
    publish(sub.app, sub.settings, scope, "probe_write:pending", 1)
    publish(sub.app, sub.settings, scope, "probe_write:rejected", 1)
    wait_until(lambda: stack.workers[0].log_text().count("not claimed") >= 2, 60)
    assert stack.effects() == []
    assert ledger.get(scope, "pending").operation.status is Status.PENDING_APPROVAL
    out = sub.decide(scope, "pending", "bob", None, approve=True)
    assert out["enqueued"] is True
    wait_until(lambda: ledger.get(scope, "pending").operation.status is Status.SUCCEEDED, 60)
    assert ledger.get(scope, "rejected").operation.status is Status.REJECTED
    assert [e["key"] for e in stack.effects()] == ["probe_write:pending"]
    with pytest.raises(ConflictError):
        sub.submit(sub.prepare(scope, "pending", "probe_write", probe_args("other")))
    sub.close()


def test_workers__zombie_past_its_lease_lands_nothing_late_result_is_evidence(stack, scope):
    # Given a worker whose child stops itself (SIGSTOP) after its tool ran, before the commit
    w = stack.worker("w1", failpoints="after_effect=stop", lease_seconds="8")
    sub = stack.submitter()
    sub.submit(sub.prepare(scope, "c1", "probe_write", probe_args(1)), approved_by="alice")
    ledger = stack.ledger()
    (ex,) = wait_until(lambda: ledger.get(scope, "c1").executions, 60, "the claim")
    child = int(ex.worker_id.rsplit(":", 1)[1])
    wait_until(lambda: process_state(child) == psutil.STATUS_STOPPED, 30, "the child to stop")
    # ... and the whole worker frozen (a VM pause): the main process too
    os.kill(w.pid, signal.SIGSTOP)
    try:
        # When its lease expires by the database clock and the ledger marks it unknown
        marked = wait_until(lambda: ledger.mark_expired(grace_seconds=0), 30, "lease expiry")
        assert [m.execution_id for m in marked] == [ex.execution_id]
        # and the zombie child wakes up and tries to commit with its old fence
        os.kill(child, signal.SIGCONT)
        wait_until(lambda: ledger.events(scope, "c1")[-1].kind == "evidence", 30, "evidence")
    finally:
        os.kill(w.pid, signal.SIGCONT)
    # Then its terminal write changed nothing, its bytes never landed, its late result is
    # evidence that says so
    row = ledger.execution(ex.execution_id)
    assert (row.status, row.result) == (Status.UNKNOWN, None)
    evidence = ledger.events(scope, "c1")[-1].detail
    assert (evidence["status"], evidence["landed"], evidence["proves"]) == (
        "succeeded",
        False,
        None,
    )
    assert evidence["staged"][0]["path"] == "out/1.txt"
    assert [e.kind for e in ledger.events(scope, "c1")] == [
        "submitted",
        "approved",
        "running",
        "unknown",
        "evidence",
    ]
    wait_until(lambda: not pending_files(Sandbox(stack.sandbox)), 30, "its stage dropped")
    assert not (stack.sandbox / scope / "out/1.txt").exists() and stack.effects() == []
    sub.close()


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_workers__warm_shutdown_mid_call_finishes_it_lands_it_and_exits_0(stack, scope, pool):
    """A deploy's SIGTERM: the call in hand finishes, commits and lands, the worker exits 0; a
    call sent during the shutdown runs once, in this worker (the threads pool runs what it
    was handed) or the next. The fixtures' teardowns SIGKILL their workers, so this is where
    a warm shutdown is held to what it promises."""
    w = stack.worker("w1", pool=pool)
    sub = stack.submitter()
    ledger = stack.ledger()
    slow = {**probe_args(1), "hold_ms": 3000}
    sub.submit(sub.prepare(scope, "c1", "probe_write", slow), approved_by="alice")
    wait_until(lambda: ledger.get(scope, "c1").executions, 60, "the claim")
    w.signal(signal.SIGTERM)
    sub.submit(sub.prepare(scope, "c2", "probe_write", probe_args(2)), approved_by="alice")
    assert w.wait(60), "the worker did not stop"
    assert w.proc is not None and w.proc.returncode == 0, w.log_text()[-3000:]
    view = ledger.get(scope, "c1")
    assert [e.status for e in view.executions] == [Status.SUCCEEDED]
    assert landed(stack.sandbox / scope / "out/1.txt") == slow["content"]
    assert ledger.get(scope, "c2").operation.status in (Status.APPROVED, Status.SUCCEEDED)
    stack.worker("w2", pool=pool)
    wait_until(lambda: ledger.get(scope, "c2").operation.status is Status.SUCCEEDED, 60, "c2")
    assert landed(stack.sandbox / scope / "out/2.txt") == probe_args(2)["content"]
    assert sorted(e["key"] for e in stack.effects()) == ["probe_write:c1", "probe_write:c2"]
    assert [len(ledger.get(scope, c).executions) for c in ("c1", "c2")] == [1, 1]
    assert ledger.verify().ok
    sub.close()


def test_workers__outbox_enqueue_failure_is_visible_and_recorded(stack, scope):
    # A broker nobody listens on: the call is recorded and approved, enqueued_at stays unset.
    sub = stack.submitter(broker="redis://127.0.0.1:1/0")
    out = sub.submit(sub.prepare(scope, "c1", "probe_write", probe_args(1)), approved_by="al")
    assert out["enqueued"] is False and "Error" in out["enqueue_error"]
    op = stack.ledger().get(scope, "c1").operation
    assert op.status is Status.APPROVED and op.enqueued_at is None
    sub.close()


def test_workers__refuses_to_start_with_inconsistent_limits(stack):
    from toolledger.harness.processes import worker_process

    proc = worker_process("bad", stack.env(lease_seconds="10", time_limit="20"), stack.root)
    proc.start()
    assert proc.wait(60)
    assert proc.proc.returncode == 2
    assert "TOOLLEDGER_TIME_LIMIT (20) < TOOLLEDGER_LEASE_SECONDS (10)" in proc.log_text()


def test_rolling_deploy__a_worker_without_the_tool_leaves_the_call_for_one_with_it(
    world: Stack,
) -> None:
    """A worker not yet restarted in a rolling deploy that added a tool is handed a call to
    it: it leaves the call approved (until 2026-12-07 it failed it, "unknown tool", its id
    spent); the sweep re-publishes it and a worker of the new release runs it, once."""
    world.workers[0].stop(warm=False)
    old = world.worker("old", tools="")  # the release before the tool's module
    sub, ledger = world.submitter(), world.ledger()
    args = {"path": "f", "content": "new tool"}
    sub.submit(sub.prepare("roll", "c1", "probe_write", args), approved_by="al")
    wait_until(lambda: "does not load tool 'probe_write'" in old.log_text(), 60, "left")
    assert ledger.get("roll", "c1").operation.status is Status.APPROVED
    assert not ledger.get("roll", "c1").executions
    # When the new release's worker is up and the sweep re-publishes the call
    world.worker("new")
    old.stop(warm=False)
    code, _, err = toolledger(world, "sweep", "--requeue-after", "0", "--json")
    assert code == 0, err
    # Then it runs, once, and its bytes land
    wait_until(lambda: ledger.get("roll", "c1").operation.status is Status.SUCCEEDED, 60, "run")
    assert len(ledger.get("roll", "c1").executions) == 1
    assert landed(world.sandbox / "roll" / "f") == "new tool"
    sub.close()
