"""The checker: what the ledger says, against what physically happened (Jepsen-style).

Inputs are the ledger (current state and events), the effects log (one line per physical
effect, written before it), the faults the harness injected and the failpoints that fired.
Each invariant is reported with its count; any non-zero count of a violation fails the run.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ledger.ledger import Ledger
from ledger.models import execution_events, executions, operations
from ledger.transitions import Status

ENDED = {Status.SUCCEEDED.value, Status.FAILED.value, Status.REJECTED.value, Status.UNKNOWN.value}


@dataclass
class Invariant:
    name: str
    ok: bool
    count: int
    detail: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "violations": self.count,
            "examples": self.detail[:10],
        }


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


_DEATH = re.compile(r"Process '[^']+' pid:(\d+) exited with '([^']+)'")


def child_deaths(logs: Path) -> dict[int, str]:
    """Pool children that died, as the workers themselves logged it: pid -> how."""
    deaths: dict[int, str] = {}
    for log in logs.glob("*.log") if logs.exists() else []:
        for match in _DEATH.finditer(log.read_text(errors="replace")):
            deaths[int(match[1])] = match[2]
    return deaths


def _pid(worker_id: str | None) -> int | None:
    try:
        return int((worker_id or "").rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def _ts(value: datetime | None) -> float:
    return value.astimezone(UTC).timestamp() if value else 0.0


class Checker:
    def __init__(
        self,
        ledger: Ledger,
        scope: str,
        out: Path,
        jobs: list[tuple[str, str, dict[str, Any]]],
        faults: list[dict[str, Any]],
        sandbox_root: Path,
        lease_seconds: float,
    ) -> None:
        self.ledger, self.scope, self.jobs = ledger, scope, jobs
        self.faults, self.sandbox_root, self.lease = faults, sandbox_root, lease_seconds
        self.effects = [e for e in read_lines(out / "effects.log") if e["scope"] == scope]
        self.firings = read_lines(out / "failpoints.log")
        self.deaths = child_deaths(out / "logs")
        with ledger.engine.connect() as conn:
            self.ops = {
                r.idempotency_key: r
                for r in conn.execute(sa.select(operations).where(operations.c.scope == scope))
            }
            self.execs = list(
                conn.execute(sa.select(executions).where(executions.c.scope == scope))
            )
            self.events = list(
                conn.execute(
                    sa.select(execution_events)
                    .where(execution_events.c.scope == scope)
                    .order_by(execution_events.c.seq)
                )
            )
            self.now = _ts(
                conn.execute(sa.select(sa.func.now())).scalar_one()
                if conn.dialect.name == "postgresql"
                else datetime.now(UTC)
            )

    # ------------------------------------------------------------------ invariants

    def at_most_one_effect(self) -> Invariant:
        per = Counter((e["key"], e["attempt"]) for e in self.effects)
        dupes = [f"{k}#{a}: {n} effects" for (k, a), n in per.items() if n > 1]
        return Invariant(
            "at most one physical effect per (scope, key, attempt)", not dupes, len(dupes), dupes
        )

    def all_ended(self) -> tuple[Invariant, int, int]:
        missing = [key for _, key, _ in self.jobs if key not in self.ops]
        lost = [k for k, op in self.ops.items() if op.status in ("approved", "pending_approval")]
        stuck = [k for k, op in self.ops.items() if op.status == "running"]
        bad = missing + lost + stuck
        return (
            Invariant(
                "every call ends succeeded/failed/rejected/unknown",
                not bad,
                len(bad),
                [f"{k}: {self.ops[k].status if k in self.ops else 'not recorded'}" for k in bad],
            ),
            len(missing) + len(lost),
            len(stuck),
        )

    def no_expired_running(self) -> Invariant:
        stale = [
            e.execution_id
            for e in self.execs
            if e.status == "running" and _ts(e.lease_expires_at) < self.now
        ]
        return Invariant(
            "after the final sweep no running row has an expired lease",
            not stale,
            len(stale),
            stale,
        )

    def unknown_explained(self) -> tuple[Invariant, Counter[str]]:
        reasons: Counter[str] = Counter()
        unexplained = []
        for ex in self.execs:
            if not self._went_unknown(ex.execution_id):
                continue
            cause = self._cause(ex)
            if cause is None:
                unexplained.append(f"{ex.execution_id} ({ex.idempotency_key}) by {ex.worker_id}")
            elif ex.status == "unknown":
                reasons[cause] += 1
        return Invariant(
            "every unknown lines up with a fault between claim and terminal write",
            not unexplained,
            len(unexplained),
            unexplained,
        ), reasons

    def reconciled_agree(self) -> Invariant:
        effects = Counter((e["key"], e["attempt"]) for e in self.effects)
        bad = []
        for ex in self.execs:
            n = effects[(ex.idempotency_key, ex.attempt)]
            if ex.status == "succeeded" and n != 1:
                bad.append(
                    f"{ex.execution_id}: succeeded{' (reconciled)' if ex.reconciled else ''}"
                    f" but {n} effects logged"
                )
        for cid, key, args in self.jobs:
            op = self.ops.get(key)
            if op is not None and op.status == "succeeded":
                path = self.sandbox_root / self.scope / args["path"]
                if not path.exists() or path.read_text() != args["content"]:
                    bad.append(f"{cid}: succeeded but {path} does not hold its content")
        return Invariant(
            "succeeded (and reconciled) results agree with the effects log and the files",
            not bad,
            len(bad),
            bad,
        )

    def no_stale_fence_write(self) -> Invariant:
        by_exec: dict[str, list[Any]] = defaultdict(list)
        for ev in self.events:
            if ev.execution_id:
                by_exec[ev.execution_id].append(ev)
        bad = []
        for eid, evs in by_exec.items():
            seen_unknown = False
            for ev in evs:
                if ev.kind == "unknown":
                    seen_unknown = True
                elif (
                    seen_unknown
                    and ev.kind in ("succeeded", "failed")
                    and not ev.detail.get("reconciled")
                ):
                    bad.append(f"{eid}: {ev.kind} by {ev.actor} after unknown")
        late = sum(1 for ev in self.events if ev.kind == "evidence")
        inv = Invariant("no write from a stale fence changed a row", not bad, len(bad), bad)
        inv.detail.append(f"{late} late results were kept as evidence instead")
        return inv

    # ------------------------------------------------------------------ causes

    def _went_unknown(self, execution_id: str) -> bool:
        return any(ev.execution_id == execution_id and ev.kind == "unknown" for ev in self.events)

    def _cause(self, ex: Any) -> str | None:
        for f in self.firings:
            if f.get("ref") == ex.execution_id:
                return f"failpoint {f['point']} ({f['action']})"
        pid, began = _pid(ex.worker_id), _ts(ex.started_at)
        for f in self.faults:
            if f["t"] < began - 1:
                continue
            if f["kind"] in ("kill_main", "kill_child", "zombie") and pid in f["pids"]:
                return str(f["kind"])
            window = began + self.lease * 3 + 15  # the terminal write's retries outlast a lease
            if f["kind"] == "pg_terminate" and f["t"] <= window:
                return "pg_terminate"
        if pid in self.deaths:  # e.g. killed by Celery's hard time limit after a stalled fsync
            return f"worker process died ({self.deaths[pid]})"
        return None

    # ------------------------------------------------------------------ all

    def check(self) -> dict[str, Any]:
        ended, lost, stuck = self.all_ended()
        explained, reasons = self.unknown_explained()
        report = self.ledger.verify()
        invariants = [
            self.at_most_one_effect(),
            ended,
            self.no_expired_running(),
            explained,
            self.reconciled_agree(),
            Invariant(
                "verify: events rebuild state exactly",
                report.ok,
                len(report.differences),
                [json.dumps(d.to_json()) for d in report.differences],
            ),
            self.no_stale_fence_write(),
        ]
        statuses = Counter(op.status for op in self.ops.values())
        return {
            "duplicates": invariants[0].count,
            "lost": lost,
            "stuck": stuck,
            "unknown": {"count": statuses.get("unknown", 0), "reasons": dict(reasons)},
            "verify_ok": report.ok,
            "statuses": dict(statuses),
            "reconciled": sum(1 for e in self.execs if e.reconciled),
            "executions": len(self.execs),
            "effects": len(self.effects),
            "failpoints_fired": dict(Counter(f"failpoint:{f['point']}" for f in self.firings)),
            "invariants": [i.to_json() for i in invariants],
            "ok": all(i.ok for i in invariants),
        }
