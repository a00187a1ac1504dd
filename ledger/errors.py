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
    """The idempotency key (or the tool_call_id) was already used for another call: other
    arguments, another tool or another key; nothing was changed. The message names what
    differs, and only that."""

    def __init__(
        self,
        *,
        scope: str,
        idempotency_key: str,
        stored_sha256: str,
        requested_sha256: str,
        stored_tool: str | None = None,
        requested_tool: str | None = None,
        tool_call_id: str | None = None,
        requested_key: str | None = None,
        detail: str = "",
    ) -> None:
        self.scope = scope
        self.idempotency_key = idempotency_key
        self.stored_sha256 = stored_sha256
        self.requested_sha256 = requested_sha256
        differs = []
        if tool_call_id is not None:  # the id is bound to a key: name the binding first
            head = (
                f"conflict: tool_call_id {tool_call_id!r} in scope {scope!r} is already "
                f"recorded under key {idempotency_key!r}"
            )
            if requested_key is not None and requested_key != idempotency_key:
                differs.append(f"this request has key {requested_key!r}")
        else:
            head = f"conflict: key {idempotency_key!r} in scope {scope!r} is already recorded"
        if stored_tool is not None and requested_tool is not None and stored_tool != requested_tool:
            differs.append(f"for tool {stored_tool!r}, this request is for {requested_tool!r}")
        if stored_sha256 != requested_sha256 or not differs:
            differs.append(f"with args_sha256 {stored_sha256}, this request has {requested_sha256}")
        if detail:
            differs.append(detail)
        super().__init__(f"{head}, {'; '.join(differs)}; nothing was changed")


class StateError(LedgerError):
    """The current state does not allow this."""


class InvalidTransition(StateError):
    """That status change is not in the table of allowed transitions."""

    def __init__(self, old: str | None, new: str, what: str = "") -> None:
        self.old = old
        self.new = new
        where = f" for {what}" if what else ""
        super().__init__(f"cannot go from {old or 'nothing'} to {new}{where}")


class StaleAttempt(InvalidTransition):
    """A decision taken on an attempt that is no longer the call's last: look again."""

    def __init__(self, old: str, what: str) -> None:
        super().__init__(old, "approved")
        # "cannot go from unknown to approved" said a retry of an unknown call was never
        # allowed, where it was refused only for being decided on an older attempt (a cold
        # review of the CLI): the message says that alone
        self.args = (what,)


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
