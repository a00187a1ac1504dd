"""The execute pipeline (DESIGN §5): claim → running → effect → terminal, step by step.

Used by the Celery task and by ``toolledger execute`` alike. Crash windows are marked with
failpoints; what recovery does after a crash in each one is tested.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from billiard.exceptions import SoftTimeLimitExceeded

from ledger.errors import NotFound, StaleFence
from ledger.identity import new_execution_id, new_lease_token
from ledger.ledger import Ledger
from ledger.records import Claim
from ledger.transitions import Status
from worker import failpoints
from worker.sandbox import Sandbox, SandboxError
from worker.tools import (
    InvalidToolArguments,
    OutcomeUnknown,
    Registry,
    Tool,
    ToolContext,
    ToolError,
    UnknownTool,
)

log = logging.getLogger("toolledger.worker")

#: How many times a terminal write is retried after a database error, and the first pause.
TERMINAL_RETRIES = 6
TERMINAL_BACKOFF_SECONDS = 0.2


@dataclass(frozen=True)
class Outcome:
    """What one delivery of a job did."""

    state: Literal["finished", "lost", "unknown", "stale", "unrecorded"]
    execution_id: str | None = None
    status: Status | None = None
    result: dict[str, Any] | None = None


class LeaseKeeper:
    """Renews the leases of every claim running in this process, each every lease/3, by the
    database clock — one long-lived thread, not one per job (profiling showed starting and
    joining a thread per job costing more than a round trip).

    If a renewal finds the row no longer ours (a sweep declared it unknown), that claim's
    ``lost`` event is set: the tool is told through ``ctx.lease_lost`` to start nothing new.
    """

    def __init__(self, ledger: Ledger, lease_seconds: float) -> None:
        self.ledger, self.lease_seconds = ledger, lease_seconds
        self.interval = lease_seconds / 3
        self._cv = threading.Condition()
        self._due: dict[str, tuple[Claim, float, threading.Event]] = {}
        self._thread: threading.Thread | None = None

    def track(self, claim: Claim) -> threading.Event:
        lost = threading.Event()
        with self._cv:
            idle = not self._due
            self._due[claim.execution_id] = (claim, time.monotonic() + self.interval, lost)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="toolledger-leases", daemon=True
                )
                self._thread.start()
            elif idle:
                # Only an idle keeper sleeps past this claim's first renewal (a new claim is
                # never due before the ones already tracked); waking it for every claim would
                # cost a thread switch per job.
                self._cv.notify()
        return lost

    def untrack(self, claim: Claim) -> None:
        with self._cv:
            self._due.pop(claim.execution_id, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                now = time.monotonic()
                due = [entry for entry in self._due.values() if entry[1] <= now]
                if not due:
                    wake = min((entry[1] for entry in self._due.values()), default=now + 60)
                    self._cv.wait(timeout=wake - now)
                    continue
            for claim, _, lost in due:
                self._renew(claim, lost)

    def _renew(self, claim: Claim, lost: threading.Event) -> None:
        try:
            ours = self.ledger.renew_lease(
                claim.execution_id, claim.lease_token, self.lease_seconds
            )
        except sa.exc.SQLAlchemyError as exc:  # keep trying until the lease runs out
            log.warning("lease renewal of %s failed: %s", claim.execution_id, exc)
            ours = True
        with self._cv:
            if claim.execution_id not in self._due:
                return  # finished meanwhile
            if not ours:
                log.warning("lease of %s lost: the row is no longer ours", claim.execution_id)
                lost.set()
                del self._due[claim.execution_id]
            else:
                self._due[claim.execution_id] = (claim, time.monotonic() + self.interval, lost)


def _json_safe(result: Any) -> dict[str, Any]:
    """The tool's return value as a JSON object (a tool must return one; be lenient)."""
    value = result if isinstance(result, dict) else {"result": result}
    try:  # round-trip, so what is stored, replayed and compared is the same object
        return json.loads(json.dumps(value, allow_nan=False))  # type: ignore[no-any-return]
    except (TypeError, ValueError):
        return {"result_repr": repr(result)[:2000], "warning": "tool result was not JSON"}


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
    ) -> None:
        self.ledger, self.registry, self.sandbox = ledger, registry, sandbox
        self.worker_id, self.lease_seconds = worker_id, lease_seconds
        self.leases = leases or LeaseKeeper(ledger, lease_seconds)

    def execute(self, scope: str, key: str, attempt: int) -> Outcome:
        # 1+2. The claim reads the operation and inserts the execution row in one commit:
        # not approved, not this attempt, or someone else's → nothing runs.
        claim = self._claim(scope, key, attempt)
        if claim is None:
            return Outcome("lost")
        # running is durable now: a crash from here on leaves evidence the effect may have begun.
        failpoints.hit("after_claim", claim.execution_id)
        lost = self.leases.track(claim)
        try:
            ctx = ToolContext(scope, self.sandbox, claim.execution_id, key, attempt, lost)
            failpoints.hit("before_effect", claim.execution_id)
            status, result, error = self._run_tool(claim, ctx)
            # The effect happened (or not) and nothing records it yet: the widest crash window.
            failpoints.hit("after_effect", claim.execution_id)
        finally:
            self.leases.untrack(claim)
        outcome = self._record(claim, status, result, error)
        failpoints.hit("after_terminal", claim.execution_id)
        return outcome

    def _claim(self, scope: str, key: str, attempt: int) -> Claim | None:
        """The claim, robust to an error around its commit: the id and token are ours, so
        after a database error the row is re-read to learn whether the claim is ours."""
        execution_id, token = new_execution_id(), new_lease_token()
        pause = TERMINAL_BACKOFF_SECONDS
        for tries_left in range(TERMINAL_RETRIES - 1, -1, -1):
            try:
                return self.ledger.claim(
                    scope,
                    key,
                    attempt,
                    worker_id=self.worker_id,
                    lease_seconds=self.lease_seconds,
                    execution_id=execution_id,
                    lease_token=token,
                )
            except sa.exc.SQLAlchemyError as exc:
                if not tries_left:
                    raise
                log.warning("claim of %s/%s#%s failed: %s; re-reading", scope, key, attempt, exc)
                time.sleep(pause)
                pause *= 2
                try:
                    mine = self.ledger.claimed(execution_id, token)
                except sa.exc.SQLAlchemyError:
                    continue
                if mine is not None:
                    return mine
        return None

    def _run_tool(
        self, claim: Claim, ctx: ToolContext
    ) -> tuple[Status, dict[str, Any] | None, str | None]:
        """3+4. Run the tool outside any transaction; classify what it reported."""
        try:
            tool = self.registry.get(claim.tool)
        except UnknownTool as exc:
            return Status.FAILED, {"error": "refused", "message": str(exc)}, str(exc)
        return run_tool(tool, claim.args, ctx)

    def _record(
        self, claim: Claim, status: Status, result: dict[str, Any] | None, error: str | None
    ) -> Outcome:
        """5. The terminal write, a compare-and-set on status and lease token.

        A COMMIT can succeed on the server while the client sees an error (celery#10271), so
        after any database error the row is re-read before trying again.
        """
        pause = TERMINAL_BACKOFF_SECONDS
        for _ in range(TERMINAL_RETRIES):
            try:
                return self._write_terminal(claim, status, result, error)
            except StaleFence:
                return self._late(claim, status, result, error)
            except sa.exc.SQLAlchemyError as exc:
                log.warning("terminal write of %s failed: %s; re-reading", claim.execution_id, exc)
                time.sleep(pause)
                pause *= 2
                written = self._already_written(claim, status, result)
                if written is not None:
                    return written
        log.error(
            "could not record %s of %s (%s); it stays running until its lease expires and the "
            "sweep declares it unknown. Result was: %r",
            status,
            claim.execution_id,
            error,
            result,
        )
        return Outcome("unrecorded", claim.execution_id, status, result)

    def _write_terminal(
        self, claim: Claim, status: Status, result: dict[str, Any] | None, error: str | None
    ) -> Outcome:
        if status is Status.UNKNOWN:
            self.ledger.mark_unknown(
                claim.execution_id,
                reason=error or "outcome unknown",
                actor=self.worker_id,
                lease_token=claim.lease_token,
            )
            return Outcome("unknown", claim.execution_id, status, None)
        assert result is not None
        self.ledger.finish(claim.execution_id, claim.lease_token, status, result, error=error)
        return Outcome("finished", claim.execution_id, status, result)

    def _already_written(
        self, claim: Claim, status: Status, result: dict[str, Any] | None
    ) -> Outcome | None:
        try:
            row = self.ledger.execution(claim.execution_id)
        except (sa.exc.SQLAlchemyError, NotFound):
            return None
        if row.status is status and row.result == result:
            return Outcome("finished", claim.execution_id, status, result)
        if row.status is not Status.RUNNING or row.lease_token != claim.lease_token:
            return self._late(claim, status, result, None)
        return None

    def _late(
        self, claim: Claim, status: Status, result: dict[str, Any] | None, error: str | None
    ) -> Outcome:
        """The row is no longer ours: keep the late result as evidence for recovery."""
        detail = {
            "late_result": result,
            "status": status.value,
            "error": error,
            "worker_id": self.worker_id,
            "attempt": claim.attempt,
        }
        try:
            self.ledger.record_evidence(claim.execution_id, detail, actor=self.worker_id)
        except sa.exc.SQLAlchemyError as exc:
            log.error("could not record the late result of %s: %s", claim.execution_id, exc)
        log.warning("%s was no longer ours; its late result is evidence", claim.execution_id)
        return Outcome("stale", claim.execution_id, status, result)

    def run_read_only(
        self, scope: str, tool: Tool, args: dict[str, Any]
    ) -> tuple[Status, dict[str, Any] | None]:
        """A read-only tool runs at once: no approval, no claim, nothing recorded."""
        if not tool.read_only:
            raise ValueError(f"{tool.name} is not read-only")
        status, result, _error = run_tool(tool, args, ToolContext(scope, self.sandbox))
        return status, result


def run_tool(
    tool: Tool, raw_args: dict[str, Any], ctx: ToolContext
) -> tuple[Status, dict[str, Any] | None, str | None]:
    """Run a tool and classify what it reported: (status, result, error)."""
    try:
        result = _json_safe(tool.run(tool.parse(raw_args), ctx))
    except (InvalidToolArguments, SandboxError) as exc:
        # Refused before any byte was written: a clean failure.
        return Status.FAILED, {"error": "refused", "message": str(exc)}, str(exc)
    except ToolError as exc:
        detail = {"error": "tool_error", "message": exc.message, **exc.detail}
        return Status.FAILED, detail, exc.message
    except (OutcomeUnknown, SoftTimeLimitExceeded) as exc:
        return Status.UNKNOWN, None, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - any other error is the tool reporting failure
        message = f"{type(exc).__name__}: {exc}"
        log.warning("tool %s failed in %s: %s", tool.name, ctx.execution_id, message)
        return Status.FAILED, {"error": type(exc).__name__, "message": str(exc)}, message
    return Status.SUCCEEDED, result, None
