"""The replay rules (DESIGN §6): what the model is told about a call, without running it."""

from __future__ import annotations

from collections.abc import Iterable

from toolledger.ledger.errors import CorruptRecord, NoReceipt
from toolledger.ledger.records import ExecutionRecord, OperationRecord, Receipt
from toolledger.ledger.transitions import TERMINAL, Flag, Review, Status

UNKNOWN_MESSAGE = (
    "The outcome of this tool call could not be confirmed: its executor stopped before "
    "recording a result. It was not run again. Treat the effect as possibly applied and "
    "ask a human before repeating it."
)

#: Beside a terminal result whose truth a flag still waiting puts in doubt (``in_doubt``).
DISPUTED_MESSAGE = (
    "This outcome is disputed: the ledger holds another report of this tool call that "
    "contradicts it, and a person is reviewing both. Treat the effect as possibly applied "
    "and do not repeat the call until the review is done."
)

#: The key a contradicted call's receipt says so under, beside the saved result.
DISPUTE_KEY = "toolledger"


def in_doubt(status: Status, execution_id: str, flags: Iterable[Flag]) -> bool:
    """Whether a terminal receipt (``status``, reported by ``execution_id``) is disputed by
    one of the call's ``flags`` still waiting. Two reasons put its truth in doubt:

    - ``contradicted`` raised on the very execution the receipt reports: another version of
      that outcome (its executor's own late result against a person's or a reconciler's
      decision) waits for a person;
    - while the receipt says ``failed``, a flag that holds proof an attempt of the call
      succeeded: ``both_ran`` (an earlier attempt proven succeeded after a later one was
      claimed), or ``contradicted`` on another attempt whose other version says it
      succeeded. The failure the model would read hides that the action took effect (it
      would do it again under a new id: a second charge, a cold review).

    Nothing else does: a contradiction about another attempt leaves a success of this one as
    true as it was (a late success of attempt 1 wrote "disputed, possibly applied" over
    attempt 2's own success, which the agent already held: a cold review), a ``both_ran``
    beside a success says the action happened, which the receipt says too, and
    ``not_landed`` is about the bytes of a committed effect, not the outcome. Every flag
    still waiting counts, not only the first one ``operations.review`` keeps (a
    ``contradicted`` raised after a ``both_ran`` left the person's bare ``failed`` to the
    model while two charges had landed: a cold review)."""
    for flag in flags:
        if flag.reason == Review.CONTRADICTED and flag.execution_id == execution_id:
            return True
        if status is Status.FAILED and (
            flag.reason == Review.BOTH_RAN
            or (flag.reason == Review.CONTRADICTED and flag.claims == Status.SUCCEEDED)
        ):
            return True
    return False


def disputed(saved: dict[str, object]) -> dict[str, object]:
    """The content of a terminal receipt whose outcome is in doubt (``in_doubt``).

    The model reads the content, not the flag: a person's ``failed`` against a late proof the
    call took effect reached it as a plain failure, which invites the same action again under
    a new id (a cold review). The saved result stays whole, every key of it (a first version
    wrote a ``message`` over the tool's own: a cold review); the dispute is said beside it,
    under a key of toolledger's, while the flag waits; a result that has that key already is
    nested under ``result``."""
    note = {"review": "contradicted", "message": DISPUTED_MESSAGE}
    if DISPUTE_KEY in saved:
        return {"result": saved, DISPUTE_KEY: note}
    return {**saved, DISPUTE_KEY: note}


def receipt_for(
    operation: OperationRecord, execution: ExecutionRecord | None, *, flags: Iterable[Flag]
) -> Receipt:
    """The receipt for ``operation``, whose current attempt is ``execution`` (or None);
    ``flags``: the call's flags still waiting (``CallView.flags``), which decide whether a
    terminal result is said disputed (``in_doubt``). Required: a caller that left them out
    would hand the model a bare result the ledger has proof against."""
    status = operation.status
    if status is Status.REJECTED:
        content: dict[str, object] = {"status": "rejected"}
        if operation.reason:
            content["reason"] = operation.reason
        return Receipt(status, content, None, review=operation.review)
    if status is Status.UNKNOWN:
        if execution is None:
            raise CorruptRecord(f"{operation.idempotency_key!r} is unknown without an execution")
        content = {
            "status": "unknown",
            "execution_id": execution.execution_id,
            "message": UNKNOWN_MESSAGE,
        }
        return Receipt(status, content, execution.execution_id, review=operation.review)
    if status in TERMINAL:
        if execution is None or execution.result is None:
            raise CorruptRecord(
                f"{operation.idempotency_key!r} is {status} without a saved result: "
                "recovery stops here; inspect the ledger"
            )
        content = execution.result
        doubt = in_doubt(status, execution.execution_id, flags)
        if doubt:
            content = disputed(content)
        return Receipt(
            status, content, execution.execution_id, review=operation.review, disputed=doubt
        )
    raise NoReceipt(f"{operation.idempotency_key!r} is {status}: there is no receipt yet")
