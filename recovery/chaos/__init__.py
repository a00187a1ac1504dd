"""Chaos runs: kill workers mid-task, then prove nothing was duplicated, lost or stuck."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from recovery.chaos.checker import Checker, read_lines
from recovery.chaos.harness import EXTERNAL, ChaosConfig, ChaosRun
from recovery.chaos.report import markdown, timeline, write_all

__all__ = ["EXTERNAL", "ChaosConfig", "ChaosRun", "markdown", "run_chaos"]


def run_chaos(cfg: ChaosConfig, *, baseline: bool = False) -> dict[str, Any]:
    """One chaos run (and optionally the baseline under the same faults); the report."""
    began = time.time()
    run = ChaosRun(cfg)
    try:
        outcome = run.run()
        cfg.progress("checking the ledger against the effects log")
        checked = Checker(
            run.submitter.ledger,
            run.scope,
            cfg.out,
            run.submitted,
            [f.to_json() for f in run.faults],
            cfg.out / "sandbox",
            cfg.lease_seconds,
        ).check()
        firings = read_lines(cfg.out / "failpoints.log")
        timeline(
            run.submitter.ledger,
            run.scope,
            run.began,
            [f.to_json() for f in run.faults],
            firings,
            cfg.out / "timeline.png",
        )
    finally:
        run.teardown()
    faults = Counter(f.kind for f in run.faults)
    faults.update(checked.pop("failpoints_fired"))
    report: dict[str, Any] = {
        "scope": run.scope,
        "jobs": cfg.jobs,
        "workers": cfg.workers,
        "concurrency": cfg.concurrency,
        "seed": cfg.seed,
        "hold_ms": cfg.hold_ms,
        "faults": dict(sorted(faults.items())),
        **{k: checked[k] for k in ("duplicates", "lost", "stuck", "unknown", "verify_ok")},
        "duration_s": round(time.time() - began, 1),
        "fault_window_s": cfg.duration,
        "recovered_s": outcome["recovered_s"],
        "reconciled": checked["reconciled"],
        "statuses": checked["statuses"],
        "executions": checked["executions"],
        "effects": checked["effects"],
        "final_sweep": outcome["final_sweep"],
        "invariants": checked["invariants"],
        "ok": checked["ok"] and outcome["recovered_s"] >= 0,
        "timeline_png": str(cfg.out / "timeline.png"),
    }
    if baseline:
        report["baseline"] = run_baseline(cfg)
    report["files"] = write_all(report, cfg.out)
    return report


def run_baseline(cfg: ChaosConfig) -> dict[str, Any]:
    from recovery.chaos.baseline import BaselineRun

    base_cfg = ChaosConfig(**{**cfg.__dict__, "out": cfg.out / "baseline"})
    base_cfg.progress(f"baseline: the same {cfg.jobs} jobs and faults, plain Celery, no ledger")
    run = BaselineRun(base_cfg)
    try:
        outcome = run.run()
        results = run.results()
    finally:
        run.teardown()
    return {**results, "recovered_s": outcome["recovered_s"]}
