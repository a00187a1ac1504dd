"""Rows as frozen dataclasses, built from database rows by ``from_row``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, Self

from toolledger.ledger.transitions import Flag, Status

_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def as_utc(value: datetime) -> datetime:
    """A stored timestamp as an aware UTC datetime: SQLite keeps naive UTC text, Postgres
    answers in the session's time zone."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:  # dataclasses.fields() on every row showed up in profiles
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


class _FromRow:
    @classmethod
    def from_row(cls, row: Any) -> Self:
        """From a SQLAlchemy row or a mapping of column names (the light reads')."""
        mapping: Mapping[str, Any] = getattr(row, "_mapping", row)
        values = {name: mapping[name] for name in _field_names(cls)}
        if "status" in values:
            values["status"] = Status(values["status"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class OperationRecord(_FromRow):
    """A logical action: what was asked, who decided, where it stands."""

    scope: str
    idempotency_key: str
    tool: str
    args: dict[str, Any]
    args_sha256: str
    status: Status
    authorized_attempts: int
    decided_by: str | None
    decided_at: datetime | None
    reason: str | None
    created_at: datetime
    enqueued_at: datetime | None
    review: str | None = None


@dataclass(frozen=True, slots=True)
class ExecutionRecord(_FromRow):
    """One real attempt."""

    execution_id: str
    scope: str
    idempotency_key: str
    attempt: int
    status: Status
    worker_id: str | None
    lease_token: str | None
    lease_expires_at: datetime | None
    heartbeat_at: datetime | None
    started_at: datetime
    finished_at: datetime | None
    result: dict[str, Any] | None
    reconciled: bool
    error: str | None
    fenced: bool = False
    effects: list[dict[str, Any]] | None = None

    @property
    def own_success(self) -> bool:
        """Succeeded by its executor's own fenced commit (not by a reconciler or a human)."""
        return self.status is Status.SUCCEEDED and not self.reconciled

    def to_json(self) -> dict[str, Any]:
        """The public view: everything but the lease token, which is the executor's fence."""
        return {
            "execution_id": self.execution_id,
            "attempt": self.attempt,
            "status": self.status.value,
            "result": self.result,
            "reconciled": self.reconciled,
            "worker_id": self.worker_id,
            "error": self.error,
            "fenced": self.fenced,
            "effects": self.effects,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "lease_expires_at": _iso(self.lease_expires_at),
        }


@dataclass(frozen=True, slots=True)
class EventRecord(_FromRow):
    """One entry of the append-only history."""

    seq: int
    scope: str
    idempotency_key: str
    execution_id: str | None
    kind: str
    actor: str
    at: datetime
    detail: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "kind": self.kind,
            "execution_id": self.execution_id,
            "actor": self.actor,
            "at": _iso(self.at),
            "detail": self.detail,
        }


class Finished:
    """An executor's own terminal commit and the sequence number of its event: the order in
    which the sandbox publishes effects on one path (a later commit's bytes win).

    ``execution`` is the row as committed. The fast stores pass a function that builds it
    from the raw row when it is first read: the executor reads only ``seq``, and converting
    every column (two JSON documents, four timestamps) on every terminal write was work
    nobody used. Otherwise it behaves as the frozen dataclass it was: immutable, equal by
    value, picklable, matched by position."""

    __slots__ = ("_execution", "_load", "seq")
    __match_args__ = ("execution", "seq")
    seq: int
    _execution: ExecutionRecord | None
    _load: Callable[[], ExecutionRecord] | None

    def __init__(
        self, execution: ExecutionRecord | Callable[[], ExecutionRecord], seq: int
    ) -> None:
        built = isinstance(execution, ExecutionRecord)
        object.__setattr__(self, "seq", seq)
        object.__setattr__(self, "_execution", execution if built else None)
        object.__setattr__(self, "_load", None if built else execution)

    @property
    def execution(self) -> ExecutionRecord:
        found = self._execution
        if found is None:
            load = self._load
            if load is None:  # another thread built it meanwhile
                found = self._execution
                assert found is not None
                return found
            found = load()  # two threads may both build it: equal records
            object.__setattr__(self, "_execution", found)
            object.__setattr__(self, "_load", None)  # the raw row and its store can go
        return found

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def __reduce__(self) -> tuple[type[Finished], tuple[ExecutionRecord, int]]:
        return Finished, (self.execution, self.seq)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Finished):
            return NotImplemented
        return (self.execution, self.seq) == (other.execution, other.seq)

    __hash__ = None  # type: ignore[assignment]  # as the dataclass's: a record holds dicts

    def __repr__(self) -> str:
        return f"Finished(execution={self.execution!r}, seq={self.seq!r})"


