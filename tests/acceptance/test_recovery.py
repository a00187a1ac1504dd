"""Recovery with real workers: crashes, zombies, lost messages, the beat."""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest
import redis

from tests.acceptance.conftest import landed, toolledger, wait_until
from toolledger.harness.processes import beat_process, process_state
from toolledger.ledger.transitions import Status

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

# Short leases so tests wait seconds, with the limits DESIGN §7 asks for: soft < hard < lease.
# Not shorter: an fsync can stall for seconds on a shared disk, and a tool past its hard
# limit is killed and its message acked, not redelivered (seen with a 4 s lease).
FAST = {"lease_seconds": "8"}


def args(i):
    return {"path": f"out/{i}.txt", "content": f"report {i}"}


def crash_before_commit(stack, scope, **env):
    """c1 submitted to a worker whose child dies after staging, before the commit; that
    worker then stopped and a healthy one started."""
    w1 = stack.worker("w1", failpoints="after_effect=exit(23)", **env)
    sub = stack.submitter()
    sub.submit(sub.prepare(scope, "c1", "probe_write", args(1)), approved_by="alice")
    wait_until(lambda: "not claimed" in w1.log_text(), 60, "the redelivery")
    w1.stop()
    stack.worker("w2", **env)
    return sub


def assert_retried_once(stack, scope):
    """Attempt 1 failed "not applied", attempt 2 landed: one effect, the events say why."""
    ledger = stack.ledger()
    view = ledger.get(scope, "c1")
    first, second = view.executions
    assert (first.status, first.reconciled, first.result["error"]) == (
        Status.FAILED,
        True,
        "not_applied",
    )
    assert (second.attempt, second.status, second.reconciled) == (2, Status.SUCCEEDED, False)
    assert ledger.receipt(scope, "c1").content == second.result
    assert landed(stack.sandbox / scope / "out/1.txt") == "report 1"
    (effect,) = stack.effects()
    assert effect["execution_id"] == second.execution_id and effect["attempt"] == 2
    assert [e.kind for e in ledger.events(scope, "c1")] == [
        "submitted",
        "approved",
        "running",
        "unknown",
        "failed",
        "approved",
        "running",
        "succeeded",
    ]
    retry = [e for e in ledger.events(scope, "c1") if e.kind == "approved"][-1]
    assert retry.detail["automatic"] and retry.detail["evidence"]["kind"] == "fence"
    assert ledger.verify().ok


def test_recovery__crash_before_commit_sweep_retries_provably_unapplied_write_once(stack, scope):
    crash_before_commit(stack, scope, **FAST)
    ledger = stack.ledger()

    def swept() -> bool:
        code, _out, err = toolledger(stack, "sweep", "--grace", "0", "--json", **FAST)
        assert code == 0, err
        return ledger.get(scope, "c1").operation.status is Status.SUCCEEDED

    wait_until(swept, 60, "the sweep to retry and the retry to succeed")
    assert_retried_once(stack, scope)


def test_recovery__zombie_append_lands_nothing_human_retry_lands_exactly_one_line(stack, scope):
    # Given append_file whose executor froze before its effect (the whole worker, as a VM)
    w = stack.worker("w1", failpoints="before_effect=stop", **FAST)
    sub = stack.submitter()
    line = {"path": "ledger.txt", "content": "charge $10\n"}
    sub.submit(sub.prepare(scope, "c1", "append_file", line), approved_by="alice")
    ledger = stack.ledger()
    (ex,) = wait_until(lambda: ledger.get(scope, "c1").executions, 30, "the claim")
    child = int(ex.worker_id.rsplit(":", 1)[1])
    wait_until(lambda: process_state(child) == psutil.STATUS_STOPPED, 30, "the stopped child")
    os.kill(w.pid, signal.SIGSTOP)
    try:
        # When the sweep revokes it and a human retries (accepting a duplicate, as the old
        # rules asked), and a healthy worker runs attempt 2
        wait_until(lambda: ledger.mark_expired(grace_seconds=0), 30, "lease expiry")
        code, _, err = toolledger(
            stack, "retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol",
            "--accept-duplicate",
        )  # fmt: skip
        assert code == 0, err
        stack.worker("w2", **FAST)
        wait_until(lambda: ledger.get(scope, "c1").operation.status is Status.SUCCEEDED, 60)
        # and then the zombie wakes and appends
        os.kill(child, signal.SIGCONT)
        wait_until(lambda: ledger.events(scope, "c1")[-1].kind == "evidence", 30, "evidence")
    finally:
        os.kill(w.pid, signal.SIGCONT)
    code, _out, err = toolledger(stack, "sweep", "--grace", "0", "--json")
    assert code == 0, err
    # Then exactly one line: the zombie's append was refused, never landed
    assert landed(stack.sandbox / scope / "ledger.txt") == "charge $10\n"
    first, second = ledger.get(scope, "c1").executions
    assert (first.status, first.result["error"]) == (Status.FAILED, "not_applied")
    assert second.status is Status.SUCCEEDED
    assert [e["execution_id"] for e in stack.effects()] == [second.execution_id]
    assert ledger.get(scope, "c1").operation.review is None


