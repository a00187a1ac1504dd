"""The ledger: the execution layer's own record of every side-effecting tool call.

The names below load on first use: importing ``toolledger.ledger.errors`` (the CLI maps
errors to exit codes with it) loads neither SQLAlchemy nor the rest of the ledger.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from toolledger.ledger.errors import (
        ConflictError,
        CorruptRecord,
        InputError,
        InvalidTransition,
        LedgerError,
        NoReceipt,
        NotFound,
        StaleFence,
        StateError,
    )
    from toolledger.ledger.identity import args_sha256, canonical_json, default_key
    from toolledger.ledger.ledger import Ledger
    from toolledger.ledger.records import (
        CallView,
        Claim,
        EventRecord,
        ExecutionRecord,
        OperationRecord,
        Receipt,
    )
    from toolledger.ledger.transitions import TRANSITIONS, EventKind, Status

#: Public name -> the module that defines it.
_EXPORTS = {
    "ConflictError": "toolledger.ledger.errors",
    "CorruptRecord": "toolledger.ledger.errors",
    "InputError": "toolledger.ledger.errors",
    "InvalidTransition": "toolledger.ledger.errors",
    "LedgerError": "toolledger.ledger.errors",
    "NoReceipt": "toolledger.ledger.errors",
    "NotFound": "toolledger.ledger.errors",
    "StaleFence": "toolledger.ledger.errors",
    "StateError": "toolledger.ledger.errors",
    "args_sha256": "toolledger.ledger.identity",
    "canonical_json": "toolledger.ledger.identity",
    "default_key": "toolledger.ledger.identity",
    "Ledger": "toolledger.ledger.ledger",
    "CallView": "toolledger.ledger.records",
    "Claim": "toolledger.ledger.records",
    "EventRecord": "toolledger.ledger.records",
    "ExecutionRecord": "toolledger.ledger.records",
    "OperationRecord": "toolledger.ledger.records",
    "Receipt": "toolledger.ledger.records",
    "TRANSITIONS": "toolledger.ledger.transitions",
    "EventKind": "toolledger.ledger.transitions",
    "Status": "toolledger.ledger.transitions",
}

__all__ = [
    "TRANSITIONS",
    "CallView",
    "Claim",
    "ConflictError",
    "CorruptRecord",
    "EventKind",
    "EventRecord",
    "ExecutionRecord",
    "InputError",
    "InvalidTransition",
    "Ledger",
    "LedgerError",
    "NoReceipt",
    "NotFound",
    "OperationRecord",
    "Receipt",
    "StaleFence",
    "StateError",
    "Status",
    "args_sha256",
    "canonical_json",
    "default_key",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (``from toolledger.ledger import db``) is found after this
        raise AttributeError(f"module 'toolledger.ledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
