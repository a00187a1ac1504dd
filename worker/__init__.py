"""The execution side: tools, the sandbox, the execute pipeline, Celery (``worker.app``)."""

from worker.config import Settings
from worker.sandbox import Sandbox, SandboxError
from worker.submit import Submitter
from worker.tools import (
    Evidence,
    OutcomeUnknown,
    Registry,
    Tool,
    ToolContext,
    ToolError,
    load_registry,
    tool,
)

__all__ = [
    "Evidence",
    "OutcomeUnknown",
    "Registry",
    "Sandbox",
    "SandboxError",
    "Settings",
    "Submitter",
    "Tool",
    "ToolContext",
    "ToolError",
    "load_registry",
    "tool",
]
