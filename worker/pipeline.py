"""The execute pipeline (DESIGN §5): claim → running → staged effect → terminal → landing.

Used by the Celery task and by ``toolledger execute`` alike. A tool's sandbox writes are
staged while it runs and land only after the execution's own terminal commit, so a revoked
execution never reaches the sandbox (``worker.effects`` has the argument). Crash windows are
marked with failpoints; what recovery does after a crash in each one is tested:

    after_claim → before_effect → [after_stage, per staged write] → after_effect
    → (terminal commit) → after_terminal → [before_publish → after_publish, per landing]
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from billiard.exceptions import SoftTimeLimitExceeded

from toolledger import failpoints
from toolledger.effects import (
    CLAIM_UNKNOWN,
    Commit,
    Effects,
    Landing,
    LeaseLost,
    LeaseWatch,
    Staged,
    effects_of,
    lease_clock,
    lock_keys,
)
from toolledger.ledger import metrics
from toolledger.ledger.errors import NotFound, StaleFence
from toolledger.ledger.identity import PROXIED_PREFIX, new_execution_id, new_lease_token
from toolledger.ledger.inputs import storable_object, valid_line
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.records import Claim
from toolledger.ledger.transitions import Status
from toolledger.observability import logs, tracing
from toolledger.sandbox import Sandbox, SandboxError
from toolledger.tools import (
    Absent,
    Evidence,
    InvalidToolArguments,
    OutcomeUnknown,
    Registry,
    Tool,
    ToolContext,
    ToolError,
    UnknownTool,
)

log = logging.getLogger("toolledger.worker")

#: How many times a claim or a terminal write is retried after a database error, and the
#: first pause (doubling): 0.2 + 0.4 + … ≈ 6 s in all.
TERMINAL_RETRIES = 6
TERMINAL_BACKOFF_SECONDS = 0.2
#: A worker that has not renewed a lease for lease * (1 - SELF_FENCE_MARGIN) on its own
#: clock treats the claim as lost (its tool is told, its sandbox refuses) — before the lease
#: could have expired at the database, whatever the clocks' rates.
SELF_FENCE_MARGIN = 0.2

State = Literal["finished", "lost", "left", "unknown", "stale", "unrecorded", "unsure"]
#: Statuses an ``execute_tool`` span ends in error with (its status ERROR).
_NOT_FINE = (Status.FAILED, Status.UNKNOWN)


@dataclass(frozen=True)
class Outcome:
    """What one delivery of a job did.

    lost: not claimed, nothing ran · left: not claimed, this worker does not load the call's
    tool (a rolling deploy): left approved for one that does, re-published by the sweep ·
    unsure: whether the claim committed could not be learned; the tool did not run
    (spooled, the sweep settles it) · finished: the terminal
    write is recorded · unknown: the executor declared it unknown · stale: revoked before
    its commit, the late result is evidence and nothing of it landed · unrecorded: the
    terminal write could not be made; the result is spooled on disk for the next settle
    (``kept`` False: nor could the disk take it, and the sweep will find it unknown).
    """

    state: State
    execution_id: str | None = None
    status: Status | None = None
    result: dict[str, Any] | None = None
    seq: int = 0
    landing: Landing | None = None
    kept: bool = True


def _brief(exc: BaseException) -> str:
    """An error for a log line: its class and first line, never SQL parameters."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return f"{type(orig).__name__}: {text[0] if text else ''}"


