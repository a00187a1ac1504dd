"""toolledger: run the side-effecting tool calls of AI agents at most once, through any crash,
never silently re-run.

The rooms (each folder at the repository's top level, installed under this name):

- ``toolledger.ledger``   storage and the state machine: claim, transitions, events, verify;
- ``toolledger.tools``, ``.sandbox``, ``.effects``, ``.config``, ``.registry``  the contract
  a tool is written against, and the fenced sandbox;
- ``toolledger.worker``   the execution side: the Celery app, the execute pipeline, leases;
- ``toolledger.recovery`` after a crash: the sweep, reconcilers, humans' decisions, replay;
- ``toolledger.cli``, ``toolledger.demo``, ``toolledger.harness``  the command line, the demo,
  chaos and the benchmarks.

The names below load on first use: importing ``toolledger`` loads neither Celery nor the
database driver, creates no file and reads no environment.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from toolledger.client import AsyncClient, CallHandle, Client, ReceiptTimeout
    from toolledger.config import ConfigError, Settings
    from toolledger.ledger import (
        ConflictError,
        InputError,
        Ledger,
        LedgerError,
        NotFound,
        Receipt,
        StateError,
        Status,
    )
    from toolledger.registry import load_registry
    from toolledger.sandbox import Sandbox, SandboxError
    from toolledger.tools import (
        Absent,
        Evidence,
        OutcomeUnknown,
        Registry,
        Tool,
        ToolContext,
        ToolError,
        tool,
    )
    from toolledger.turns import CallsWaiting
    from toolledger.worker.submit import Submitter

#: Public name -> the module that defines it.
_EXPORTS = {
    "AsyncClient": "toolledger.client",
    "CallHandle": "toolledger.client",
    "Client": "toolledger.client",
    "ReceiptTimeout": "toolledger.client",
    "ConfigError": "toolledger.config",
    "Settings": "toolledger.config",
    "ConflictError": "toolledger.ledger",
    "InputError": "toolledger.ledger",
    "Ledger": "toolledger.ledger",
    "LedgerError": "toolledger.ledger",
    "NotFound": "toolledger.ledger",
    "Receipt": "toolledger.ledger",
    "StateError": "toolledger.ledger",
    "Status": "toolledger.ledger",
    "load_registry": "toolledger.registry",
    "Sandbox": "toolledger.sandbox",
    "SandboxError": "toolledger.sandbox",
    "Absent": "toolledger.tools",
    "Evidence": "toolledger.tools",
    "OutcomeUnknown": "toolledger.tools",
    "Registry": "toolledger.tools",
    "Tool": "toolledger.tools",
    "ToolContext": "toolledger.tools",
    "ToolError": "toolledger.tools",
    "tool": "toolledger.tools",
    "CallsWaiting": "toolledger.turns",
    "Submitter": "toolledger.worker.submit",
}

__all__ = [
    "Absent",
    "AsyncClient",
    "CallHandle",
    "CallsWaiting",
    "Client",
    "ConfigError",
    "ConflictError",
    "Evidence",
    "InputError",
    "Ledger",
    "LedgerError",
    "NotFound",
    "OutcomeUnknown",
    "Receipt",
    "ReceiptTimeout",
    "Registry",
    "Sandbox",
    "SandboxError",
    "Settings",
    "StateError",
    "Status",
    "Submitter",
    "Tool",
    "ToolContext",
    "ToolError",
    "load_registry",
    "tool",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'toolledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
