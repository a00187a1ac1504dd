"""Recovery with real workers: crashes, zombies, lost messages, the beat."""

from __future__ import annotations

import json
import os
import signal

import pytest
import redis

from ledger.transitions import Status
from tests.acceptance.conftest import toolledger, wait_until
from worker.processes import beat_process, process_state

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

# Short leases so tests wait seconds, with the limits DESIGN §7 asks for: soft < hard < lease.
# Not shorter: an fsync can stall for seconds on a shared disk, and a tool past its hard
# limit is killed and its message acked, not redelivered (seen with a 4 s lease).
FAST = {"lease_seconds": "8"}


def args(i):
    return {"path": f"out/{i}.txt", "content": f"report {i}"}


def test_recovery__crash_after_effect_then_sweep_reconciles_same_execution(stack, scope):
    # Given a worker child that dies between the file write and the terminal record
    w = stack.worker("w1", failpoints="after_effect=exit(23)", **FAST)
    sub = stack.submitter()
    sub.submit(sub.prepare(scope, "c1", "probe_write", args(1)), approved_by="alice")
    wait_until(lambda: "not claimed" in w.log_text(), 60, "the redelivery")
    path = stack.sandbox / scope / "out/1.txt"
    before = (path.read_bytes(), path.stat().st_ino, path.stat().st_mtime_ns)
    ledger = stack.ledger()
    (running,) = ledger.get(scope, "c1").executions
    # When its lease has expired and the sweep runs (the real CLI)
    marked = reconciled = 0

    def swept() -> bool:
        nonlocal marked, reconciled
        code, out, err = toolledger(stack, "sweep", "--grace", "0", "--json", **FAST)
        assert code == 0, err
        summary = json.loads(out)
        marked += summary["marked_unknown"]
        reconciled += summary["reconciled"]
        return reconciled >= 1

    wait_until(swept, 30, "the sweep to reconcile")
    assert (marked, reconciled) == (1, 1)
    # Then the same execution is succeeded, reconciled, and the file was never touched
    view = ledger.get(scope, "c1")
    (ex,) = view.executions
    assert (ex.execution_id, ex.status, ex.reconciled) == (
        running.execution_id,
        Status.SUCCEEDED,
        True,
    )
    kinds = [e.kind for e in ledger.events(scope, "c1") if e.execution_id == ex.execution_id]
    assert kinds == ["running", "unknown", "succeeded"]
    assert (path.read_bytes(), path.stat().st_ino, path.stat().st_mtime_ns) == before
    assert len(stack.effects()) == 1


def test_recovery__zombie_resumed_late_result_resolves_unknown(stack, scope):
    w = stack.worker("w1", failpoints="after_effect=stop", **FAST)
    sub = stack.submitter()
    sub.submit(
        sub.prepare(scope, "c1", "append_file", {"path": "log.txt", "content": "x\n"}),
        approved_by="alice",
    )
    ledger = stack.ledger()
    wait_until(lambda: ledger.get(scope, "c1").executions, 30)
    child = wait_until(
        lambda: next((p for p in w.children() if process_state(p) == "T"), None),
        30,
        "the stopped child",
    )
    os.kill(w.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: ledger.mark_expired(grace_seconds=0), 30, "lease expiry")
        os.kill(child, signal.SIGCONT)
        wait_until(lambda: ledger.events(scope, "c1")[-1].kind == "evidence", 30)
    finally:
        os.kill(w.pid, signal.SIGCONT)
    # append_file has no reconciler: only the executor's late result can resolve it
    code, out, _ = toolledger(stack, "sweep", "--grace", "0", "--json")
    assert code == 0 and json.loads(out)["from_late_result"] == 1
    ex = ledger.get(scope, "c1").current
    assert (ex.status, ex.reconciled) == (Status.SUCCEEDED, True)
    assert ex.result["bytes_appended"] == 2
    assert (stack.sandbox / scope / "log.txt").read_text() == "x\n"


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
    stack.worker("w1", failpoints="after_effect=exit(23)", **env)
    beat = beat_process(
        "beat", stack.env(home=str(stack.root / "beat"), **env), stack.root / "logs"
    ).start()
    stack.workers.append(beat)
    beat.wait_ready()
    sub = stack.submitter()
    sub.submit(sub.prepare(scope, "c1", "probe_write", args(1)), approved_by="alice")
    ledger = stack.ledger()
    wait_until(
        lambda: ledger.get(scope, "c1").operation.status is Status.SUCCEEDED,
        60,
        "the beat's sweep to reconcile",
    )
    assert ledger.get(scope, "c1").current.reconciled
    assert "Sending due task toolledger-sweep" in beat.log_text()
    assert len(stack.effects()) == 1
