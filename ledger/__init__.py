"""The ledger: the execution layer's own record of every side-effecting tool call."""

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