@dataclass(frozen=True, slots=True)
class EffectState:
    """What the ledger says about an execution whose staged effects wait in a sandbox."""

    execution_id: str
    scope: str
    idempotency_key: str
    attempt: int
    status: Status
    reconciled: bool
    lease_token: str | None
    effects: tuple[dict[str, Any], ...]
    seq: int  # its own succeeded event; 0 unless ``own_success``

    @property
    def own_success(self) -> bool:
        return self.status is Status.SUCCEEDED and not self.reconciled and self.seq > 0

    def holds_own_write(self, status: Status) -> bool:
        """Whether the row already holds what its executor meant to write, ``status``, by that
        executor's own terminal write: asked when a commit's answer was lost, which looks like
        a revocation until the row is read. An unreconciled ``succeeded`` (with its own
        succeeded event) or ``failed`` is only ever committed by the lease token's holder: a
        revocation leaves ``unknown``, a reconciliation or a human's resolution sets
        ``reconciled``. An unreconciled ``unknown`` counts whoever wrote it (the sweep's mark
        says the same); a settle of a spooled ``unknown`` asks only for the two others."""
        if status is Status.SUCCEEDED:
            return self.own_success
        return self.status is status and not self.reconciled


@dataclass(frozen=True, slots=True)
class Claim:
    """The right to run one attempt, held under a lease token (the fence)."""

    execution_id: str
    scope: str
    idempotency_key: str
    attempt: int
    lease_token: str
    lease_expires_at: datetime
    worker_id: str
    tool: str
    args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Receipt:
    """The tool result handed back to the model for one tool_call_id.

    ``content`` is what the model reads (as JSON text: ``text``); the ``to_*`` helpers wrap
    it as a tool-result message of each API, under the call's own id — the same items
    ``repair`` inserts. ``scope`` and ``tool_call_id`` are set when the receipt was asked for
    by call (the client, ``wait``); ``reconciled``: the result was established after the
    fact (a reconciler, a late result, a person), not reported by the execution itself;
    ``review``: the flag waiting on the call (``contradicted``: the ledger holds another
    version of its outcome, a person decides; ``not_landed``…), None when there is none.
    A flagged receipt is the ledger's word now, and may change at the review. ``disputed``:
    its content carries the dispute note (``receipts.in_doubt``), which follows every flag
    still waiting, not only the one ``review`` names."""

    status: Status
    content: dict[str, Any]
    execution_id: str | None
    scope: str | None = None
    tool_call_id: str | None = None
    reconciled: bool = False
    review: str | None = None
    disputed: bool = False

    @property
    def is_error(self) -> bool:
        """Failed, rejected, or unknown (whether it took effect is not known): never read as
        a success by the model or its framework (DESIGN §6)."""
        return self.status in (Status.FAILED, Status.REJECTED, Status.UNKNOWN)

    @property
    def text(self) -> str:
        return json.dumps(self.content, ensure_ascii=False)

    def to_openai(self) -> dict[str, Any]:
        """An OpenAI chat ``tool`` message."""
        return {"role": "tool", "tool_call_id": self.tool_call_id, "content": self.text}

    def to_responses(self) -> dict[str, Any]:
        """An OpenAI Responses ``function_call_output`` item."""
        return {"type": "function_call_output", "call_id": self.tool_call_id, "output": self.text}

    def to_anthropic(self) -> dict[str, Any]:
        """An Anthropic ``tool_result`` block (it goes in a ``user`` message)."""
        block: dict[str, Any] = {
            "type": "tool_result",
            "tool_use_id": self.tool_call_id,
            "content": self.text,
        }
        if self.is_error:
            block["is_error"] = True
        return block

    def to_json(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "tool_call_id": self.tool_call_id,
            "status": self.status.value,
            "content": self.content,
            "execution_id": self.execution_id,
            "reconciled": self.reconciled,
            "is_error": self.is_error,
            "review": self.review,
        }


