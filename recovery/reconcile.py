"""Reconciliation: move ``unknown`` to what the evidence proves — never by running the tool.

Evidence, in this order:
1. the original executor's late result (an ``evidence`` event its fenced-out terminal write
   left): what the tool reported — unless its sandbox effects were refused by the fence, in
   which case the report describes bytes that never landed and proves nothing; or the
   executor's record that it never started the tool (a claim whose commit it could not
   confirm), which proves the effect absent;
2. the tool's reconciler, which looks at the world: the requested effect holds (Evidence),
   provably does not (Absent), or it cannot tell (write_file compares the file's bytes; a
   tool calling a downstream service asks it for its receipt under the idempotency key);
3. the fence: an execution that ran under the staged-effect protocol and was revoked before
   its commit left nothing in the sandbox, so for a ``sandboxed`` tool its effect is absent.
Absent → ``failed`` (``not_applied``), and if the tool's contract allows it and its
reconciler proved the absence, the next attempt is authorised in the same transaction. No
evidence: the row stays ``unknown`` for a human. A reconciled result proves the target state
holds, not who produced it or how often.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from toolledger.ledger import metrics
from toolledger.ledger.errors import StaleFence
from toolledger.ledger.inputs import storable_object
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.records import EventRecord, ExecutionRecord, OperationRecord
from toolledger.ledger.transitions import TERMINAL, Status
from toolledger.observability import logs, tracing
from toolledger.sandbox import Sandbox
from toolledger.tools import Absent, Evidence, Finding, Registry, Tool, ToolContext, UnknownTool

log = logging.getLogger("toolledger.recovery")

#: Automatic retries of one call at most (a tool that crashes its worker every time must not
#: be retried forever): attempt N is retried automatically only while N <= this.
MAX_AUTO_RETRIES = 3

#: The receipt of an execution proven never to have taken effect.
NOT_APPLIED = {
    "error": "not_applied",
    "message": (
        "This tool call did not take effect: its execution was stopped before it committed, "
        "and nothing of it was applied. It was not run again."
    ),
}


Position = tuple[str, str, str]  # (scope, idempotency_key, execution_id): the pages' order


@dataclass
class ReconcileTally:
    reconciled: int = 0
    from_late_result: int = 0
    from_reconciler: int = 0
    not_applied: int = 0
    auto_retried: int = 0
    #: Proven not applied, its tool allowing an automatic retry, but its call flagged: no new
    #: attempt, the call left as it is for the person who reviews the flag.
    retry_held: int = 0
    still_unknown: int = 0
    #: Found after a person decided otherwise meanwhile: the call flagged contradicted.
    contradicted: int = 0
    #: Tools' reconcilers that raised: their rows stay unknown, for a person (the inbox).
    reconciler_failures: int = 0
    #: Celery's soft time limit interrupted the pass: it stops there (the next goes on after
    #: the row it was at).
    out_of_time: bool = False
    errors: list[str] = field(default_factory=list)
    to_publish: list[tuple[str, str, int]] = field(default_factory=list)
    #: Where the pass stopped when its time ran out (the next pass starts after it); None
    #: when it went round every unknown execution.
    resume_after: Position | None = None


def _position(ex: ExecutionRecord) -> Position:
    return (ex.scope, ex.idempotency_key, ex.execution_id)


def _pages(
    ledger: Ledger, page_size: int, start_after: Position | None
) -> Iterator[list[tuple[ExecutionRecord, OperationRecord]]]:
    """The unknown executions in pages, from just after ``start_after`` to the end, then
    from the start up to it: each once, wherever the pass begins. Every bound is compared by
    the database, whose collation orders the pages (Python's code-point order differs from
    ICU's or en_US's: a wrap filtered in Python skipped a row every pass)."""
    after = start_after
    while page := ledger.unknown_executions(page_size, after):
        yield page
        after = _position(page[-1][0])
    if start_after is None:
        return
    after = None
    while page := ledger.unknown_executions(page_size, after, until=start_after):
        yield page
        after = _position(page[-1][0])


def late_result(events: list[EventRecord]) -> Finding:
    """What the executor itself left after it was fenced out (the newest fact first)."""
    for ev in reversed(events):
        d = ev.detail
        if d.get("absent"):
            return Absent({"kind": "not_started", "event_seq": ev.seq, "worker_id": ev.actor})
        proves = d["proves"] if "proves" in d else d.get("status")  # older events: status
        result = d.get("late_result")
        if proves in {s.value for s in TERMINAL} and isinstance(result, dict):
            detail = {"kind": "late_result", "event_seq": ev.seq, "worker_id": ev.actor}
            return Evidence(Status(proves), result, detail)
    return None


class BadReconcilerAnswer(Exception):
    """A reconciler answered what no reconciliation can record (a status not terminal)."""


def ask_reconciler(
    tool: Tool | None,
    sandbox: Sandbox,
    ex: ExecutionRecord,
    op: OperationRecord,
    ledger: Ledger | None = None,
) -> Finding:
    if tool is None or tool.reconcile is None:
        return None
    states = ledger.effect_states if ledger is not None else None
    ctx = ToolContext(
        op.scope, sandbox, ex.execution_id, op.idempotency_key, ex.attempt, effect_states=states
    )
    found = tool.reconcile(tool.parse(op.args), ctx)
    extra = {"kind": "reconciler", "tool": tool.name}
    # what a reconciler says is stored as a tool's result is: JSON, every string storable
    if isinstance(found, Evidence):
        if found.status not in TERMINAL:  # the tool's mistake, counted as its failure: the
            # ledger refused it while recording, a failure of the pass's own, and every
            # pass then fired the stalled-sweep alert (a cold review)
            raise BadReconcilerAnswer(
                f"a reconciler's Evidence says succeeded or failed, not {found.status}"
            )
        detail = storable_object({**extra, **found.detail})
        return Evidence(found.status, storable_object(found.result), detail)
    if isinstance(found, Absent):
        return Absent(storable_object({**extra, **found.detail}))
    return None


def _fence(tool: Tool | None, ex: ExecutionRecord) -> Absent | None:
    if tool is not None and tool.sandboxed and ex.fenced:
        return Absent({"kind": "fence", "method": "revoked before its commit: nothing landed"})
    return None


def reconcile_unknown(
    ledger: Ledger,
    registry: Registry,
    sandbox: Sandbox,
    *,
    page_size: int = 500,
    actor: str = "sweep",
    max_auto_retries: int = MAX_AUTO_RETRIES,
    budget_s: float | None = None,
    start_after: Position | None = None,
    on_retry: Callable[[str, str, int], None] | None = None,
    on_ask: Callable[[Position], None] | None = None,
) -> ReconcileTally:
    """One pass over every execution that is unknown now (page by page).

    ``budget_s``: start no reconciliation after this many seconds (a sweep run under a time
    limit: reconcilers that each wait on a service that is down made every pass overrun its
    limit at the same row, and be killed before it re-published lost work). ``start_after``:
    begin after this execution and wrap around (where the last pass ran out of time), so the
    rows at the front do not take every pass's time. ``on_retry``: called with each attempt
    this pass authorises as it is decided (its publish), instead of listing it in
    ``to_publish`` for the end of the pass. ``on_ask``: called with each row's position before
    it is reconciled (kept where a process killed there leaves it: the next pass goes on
    after that row, not from the start to it again)."""
    tally = ReconcileTally()
    began = time.monotonic()
    last: Position | None = None
    for page in _pages(ledger, page_size, start_after):
        evidence = ledger.evidence_for([ex for ex, _ in page])
        traces = call_traces(ledger, [(ex.scope, ex.idempotency_key) for ex, _ in page])
        for ex, op in page:
            # at least one row a pass: a budget spent before the first (a slow first page on
            # a loaded machine) reconciled nothing, said nothing was deferred, and would do
            # so every pass (CI run 6 of 2026-12-06)
            if budget_s is not None and last is not None and time.monotonic() - began >= budget_s:
                tally.resume_after = last
                log.info(
                    "reconciliation stopped after %.1f s (its budget); the next pass goes on "
                    "after %s/%s",
                    time.monotonic() - began,
                    ex.scope,
                    ex.idempotency_key,
                )
                return tally
            last = _position(ex)
            if on_ask is not None:
                on_ask(last)
            with _observed(ex, op, traces.get((ex.scope, ex.idempotency_key))) as span:
                events = evidence.get(ex.execution_id, [])
                found = _findings(ledger, registry, sandbox, ex, op, events, tally)
                if tally.out_of_time:  # the pass stops; the next goes on after this row
                    tally.resume_after = last
                    return tally
                if found is None:
                    continue
                retry = ex.attempt <= max_auto_retries
                try:
                    outcome = _decide(ledger, ex, *found, actor, tally, retry)
                except StaleFence:  # another sweep (or a human) resolved it first: once each
                    continue
                except Exception as exc:  # noqa: BLE001 - one row cannot stop the pass
                    tally.still_unknown += 1
                    if _time_limit(exc):  # but the time limit stops it (no success)
                        tally.errors.append(f"the time limit stopped the pass at {ex.execution_id}")
                        log.warning("the time limit stopped the pass at %s", ex.execution_id)
                        tally.out_of_time, tally.resume_after = True, last
                        return tally
                    tally.errors.append(f"recording {ex.execution_id} failed: {exc}")
                    log.warning("recording what was found for %s failed: %s", ex.execution_id, exc)
                    continue
                tracing.annotate(span, {"toolledger.reconcile.outcome": outcome})
            while on_retry is not None and tally.to_publish:  # published as decided
                scope, key, attempt = tally.to_publish.pop()
                with tracing.for_call(traces.get((scope, key))):  # its execution links to it
                    on_retry(scope, key, attempt)
    return tally


def call_traces(
    ledger: Ledger, calls: list[tuple[str, str]]
) -> dict[tuple[str, str], dict[str, str]]:
    """The trace contexts these calls were submitted under (``Ledger.call_traces``), read
    only when this process traces (else nothing is read); a read that failed links nothing
    (the links are for a person's eyes: the pass goes on)."""
    if not tracing.active() or not calls:
        return {}
    try:
        return ledger.call_traces(calls)
    except sa.exc.SQLAlchemyError as exc:
        log.debug("reading the calls' trace contexts failed: %s", type(exc).__name__)
        return {}


@contextlib.contextmanager
def _observed(
    ex: ExecutionRecord, op: OperationRecord, trace: dict[str, str] | None = None
) -> Iterator[Any]:
    """A span and the log ids for one reconciliation; its span links to the call's submit
    span (``trace``, its context as the ledger kept it), the sweep's staying its parent."""
    attrs = {
        "gen_ai.tool.name": op.tool,
        "toolledger.scope": ex.scope,
        "toolledger.idempotency_key": ex.idempotency_key,
        "toolledger.execution_id": ex.execution_id,
        "toolledger.attempt": ex.attempt,
    }
    with (
        tracing.span(f"reconcile {op.tool}", attrs, links=tracing.links_to(trace)) as span,
        logs.bind(
            scope=ex.scope,
            idempotency_key=ex.idempotency_key,
            execution_id=ex.execution_id,
            attempt=ex.attempt,
            tool=op.tool,
        ),
    ):
        yield span


def _findings(
    ledger: Ledger,
    registry: Registry,
    sandbox: Sandbox,
    ex: ExecutionRecord,
    op: OperationRecord,
    events: list[EventRecord],
    tally: ReconcileTally,
) -> tuple[Tool | None, Finding, Finding] | None:
    """(the tool, what its executor left, what its reconciler sees); None if that failed."""
    try:
        tool: Tool | None = registry.get(op.tool)
    except UnknownTool:
        tool = None
    try:
        own = late_result(events)  # toolledger's own reading: its failure is the pass's
    except Exception as exc:  # noqa: BLE001 - one row cannot stop the pass
        tally.still_unknown += 1  # its class only above DEBUG: a result's text may be quoted
        tally.errors.append(
            f"reading the late result of {ex.execution_id} failed: {type(exc).__name__}"
        )
        log.warning("reading the late result of %s failed: %s", ex.execution_id, type(exc).__name__)
        log.debug("reading the late result of %s failed: %s", ex.execution_id, exc)
        return None
    if isinstance(own, Evidence):
        return tool, own, None
    try:
        world = ask_reconciler(tool, sandbox, ex, op, ledger)
    except Exception as exc:  # noqa: BLE001 - a broken reconciler leaves the row for a human
        # (not a SystemExit: a prefork child's SIGTERM is one, billiard's, and a pass that
        # took it for a tool's failure went on reconciling after its worker was told to stop;
        # a tool's own sys.exit() ends the pass, which `toolledger sweep` says: cold reviews)
        if _time_limit(exc):  # a reconciler slower than the pass's time: the pass stops there
            # (the next goes on after this row) and the slowness is the tool's, as a failure
            # would be: counted the pass's, one slow reconciler failed every pass and fired
            # the stalled-sweep alert (a cold review)
            tally.still_unknown += 1
            tally.out_of_time = True
            tally.reconciler_failures += 1
            tally.errors.append(f"reconciler for {ex.execution_id} stopped by the time limit")
            log.warning("reconciler for %s stopped by the time limit", ex.execution_id)
            return None
        # The exception's class only, above DEBUG: a tool's own text may quote the call's
        # arguments, which no line at INFO or above holds (a cold review found a reconciler's
        # message, with the mail body it quoted, in the WARNING line and the sweep's summary).
        tally.still_unknown += 1
        tally.reconciler_failures += 1
        tally.errors.append(f"reconciler for {ex.execution_id} failed: {type(exc).__name__}")
        log.warning("reconciler for %s failed: %s", ex.execution_id, type(exc).__name__)
        log.debug("reconciler for %s failed: %s", ex.execution_id, exc)
        return None
    return tool, own, world


def _time_limit(exc: BaseException) -> bool:
    """Celery's soft time limit (billiard's, an ``Exception``): imported only when asked, so
    that the commands reading a sweep's module never load billiard."""
    from billiard.exceptions import SoftTimeLimitExceeded

    return isinstance(exc, SoftTimeLimitExceeded)


def _decided_meanwhile(
    ledger: Ledger,
    ex: ExecutionRecord,
    status: Status,
    result: dict[str, Any],
    evidence: dict[str, Any],
    actor: str,
    tally: ReconcileTally,
) -> str:
    """``ex`` was decided while the pass looked at it (a human, another sweep, a late
    result): what was found is not dropped when it contradicts a human's decision — the call
    is flagged ``contradicted`` (a retry the human authorised cannot be claimed until it is
    reviewed). It was dropped without a word, and the retry applied the effect again (a cold
    review)."""
    if ledger.record_finding_after_decision(
        ex.execution_id, status, result, evidence=evidence, actor=actor
    ):
        tally.contradicted += 1
        log.warning(
            "%s was resolved by a person while the sweep looked: what it found (%s) says "
            "otherwise; the call is flagged contradicted for review",
            ex.execution_id,
            status,
        )
        return "contradicted"
    return "decided_meanwhile"


def _decide(
    ledger: Ledger,
    ex: ExecutionRecord,
    tool: Tool | None,
    own: Finding,
    world: Finding,
    actor: str,
    tally: ReconcileTally,
    retry_allowed: bool,
) -> str:
    """Settle ``ex`` by the evidence; what happened: succeeded, failed, not_applied, or
    still_unknown."""
    name = tool.name if tool is not None else ""
    proof = own if isinstance(own, Evidence) else world
    if isinstance(proof, Evidence):
        idempotent = tool is not None and tool.idempotent  # both ran: twice is once
        try:
            ledger.reconcile(
                ex.execution_id,
                proof.status,
                proof.result,
                evidence=proof.detail,
                actor=actor,
                flag_both_ran=not idempotent,
            )
        except StaleFence:
            return _decided_meanwhile(
                ledger, ex, proof.status, proof.result, proof.detail, actor, tally
            )
        tally.reconciled += 1
        if proof.detail.get("kind") == "late_result":
            tally.from_late_result += 1
        else:
            tally.from_reconciler += 1
        metrics.transition(name, proof.status)
        metrics.reconciled(proof.status.value)
        return proof.status.value
    absent = own if isinstance(own, Absent) else _fence(tool, ex)
    if absent is None:
        tally.still_unknown += 1
        return "still_unknown"
    # Automatic retry only on the reconciler's word that applying it now is right.
    retry = retry_allowed and tool is not None and tool.auto_retry and isinstance(world, Absent)
    evidence: dict[str, Any] = {**absent.detail}
    if isinstance(world, Absent):
        evidence["reconciler"] = world.detail
    try:
        ledger.reconcile(
            ex.execution_id, Status.FAILED, NOT_APPLIED, evidence=evidence, actor=actor, retry=retry
        )
    except StaleFence:
        return _decided_meanwhile(ledger, ex, Status.FAILED, NOT_APPLIED, evidence, actor, tally)
    tally.reconciled += 1
    tally.not_applied += 1
    metrics.transition(name, Status.FAILED)
    metrics.reconciled("not_applied")
    if retry:
        op = ledger.operation(ex.scope, ex.idempotency_key)
        if op.status is Status.APPROVED and op.authorized_attempts == ex.attempt + 1:
            metrics.transition(name, Status.APPROVED)
            tally.auto_retried += 1
            tally.to_publish.append((op.scope, op.idempotency_key, op.authorized_attempts))
        elif op.review is not None and op.authorized_attempts == ex.attempt:
            tally.retry_held += 1
            log.info(
                "%s: no automatic retry: its call is flagged %s, a person reviews it first",
                ex.execution_id,
                op.review,
            )
    return "not_applied"
