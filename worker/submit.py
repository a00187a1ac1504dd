"""Submitting and deciding calls from the edge (CLI, Python API): validate, record, enqueue.

Order matters: every check that needs no database runs before anything is recorded (refused
input leaves no trace); the call is committed before its message is published (outbox). The
commit also stamps ``enqueued_at`` (saving a second commit per call); a publish that fails
clears it again, so the operation is visibly approved and unpublished, and the sweep
re-publishes it. A crash between the commit and the publish leaves the stamp: the sweep
re-publishes that one too, once the stamp is older than TOOLLEDGER_REQUEUE_AFTER.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from toolledger.config import Settings
from toolledger.ledger.errors import InputError, NotFound
from toolledger.ledger.identity import PROXIED_PREFIX, check_call, check_new_tool_call_id
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.records import OperationRecord
from toolledger.ledger.transitions import Status
from toolledger.observability import logs, tracing
from toolledger.registry import load_registry
from toolledger.sandbox import Sandbox
from toolledger.tools import Registry, ToolContext, UnknownTool

if TYPE_CHECKING:
    from celery import Celery  # imported by ``app`` and ``enqueue``: a call left pending needs none

log = logging.getLogger("toolledger.submit")

#: Seconds after which a replayed submit of an approved call nobody claimed publishes it again.
REPUBLISH_AFTER = 5.0


def _a_workers(op: OperationRecord) -> bool:
    """Whether a replay may publish the call for a worker, as the sweep's re-publish would:
    not an upstream's tool the MCP proxy recorded (a proxy sends it: a worker handed one ended
    it failed, the upstream never asked), not a call flagged for review (its claim is refused
    until a person has reviewed it) (a cold review)."""
    return op.review is None and not op.tool.startswith(PROXIED_PREFIX)


def lost_after(op: OperationRecord) -> float | None:
    """Seconds until a call approved, stamped as published and unclaimed counts as lost
    (``Submitter.publish_if_lost``; negative: it does now), or None if it never can: not
    approved (claimed, ended, waiting for a person), never stamped, or not a worker's."""
    if op.status is not Status.APPROVED or op.enqueued_at is None or not _a_workers(op):
        return None
    return REPUBLISH_AFTER - (datetime.now(UTC) - op.enqueued_at).total_seconds()


@dataclass(frozen=True)
class PreparedCall:
    """A call that passed every check that needs no database."""

    scope: str
    tool_call_id: str
    tool: str
    args: dict[str, Any]
    key: str
    args_sha256: str
    read_only: bool


def _summary(op: OperationRecord, scope: str, tool_call_id: str) -> dict[str, Any]:
    return {
        "scope": scope,
        "tool_call_id": tool_call_id,
        "idempotency_key": op.idempotency_key,
        "tool": op.tool,
        "status": op.status.value,
        "args_sha256": op.args_sha256,
    }