def test_recovery__lost_broker_messages_are_requeued_and_run_once(stack, scope):
    # Given approved calls whose messages Redis lost (queue deleted, e.g. a restart)
    sub = stack.submitter()
    for i in range(20):
        sub.submit(sub.prepare(scope, f"c{i}", "probe_write", args(i)), approved_by="alice")
    client = redis.Redis.from_url(stack.broker)
    queue_keys = [k for k in client.scan_iter(match=f"{stack.prefix}*") if b"toolledger" in k]
    assert queue_keys and client.delete(*queue_keys)
    stack.worker("w1")
    ledger = stack.ledger()
    assert all(c.status is Status.APPROVED for c in ledger.list_calls(scope=scope))
    # When the sweep re-enqueues what was approved but never claimed
    code, out, err = toolledger(stack, "sweep", "--requeue-after", "0", "--json")
    assert code == 0, err
    assert json.loads(out)["requeued"] == 20
    # Then each call completes, once
    wait_until(
        lambda: all(c.status is Status.SUCCEEDED for c in ledger.list_calls(scope=scope)),
        60,
        "all succeeded",
    )
    effects = [e for e in stack.effects() if e["scope"] == scope]
    assert sorted(e["key"] for e in effects) == sorted(f"probe_write:c{i}" for i in range(20))


def test_recovery__beat_schedules_sweeps_that_recover_a_crash(stack, scope):
    env = {"sweep_interval": "1", "sweep_grace": "0", **FAST}
    beat = beat_process(
        "beat", stack.env(home=str(stack.root / "beat"), **env), stack.root / "logs"
    ).start()
    stack.workers.append(beat)
    beat.wait_ready()
    crash_before_commit(stack, scope, **env)
    ledger = stack.ledger()
    wait_until(
        lambda: ledger.get(scope, "c1").operation.status is Status.SUCCEEDED,
        60,
        "the beat's sweep to retry it",
    )
    assert "Sending due task toolledger-sweep" in beat.log_text()
    assert_retried_once(stack, scope)


def test_recovery__slow_reconcilers_never_starve_the_beats_requeue_of_lost_work(
    stack, scope, monkeypatch
):
    """Unknown calls whose reconciler waits 2 s on a service that is down, three of them:
    every beat pass overran its hard time limit (5 s under a 6 s lease) asking them, was
    killed there, and never reached the re-publishing of lost work that came after, so an
    approved call whose message the broker lost stayed approved for good, nothing flagged (a
    cold review, 12-05: 75 s and counting). Now the pass re-publishes first and reconciles
    within half its soft limit, going on where the last pass stopped."""
    env = {
        "lease_seconds": "6",
        "sweep_interval": "1",
        "sweep_grace": "0",
        "requeue_after": "1",
        "tools": "toolledger.harness.probe,tests.payment_tools",
    }
    ledger = stack.ledger()
    for i in range(3):  # crashed after their claims: unknown once the sweep sees them
        ledger.submit(scope, f"pay{i}", "charge", {"amount": i}, approved_by="alice")
        assert ledger.claim(scope, f"charge:pay{i}", 1, worker_id="dead", lease_seconds=0.05)
    ledger.submit(scope, "lost", "probe_write", args(1), approved_by="alice")  # never published
    monkeypatch.setenv("TEST_RECONCILE_SECONDS", "2")  # the workers' environment, unprefixed
    worker = stack.worker("w1", concurrency=1, **env)
    beat = beat_process(
        "beat", stack.env(home=str(stack.root / "beat"), **env), stack.root / "logs"
    ).start()
    stack.workers.append(beat)
    beat.wait_ready()
    wait_until(
        lambda: ledger.get(scope, "lost").operation.status is Status.SUCCEEDED,
        60,
        "the beat's sweep to re-publish the lost call",
    )
    wait_until(
        lambda: all(
            ledger.get(scope, f"pay{i}").operation.status is Status.UNKNOWN for i in range(3)
        ),
        30,
        "the crashed charges to be marked unknown, for a human",
    )
    assert "Hard time limit" not in worker.log_text()
    assert ledger.verify().ok
