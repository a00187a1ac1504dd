"""Every error the ledger raises, one class per thing that happened.

The docstring of each class is its default message. Ids the caller needs are attributes.
"""

from __future__ import annotations


class LedgerError(Exception):
    """The ledger refused the request."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class InputError(LedgerError):
    """The input was refused; nothing was recorded."""


class InvalidIdentifier(InputError):
    """An identifier (scope, tool name, tool_call_id, key, actor) is not acceptable."""


class InvalidArguments(InputError):
    """The tool arguments are not a JSON object that can be hashed canonically."""


class ArgumentsTooLarge(InputError):
    """The canonical JSON of the arguments is over the configured cap."""


class InvalidStatus(InputError):
    """That status is not in the vocabulary."""


class NotFound(LedgerError):
    """No such call in the ledger."""


class ConflictError(LedgerError):
    """The idempotency key was already used for different arguments; nothing was changed."""

    def __init__(
        self,
        *,
        scope: str,
        idempotency_key: str,
        stored_sha256: str,
        requested_sha256: str,
        detail: str = "",
    ) -> None:
        self.scope = scope
        self.idempotency_key = idempotency_key
        self.stored_sha256 = stored_sha256
        self.requested_sha256 = requested_sha256
        message = (
            f"conflict: key {idempotency_key!r} in scope {scope!r} is already recorded with "
            f"args_sha256 {stored_sha256}, this request has {requested_sha256}"
        )
        super().__init__(f"{message}{'; ' + detail if detail else ''}; nothing was changed")


class StateError(LedgerError):
    """The current state does not allow this."""


class InvalidTransition(StateError):
    """That status change is not in the table of allowed transitions."""

    def __init__(self, old: str | None, new: str, what: str = "") -> None:
        self.old = old
        self.new = new
        where = f" for {what}" if what else ""
        super().__init__(f"cannot go from {old or 'nothing'} to {new}{where}")


class StaleFence(StateError):
    """The row is no longer this executor's: its status or lease token changed."""

    def __init__(self, execution_id: str, message: str | None = None) -> None:
        self.execution_id = execution_id
        super().__init__(
            message
            or f"execution {execution_id} is no longer running under this lease; nothing changed"
        )


class NoReceipt(StateError):
    """No receipt can be given for this call in its current state."""


class CorruptRecord(StateError):
    """The stored record breaks an invariant (e.g. a terminal status without a result)."""