class LeaseKeeper:
    """Renews the leases of every claim running in this process, each every lease/3, by the
    database clock — one long-lived thread, not one per job (profiling showed starting and
    joining a thread per job costing more than a round trip).

    Each claim has a ``LeaseWatch``: its deadline moves forward after each successful
    renewal (measured from when the renewal was sent), and ``lost`` is set when a renewal
    finds the row no longer ours or the deadline passes without one — a worker cut off from
    the database stops itself before the sweep could revoke it. Renewals run with the
    ledger's statement and connect timeouts, so a hung connection cannot stall this thread.

    ``time_limit`` (seconds, 0: none): a claim held longer is no longer renewed and is treated
    as lost, as a prefork child past Celery's hard limit would be killed. On a pool that
    cannot kill its tool (threads), a hung tool is then revoked by the sweep one lease later
    and fenced, instead of renewed for ever: it keeps its thread, never its claim.
    """

    def __init__(self, ledger: Ledger, lease_seconds: float, time_limit: float = 0.0) -> None:
        self.ledger, self.lease_seconds, self.time_limit = ledger, lease_seconds, time_limit
        self.interval = lease_seconds / 3
        self.keep = lease_seconds * (1 - SELF_FENCE_MARGIN)
        # the longest an idle keeper sleeps: a claim tracked meanwhile is due no sooner
        self.idle_wait = min(self.interval, time_limit) if time_limit else self.interval
        self._cv = threading.Condition()
        self._due: dict[str, tuple[Claim, float, LeaseWatch]] = {}
        self._thread: threading.Thread | None = None
        self._wakes_at = math.inf  # when the sleeping keeper wakes by itself (under _cv)

    def track(self, claim: Claim, sent_at: float) -> LeaseWatch:
        """Watch ``claim``, whose claim statement was sent at ``sent_at`` (``lease_clock``)."""
        watch = LeaseWatch(claim.execution_id, sent_at + self.keep)
        if self.time_limit:
            watch.renew_until = sent_at + self.time_limit
        with self._cv:
            self._due[claim.execution_id] = (claim, lease_clock() + self.interval, watch)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="toolledger-leases", daemon=True
                )
                self._thread.start()
            elif min(watch.renew_until, watch.deadline) < self._wakes_at:
                # Rare: a new claim is due (renewal, time limit) no sooner than those already
                # tracked, and an idle keeper sleeps at most ``idle_wait``: only a claim whose
                # statement was sent before the keeper last slept can be due before it wakes.
                # Waking it for every claim cost a thread switch per job.
                self._cv.notify()
        return watch

    def untrack(self, claim: Claim) -> None:
        with self._cv:
            self._due.pop(claim.execution_id, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                now = lease_clock()
                for eid, (_, _, watch) in list(self._due.items()):
                    if not watch.valid():
                        log.warning("lease of %s not renewed in time: claim treated as lost", eid)
                        del self._due[eid]
                    elif now >= watch.renew_until:
                        self._give_up(eid, watch)
                due = [entry for entry in self._due.values() if entry[1] <= now]
                if not due:
                    wake = min(
                        (min(e[1], e[2].deadline, e[2].renew_until) for e in self._due.values()),
                        default=now + self.idle_wait,
                    )
                    self._wakes_at = wake
                    self._cv.wait(timeout=max(0.0, wake - now))
                    self._wakes_at = math.inf
                    continue
            self._renew(due)

    def _give_up(self, eid: str, watch: LeaseWatch) -> None:
        """The claim ran past the time limit: no more renewals, and it is lost (under _cv)."""
        limit = self.time_limit
        log.warning("%s ran past the time limit (%s s): its lease is no longer renewed", eid, limit)
        watch.timed_out = True
        watch.lost.set()
        del self._due[eid]

    def _renew(self, due: list[tuple[Claim, float, LeaseWatch]]) -> None:
        """Renew every claim that is due, in one statement (``Ledger.renew_leases``)."""
        sent = lease_clock()
        held = [(c.execution_id, c.lease_token) for c, _, w in due if sent < w.renew_until]
        renewed: set[str] | None
        try:
            renewed = self.ledger.renew_leases(held, self.lease_seconds)
        except sa.exc.SQLAlchemyError as exc:  # keep trying until the deadline
            log.warning("lease renewal of %d claims failed: %s", len(held), _brief(exc))
            renewed = None
        with self._cv:
            for claim, _, watch in due:
                eid = claim.execution_id
                if eid not in self._due:
                    continue  # finished (or given up) meanwhile
                if sent >= watch.renew_until:  # passed since the round began: not renewed
                    self._give_up(eid, watch)
                    continue
                ours = None if renewed is None else eid in renewed
                if ours is False:
                    log.warning("lease of %s lost: the row is no longer ours", eid)
                    watch.lost.set()
                    del self._due[eid]
                    continue
                if ours:
                    watch.deadline = max(watch.deadline, sent + self.keep)
                retry_in = self.interval if ours else min(self.interval, 1.0)
                self._due[eid] = (claim, lease_clock() + retry_in, watch)


class Executor:
    """Runs one authorised attempt of one call, at most once, whatever happens around it."""

    def __init__(
        self,
        ledger: Ledger,
        registry: Registry,
        sandbox: Sandbox,
        *,
        worker_id: str,
        lease_seconds: float,
        leases: LeaseKeeper | None = None,
        tool_wait: float = 0.0,
    ) -> None:
        self.ledger, self.registry, self.sandbox = ledger, registry, sandbox
        self.worker_id, self.lease_seconds = worker_id, lease_seconds
        self.tool_wait = tool_wait
        self.leases = leases or LeaseKeeper(ledger, lease_seconds)
        effects_of(sandbox).check_format()  # before any claim: a later version's sandbox

    def execute(
        self,
        scope: str,
        key: str,
        attempt: int,
        *,
        tool_call_id: str | None = None,
        published_at: float | None = None,
        parent: Any = None,
        report: Callable[[Outcome], None] | None = None,
        tool: str | None = None,
        links: Sequence[Any] = (),
    ) -> Outcome:
        """Run attempt ``attempt`` of ``scope``/``key`` if this delivery wins its claim.

        ``tool_call_id`` and ``published_at`` (Unix time), when the message carried them,
        label the span and the schedule-to-start histogram; ``tool``, the call's tool as the
        message named it (a label too: the claim reads the tool it runs from the ledger), lets
        a worker that does not load it leave the call without a read; ``parent``: the trace context
        the message carried (the submitter's span); ``links``: to the call's own submit span,
        when another published it (``tracing.call_links``: the sweep, a retry); ``report`` is
        called with the outcome while the span is current and the call's ids are bound (its
        log lines carry them)."""
        ids = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.call.id": tool_call_id,
            "toolledger.scope": scope,
            "toolledger.idempotency_key": key,
            "toolledger.attempt": attempt,
        }
        with (
            tracing.span("execute_tool", ids, parent=parent, links=links) as span,
            logs.bind(scope=scope, idempotency_key=key, attempt=attempt, tool_call_id=tool_call_id),
        ):
            outcome = (
                Outcome("left")
                if self._leaves(scope, key, tool)
                else self._execute(scope, key, attempt, span, tool_call_id, published_at)
            )
            status = outcome.status.value if outcome.status else None
            tracing.annotate(
                span, {"toolledger.status": status, "toolledger.outcome": outcome.state}
            )
            if outcome.state not in ("finished", "lost", "left") or outcome.status in _NOT_FINE:
                tracing.failed(span, f"{outcome.state}: {status}")  # a lost claim ran nothing
            if report is not None:
                report(outcome)
            return outcome

    def _leaves(self, scope: str, key: str, tool: str | None) -> bool:
        """Whether this delivery is left unclaimed: this worker does not load the call's tool
        (a worker not yet restarted in a rolling deploy that added it) and the call was
        authorised less than ``tool_wait`` ago. The call stays approved; the sweep re-publishes
        it after ``requeue_after`` for any worker, which runs it if it loads the tool. Past the
        wait the claim goes ahead and the call fails, "unknown tool", as it did before
        2026-12-07 at once: a call no worker can run is not left waiting for ever.

        A message that names a tool this worker loads costs nothing here; one that names none
        (the sweep's re-publish, a retry, an older producer's) costs a read of the call's
        tool. An upstream's tool recorded by the MCP proxy is no worker's: never left."""
        if self.tool_wait <= 0 or (tool is not None and tool in self.registry):
            return False
        try:
            if tool is None:
                tool = self.ledger.operation(scope, key).tool
                if tool in self.registry:
                    return False
            if tool.startswith(PROXIED_PREFIX):
                return False
            waiting = self.ledger.authorised_within(scope, key, self.tool_wait)
        except (NotFound, sa.exc.SQLAlchemyError):
            return False  # the claim decides, and says why, as for any other call
        if waiting:
            metrics.call_left()
            log.warning(
                "%s/%s: this worker does not load tool %r: left approved for a worker that "
                "does (re-published by the sweep; failed as unknown if none has run it %g s "
                "after it was authorised)",
                scope,
                key,
                tool,
                self.tool_wait,
            )
        return waiting

    def _execute(
        self,
        scope: str,
        key: str,
        attempt: int,
        span: Any,
        tool_call_id: str | None,
        published_at: float | None,
    ) -> Outcome:
        # 1+2. The claim reads the operation and inserts the execution row in one commit:
        # not approved, not this attempt, or someone else's → nothing runs.
        claimed = self._claim(scope, key, attempt)
        if isinstance(claimed, Outcome):
            if claimed.state == "lost":
                metrics.claim_lost()
            return claimed
        claim, sent_at = claimed
        eid = claim.execution_id
        # Up to the tool's start, the soft time limit (raised anywhere, a claim that waited
        # out a partition) means the tool never started: put on record as a lost lease is
        # (helper-89: it escaped the task, and a call that never ran read "possibly applied")
        watch: LeaseWatch | None = None
        try:
            self._observe_claim(claim, span, tool_call_id, published_at)
            # running is durable now: a crash from here on leaves evidence the effect may
            # have begun.
            failpoints.hit("after_claim", eid)
            watch = self.leases.track(claim, sent_at)
            staging = effects_of(self.sandbox).staging(claim.scope, eid, watch)
            ctx = ToolContext(
                claim.scope, staging, eid, key, attempt, watch.lost, watch,
                self.ledger.effect_states,
            )  # fmt: skip
            if not watch.valid():  # frozen (or cut off) since the claim: never start the tool
                try:
                    return self._not_started(claim, watch)
                finally:
                    self.leases.untrack(claim)
            # (a freeze from here on is the fence's: the tool runs, its writes are refused,
            # and ctx.lease_lost reads set once the deadline has passed)
            failpoints.hit("before_effect", eid)
            # an automatic retry asks its reconciler again first: still before the tool
            # (helper-92: the soft limit there left the task, or read "superseded")
            tool, early = self._before_tool(claim, ctx)
        except BaseException as exc:
            if watch is not None:
                self.leases.untrack(claim)
            if isinstance(exc, SoftTimeLimitExceeded):
                return self._cut_before_start(claim)
            raise
        try:
            if early is not None:
                status, result, error = early
            else:
                assert tool is not None  # None comes with an outcome
                status, result, error = run_tool(tool, claim.args, ctx)
            if status is not Status.UNKNOWN and watch.timed_out:
                # Returned after its claim was given up at the time limit (a threads pool:
                # nothing killed it): recorded as a prefork child killed at the hard limit
                # would leave it, unknown, its staged effects dropped. (A lease lost to the
                # database is different: a late result is evidence, see _late.)
                late = watch.error()
                status, result, error = Status.UNKNOWN, None, f"{type(late).__name__}: {late}"
            staged = staging.seal()
            # The tool ran; its sandbox effects are staged, nothing of them has landed, and
            # nothing records the outcome yet: a crash here leaves the call to the sweep.
            failpoints.hit("after_effect", eid)
        finally:
            self.leases.untrack(claim)
        outcome = self._record(claim, status, result, error, staged)
        metrics.execution_finished(claim.tool, lease_clock() - sent_at)
        # Committed (or not): a crash here leaves staged effects that settle lands (or drops).
        failpoints.hit("after_terminal", eid)
        return self._land(claim, outcome, staged)

    @staticmethod
    def _observe_claim(
        claim: Claim, span: Any, tool_call_id: str | None, published_at: float | None
    ) -> None:
        metrics.scheduled_started(claim.tool, published_at)
        if tool_call_id is None and claim.idempotency_key.startswith(f"{claim.tool}:"):
            tool_call_id = claim.idempotency_key[len(claim.tool) + 1 :]  # the default key
        logs.bind_more(execution_id=claim.execution_id, tool=claim.tool, tool_call_id=tool_call_id)
        attrs = {
            "gen_ai.tool.name": claim.tool,
            "gen_ai.tool.call.id": tool_call_id,
            "toolledger.execution_id": claim.execution_id,
        }
        tracing.annotate(span, attrs, name=f"execute_tool {claim.tool}")

    # ------------------------------------------------------------------ claim

    def _claim(self, scope: str, key: str, attempt: int) -> tuple[Claim, float] | Outcome:
        """The claim, robust to an error around its commit: the id and token are ours, so
        after a database error the claim is only called lost once the database said so —
        a claim committed by an earlier try is found by its (execution_id, token)."""
        eid, token = new_execution_id(), new_lease_token()
        try:
            return self._claim_tries(scope, key, attempt, eid, token)
        except SoftTimeLimitExceeded:
            # cut inside a try (its statement may have reached the server and committed), or
            # between tries: the tool has not run; what the ledger holds is learned by the
            # sweep (helper-89: a claim waiting out a partition met the soft limit first, the
            # exception left the task, and the call read "possibly applied")
            log.warning("claim %s of %s/%s#%s: soft time limit", eid, scope, key, attempt)
        return self._claim_unsure(scope, key, attempt, eid, token)

    def _claim_tries(
        self, scope: str, key: str, attempt: int, eid: str, token: str
    ) -> tuple[Claim, float] | Outcome:
        sent_at, ambiguous, pause = lease_clock(), False, TERMINAL_BACKOFF_SECONDS
        for tries_left in range(TERMINAL_RETRIES - 1, -1, -1):
            try:
                claim = self.ledger.claim(
                    scope,
                    key,
                    attempt,
                    worker_id=self.worker_id,
                    lease_seconds=self.lease_seconds,
                    execution_id=eid,
                    lease_token=token,
                )
                if claim is None and ambiguous:
                    # Refused now; an earlier try of ours may be why (this claim waited for it).
                    claim = self.ledger.claimed(eid, token)
                return (claim, sent_at) if claim is not None else Outcome("lost")
            except sa.exc.SQLAlchemyError as exc:
                ambiguous = True
                log.warning("claim of %s/%s#%s failed: %s", scope, key, attempt, _brief(exc))
            if not tries_left:
                break
            time.sleep(pause)
            pause *= 2
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                if (mine := self.ledger.claimed(eid, token)) is not None:
                    return mine, sent_at
        return self._claim_unsure(scope, key, attempt, eid, token)

    def _claim_unsure(self, scope: str, key: str, attempt: int, eid: str, token: str) -> Outcome:
        log.error(
            "claim %s of %s/%s#%s: cannot learn whether it committed; the tool did not run. "
            "If it committed, the sweep declares it unknown and this is on record.",
            eid,
            scope,
            key,
            attempt,
        )
        late = {"not_started": True, "absent": True, "worker_id": self.worker_id}
        self._spool(eid, token, {"status": "not_started", "reason": CLAIM_UNKNOWN}, late)
        return Outcome("unsure", eid)

    # ------------------------------------------------------------------ the tool

    def _cut_before_start(self, claim: Claim) -> Outcome:
        """The soft time limit passed between the claim and the tool's start: the tool is not
        started, and that is spooled (not written: the hard limit may come before a database
        answers) for the sweep, which records it under this lease, then proves the execution
        ``not_applied`` from it."""
        eid = claim.execution_id
        reason = "SoftTimeLimitExceeded: the time limit passed before the tool started"
        late = {"not_started": True, "absent": True, "worker_id": self.worker_id, "reason": reason}
        self._spool(eid, claim.lease_token, {"status": "not_started", "reason": reason}, late)
        log.warning("%s: %s; it was not started", eid, reason)
        return Outcome("stale", eid)

    def _not_started(self, claim: Claim, watch: LeaseWatch) -> Outcome:
        """The lease was lost between the claim and the tool (a freeze, a partition): the
        tool is not started, and that is put on record as evidence that its effect is absent
        (as for a claim whose commit could not be learned), which the sweep proves
        ``not_applied`` from once the execution is unknown. Before 12-05 the tool started
        anyway, told only through ``ctx.lease_lost`` if the keeper's thread had run."""
        eid = claim.execution_id
        reason = f"{type(watch.error()).__name__}: the lease was lost before the tool started"
        late = {
            "not_started": True,
            "absent": True,
            "worker_id": self.worker_id,
            "reason": reason,
            "lease_lost": True,  # the fence stopped it (the chaos checker counts these)
        }
        try:
            self.ledger.record_late_result(eid, late, actor=self.worker_id, outcome=None)
        except sa.exc.SQLAlchemyError as exc:
            log.warning("that %s never started is not recorded: %s", eid, _brief(exc))
            self._spool(eid, claim.lease_token, {"status": "not_started", "reason": reason}, late)
        log.warning("%s: %s; it was not started", eid, reason)
        return Outcome("stale", eid)

    def _before_tool(
        self, claim: Claim, ctx: ToolContext
    ) -> tuple[Tool | None, tuple[Status, dict[str, Any] | None, str | None] | None]:
        """The tool to run (3+4, outside any transaction: ``run_tool`` classifies what it
        reported), or the outcome that ends the execution without it: a tool no longer
        registered; an automatic retry whose target moved on (``_still_absent``)."""
        try:
            tool = self.registry.get(claim.tool)
        except UnknownTool as exc:
            return None, (Status.FAILED, {"error": "refused", "message": str(exc)}, str(exc))
        if claim.attempt > 1 and tool.auto_retry and self.ledger.retried_automatically(claim):
            stale = self._still_absent(tool, claim, ctx)
            if stale is not None:
                return tool, stale
        return tool, None

    def _still_absent(
        self, tool: Tool, claim: Claim, ctx: ToolContext
    ) -> tuple[Status, dict[str, Any], str | None] | None:
        """An automatic retry was authorised on the reconciler's word that the effect is
        absent: ask again now. If the world moved on meanwhile (another call wrote the path),
        applying it late would overwrite newer bytes: it ends without running."""
        assert tool.reconcile is not None
        try:
            found = tool.reconcile(tool.parse(claim.args), ctx)
        except SoftTimeLimitExceeded:
            raise  # out of time, not "the target changed": never started (the caller)
        except Exception as exc:  # noqa: BLE001 - cannot tell: do not apply it late
            found = None  # its class above DEBUG: a tool's text may quote the arguments
            log.warning(
                "reconciler of %s failed before its retry: %s",
                claim.execution_id,
                type(exc).__name__,
            )
            log.debug("reconciler of %s failed before its retry: %s", claim.execution_id, exc)
        if isinstance(found, Absent):
            return None
        if isinstance(found, Evidence):
            return found.status, storable_object(found.result), None  # it holds: nothing to write
        superseded = {
            "error": "superseded",
            "message": "the target changed after this automatic retry was authorised; "
            "nothing was written",
        }
        return Status.FAILED, superseded, "superseded"

    # ------------------------------------------------------------------ the terminal write

    def _record(
        self,
        claim: Claim,
        status: Status,
        result: dict[str, Any] | None,
        error: str | None,
        staged: list[Staged],
    ) -> Outcome:
        """5. The terminal write, a compare-and-set on status and lease token.

        A COMMIT can succeed on the server while the client sees an error (celery#10271), so
        after any database error the row is re-read before trying again. A result that can
        still not be recorded (retries exhausted, the soft time limit) is spooled on disk.
        """
        pause = TERMINAL_BACKOFF_SECONDS
        ambiguous = False  # a try failed: its commit may have succeeded all the same
        lost: str | None = None  # the last try's database error, for a late result's record
        try:
            for tries_left in range(TERMINAL_RETRIES - 1, -1, -1):
                try:
                    return self._write_terminal(claim, status, result, error, staged)
                except StaleFence:
                    if not ambiguous:
                        return self._late(claim, status, result, error, staged)
                    # the row left running: maybe by our own earlier commit, whose answer was
                    # lost. Only the row can tell (a cold review: read as a revocation, a
                    # committed success's bytes were dropped, and verify said ok)
                    written = self._already_written(claim, status, result, error, staged, lost)
                    if written is not None:
                        return written
                    log.warning(
                        "terminal write of %s: the row left running, unreadable for now",
                        claim.execution_id,
                    )
                except sa.exc.SQLAlchemyError as exc:
                    ambiguous, lost = True, _brief(exc)
                    log.warning("terminal write of %s failed: %s", claim.execution_id, lost)
                if not tries_left:
                    break
                time.sleep(pause)
                pause *= 2
                written = self._already_written(claim, status, result, error, staged, lost)
                if written is not None:
                    return written
        except SoftTimeLimitExceeded:
            log.warning("soft time limit while recording %s", claim.execution_id)
        return self._unrecorded(claim, status, result, error, staged)

    def _write_terminal(
        self,
        claim: Claim,
        status: Status,
        result: dict[str, Any] | None,
        error: str | None,
        staged: list[Staged],
    ) -> Outcome:
        if status is Status.UNKNOWN:
            self.ledger.mark_unknown(
                claim.execution_id,
                reason=error or "outcome unknown",
                actor=self.worker_id,
                lease_token=claim.lease_token,
            )
            metrics.transition(claim.tool, status)
            return Outcome("unknown", claim.execution_id, status, None)
        assert result is not None
        effects = [s.to_json() for s in staged] or None
        done = self.ledger.finish(
            claim.execution_id,
            claim.lease_token,
            status,
            result,
            error=error,
            effects=effects,
            lock_keys=lock_keys(claim.scope, staged),
        )
        metrics.transition(claim.tool, status)
        return Outcome("finished", claim.execution_id, status, result, done.seq)

    def _already_written(
        self,
        claim: Claim,
        status: Status,
        result: dict[str, Any] | None,
        error: str | None,
        staged: list[Staged],
        lost: str | None = None,
    ) -> Outcome | None:
        try:
            state = self.ledger.effect_states([claim.execution_id]).get(claim.execution_id)
        except sa.exc.SQLAlchemyError:
            return None
        if state is None or state.status is Status.RUNNING:
            return None  # not written yet: try again
        if state.holds_own_write(status):
            metrics.transition(claim.tool, status)  # our commit did land
            return Outcome("finished", claim.execution_id, status, result, state.seq)
        return self._late(claim, status, result, error, staged, lost)

    def _late(
        self,
        claim: Claim,
        status: Status,
        result: dict[str, Any] | None,
        error: str | None,
        staged: list[Staged],
        lost: str | None = None,
    ) -> Outcome:
        """The row is no longer ours: the execution was revoked. Its staged effects will be
        dropped, never landed; its result is kept as evidence for recovery, with the database
        error that kept its terminal write from the ledger if one did (``write_error``): why it
        came late. Without it a Postgres crash that held the write until the sweep revoked the
        execution left no word of itself in the ledger, and the chaos checker found the unknown
        unexplained (CI's threads run, 12-07: 2 such)."""
        metrics.stale_result()
        detail = self._late_detail(claim, status, result, error, staged)
        if lost:
            detail["write_error"] = lost
        try:
            self.ledger.record_late_result(
                claim.execution_id,
                detail,
                actor=self.worker_id,
                outcome=self._proves(status, staged),
                idempotent=detail["idempotent"],
            )
        except sa.exc.SQLAlchemyError as exc:
            log.warning("late result of %s not recorded: %s", claim.execution_id, _brief(exc))
            self._spool(claim.execution_id, claim.lease_token, {"status": "revoked"}, detail)
        log.warning(
            "%s was revoked: its late result is evidence, its effects never land",
            claim.execution_id,
        )
        return Outcome("stale", claim.execution_id, status, result)

    @staticmethod
    def _proves(status: Status, staged: list[Staged]) -> Status | None:
        """What a late result says about the world: nothing if its sandbox effects were
        refused (the report describes bytes that never landed), else the tool's own word."""
        if status is Status.UNKNOWN or staged:
            return None
        return status

    def _late_detail(
        self,
        claim: Claim,
        status: Status,
        result: dict[str, Any] | None,
        error: str | None,
        staged: list[Staged],
    ) -> dict[str, Any]:
        proves = self._proves(status, staged)
        return {
            "late_result": result,
            "status": status.value,
            "error": error,
            "worker_id": self.worker_id,
            "attempt": claim.attempt,
            "staged": [s.to_json() for s in staged],
            "landed": False,
            "proves": proves.value if proves else None,
            "idempotent": claim.tool in self.registry and self.registry.get(claim.tool).idempotent,
        }

    def _unrecorded(
        self,
        claim: Claim,
        status: Status,
        result: dict[str, Any] | None,
        error: str | None,
        staged: list[Staged],
    ) -> Outcome:
        record = {
            "status": status.value,
            "result": result,
            "error": error,
            "reason": error,
            "effects": [s.to_json() for s in staged] or None,
            "proves": (p.value if (p := self._proves(status, staged)) else None),
        }
        late = self._late_detail(claim, status, result, error, staged)
        if self._spool(claim.execution_id, claim.lease_token, record, late):
            log.error(
                "could not record %s of %s: spooled; the worker's next start or the next sweep "
                "records it (under its lease if still running, else as evidence)",
                status.value,
                claim.execution_id,
            )
            return Outcome("unrecorded", claim.execution_id, status, result)
        # Said as it is (helper-90: a full disk took neither, and this said "spooled"): the
        # sweep will find the execution unknown, its effect possibly applied, for a person.
        log.error(
            "could not record %s of %s, nor keep it on disk: lost; the sweep will find it "
            "unknown (its effect may have happened)",
            status.value,
            claim.execution_id,
        )
        return Outcome("unrecorded", claim.execution_id, status, result, kept=False)

    def _spool(self, eid: str, token: str, record: dict[str, Any], late: dict[str, Any]) -> bool:
        marker = f"{eid}:{time.time_ns()}"
        full = {
            "execution_id": eid,
            "lease_token": token,
            **record,
            "late": {**late, "spool": marker},
        }
        try:
            effects_of(self.sandbox).spool(eid, full)
        except OSError as exc:
            log.error("could not spool the outcome of %s either: %s", eid, exc)
            return False
        return True

    # ------------------------------------------------------------------ landing

    def _land(self, claim: Claim, outcome: Outcome, staged: list[Staged]) -> Outcome:
        """6. After the commit: land the effects (own success), or drop them (anything
        else). An unrecorded outcome keeps them: settle decides once the ledger answers."""
        if not staged or outcome.state == "unrecorded":
            return outcome
        effects, eid = effects_of(self.sandbox), claim.execution_id
        if outcome.state == "finished" and outcome.status is Status.SUCCEEDED:
            commit = Commit(eid, outcome.seq, claim.scope, claim.idempotency_key, claim.attempt)
            try:
                landing = effects.publish(commit, staged, self.ledger)
            except OSError as exc:
                log.error(
                    "effects of %s not landed yet (%s): settle lands them", claim.execution_id, exc
                )
                return outcome
            return dataclasses.replace(outcome, landing=landing)
        effects.discard(claim.execution_id)
        return outcome

    def run_read_only(
        self, scope: str, tool: Tool, args: dict[str, Any]
    ) -> tuple[Status, dict[str, Any] | None]:
        """A read-only tool runs at once: no approval, no claim, nothing recorded.

        It reads what the ledger says happened: effects already committed but not yet landed
        (a receipt is given at the commit; the bytes move a moment later, or after a crash at
        the next settle) are landed first, so a read that follows a receipt sees its write."""
        if not tool.read_only:
            raise ValueError(f"{tool.name} is not read-only")
        effects = effects_of(self.sandbox)
        if effects.has_pending():
            try:
                landing = effects.settle(self.ledger, actor="read")
            except Exception as exc:  # noqa: BLE001 - a read still runs; it says what it saw
                log.warning("could not settle pending effects before a read: %s", exc)
            else:
                if landing.unlanded:  # committed bytes the sandbox cannot take now
                    return Status.FAILED, _not_settled(
                        f"{len(landing.unlanded)} committed effect(s) in the sandbox could "
                        f"not land before this read ({landing.unlanded[0]})"
                    )
        view = SettledReads(effects, self.ledger)
        status, result, _error = run_tool(tool, args, ToolContext(scope, view))
        if view.refused is not None:  # whatever the tool made of the refusal
            return Status.FAILED, _not_settled(view.refused)
        return status, result