@dataclass(frozen=True, slots=True)
class Submitted:
    """What submit did: recorded a new action, linked a new call to one, or found the call."""

    operation: OperationRecord
    tool_call_id: str
    outcome: Literal["created", "linked", "existing"]


@dataclass(frozen=True, slots=True)
class Decided:
    """What a person's decision did: ``decided`` (recorded, its event appended), or
    ``existing``: the same person had made the same decision, with the same reason, before
    (a decision retried after its answer was lost): nothing written, the call as it stands."""

    operation: OperationRecord
    outcome: Literal["decided", "existing"]


@dataclass(frozen=True, slots=True)
class CallView:
    """Everything known about one tool call: its action and every attempt at it.
    ``flags``: the flags still waiting on it, from its history (read only when the call is
    flagged): ``operations.review`` keeps one reason, and the receipt follows them all."""

    scope: str
    tool_call_id: str
    operation: OperationRecord
    executions: tuple[ExecutionRecord, ...]
    flags: tuple[Flag, ...] = ()

    @property
    def current(self) -> ExecutionRecord | None:
        """The execution of the latest authorised attempt, if it was claimed."""
        attempt = self.operation.authorized_attempts
        return next((e for e in self.executions if e.attempt == attempt), None)

    @property
    def last_attempt(self) -> int:
        """The call's last attempt: its authorised one, or a later one claimed before a
        withdrawal made an earlier attempt current again (``authorized_attempts`` went back
        down then, and a retry decided on a page that showed attempt 1 at the start was taken
        as decided on the call as it is: a cold review). A withdrawn attempt that nobody
        claimed is not counted: it never ran, and the next retry takes its number."""
        claimed = max((e.attempt for e in self.executions), default=0)
        return max(self.operation.authorized_attempts, claimed)

    def to_json(self, receipt: Receipt | None) -> dict[str, Any]:
        op = self.operation
        return {
            "scope": self.scope,
            "tool_call_id": self.tool_call_id,
            "tool": op.tool,
            "idempotency_key": op.idempotency_key,
            "args_sha256": op.args_sha256,
            "status": op.status.value,
            "review": op.review,
            "args": op.args,
            "authorized_attempts": op.authorized_attempts,
            "last_attempt": self.last_attempt,
            "decided_by": op.decided_by,
            "reason": op.reason,
            "created_at": _iso(op.created_at),
            "enqueued_at": _iso(op.enqueued_at),
            "executions": [e.to_json() for e in self.executions],
            "receipt": receipt.content if receipt else None,
        }


@dataclass(frozen=True, slots=True)
class ListedCall:
    """One row of ``list``: an action, its first tool call and its current attempt."""

    scope: str
    idempotency_key: str
    tool_call_id: str | None
    tool: str
    status: Status
    attempt: int
    execution_id: str | None
    reconciled: bool | None
    created_at: datetime
    review: str | None = None

    @property
    def position(self) -> tuple[datetime, str, str]:
        """Where this row sits in ``list``'s order: the keyset cursor to the next page."""
        return (self.created_at, self.scope, self.idempotency_key)

    @classmethod
    def from_row(cls, row: Any) -> ListedCall:
        m = row._mapping
        return cls(
            scope=m["scope"],
            idempotency_key=m["idempotency_key"],
            tool_call_id=m["tool_call_id"],
            tool=m["tool"],
            status=Status(m["status"]),
            attempt=m["authorized_attempts"],
            execution_id=m["execution_id"],
            reconciled=m["reconciled"],
            created_at=m["created_at"],
            review=m["review"],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "tool_call_id": self.tool_call_id,
            "idempotency_key": self.idempotency_key,
            "tool": self.tool,
            "status": self.status.value,
            "attempt": self.attempt,
            "execution_id": self.execution_id,
            "reconciled": self.reconciled,
            "review": self.review,
            "created_at": _iso(self.created_at),
        }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None
