"""Chaos: real workers killed, frozen, partitioned and their database crashed mid-task; the
ledger, the sandbox and the downstream service checked afterwards (the checker's own tests,
one per invariant on facts made to break it: tests/unit/test_chaos_checker.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from toolledger.failpoints import POINTS
from toolledger.harness.chaos import EXTERNAL, ChaosConfig, run_chaos
from toolledger.harness.chaos.faults import KINDS

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

KEYS = ("faults", "duplicates", "effects_after_revocation", "shared_path_mismatches",
        "hidden_effects", "absent_effects", "foreign_effects", "lost", "stuck", "inbox", "unknown", "operator", "auto_retries", "fenced", "stopped_and_woken",
        "statuses", "recovered_s", "duration_s", "faults_met_work",
        "faults_not_injected")  # fmt: skip


def assert_clean(report: dict, *, prefork: bool = True) -> None:
    broken = [i for i in report["invariants"] if not i["ok"]]
    assert not broken, json.dumps(broken, indent=2)
    assert report["duplicates"] == report["effects_after_revocation"] == 0
    assert report["shared_path_mismatches"] == report["hidden_effects"] == 0
    assert report["absent_effects"] == report["foreign_effects"] == 0
    assert (report["lost"], report["stuck"]) == (0, 0)
    assert report["verify_ok"] and report["ok"]
    # ... and it measured something: revoked executions went on (failpoints stopped them
    # until the sweep revoked them) and met the fence, before their tool and at their commit
    # with staged bytes (every "0 landed" above was 0 of 0 before: a cold review)
    fenced = report["fenced"]
    # On threads it is reported, not required: CI's run of 12-06 06:16 met it 0, 0 (0) with
    # two processes stopped and woken — the woken process lost its leases (the keeper's own
    # stop: "claim treated as lost", its writes refused) and another thread's stop, then a
    # restart, ended it before any thread put its fence on record. The ledger's fence is
    # proved every run by tests/acceptance/test_fencing.py, on both pools' paths.
    assert fenced["not_started"] + fenced["refused_at_commit"] >= 1 or not prefork, fenced
    # each kind on prefork. A threads pool's process is stopped, woken and killed whole, so
    # another thread's failpoint may end it before the thread a figure waits for records
    # (CI, 12-05: 1, 1 (0); then 0, 11 (2)). Staged bytes refused at the commit are reported,
    # not required: 8 prefork runs of 9 had them, CI's ninth (12-06) 1, 2 (0) — the child
    # stopped after staging ended another way; tests/acceptance/test_fencing.py refuses
    # staged bytes at a revoked commit every run (a partition after_stage)
    each = fenced["not_started"] >= 1 and fenced["refused_at_commit"] >= 1
    assert each or not prefork, fenced
    # (a threads pool's process stops once for two threads that stop it together)
    assert report["stopped_and_woken"] >= 1, report["stopped_and_woken"]


def assert_faults_met_work(report: dict) -> None:
    """Each kind the run injected that can cut an execution off (a kill, a freeze, a cut, a
    database fault) struck one in flight at least once: a kill that met no work tested
    nothing, and CI's kills, terminates and crashes met none in 3 of 3 each (a cold review).
    The broker's kinds (a flush, a duplicate publication) are not measured."""
    crash = [
        k for k in EXTERNAL
        if k not in report["fault_kinds_skipped"] and (KINDS[k].blames or KINDS[k].database)
    ]  # fmt: skip
    met = report["faults_met_work"]
    missed = {k: met.get(k) for k in crash if not met.get(k)}
    assert not missed, (missed, met, report["faults"], report["faults_not_injected"])


def test_chaos__small_run_every_fault_kind_every_invariant(
    pg_server, redis_server, tmp_path, record_property
):
    cfg = ChaosConfig(
        out=tmp_path / "chaos",
        db=pg_server,
        broker=redis_server,
        # three: the first worker's failpoints stop it (the fence's measure) most of the first
        # 40 s, and a fault that takes a worker out never takes the last one up
        workers=3,
        concurrency=2,
        jobs=300,
        duration=45,
        seed=7,
        progress=print,
    )
    report = run_chaos(cfg)
    print(json.dumps({k: report[k] for k in KEYS}, indent=1))
    assert_clean(report)
    assert_faults_met_work(report)
    faults = report["faults"]
    assert not report["fault_kinds_skipped"], report["fault_kinds_skipped"]
    for kind in (*EXTERNAL, *(f"failpoint:{p}" for p in POINTS)):
        assert faults.get(kind, 0) >= 1, (kind, faults)
    assert set(report["mix"]) == {"write", "shared", "append", "charge"}
    assert report["inbox"]["share"] <= 0.01, report["inbox"]
    assert (tmp_path / "chaos" / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "chaos" / "report.md").read_text().startswith("# Chaos run")
    # the sandbox is at format 2: its sweeps removed path lock files while the landings ran
    assert lock_files_removed(tmp_path / "chaos" / "logs") > 0
    record_property("faults", json.dumps(faults))


def lock_files_removed(logs: Path) -> int:
    """What the run's sweeps say they removed (``recovery.sweep``'s log line)."""
    said = re.compile(r"removed (\d+) path lock files")
    return sum(
        int(n) for log in logs.glob("*.log") for n in said.findall(log.read_text(errors="replace"))
    )


def test_chaos__threads_pool_every_fault_kind_every_invariant(
    pg_server, redis_server, tmp_path, record_property
):
    """The threads pool (issue 18: I/O-bound tools, one process per worker) under the same
    faults: failpoints and kills take the whole worker, frozen ones are fenced as before."""
    cfg = ChaosConfig(
        out=tmp_path / "chaos",
        db=pg_server,
        broker=redis_server,
        workers=3,  # as above: one is the failpoints' to stop, one may be taken out
        concurrency=4,
        pool="threads",
        jobs=240,
        duration=36,
        seed=11,
        # a firing ends the whole worker (every thread's execution) and a restart takes
        # seconds: 0.3 % each, first+ still fires every point once (at 1 % the workers were
        # restarting most of the window, and the faults found none up holding work)
        failpoint_percent=0.3,
        progress=print,
    )
    report = run_chaos(cfg)
    print(json.dumps({k: report[k] for k in KEYS}, indent=1))
    assert_clean(report, prefork=False)
    assert_faults_met_work(report)
    assert report["pool"] == "threads"
    assert report["fault_kinds_skipped"] == ["kill_child"]  # no pool child to kill
    faults = report["faults"]
    for kind in (*(k for k in EXTERNAL if k != "kill_child"), *(f"failpoint:{p}" for p in POINTS)):
        assert faults.get(kind, 0) >= 1, (kind, faults)
    record_property("faults", json.dumps(faults))


@pytest.mark.large
def test_chaos__large_run_with_baseline(pg_server, redis_server, tmp_path):
    cfg = ChaosConfig(
        out=tmp_path / "chaos",
        db=pg_server,
        broker=redis_server,
        jobs=10_000,
        duration=1800,
        faults=800,
        progress=print,
    )
    report = run_chaos(cfg, baseline=True)
    assert_clean(report)
    assert report["inbox"]["share"] <= 0.01
    print(json.dumps(report, indent=1, default=str))