class NotSettled(SandboxError):
    """A read-only tool read a path whose committed bytes have not landed."""


class SettledReads(Sandbox):
    """The sandbox as a read-only tool sees it: a path is read only once no bytes committed
    for it wait to land (``Effects.unlanded_on``, which lands them first). The settle before
    the tool runs passes over a path whose lock a frozen lander holds, or that a full disk
    refuses: a read of it returned the old bytes after the call's succeeded receipt (a cold
    review). Such a read is refused, ``not_settled``; other paths read as ever."""

    def __init__(self, effects: Effects, book: Ledger) -> None:
        base = effects.sandbox
        super().__init__(
            base.root, base.max_content_bytes, effects_log=base.effects_log,
            lock_wait=base.lock_wait,
        )  # fmt: skip
        self._effects, self._book = effects, book
        self.refused: str | None = None

    def _settled(self, scope: str, path: str) -> None:
        why = self._effects.unlanded_on(self._book, scope, path)
        if why is not None:
            self.refused = self.refused or why
            raise NotSettled(why)

    def read(self, scope: str, path: str, max_bytes: int | None = None) -> bytes | None:
        self._settled(scope, path)
        return super().read(scope, path, max_bytes)

    def sha256(self, scope: str, path: str) -> str | None:
        self._settled(scope, path)
        return super().sha256(scope, path)

    def stat(self, scope: str, path: str) -> os.stat_result | None:
        self._settled(scope, path)
        return super().stat(scope, path)