class Submitter:
    """Validates, records and enqueues calls. One per process; reuses its broker connection."""

    def __init__(
        self,
        settings: Settings,
        *,
        ledger: Ledger | Callable[[], Ledger] | None = None,
        registry: Registry | None = None,
        app: Celery | None = None,
    ) -> None:
        self.settings = settings
        self._ledger_factory = ledger if callable(ledger) else None
        self._ledger = None if callable(ledger) else ledger
        self.registry = registry if registry is not None else load_registry(settings.tools)
        self.sandbox = Sandbox.configured(settings)
        self._app = app
        tracing.configure()  # OTEL_* set: the submit spans are exported (else nothing)

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            # every wait bounded by db_timeout, as a worker's and the CLI's: unbounded, a write
            # behind a lock on Postgres waited for ever, each one a thread of `serve` (helper-91:
            # 45 approvals behind one row lock left no thread to answer even a read) or a
            # client's submit held as long as the lock
            factory = self._ledger_factory or (
                lambda: Ledger(
                    self.settings.db,
                    max_args_bytes=self.settings.max_args_bytes,
                    timeout=self.settings.db_timeout,
                )
            )
            self._ledger = factory()
        return self._ledger

    @cached_property
    def app(self) -> Celery:
        if self._app is not None:
            return self._app
        from toolledger.worker.app import create_app

        return create_app(self.settings)

    def prepare(
        self,
        scope: str,
        tool_call_id: str,
        tool: str,
        args: dict[str, Any],
        key: str | None = None,
        *,
        replay: bool = True,
    ) -> PreparedCall:
        """Identifiers, size, tool name, schema and sandbox paths — before any write.

        A call the ledger already holds, the same (tool, key, arguments), passes even where
        the tool's schema or its check would refuse it now (the tool gone from this
        process's registry, a file since hard-linked, a schema since narrowed): asking for it
        again is a replay, answered with its receipt, never a refusal, which told the model
        that a call that took effect had failed (and invited it to issue it again).

        ``replay=False`` says the ledger holds no call (the CLI, where the embedded ledger's
        file does not exist yet): a refusal stands without reading it, so a refused call
        does not make the ledger only to look into it (a cold review)."""
        key, sha = check_call(scope, tool_call_id, tool, args, key, self.settings.max_args_bytes)
        try:
            check_new_tool_call_id(tool_call_id)
            spec = self.registry.get(tool)
            parsed = spec.parse(args)
            spec.refuse(parsed, ToolContext(scope, self.sandbox))
        except (InputError, UnknownTool):
            if replay and self._recorded_as(scope, tool_call_id, tool, key, sha):
                return PreparedCall(scope, tool_call_id, tool, args, key, sha, False)
            raise
        return PreparedCall(scope, tool_call_id, tool, args, key, sha, spec.read_only)

    def _recorded_as(self, scope: str, tool_call_id: str, tool: str, key: str, sha: str) -> bool:
        """The ledger holds this call: its id bound to ``key``, whose action is ``tool`` on
        these arguments. Read only where a check refused (a new call never pays for it); a
        ledger that cannot answer leaves the refusal standing."""
        try:
            if self.ledger.key_for(scope, tool_call_id) != key:
                return False
            op = self.ledger.operation(scope, key)
        except Exception:  # noqa: BLE001 - not found, or no answer: the refusal stands
            return False
        return op.tool == tool and op.args_sha256 == sha

    def submit(
        self,
        call: PreparedCall,
        *,
        approved_by: str | None = None,
        reason: str | None = None,
        actor: str = "agent",
    ) -> dict[str, Any]:
        """Record the call (or run it, if read-only) and enqueue it if approved; ``actor``
        is who submitted it (the HTTP API: the token's name)."""
        if call.read_only:
            # Nothing is recorded, but the id may be: a read under a tool_call_id recorded
            # for another call ran and answered for it, where a write was refused (exit 3;
            # a cold review); its key recorded for another action is the same conflict
            conflict = self.ledger.conflict_of(
                call.scope, call.tool_call_id, call.key, call.tool, call.args_sha256
            )
            if conflict is not None:
                raise conflict
            return self._read_only(call)
        attrs = {
            "gen_ai.operation.name": "submit_tool",
            "gen_ai.tool.name": call.tool,
            "gen_ai.tool.call.id": call.tool_call_id,
            "toolledger.scope": call.scope,
            "toolledger.idempotency_key": call.key,
        }
        with tracing.span(f"submit_tool {call.tool}", attrs) as span:
            out = self._submit(call, approved_by, reason, actor)
            outcome = out["outcome"]
            tracing.annotate(
                span, {"toolledger.status": out["status"], "toolledger.outcome": outcome}
            )
            if span is not None and outcome != "created":
                # a replay (an agent restarted: another trace) or a new id linked to the key:
                # found from the call's own trace, as its approval and execution are
                for link in tracing.links_to(self._call_trace(call.scope, call.tool_call_id)):
                    span.add_link(link.context, link.attributes)
            return out

    def _submit(
        self, call: PreparedCall, approved_by: str | None, reason: str | None, actor: str
    ) -> dict[str, Any]:
        submitted = self.ledger.submit(
            call.scope,
            call.tool_call_id,
            call.tool,
            call.args,
            key=call.key,
            approved_by=approved_by,
            reason=reason,
            actor=actor,
            stamp_enqueued=True,
            trace=tracing.carrier(),  # the submit span's, kept with the call (no statement)
        )
        op = submitted.operation
        out = _summary(op, call.scope, call.tool_call_id)
        out["outcome"] = submitted.outcome
        if approved_by is not None and submitted.outcome != "created":
            # the approval is not the submit's to give: said, not silently dropped. A new
            # tool_call_id linked to a recorded key is no existing call: its key's action is
            # what waits or was rejected (a cold review)
            what = (
                "the call already exists"
                if submitted.outcome == "existing"
                else f"its key {op.idempotency_key!r} names an action recorded before"
            )
            if op.status is Status.PENDING_APPROVAL:
                out["warning"] = (
                    f"{what}, waiting for approval: this submit's approval by {approved_by!r} "
                    "was not applied (approve it: toolledger approve, or POST .../approve)"
                )
            elif op.status is Status.REJECTED:  # said as "rejected" alone, exit 0 (a review)
                out["warning"] = (
                    f"{what}, and it was rejected: this submit's approval by {approved_by!r} "
                    "was not applied (a rejected action stays rejected: another is submitted "
                    "under a new tool_call_id, and a new --key if one was given)"
                )
        attempt, call_id = op.authorized_attempts, call.tool_call_id
        if op.status is Status.APPROVED and submitted.outcome == "created":
            out.update(
                self.enqueue(
                    op.scope,
                    op.idempotency_key,
                    attempt,
                    stamped=True,
                    tool_call_id=call_id,
                    tool=op.tool,
                )
            )
        else:
            out.update(self._publish_again(op, call_id) or {})
        return out

    def _publish_again(self, op: OperationRecord, tool_call_id: str) -> dict[str, Any] | None:
        """A replay's publish (a submit or a decision given again): a call approved and
        never stamped published, one stamped and lost published again (``publish_if_lost``),
        else none (the enqueue's report, or None)."""
        if not _a_workers(op):
            return None  # a proxy's call (a proxy sends it), or one flagged (no claim takes it)
        if op.status is Status.APPROVED and not op.enqueued_at:
            return self.enqueue(
                op.scope,
                op.idempotency_key,
                op.authorized_attempts,
                tool_call_id=tool_call_id,
                tool=op.tool,
            )
        return self.publish_if_lost(op, tool_call_id)

    def publish_if_lost(self, op: OperationRecord, tool_call_id: str) -> dict[str, Any] | None:
        """Publish again a call approved, stamped more than ``REPUBLISH_AFTER`` ago and still
        unclaimed (the enqueue's report), else None: its publish may have died with the
        process that stamped it (killed between the commit and the publish), and the sweep
        re-publishes it only after requeue_after (120 s): a crashed agent's run_turn, run
        again, waited out its timeout (a cold review). A replayed submit asks (a wait does
        not: README, Known limitations). Published again, the stamp renewed: a second message
        is harmless, the claim decides which one runs."""
        left = lost_after(op)
        if left is None or left >= 0:
            return None
        attempt = op.authorized_attempts
        return self.enqueue(
            op.scope, op.idempotency_key, attempt, tool_call_id=tool_call_id, tool=op.tool
        )

    def _read_only(self, call: PreparedCall) -> dict[str, Any]:
        from toolledger.worker.pipeline import Executor

        spec = self.registry.get(call.tool)
        executor = Executor(
            self.ledger,
            self.registry,
            self.sandbox,
            worker_id="read-only",
            lease_seconds=self.settings.lease_seconds,
        )
        status, result = executor.run_read_only(call.scope, spec, call.args)
        return {
            "scope": call.scope,
            "tool_call_id": call.tool_call_id,
            "tool": call.tool,
            "idempotency_key": call.key,
            "args_sha256": call.args_sha256,
            "status": status.value,
            "outcome": "read_only",
            "recorded": False,
            "result": result,
        }

    def decide(
        self, scope: str, tool_call_id: str, by: str, reason: str | None, *, approve: bool
    ) -> dict[str, Any]:
        """Approve (and enqueue) or reject a pending call. Its span links to the call's
        submit span, and so does the execution an approval publishes (``tracing.for_call``):
        a person's decision, made later in another process, is found from the call's trace."""
        attrs = {"toolledger.scope": scope, "gen_ai.tool.call.id": tool_call_id}
        name = "approve_tool" if approve else "reject_tool"
        trace = self._call_trace(scope, tool_call_id)
        with (
            tracing.span(name, attrs, links=tracing.links_to(trace)) as span,
            tracing.for_call(trace),
        ):
            out = self._decide(scope, tool_call_id, by, reason, approve=approve)
            tracing.annotate(span, {"toolledger.status": out["status"]}, f"{name} {out['tool']}")
            return out

    def _call_trace(self, scope: str, tool_call_id: str) -> dict[str, str] | None:
        """The trace context the call was submitted under (``Ledger.call_traces``), read only
        when this process traces; a call not found (the decision says so) or a ledger that
        does not answer: none."""
        if not tracing.active():
            return None
        import sqlalchemy as sa

        try:
            key = self.ledger.key_for(scope, tool_call_id)
            return self.ledger.call_traces([(scope, key)]).get((scope, key))
        except (NotFound, sa.exc.SQLAlchemyError):
            return None

    def _decide(
        self, scope: str, tool_call_id: str, by: str, reason: str | None, *, approve: bool
    ) -> dict[str, Any]:
        new = Status.APPROVED if approve else Status.REJECTED
        decided = self.ledger.decide(scope, tool_call_id, new, by, reason, stamp_enqueued=approve)
        op = decided.operation
        out = _summary(op, scope, tool_call_id)
        out["outcome"] = decided.outcome
        if decided.outcome == "existing":
            # the same decision, given again: published again only as a replayed submit is
            # (its publish may have died with the process that decided)
            out.update(self._publish_again(op, tool_call_id) or {})
        elif op.status is Status.APPROVED:
            out.update(
                self.enqueue(
                    scope,
                    op.idempotency_key,
                    op.authorized_attempts,
                    stamped=True,
                    tool_call_id=tool_call_id,
                    tool=op.tool,
                )
            )
        return out

    def enqueue(
        self,
        scope: str,
        key: str,
        attempt: int,
        *,
        stamped: bool = False,
        tool_call_id: str | None = None,
        tool: str | None = None,
    ) -> dict[str, Any]:
        """Publish the job and keep the outbox stamp true; a failure is reported, not raised.

        ``stamped``: the commit that made it approved already stamped enqueued_at; ``tool``
        and ``tool_call_id`` are labels the message carries (headers)."""
        from toolledger.worker.tasks import publish

        try:
            with self.app.producer_or_acquire() as producer:  # pooled: no client per call
                publish(
                    self.app,
                    self.settings,
                    scope,
                    key,
                    attempt,
                    tool_call_id=tool_call_id,
                    tool=tool,
                    producer=producer,
                )
        except Exception as exc:  # noqa: BLE001 - any broker failure: the sweep will retry
            said = logs.error_line(exc)
            log.warning(
                "enqueue of %s/%s failed (the sweep will re-enqueue it): %s", scope, key, said
            )
            if stamped:
                self._stamp(self.ledger.clear_enqueued, scope, key, attempt)
            return {"enqueued": False, "enqueue_error": f"{type(exc).__name__}: {said}"}
        if not stamped:
            self._stamp(self.ledger.mark_enqueued, scope, key, attempt)
        return {"enqueued": True}

    @staticmethod
    def _stamp(
        write: Callable[[str, str, int], object], scope: str, key: str, attempt: int
    ) -> None:
        """Keep the outbox's stamp after a publish, or log that it could not be kept: the
        call is recorded (and decided) whatever the stamp says, and a stamp left stale only
        moves the sweep's re-publication (``TOOLLEDGER_REQUEUE_AFTER`` after it). Raised, it
        made ``submit`` of a recorded call exit 1 with no answer on stdout (a ledger on a full
        disk, its broker on the same: a review)."""
        import sqlalchemy as sa

        try:
            write(scope, key, attempt)
        except sa.exc.SQLAlchemyError as exc:
            said = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            log.warning(
                "the outbox stamp of %s/%s could not be written (the sweep re-publishes it "
                "after TOOLLEDGER_REQUEUE_AFTER): %s",
                scope,
                key,
                said,
            )

    def warm(self) -> None:
        """Import, before the first call, what the first publish would import between its
        call's commit and its publish: Celery, its amqp and events parts, the broker's kombu
        transport and, through kombu's SQLAlchemy transport, ``sqlalchemy.orm`` (which other
        threads' statements reach meanwhile: a fresh HTTP server's first decisions saw it
        half-imported and answered 500). Imported then, they held a new ``mcp serve``'s first
        call committed and unpublished for 1.2-1.4 s (0.04-0.12 s once warm), and a host that
        killed the server there and started another within 5 s waited out its ``--timeout``
        for the call, which the sweep published 120 s later (a cold review: 11 of 12 kills).
        Nothing connects; a transport that cannot load is left to the first publish, which
        reports it."""
        import sqlalchemy.orm  # noqa: F401

        try:
            self.app.connection_for_write().transport  # noqa: B018 - loads its module
            self.app.amqp  # noqa: B018 - the producer's router and message builder
            self.app.events.Dispatcher  # noqa: B018 - the publish's "task-sent" events
            self.app.backend  # noqa: B018 - the result backend send_task asks about
        except Exception as exc:  # noqa: BLE001 - the first publish says what is wrong
            log.warning("the broker's transport could not be loaded at start: %s", exc)

    def close(self) -> None:
        if self._ledger is not None and self._ledger_factory is None:
            self._ledger.close()
        if "app" in self.__dict__ and self._app is None:
            self.app.close()
