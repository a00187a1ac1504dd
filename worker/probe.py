"""probe_write: write_file that also counts its physical effects outside the ledger.

Each real execution appends one JSON line (O_APPEND + fsync) to the effects log named by
``TOOLLEDGER_EFFECTS_LOG``, just before the file write — the two together are the effect.
Logging first means a crash between them over-counts, never under-counts: a duplicate can
hide nowhere, and any file a reconciler finds has its line in the log.
Tests and ``toolledger chaos`` count those lines to prove at most one effect per
(scope, key, attempt), whatever the ledger says. Enable with ``TOOLLEDGER_TOOLS=worker.probe``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

from pydantic import Field

from worker.builtin_tools import ContentArgs, check_file, reconcile_write_file
from worker.tools import ToolContext, tool

EFFECTS_LOG_ENV = "TOOLLEDGER_EFFECTS_LOG"


def record_effect(ctx: ToolContext, **fields: Any) -> None:
    path = os.environ.get(EFFECTS_LOG_ENV)
    if not path:
        return
    line = {
        "scope": ctx.scope,
        "key": ctx.idempotency_key,
        "attempt": ctx.attempt,
        "execution_id": ctx.execution_id,
        "pid": os.getpid(),
        "t": time.time(),
        **fields,
    }
    data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)  # one write of a short line under O_APPEND: never interleaved
        os.fsync(fd)
    finally:
        os.close(fd)


class ProbeArgs(ContentArgs):
    hold_ms: int = Field(
        0, ge=0, le=60_000, description="Sleep half before the effect and half after it."
    )


@tool(idempotent=True, reconcile=reconcile_write_file, check=check_file)
def probe_write(args: ProbeArgs, ctx: ToolContext) -> dict[str, Any]:
    """write_file, plus one line per real execution in the effects log."""
    time.sleep(args.hold_ms / 2000)
    data = args.content.encode("utf-8")
    record_effect(ctx, path=args.path, sha256=hashlib.sha256(data).hexdigest())
    facts = ctx.sandbox.write_atomic(ctx.scope, args.path, data)
    time.sleep(args.hold_ms / 2000)
    return {"path": args.path, "bytes_written": facts.size, "sha256": facts.sha256}
