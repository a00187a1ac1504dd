"""The sweep: one recovery pass, run by the beat on its own queue (or ``toolledger sweep``).

1. ``running`` whose lease expired by the database clock (plus a grace) -> ``unknown``;
2. the sandbox settled (if this process can see it): results that executors spooled are
   recorded, effects committed but not landed land, staged effects of revoked executions
   are dropped (``worker.effects``);
3. approved work whose message was lost (unclaimed, last published long ago) -> published
   again;
4. every ``unknown`` with evidence -> ``succeeded``/``failed``, ``reconciled: true``; a call
   whose effect is proven absent, of a tool that allows it, gets its next attempt (published
   as it is decided). Reconcilers look at the world and may each wait on a service: under a
   time limit (the beat's task) this step has a budget, and the next pass goes on where it
   stopped. It comes last, so a pass cut short in it has re-published lost work already
   (before 12-05 it came before step 3, and slow reconcilers starved step 3 for good).

Each step reads through a partial index, so a pass costs what it touches, not the ledger's
size. Two sweeps at once are safe: step 1 skips rows the other holds and re-checks status
and lease in its UPDATE; step 2 is a compare-and-set; step 3 stamps what it takes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from toolledger.effects import FormatTooNew, effects_of
from toolledger.ledger import metrics
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.models import operations
from toolledger.ledger.records import ExecutionRecord
from toolledger.ledger.transitions import Status
from toolledger.observability import logs, tracing
from toolledger.recovery.reconcile import (
    MAX_AUTO_RETRIES,
    Position,
    call_traces,
    reconcile_unknown,
)
from toolledger.sandbox import Sandbox
from toolledger.tools import Registry

log = logging.getLogger("toolledger.recovery")

Publish = Callable[[str, str, int], None]

#: Rows one statement takes at a time (a pass loops until nothing is left).
BATCH = 1000

#: Where this process's last pass over each ledger ran out of reconciling time.
_resume: dict[str, Position] = {}


@dataclass
class SweepSummary:
    marked_unknown: int = 0
    reconciled: int = 0
    still_unknown: int = 0
    requeued: int = 0
    from_late_result: int = 0
    from_reconciler: int = 0
    not_applied: int = 0
    auto_retried: int = 0
    #: Automatic retries not authorised because a flag waits on the call (a person first).
    retry_held: int = 0
    landed: int = 0
    dropped: int = 0
    spooled_results: int = 0
    #: What the pass found contradicts a person's decision made while it looked: flagged.
    contradicted: int = 0
    #: Effects staged in the sandbox by executions this ledger does not know: kept, never
    #: landed nor removed by it (the sandbox shared with another ledger, or this process
    #: pointed at the wrong one: an unset TOOLLEDGER_DB makes the embedded ledger).
    strangers: int = 0
    #: Paths whose committed bytes could not land: their lock held past the sandbox's
    #: ``lock_wait`` by another lander (frozen, or stuck in a slow fsync). Left for the next
    #: pass; reads of them fail ``not_settled`` and reconcilers say nothing about them
    #: meanwhile. One pass after another with some: look for that lander.
    busy: int = 0
    #: Committed effects that could not land (their target turned unsafe: a directory, a
    #: hard link): kept aside, their calls flagged ``not_landed`` for a person. They were in
    #: a log line only, the summary saying nothing (a cold review of the CLI).
    kept_aside: int = 0
    #: Tools' reconcilers that raised or outlasted the soft time limit (each also in
    #: ``errors``): their calls stay unknown for a person. Not the pass's own failure: it
    #: counts as a success.
    reconciler_failures: int = 0
    #: The reconciling step ran out of its time budget: the next pass goes on after it.
    reconcile_deferred: bool = False
    duration_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sweep(
    ledger: Ledger,
    registry: Registry,
    sandbox: Sandbox,
    *,
    grace_seconds: float,
    requeue_after: float,
    publish: Publish | None,
    batch: int = BATCH,
    actor: str = "sweep",
    max_auto_retries: int = MAX_AUTO_RETRIES,
    reconcile_budget: float | None = None,
    resume_file: Path | None = None,
) -> SweepSummary:
    """One recovery pass. Never executes a tool. ``reconcile_budget``: seconds the pass may
    spend starting reconciliations (None: as long as it takes), for a pass run under a time
    limit. ``resume_file``: where the row being reconciled is kept, so a pass killed there (a
    reconciler past the hard time limit kills the process) is followed by one that goes on
    after it."""
    began = time.perf_counter()
    with tracing.span("sweep", {"toolledger.actor": actor}) as span, logs.bind(sweep=actor):
        try:
            summary = _sweep(
                ledger,
                registry,
                sandbox,
                grace_seconds=grace_seconds,
                requeue_after=requeue_after,
                publish=publish,
                batch=batch,
                actor=actor,
                max_auto_retries=max_auto_retries,
                reconcile_budget=reconcile_budget,
                resume_file=resume_file,
            )
        except BaseException:
            # A pass the ledger stopped (out of reach, a table gone) is a pass that failed:
            # uncounted, the passes' rate fell to 0 while a pass failed every interval, as if
            # none were scheduled (a cold review). Its last success stays as it was.
            metrics.sweep_finished(time.perf_counter() - began, ok=False)
            raise
        summary.duration_s = round(time.perf_counter() - began, 4)
        # A tool's broken reconciler is the tool's: its calls wait in the inbox (their alert).
        # Counted as the pass failing, it fired the critical stalled-sweep alert for ever,
        # saying no pass ran (a cold review).
        ok = len(summary.errors) == summary.reconciler_failures
        metrics.sweep_finished(time.perf_counter() - began, ok=ok, unlanded=summary.busy)
        tracing.annotate(
            span,
            {
                "toolledger.sweep.marked_unknown": summary.marked_unknown,
                "toolledger.sweep.reconciled": summary.reconciled,
                "toolledger.sweep.still_unknown": summary.still_unknown,
                "toolledger.sweep.requeued": summary.requeued,
                "toolledger.sweep.errors": len(summary.errors),
            },
        )
    return summary


def _count_expired(ledger: Ledger, marked: list[ExecutionRecord]) -> None:
    """Lease expirations and their running -> unknown transitions, by tool (one query, only
    when this process counts)."""
    metrics.lease_expired(len(marked))
    if metrics.active() is None or not marked:
        return
    pairs = sorted({(ex.scope, ex.idempotency_key) for ex in marked})
    o = operations.c
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            sa.select(o.scope, o.idempotency_key, o.tool).where(
                sa.tuple_(o.scope, o.idempotency_key).in_(pairs)
            )
        ).all()
    tools = {(r.scope, r.idempotency_key): r.tool for r in rows}
    for ex in marked:
        metrics.transition(tools.get((ex.scope, ex.idempotency_key), ""), Status.UNKNOWN)


def _sweep(
    ledger: Ledger,
    registry: Registry,
    sandbox: Sandbox,
    *,
    grace_seconds: float,
    requeue_after: float,
    publish: Publish | None,
    batch: int,
    actor: str,
    max_auto_retries: int,
    reconcile_budget: float | None,
    resume_file: Path | None,
) -> SweepSummary:
    # a later version's sandbox: its own sweep settles and reconciles there (FormatTooNew,
    # before anything is changed)
    summary = SweepSummary()
    try:
        # a later version's sandbox: its own sweep marks, settles and reconciles there (its
        # reconcilers read a layout this one does not know: helper-92, a receipt recorded and
        # a retry authorised after this check, made only before the settling, had failed)
        effects_of(sandbox).check_format()
    except FormatTooNew as exc:
        summary.errors.append(str(exc))
        log.error("%s: this pass changes nothing", exc)
        return summary
    except OSError:
        pass  # a format file that is not one: the settling below says so in the pass's errors
    while marked := ledger.mark_expired(grace_seconds=grace_seconds, limit=batch, actor=actor):
        summary.marked_unknown += len(marked)
        try:
            _count_expired(ledger, marked)
        except sa.exc.SQLAlchemyError as exc:  # a count is not worth failing the pass
            log.warning("counting expired leases failed: %s", type(exc).__name__)
        if len(marked) < batch:
            break
    try:
        effects = effects_of(sandbox)
        effects.check_format()  # unreadable (OSError): nothing settled, said in the errors
        landing = effects.settle(ledger, actor=actor)
        summary.landed, summary.dropped = landing.landed, landing.discarded
        summary.spooled_results = landing.recorded + landing.evidence
        summary.strangers = landing.strangers
        summary.busy = landing.busy
        summary.kept_aside = landing.refused
        if landing.busy:
            log.warning(
                "%d paths' committed bytes could not land: another lander holds their lock "
                "(frozen or slow?); left for the next pass",
                landing.busy,
            )
        if landing.strangers:
            log.warning(
                "%d staged effects or spooled results in the sandbox belong to executions "
                "this ledger does not know: kept (is this process pointed at another ledger "
                "than the workers?)",
                landing.strangers,
            )
        summary.errors.extend(landing.problems)
        if removed := effects.sweep_locks():  # format 2: the lock files no lander holds
            log.info("removed %d path lock files no lander held", removed)
        if removed := effects.sweep_refused(ledger):  # reviewed by a human: not kept any more
            log.info("removed the kept bytes of %d effects a human reviewed", removed)
    except (OSError, sa.exc.SQLAlchemyError) as exc:  # the rest of the pass still runs
        summary.errors.append(f"settling the sandbox failed: {exc}")
        log.warning("settling the sandbox failed: %s", exc)
    on_retry: Publish | None = None
    if publish is not None:
        summary.requeued = requeue_lost(ledger, publish, requeue_after, batch, summary.errors)
        to_broker: Publish = publish

        def on_retry(scope: str, key: str, attempt: int) -> None:
            if _publish_one(to_broker, scope, key, attempt, summary.errors):
                ledger.mark_enqueued(scope, key, attempt)

    where = str(ledger.engine.url)
    if resume_file is not None:  # kept on disk: outlives a child killed mid-pass
        if (kept := _read_resume(resume_file, where)) is not None:
            _resume[where] = kept
        else:
            _resume.pop(where, None)
    on_ask = None
    if resume_file is not None and reconcile_budget is not None:
        keep_at: Path = resume_file

        def on_ask(position: Position) -> None:
            _write_resume(keep_at, where, position)

    tally = reconcile_unknown(
        ledger,
        registry,
        sandbox,
        page_size=batch,
        actor=actor,
        max_auto_retries=max_auto_retries,
        budget_s=reconcile_budget,
        start_after=_resume.get(where) if reconcile_budget is not None else None,
        on_retry=on_retry,
        on_ask=on_ask,
    )
    if tally.resume_after is not None:  # (kept if the pass raised: the next starts there)
        _resume[where] = tally.resume_after
        summary.reconcile_deferred = True
    else:
        _resume.pop(where, None)
    if on_ask is not None and resume_file is not None:
        _write_resume(resume_file, where, tally.resume_after)
    summary.reconciled, summary.still_unknown = tally.reconciled, tally.still_unknown
    summary.from_late_result, summary.from_reconciler = (
        tally.from_late_result,
        tally.from_reconciler,
    )
    summary.not_applied, summary.auto_retried = tally.not_applied, tally.auto_retried
    summary.contradicted = tally.contradicted
    summary.retry_held = tally.retry_held
    summary.reconciler_failures = tally.reconciler_failures
    summary.errors.extend(tally.errors)
    return summary


def _publish_one(publish: Publish, scope: str, key: str, attempt: int, errors: list[str]) -> bool:
    try:
        publish(scope, key, attempt)
    except Exception as exc:  # noqa: BLE001 - the broker is down: the outbox retries
        said = logs.error_line(exc)
        errors.append(f"publish of {scope}/{key}#{attempt} failed: {said}")
        log.warning("publish of %s/%s#%s failed: %s", scope, key, attempt, said)
        return False
    return True


def requeue_lost(
    ledger: Ledger, publish: Publish, older_than: float, batch: int, errors: list[str]
) -> int:
    """Publish again what was approved but never claimed and not published recently.

    The rows are stamped before the publish: if a publish fails (the broker down), the pass
    stops publishing and clears the stamps of the batch's rows it did not publish, due again
    at the next pass (they stayed stamped as published, not due for another threshold after
    the broker was back); a message published twice is harmless (the claim decides). Each
    due call once a pass: a threshold shorter than the pass hands back what it stamped, after
    every call due longer (``take_due_for_enqueue``'s order), and the pass ends there — having
    published the rest of that batch, which it stamped too (they were stamped and dropped)."""
    published, seen = 0, set[tuple[str, str, int]]()
    while due := ledger.take_due_for_enqueue(older_than_seconds=older_than, limit=batch):
        again = seen.intersection(due)  # a tiny threshold hands back what we just stamped
        seen.update(due)
        todo = [d for d in due if d not in again]
        # what each call was submitted under: its execution's span links to it (read only
        # when tracing, one query a batch)
        traces = call_traces(ledger, [(scope, key) for scope, key, _ in todo])
        for i, (scope, key, attempt) in enumerate(todo):
            try:
                with tracing.for_call(traces.get((scope, key))):
                    publish(scope, key, attempt)
                published += 1
            except Exception as exc:  # noqa: BLE001 - the broker is down: next sweep retries
                said = logs.error_line(exc)
                errors.append(f"requeue of {scope}/{key} failed: {said}")
                log.warning("requeue of %s/%s failed: %s", scope, key, said)
                _unstamp(ledger, todo[i:], errors)
                return published
        if again or len(due) < batch:
            break
    return published


def _unstamp(ledger: Ledger, jobs: list[tuple[str, str, int]], errors: list[str]) -> None:
    """What this pass stamped and did not publish: unstamped, due at the next pass."""
    try:
        ledger.clear_enqueued_all(jobs)
    except sa.exc.SQLAlchemyError as exc:  # then due once the threshold has passed again
        errors.append(f"clearing the stamps of {len(jobs)} unpublished calls failed: {exc}")
        log.warning("clearing the stamps of %d unpublished calls failed: %s", len(jobs), exc)


def _read_resume(path: Path, where: str) -> Position | None:
    """Where the last pass over this ledger stopped, as ``_write_resume`` kept it (None: from
    the start; an unreadable file is no position)."""
    try:
        kept = json.loads(path.read_text(encoding="utf-8")).get(where)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(kept, list) and len(kept) == 3 and all(isinstance(k, str) for k in kept):
        return (kept[0], kept[1], kept[2])
    return None


def _write_resume(path: Path, where: str, position: Position | None) -> None:
    """Keep (or, None, forget) where passes over this ledger go on; a failure to keep it only
    loses the place (the next pass starts from the first row)."""
    try:
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            kept = {}
        if not isinstance(kept, dict):
            kept = {}
        if position is None:
            kept.pop(where, None)
        else:
            kept[where] = list(position)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        if path not in _unkept:  # said once a process: it is written before every row asked
            _unkept.add(path)
            log.warning("keeping where the sweep goes on failed (said once): %s", exc)


#: Resume files this process could not write (their warning said once).
_unkept: set[Path] = set()
