"""Rebuild current state from the event history alone, and compare it with the stored rows.

``verify`` walks the operations in primary-key pages, so its memory stays flat however large
the ledger grows; each page is checked against the events, tool calls and executions in the
same key range, read in one snapshot.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from toolledger.ledger.errors import InvalidTransition
from toolledger.ledger.identity import args_sha256
from toolledger.ledger.models import execution_events, executions, operations, tool_calls
from toolledger.ledger.transitions import REVIEW, EventKind, Status, check_transition

OpKey = tuple[str, str]


@dataclass
class RebuiltExecution:
    attempt: int
    status: Status
    result: dict[str, Any] | None = None
    reconciled: bool = False
    fenced: bool = False
    effects: list[dict[str, Any]] | None = None
    error: str | None = None
    flags: int = 0  # flags raised on it that no review has settled yet


@dataclass
class RebuiltOperation:
    tool: str
    args: dict[str, Any]
    status: Status | None = None
    authorized_attempts: int = 0
    decided_by: str | None = None
    reason: str | None = None  # the approval's or rejection's (a retry's is its event's)
    review: str | None = None
    tool_calls: dict[str, str] = field(default_factory=dict)  # tool_call_id -> args_sha256
    executions: dict[str, RebuiltExecution] = field(default_factory=dict)


@dataclass(frozen=True)
class Difference:
    """One way the stored state disagrees with the state the events rebuild."""

    table: str
    scope: str
    key: str
    field: str
    stored: Any
    rebuilt: Any

    def to_json(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "scope": self.scope,
            "idempotency_key": self.key,
            "field": self.field,
            "stored": self.stored,
            "rebuilt": self.rebuilt,
        }


@dataclass
class VerifyReport:
    operations: int = 0
    executions: int = 0
    events: int = 0
    flagged: int = 0  # calls waiting for a human's review (operations.review set)
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "operations": self.operations,
            "executions": self.executions,
            "events": self.events,
            "flagged": self.flagged,
            "differences": [d.to_json() for d in self.differences],
        }


class _Replay:
    """Apply events of one operation in order, checking each against the transition table."""

    def __init__(self, scope: str, key: str, report: VerifyReport) -> None:
        self.scope, self.key, self.report = scope, key, report
        self.op: RebuiltOperation | None = None

    def problem(self, what: str, stored: Any = None, rebuilt: Any = None) -> None:
        diff = Difference("execution_events", self.scope, self.key, what, stored, rebuilt)
        self.report.differences.append(diff)

    def apply(self, ev: sa.Row[Any]) -> None:
        # An event whose detail lacks what its kind records, or holds what no status is, is a
        # difference to report, not the end of the report ("internal error", nothing listed:
        # a cold review)
        try:
            kind, detail = EventKind(ev.kind), ev.detail
            if kind is EventKind.SUBMITTED:
                if self.op is not None:  # a call is recorded once: never over what it was
                    self.problem(f"seq {ev.seq}: submitted again")
                op = RebuiltOperation(tool=detail["tool"], args=detail["args"])
                op.tool_calls[detail["tool_call_id"]] = args_sha256(detail["args"])
                self.op = op
                return
            if self.op is None:
                self.problem(f"seq {ev.seq}: {kind} before submitted")
                return
            self._apply(self.op, kind, ev)
        except (InvalidTransition, KeyError, ValueError, TypeError, _NotAReview) as exc:
            self.problem(f"seq {ev.seq}: {ev.kind}: {type(exc).__name__}: {exc}")

    def _apply(self, op: RebuiltOperation, kind: EventKind, ev: sa.Row[Any]) -> None:
        detail = ev.detail
        if kind is EventKind.LINKED:
            op.tool_calls[detail["tool_call_id"]] = args_sha256(op.args)
        elif kind is EventKind.EVIDENCE:
            _ = op.executions[ev.execution_id]  # evidence must name a known execution
        elif kind is EventKind.FLAGGED:
            op.executions[ev.execution_id].flags += 1
            op.review = op.review or detail["reason"]
        elif kind is EventKind.REVIEWED:
            op.executions[ev.execution_id].flags = 0
            op.review = detail.get("review_after")  # flags raised on other executions wait
        elif kind is EventKind.WITHDRAWN:
            # an unclaimed attempt withdrawn by proof (approved -> succeeded), or, at a
            # person's review, a claimed attempt that failed set aside for an earlier one the
            # review found succeeded (failed -> succeeded: only a review may take that pair)
            proven = op.executions[ev.execution_id]
            new = Status(detail["status"])
            check_transition(op.status, new)
            if (op.status, new) in REVIEW and not (detail.get("evidence") or {}).get("review"):
                raise _NotAReview(f"the call's {op.status} set aside by something not a review")
            if (op.status, new) in REVIEW and proven.status is not new:
                raise _NotAReview(f"the call set aside for an attempt that is {proven.status}")
            op.status, op.authorized_attempts = new, proven.attempt
        elif kind in (EventKind.PENDING_APPROVAL, EventKind.APPROVED, EventKind.REJECTED):
            new = Status(kind.value)
            check_transition(op.status, new)
            op.status = new
            if new is Status.APPROVED:
                op.authorized_attempts = detail["attempt"]
            if not detail.get("retry") and new is not Status.PENDING_APPROVAL:
                op.decided_by = ev.actor
                op.reason = detail.get("reason")
        elif kind is EventKind.RUNNING:
            check_transition(op.status, Status.RUNNING)
            op.executions[ev.execution_id] = RebuiltExecution(
                detail["attempt"], Status.RUNNING, fenced=bool(detail.get("fenced"))
            )
            op.status = Status.RUNNING
        else:
            new = Status(kind.value)
            ex = op.executions[ev.execution_id]
            check_transition(ex.status, new)
            if (ex.status, new) in REVIEW:
                _check_review(ex, ev)
            ex.status = new
            ex.result = detail.get("result")
            ex.reconciled = bool(detail.get("reconciled", False))
            if not ex.reconciled:
                ex.effects = detail.get("effects")
                ex.error = detail.get("error")
            if ex.attempt == op.authorized_attempts:
                op.status = new


class _NotAReview(Exception):
    """A terminal status changed to another without what only a human's review may do."""


