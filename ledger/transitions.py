"""The state machine: the vocabulary of statuses and the one table of allowed changes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from toolledger.ledger.errors import InvalidStatus, InvalidTransition


class Status(StrEnum):
    """Where a logical action (and each real attempt at it) stands."""

    PENDING_APPROVAL = "pending_approval"  # recorded; waits for a human decision
    APPROVED = "approved"  # may run; its authorised attempt is not claimed yet
    REJECTED = "rejected"  # a human said no; nothing ever runs
    RUNNING = "running"  # claimed, durable before the effect starts
    SUCCEEDED = "succeeded"  # the tool reported success; its result was saved with it
    FAILED = "failed"  # the tool reported failure; partial effects are still possible
    UNKNOWN = "unknown"  # the outcome cannot be confirmed; NOT "safe to run again"


class EventKind(StrEnum):
    """What an event in the history records: a status change, or one of these."""

    SUBMITTED = "submitted"  # the operation and its first tool call were recorded
    LINKED = "linked"  # another tool_call_id names the same key, same arguments
    PENDING_APPROVAL = "pending_approval"
    APPROVED = "approved"  # also a retry: a new attempt authorised under the same key
    REJECTED = "rejected"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    EVIDENCE = "evidence"  # a fact about an execution that changed no state (late result)
    WITHDRAWN = "withdrawn"  # an authorised, unclaimed attempt withdrawn: an earlier one proved
    FLAGGED = "flagged"  # the call needs a human: evidence contradicts a decision, or both ran
    REVIEWED = "reviewed"  # a human settled a flagged call


class Review(StrEnum):
    """Why a call waits for a human although it has a status (``operations.review``)."""

    # a late result (or the sweep's finding) contradicts a human's resolution, or the
    # executor's own late success contradicts a reconciler's "failed"
    CONTRADICTED = "contradicted"
    BOTH_RAN = "both_ran"  # an earlier attempt proved succeeded after a later one was claimed
    NOT_LANDED = "not_landed"  # committed, but its effect could not land (its target changed)


#: Statuses an execution row (one real attempt) can have.
EXECUTION_STATUSES = frozenset({Status.RUNNING, Status.SUCCEEDED, Status.FAILED, Status.UNKNOWN})
#: Statuses whose row must carry a result, written in the same transaction.
TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED})
#: The statuses a call has a receipt in (a waiter returns): terminal, rejected, unknown.
RECEIPT_STATUSES = frozenset({*TERMINAL, Status.REJECTED, Status.UNKNOWN})

#: Statuses a human may authorise a new attempt from (a retry is not an approval).
RETRYABLE = frozenset({Status.UNKNOWN, Status.FAILED})

#: Every allowed (old, new) pair; ``None`` is "not recorded yet". Nothing else is allowed.
TRANSITIONS: frozenset[tuple[Status | None, Status]] = frozenset(
    {
        (None, Status.PENDING_APPROVAL),  # submit without an approver
        (None, Status.APPROVED),  # submit with an approver
        (Status.PENDING_APPROVAL, Status.APPROVED),
        (Status.PENDING_APPROVAL, Status.REJECTED),
        (Status.APPROVED, Status.RUNNING),  # the claim
        (Status.RUNNING, Status.SUCCEEDED),  # the executor's terminal write
        (Status.RUNNING, Status.FAILED),
        (Status.RUNNING, Status.UNKNOWN),  # lease expired: the executor is gone
        (Status.UNKNOWN, Status.SUCCEEDED),  # reconciled with evidence, or resolved by a human
        (Status.UNKNOWN, Status.FAILED),
        (Status.UNKNOWN, Status.APPROVED),  # a new attempt: a human, or the sweep on proof
        (Status.FAILED, Status.APPROVED),  # of absence (a tool contract option)
        (Status.APPROVED, Status.SUCCEEDED),  # withdrawn: proof that an earlier attempt succeeded
        # A human's review of a flagged call may correct a decision made by a human or a
        # reconciler (never an executor's own result): see REVIEW.
        (Status.SUCCEEDED, Status.FAILED),
        (Status.FAILED, Status.SUCCEEDED),
    }
)

#: The pairs only a human's review of a flagged call may take.
REVIEW = frozenset({(Status.SUCCEEDED, Status.FAILED), (Status.FAILED, Status.SUCCEEDED)})


def parse_status(value: str) -> Status:
    """The Status named ``value``, or InvalidStatus before anything is written."""
    try:
        return Status(value)
    except ValueError:
        names = ", ".join(s.value for s in Status)
        raise InvalidStatus(f"unknown status {value!r}; expected one of: {names}") from None


def check_transition(old: Status | None, new: Status, what: str = "") -> None:
    """Raise InvalidTransition unless (old, new) is in the table."""
    if (old, new) not in TRANSITIONS:
        raise InvalidTransition(old, new, what)


@dataclass(frozen=True)
class Flag:
    """One reason a call waits for a human, raised on one execution (a ``flagged`` event);
    ``kept``: where a ``not_landed`` effect's bytes are kept, relative to the sandbox;
    ``claims``: the status a ``contradicted`` flag's other version says the execution
    ended in (its ``late`` version's: ``succeeded`` is proof the action took effect)."""

    execution_id: str
    reason: str
    kept: str | None = None
    claims: str | None = None


def fold_flags(events: Iterable[tuple[str, str, dict[str, Any]]]) -> tuple[list[Flag], list[Flag]]:
    """A call's flags still waiting and those a review settled, from its ``flagged`` and
    ``reviewed`` events (kind, execution_id, detail) in seq order. A review settles the flags
    raised on the execution it names (it records ``review_after``, what the call is still
    flagged for); a review recorded before there was ``review_after`` settled every flag."""
    waiting: list[Flag] = []
    settled: list[Flag] = []
    for kind, execution_id, detail in events:
        if kind == EventKind.FLAGGED:
            kept = (detail.get("effect") or {}).get("kept")
            late = detail.get("late")  # read on every flagged call's read: never raise on it
            claims = late.get("status") if isinstance(late, dict) else None
            waiting.append(Flag(execution_id, detail["reason"], kept, claims))
        elif kind == EventKind.REVIEWED:
            done = [
                f for f in waiting if "review_after" not in detail or f.execution_id == execution_id
            ]
            settled += done
            waiting = [f for f in waiting if f not in done]
    return waiting, settled
