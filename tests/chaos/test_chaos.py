"""Chaos: real workers killed, frozen and cut off mid-task; the ledger checked afterwards."""

from __future__ import annotations

import json

import pytest

from recovery.chaos import EXTERNAL, ChaosConfig, run_chaos
from worker.failpoints import POINTS

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def assert_clean(report: dict) -> None:
    broken = [i for i in report["invariants"] if not i["ok"]]
    assert not broken, json.dumps(broken, indent=2)
    assert (report["duplicates"], report["lost"], report["stuck"]) == (0, 0, 0)
    assert report["verify_ok"] and report["ok"]


def test_chaos__small_run_every_fault_kind_no_invariant_broken(
    pg_server, redis_server, tmp_path, record_property
):
    cfg = ChaosConfig(
        out=tmp_path / "chaos",
        db=pg_server,
        broker=redis_server,
        workers=2,
        concurrency=2,
        jobs=300,
        duration=45,
        seed=7,
        progress=print,
    )
    report = run_chaos(cfg)
    assert_clean(report)
    faults = report["faults"]
    for kind in (*EXTERNAL, *(f"failpoint:{p}" for p in POINTS)):
        assert faults.get(kind, 0) >= 1, (kind, faults)
    assert sum(faults.values()) >= 20
    assert report["statuses"].get("succeeded", 0) + report["unknown"]["count"] == 300
    assert (tmp_path / "chaos" / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "chaos" / "report.md").read_text().startswith("# Chaos run")
    record_property("faults", json.dumps(faults))
    print(
        json.dumps(
            {
                k: report[k]
                for k in (
                    "faults",
                    "duplicates",
                    "lost",
                    "stuck",
                    "unknown",
                    "duration_s",
                    "recovered_s",
                )
            },
            indent=1,
        )
    )


@pytest.mark.large
def test_chaos__large_run_with_baseline(pg_server, redis_server, tmp_path):
    cfg = ChaosConfig(
        out=tmp_path / "chaos",
        db=pg_server,
        broker=redis_server,
        jobs=10_000,
        duration=600,
        progress=print,
    )
    report = run_chaos(cfg, baseline=True)
    assert_clean(report)
    print(json.dumps(report, indent=1, default=str))