def _check_review(ex: RebuiltExecution, ev: sa.Row[Any]) -> None:
    """succeeded <-> failed is a human's correction of a flagged call's human or reconciler
    decision: never an executor's own result, never without a flag waiting on it."""
    if not ex.reconciled:
        raise _NotAReview(f"{ex.status} was its executor's own result: that stands")
    if not ex.flags:
        raise _NotAReview(f"{ex.status} changed with no flag waiting on the execution")
    if not (ev.detail.get("evidence") or {}).get("review"):
        raise _NotAReview(f"{ex.status} changed by something other than a review")


def _compare(
    report: VerifyReport,
    table: str,
    scope: str,
    key: str,
    pairs: Iterable[tuple[str, Any, Any]],
) -> None:
    for name, stored, rebuilt in pairs:
        if not _same(stored, rebuilt):
            report.differences.append(Difference(table, scope, key, name, stored, rebuilt))


def _same(stored: Any, rebuilt: Any) -> bool:
    """Equal as JSON says it, for a JSON value (a result, arguments, effects): Python's ``==``
    holds ``true == 1 == 1.0``, and a result rewritten so in the database passed ``verify``
    while ``show`` handed the agent the rewritten receipt (a cold review)."""
    if not isinstance(stored, dict | list) and not isinstance(rebuilt, dict | list):
        return bool(stored == rebuilt)
    try:
        return _as_json(stored) == _as_json(rebuilt)
    except (TypeError, ValueError):  # not JSON (never in these columns): as Python says
        return bool(stored == rebuilt)


def _as_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, allow_nan=False)


def _check_operation(
    report: VerifyReport,
    op_row: sa.Row[Any],
    rebuilt: RebuiltOperation | None,
    calls: list[sa.Row[Any]],
    execs: list[sa.Row[Any]],
) -> None:
    scope, key = op_row.scope, op_row.idempotency_key
    if rebuilt is None:
        report.differences.append(Difference("operations", scope, key, "row", "present", None))
        return
    status = rebuilt.status.value if rebuilt.status else None
    _compare(
        report,
        "operations",
        scope,
        key,
        [
            ("tool", op_row.tool, rebuilt.tool),
            ("args", op_row.args, rebuilt.args),
            ("args_sha256", op_row.args_sha256, args_sha256(rebuilt.args)),
            ("status", op_row.status, status),
            ("authorized_attempts", op_row.authorized_attempts, rebuilt.authorized_attempts),
            ("decided_by", op_row.decided_by, rebuilt.decided_by),
            ("reason", op_row.reason, rebuilt.reason),
            ("review", op_row.review, rebuilt.review),
        ],
    )
    report.flagged += op_row.review is not None
    stored_calls = {c.tool_call_id: c.args_sha256 for c in calls}
    _compare(report, "tool_calls", scope, key, [("calls", stored_calls, rebuilt.tool_calls)])
    stored_execs = {e.execution_id: e for e in execs}
    for eid in sorted(set(stored_execs) | set(rebuilt.executions)):
        row, ex = stored_execs.get(eid), rebuilt.executions.get(eid)
        if row is None or ex is None:
            report.differences.append(
                Difference("executions", scope, key, eid, row is not None, ex is not None)
            )
            continue
        _compare(
            report,
            "executions",
            scope,
            key,
            [
                (f"{eid}.attempt", row.attempt, ex.attempt),
                (f"{eid}.status", row.status, ex.status.value),
                (f"{eid}.result", row.result, ex.result),
                (f"{eid}.reconciled", row.reconciled, ex.reconciled),
                (f"{eid}.fenced", row.fenced, ex.fenced),
                (f"{eid}.effects", row.effects, ex.effects),
                (f"{eid}.error", row.error, ex.error),
            ],
        )
        _check_columns(report, scope, key, row)


