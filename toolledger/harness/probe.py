"""probe_write and probe_append: write_file and append_file that take their time, for tests.

``hold_ms`` sleeps half before staging its bytes and half after, so that faults meet work in
progress. Its physical effects are counted by the sandbox itself: with ``TOOLLEDGER_EFFECTS_LOG``
set, every landing appends one JSON line (scope, path, execution_id, the commit's seq) under
the path's lock, before the bytes move (``worker.effects``). Enable the tool with
``TOOLLEDGER_TOOLS=toolledger.harness.probe``.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import Field

from toolledger.builtin_tools import ContentArgs, check_append, check_file, reconcile_write_file
from toolledger.tools import ToolContext, tool


class ProbeArgs(ContentArgs):
    hold_ms: int = Field(
        0, ge=0, le=60_000, description="Sleep half before the effect and half after it."
    )


@tool(
    idempotent=True,
    reconcile=reconcile_write_file,
    check=check_file,
    sandboxed=True,
    auto_retry=True,
)
def probe_write(args: ProbeArgs, ctx: ToolContext) -> dict[str, Any]:
    """write_file that holds each execution a while, so that faults meet work in progress."""
    time.sleep(args.hold_ms / 2000)
    staged = ctx.sandbox.write_atomic(ctx.scope, args.path, args.content.encode("utf-8"))
    time.sleep(args.hold_ms / 2000)
    return {"path": args.path, "bytes_written": staged.size, "sha256": staged.sha256}


@tool(idempotent=False, check=check_append, sandboxed=True)
def probe_append(args: ProbeArgs, ctx: ToolContext) -> dict[str, Any]:
    """append_file that holds each execution a while. Not idempotent and not reconcilable: an
    execution cut off mid-hold stays ``unknown`` for a human (its staged line never lands)."""
    time.sleep(args.hold_ms / 2000)
    staged = ctx.sandbox.append(ctx.scope, args.path, args.content.encode("utf-8"))
    time.sleep(args.hold_ms / 2000)
    return {"path": args.path, "bytes_appended": staged.size, "sha256": staged.sha256}
