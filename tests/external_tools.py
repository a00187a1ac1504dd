"""Tools whose effects reach outside the sandbox: what the fence does not cover.

Load with ``TOOLLEDGER_TOOLS=tests.external_tools`` (or ``load_registry("tests.external_tools")``).
"""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel

from toolledger.tools import ToolContext, tool


class NotifyArgs(BaseModel):
    to: str


@tool(idempotent=False)
def notify(args: NotifyArgs, ctx: ToolContext) -> dict[str, Any]:
    """Send a notification: an effect outside the sandbox, not idempotent, not reconcilable."""
    return {"notified": args.to, "key": ctx.idempotency_key}


class SlowReadArgs(BaseModel):
    seconds: float
    done_file: str


@tool(read_only=True)
def slow_read(args: SlowReadArgs, ctx: ToolContext) -> dict[str, Any]:
    """A read that takes its time, then says so in ``done_file`` (MCP serve's --timeout)."""
    import time
    from pathlib import Path

    time.sleep(args.seconds)
    Path(args.done_file).write_text("done")
    return {"slept": args.seconds}


#: What ``held_read`` waits for, and one entry a run that started: the tests' own (a server
#: under ``TestClient`` runs in their process).
HELD = threading.Event()
HELD_RUNS: list[int] = []


class HeldReadArgs(BaseModel):
    seconds: float


@tool(read_only=True)
def held_read(args: HeldReadArgs, ctx: ToolContext) -> dict[str, Any]:
    """A read that runs until the test lets it go (``HELD``), ``seconds`` at most."""
    HELD_RUNS.append(1)
    return {"held": not HELD.wait(args.seconds)}
