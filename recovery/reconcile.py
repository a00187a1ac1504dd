"""Reconciliation: move ``unknown`` to what the evidence proves — never by running the tool.

Two kinds of evidence, in this order:
1. the original executor's late result (an ``evidence`` event its fenced-out terminal write
   left): the tool did finish, and this is what it reported;
2. the tool's reconciler, which looks at the world and says whether the requested effect
   holds (write_file compares the file's bytes; a tool calling a downstream service asks it
   for its receipt under the idempotency key). It must only read.
No evidence: the row stays ``unknown`` for a human. A reconciled result proves the target
state holds, not who produced it or how often.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ledger.errors import StaleFence
from ledger.ledger import Ledger
from ledger.records import EventRecord, ExecutionRecord, OperationRecord
from ledger.transitions import TERMINAL, Status
from worker.sandbox import Sandbox
from worker.tools import Evidence, Registry, ToolContext, UnknownTool

log = logging.getLogger("toolledger.recovery")


@dataclass
class ReconcileTally:
    reconciled: int = 0
    from_late_result: int = 0
    from_reconciler: int = 0
    still_unknown: int = 0
    errors: list[str] = field(default_factory=list)


def late_result(events: list[EventRecord]) -> Evidence | None:
    """The executor's own terminal result, recorded after it was fenced out."""
    for ev in reversed(events):
        status, result = ev.detail.get("status"), ev.detail.get("late_result")
        if status in {s.value for s in TERMINAL} and isinstance(result, dict):
            detail = {"kind": "late_result", "event_seq": ev.seq, "worker_id": ev.actor}
            return Evidence(Status(status), result, detail)
    return None


def ask_reconciler(
    registry: Registry, sandbox: Sandbox, ex: ExecutionRecord, op: OperationRecord
) -> Evidence | None:
    try:
        tool = registry.get(op.tool)
    except UnknownTool:
        return None
    if tool.reconcile is None:
        return None
    ctx = ToolContext(op.scope, sandbox, ex.execution_id, op.idempotency_key, ex.attempt)
    found = tool.reconcile(tool.parse(op.args), ctx)
    if found is None:
        return None
    return Evidence(
        found.status, found.result, {"kind": "reconciler", "tool": tool.name, **found.detail}
    )


def reconcile_unknown(
    ledger: Ledger,
    registry: Registry,
    sandbox: Sandbox,
    *,
    page_size: int = 500,
    actor: str = "sweep",
) -> ReconcileTally:
    """One pass over every execution that is unknown now (page by page)."""
    tally = ReconcileTally()
    after: tuple[str, str, str] | None = None
    while page := ledger.unknown_executions(page_size, after):
        evidence = ledger.evidence_for([ex for ex, _ in page])
        for ex, op in page:
            _reconcile_one(
                ledger, registry, sandbox, ex, op, evidence.get(ex.execution_id, []), actor, tally
            )
        last = page[-1][0]
        after = (last.scope, last.idempotency_key, last.execution_id)
    return tally


def _reconcile_one(
    ledger: Ledger,
    registry: Registry,
    sandbox: Sandbox,
    ex: ExecutionRecord,
    op: OperationRecord,
    events: list[EventRecord],
    actor: str,
    tally: ReconcileTally,
) -> None:
    try:
        found = late_result(events) or ask_reconciler(registry, sandbox, ex, op)
    except Exception as exc:  # noqa: BLE001 - a broken reconciler leaves the row for a human
        tally.still_unknown += 1
        tally.errors.append(f"reconciler for {ex.execution_id} failed: {exc}")
        log.warning("reconciler for %s failed: %s", ex.execution_id, exc)
        return
    if found is None:
        tally.still_unknown += 1
        return
    try:
        ledger.reconcile(
            ex.execution_id, found.status, found.result, evidence=found.detail, actor=actor
        )
    except StaleFence:
        return  # another sweep (or a human) resolved it first: each row changes once
    tally.reconciled += 1
    kind: Any = found.detail.get("kind")
    if kind == "late_result":
        tally.from_late_result += 1
    else:
        tally.from_reconciler += 1
