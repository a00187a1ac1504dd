"""Chaos runs: kill, freeze, partition and crash the world mid-task, then prove that nothing was
duplicated, lost, stuck, landed after its revocation or hidden from the model."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from toolledger.harness.chaos.checker import check, gather, read_lines
from toolledger.harness.chaos.faults import EXTERNAL
from toolledger.harness.chaos.harness import ChaosConfig, ChaosRun
from toolledger.harness.chaos.report import markdown, timeline, write_all
from toolledger.ledger.db import upgrade
from toolledger.ledger.ledger import Ledger

__all__ = ["EXTERNAL", "ChaosConfig", "ChaosRun", "markdown", "run_chaos"]


def run_chaos(cfg: ChaosConfig, *, baseline: bool = False) -> dict[str, Any]:
    """One chaos run (and optionally the baseline under the same faults); the report."""
    began = time.time()
    run = ChaosRun(cfg)
    try:
        outcome = run.run()
        cfg.progress("checking the ledger against the world")
        ledger = Ledger(run.db_url)
        try:
            upgrade(ledger.engine)  # an older version's schema, read by this one's checker
            faults = [f.to_json() for f in run.faults]
            logged = cfg.code is None or any(
                (cfg.code / where / "effects.py").exists() for where in ("worker", "toolledger")
            )
            facts = gather(ledger, run.scope, cfg.out, run.workload, faults, landings_logged=logged)
            checked = check(facts)
            firings = read_lines(cfg.out / "failpoints.log")
            timeline(ledger, run.scope, run.began, faults, firings, cfg.out / "timeline.png")
        finally:
            ledger.close()
    finally:
        run.teardown()
    faults_by_kind = Counter(f.kind for f in run.faults)
    faults_by_kind.update(
        f"{'stop' if f.get('action') == 'stop' else 'failpoint'}:{f['point']}" for f in firings
    )
    operator = Counter(a["action"] for a in read_lines(cfg.out / "operator.log"))
    report: dict[str, Any] = {
        "scope": run.scope,
        "code": str(cfg.code) if cfg.code else "this checkout",
        "jobs": cfg.jobs,
        "mix": dict(Counter(j.kind for j in run.workload.jobs)),
        "workers": cfg.workers,
        "concurrency": cfg.concurrency,
        "pool": cfg.pool,
        "seed": cfg.seed,
        "hold_ms": cfg.hold_ms,
        "lease_s": cfg.lease_seconds,
        "faults": dict(sorted(faults_by_kind.items())),
        "fault_kinds_skipped": sorted(set(cfg.kinds) - set(run.kinds)),
        # scheduled, but no target was there until its deadline: not injected
        "faults_not_injected": dict(sorted(run.missed.items())),
        "duration_s": round(time.time() - began, 1),
        "fault_window_s": cfg.duration,
        "recovered_s": outcome["recovered_s"],
        "final_sweep": outcome["final_sweep"],
        "operator": dict(operator),
        # processes a failpoint stopped, woken once their executions were revoked
        "stopped_and_woken": len(run.woken),
        **checked,
        "timeline_png": str(cfg.out / "timeline.png"),
    }
    report["ok"] = checked["ok"] and outcome["recovered_s"] >= 0
    if baseline:
        from toolledger.harness.chaos.baseline import run_baseline

        report["baseline"] = run_baseline(cfg, run.workload)
    report["files"] = write_all(report, cfg.out)
    return report