def _check_columns(report: VerifyReport, scope: str, key: str, row: sa.Row[Any]) -> None:
    """What no event records but the status requires of its row: a running execution holds a
    lease (a worker, a token, an expiry: the sweep finds it by the expiry, the fence checks
    the token), and a terminal one its end."""
    needed: tuple[str, ...] = ()
    if row.status == Status.RUNNING.value:
        needed = ("worker_id", "lease_token", "lease_expires_at")
    elif row.status in (Status.SUCCEEDED.value, Status.FAILED.value):
        needed = ("finished_at",)
    for name in needed:
        if getattr(row, name) is None:
            field_ = f"{row.execution_id}.{name}"
            report.differences.append(
                Difference("executions", scope, key, field_, None, f"set ({row.status})")
            )


def _in_range(table: sa.Table, first: OpKey, last: OpKey) -> sa.ColumnElement[bool]:
    pair = sa.tuple_(table.c.scope, table.c.idempotency_key)
    return sa.and_(pair >= sa.tuple_(*first), pair <= sa.tuple_(*last))


def _grouped(rows: Iterable[sa.Row[Any]]) -> dict[OpKey, list[sa.Row[Any]]]:
    groups: dict[OpKey, list[sa.Row[Any]]] = defaultdict(list)
    for row in rows:
        groups[(row.scope, row.idempotency_key)].append(row)
    return groups


def _verify_page(conn: sa.Connection, report: VerifyReport, ops: Sequence[sa.Row[Any]]) -> int:
    """Check one page of operations; return how many events, calls, executions it matched."""
    first, last = (ops[0].scope, ops[0].idempotency_key), (ops[-1].scope, ops[-1].idempotency_key)
    events = _grouped(
        conn.execute(
            sa.select(execution_events)
            .where(_in_range(execution_events, first, last))
            .order_by(execution_events.c.seq)
        )
    )
    calls = _grouped(conn.execute(sa.select(tool_calls).where(_in_range(tool_calls, first, last))))
    execs = _grouped(conn.execute(sa.select(executions).where(_in_range(executions, first, last))))
    matched = 0
    for op_row in ops:
        key = (op_row.scope, op_row.idempotency_key)
        replay = _Replay(*key, report)
        for ev in events.get(key, []):
            replay.apply(ev)
        _check_operation(report, op_row, replay.op, calls.get(key, []), execs.get(key, []))
        matched += len(events.get(key, [])) + len(calls.get(key, [])) + len(execs.get(key, []))
        report.executions += len(execs.get(key, []))
        report.events += len(events.get(key, []))
    return matched


def _orphans(conn: sa.Connection, report: VerifyReport) -> None:
    """Rows whose operation does not exist (someone deleted it behind the ledger's back)."""
    for table in (execution_events, tool_calls, executions):
        exists = (
            sa.select(operations.c.scope)
            .where(
                operations.c.scope == table.c.scope,
                operations.c.idempotency_key == table.c.idempotency_key,
            )
            .exists()
        )
        rows = conn.execute(
            sa.select(table.c.scope, table.c.idempotency_key).where(~exists).distinct().limit(100)
        )
        for row in rows:
            report.differences.append(
                Difference("operations", row.scope, row.idempotency_key, "row", None, "present")
            )


def verify(engine: sa.Engine, page_size: int = 1000) -> VerifyReport:
    report = VerifyReport()
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():  # one snapshot for every page
            totals = sum(
                conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
                for t in (execution_events, tool_calls, executions)
            )
            matched, after = 0, None
            while True:
                query = sa.select(operations).order_by(
                    operations.c.scope, operations.c.idempotency_key
                )
                if after is not None:
                    pair = sa.tuple_(operations.c.scope, operations.c.idempotency_key)
                    query = query.where(pair > sa.tuple_(*after))
                ops = conn.execute(query.limit(page_size)).all()
                if not ops:
                    break
                report.operations += len(ops)
                matched += _verify_page(conn, report, ops)
                after = (ops[-1].scope, ops[-1].idempotency_key)
            if matched != totals:
                _orphans(conn, report)
    return report