def _not_settled(why: str) -> dict[str, Any]:
    """A read refused because committed effects could not land first (a full disk, a
    quota, EIO, a frozen lander holding the path): it would have read what they replace, a
    cut-off append included, as the file (a cold review)."""
    return {
        "error": "not_settled",
        "message": (
            f"{why}: the read would not see them, so nothing was read. Read again once "
            "they land (the next sweep lands them)."
        ),
    }


def run_tool(
    tool: Tool, raw_args: dict[str, Any], ctx: ToolContext
) -> tuple[Status, dict[str, Any] | None, str | None]:
    """Run a tool and classify what it reported: (status, result, error). Whatever a tool
    raises ends in something the ledger can store: a failure's detail goes through the same
    JSON round trip as a result, its message is text a column takes."""
    try:
        result = storable_object(tool.run(tool.parse(raw_args), ctx))
    except Exception as exc:  # noqa: BLE001 - classified below
        try:
            status, detail, error = _failure(tool, ctx, exc)
        except SoftTimeLimitExceeded:  # the time limit, while its error was being read
            return (
                Status.UNKNOWN,
                None,
                f"SoftTimeLimitExceeded: while reading {type(exc).__name__}",
            )
        return status, (None if detail is None else storable_object(detail)), valid_line(error)
    return Status.SUCCEEDED, result, None


