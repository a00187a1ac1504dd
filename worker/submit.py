"""Submitting and deciding calls from the edge (CLI, API): validate, record, then act."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledger.identity import check_call
from ledger.ledger import Ledger
from ledger.records import OperationRecord
from worker.config import Settings


@dataclass(frozen=True)
class PreparedCall:
    """A call that passed every check that needs no database."""

    scope: str
    tool_call_id: str
    tool: str
    args: dict[str, Any]
    key: str
    args_sha256: str


def prepare_call(
    settings: Settings,
    scope: str,
    tool_call_id: str,
    tool: str,
    args: dict[str, Any],
    key: str | None = None,
) -> PreparedCall:
    """Validate before anything is recorded (or any file created)."""
    key, sha = check_call(scope, tool_call_id, tool, args, key, settings.max_args_bytes)
    return PreparedCall(scope, tool_call_id, tool, args, key, sha)


def _summary(op: OperationRecord, scope: str, tool_call_id: str) -> dict[str, Any]:
    return {
        "scope": scope,
        "tool_call_id": tool_call_id,
        "idempotency_key": op.idempotency_key,
        "tool": op.tool,
        "status": op.status.value,
        "args_sha256": op.args_sha256,
    }


def submit_call(
    settings: Settings,
    ledger: Ledger,
    call: PreparedCall,
    *,
    approved_by: str | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """Record the call."""
    submitted = ledger.submit(
        call.scope,
        call.tool_call_id,
        call.tool,
        call.args,
        key=call.key,
        approved_by=approved_by,
        reason=reason,
    )
    out = _summary(submitted.operation, call.scope, call.tool_call_id)
    out["outcome"] = submitted.outcome
    return out


def decide_call(
    settings: Settings,
    ledger: Ledger,
    scope: str,
    tool_call_id: str,
    by: str,
    reason: str | None,
    *,
    approve: bool,
) -> dict[str, Any]:
    """Approve or reject a pending call."""
    decide = ledger.approve if approve else ledger.reject
    op = decide(scope, tool_call_id, by=by, reason=reason)
    return _summary(op, scope, tool_call_id)
