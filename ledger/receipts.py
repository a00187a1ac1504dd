"""The replay rules (DESIGN §6): what the model is told about a call, without running it."""

from __future__ import annotations

from toolledger.ledger.errors import CorruptRecord, NoReceipt
from toolledger.ledger.records import ExecutionRecord, OperationRecord, Receipt
from toolledger.ledger.transitions import TERMINAL, Status

UNKNOWN_MESSAGE = (
    "The outcome of this tool call could not be confirmed: its executor stopped before "
    "recording a result. It was not run again. Treat the effect as possibly applied and "
    "ask a human before repeating it."
)

#: Beside a terminal result a later report contradicts (the call's ``contradicted`` flag).
DISPUTED_MESSAGE = (
    "This outcome is disputed: the ledger holds another report of this tool call that "
    "contradicts it, and a person is reviewing both. Treat the effect as possibly applied "
    "and do not repeat the call until the review is done."
)

#: The key a contradicted call's receipt says so under, beside the saved result.
DISPUTE_KEY = "toolledger"


def disputed(saved: dict[str, object]) -> dict[str, object]:
    """The content of a terminal receipt whose outcome is contradicted (the call's flag).

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


def receipt_for(operation: OperationRecord, execution: ExecutionRecord | None) -> Receipt:
    """The receipt for ``operation``, whose current attempt is ``execution`` (or None)."""
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
        if operation.review == "contradicted":
            content = disputed(content)
        return Receipt(status, content, execution.execution_id, review=operation.review)
    raise NoReceipt(f"{operation.idempotency_key!r} is {status}: there is no receipt yet")