def _shown(exc: BaseException) -> str:
    """``str(exc)``, or what can be said when that raises."""
    try:
        return str(exc)
    except SoftTimeLimitExceeded:
        raise  # the time limit, not the tool's text: the call's outcome is unknown
    except Exception:  # noqa: BLE001 - a tool's exception class is the tool's code
        return f"({type(exc).__name__} could not be shown)"


def _failure(
    tool: Tool, ctx: ToolContext, exc: Exception
) -> tuple[Status, dict[str, Any] | None, str]:
    """What a tool's exception says happened: (status, result, error)."""
    name, text = type(exc).__name__, _shown(exc)
    if isinstance(exc, InvalidToolArguments | SandboxError):
        # Refused before any byte was staged: a clean failure.
        return Status.FAILED, {"error": "refused", "message": text}, text
    if isinstance(exc, ToolError):
        message = exc.message if isinstance(exc.message, str) else text  # str() of it
        return Status.FAILED, {"error": "tool_error", "message": message, **exc.detail}, message
    if isinstance(exc, OutcomeUnknown | SoftTimeLimitExceeded | LeaseLost):
        return Status.UNKNOWN, None, f"{name}: {text}"
    # any other error is the tool reporting failure
    message = f"{name}: {text}"
    # the class only at WARNING: an exception's text may quote the call's arguments
    log.warning("tool %s failed in %s: %s", tool.name, ctx.execution_id, name)
    log.debug("tool %s failed in %s: %s", tool.name, ctx.execution_id, message)
    return Status.FAILED, {"error": name, "message": text}, message
