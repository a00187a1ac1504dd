"""The chaos run's tools, loaded by the workers under test (``TOOLLEDGER_TOOLS``).

A plain module on its own directory (not inside the package), so that the harness can load it
into any version of toolledger it tests — today's, or an older one checked out in a worktree —
using only the tool API they share. Each tool holds a while (``hold_ms``: half before its
effect, half after), so that faults meet work in progress:

- ``chaos_write``: write_file (reconciled by the file's bytes);
- ``chaos_append``: append one line (not idempotent: a second effect is a second line);
- ``chaos_charge``: charge through the downstream service (``TOOLLEDGER_CHAOS_DOWNSTREAM``),
  sending ``ctx.idempotency_key`` — the service charges once per key — and reconciled by
  asking it for its receipt under that key. Not fenced by the sandbox: the service's key
  check is what stops a duplicate.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

#: An older checkout under test (``--code``) names its modules without the namespace.
LEGACY = bool(os.environ.get("TOOLLEDGER_CHAOS_LEGACY"))

if TYPE_CHECKING:
    from toolledger.builtin_tools import reconcile_write_file
    from toolledger.ledger.transitions import Status
    from toolledger.tools import Evidence, OutcomeUnknown, ToolContext, ToolError, make_tool, tool
else:

    def _module(name: str) -> Any:
        return importlib.import_module(name.removeprefix("toolledger.") if LEGACY else name)

    _tools = _module("worker.tools" if LEGACY else "toolledger.tools")
    Status = _module("toolledger.ledger.transitions").Status
    reconcile_write_file = _module(
        "worker.builtin_tools" if LEGACY else "toolledger.builtin_tools"
    ).reconcile_write_file
    Evidence, OutcomeUnknown, ToolContext = (
        _tools.Evidence,
        _tools.OutcomeUnknown,
        _tools.ToolContext,
    )
    ToolError, make_tool, tool = _tools.ToolError, _tools.make_tool, _tools.tool

#: Contract options only newer versions know (a sandbox fenced by the ledger).
_NEW = "sandboxed" in inspect.signature(make_tool).parameters


def _contract(**options: Any) -> dict[str, Any]:
    return (
        options
        if _NEW
        else {k: v for k, v in options.items() if k not in ("sandboxed", "auto_retry")}
    )


class WriteArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    content: str
    hold_ms: int = Field(0, ge=0, le=60_000)


class ChargeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    account: str
    cents: int = Field(gt=0)
    hold_ms: int = Field(0, ge=0, le=60_000)


def _hold(args: Any) -> None:
    time.sleep(args.hold_ms / 2000)


@tool(**_contract(idempotent=True, reconcile=reconcile_write_file, sandboxed=True, auto_retry=True))
def chaos_write(args: WriteArgs, ctx: ToolContext) -> dict[str, Any]:
    """Set a file's content (write_file that takes its time)."""
    _hold(args)
    done = ctx.sandbox.write_atomic(ctx.scope, args.path, args.content.encode("utf-8"))
    _hold(args)
    return {"path": args.path, "bytes_written": done.size, "sha256": done.sha256}


@tool(**_contract(idempotent=False, sandboxed=True))
def chaos_append(args: WriteArgs, ctx: ToolContext) -> dict[str, Any]:
    """Append one line to a file (not idempotent)."""
    _hold(args)
    ctx.sandbox.append(ctx.scope, args.path, args.content.encode("utf-8"))
    _hold(args)
    return {"path": args.path, "bytes_appended": len(args.content.encode("utf-8"))}


def _service() -> str:
    return os.environ["TOOLLEDGER_CHAOS_DOWNSTREAM"]


def reconcile_charge(args: ChargeArgs, ctx: ToolContext) -> Evidence | None:
    """The service's receipt under the original key, if it has one for these terms."""
    url = f"{_service()}/receipt?key={urllib.parse.quote(str(ctx.idempotency_key))}"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our loopback
            found = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None  # no receipt yet: a frozen executor may still send it
        raise
    if (found["account"], found["cents"]) != (args.account, args.cents):
        return None
    return Evidence(Status.SUCCEEDED, found, {"method": "downstream receipt under the key"})


@tool(**_contract(idempotent=True, reconcile=reconcile_charge))
def chaos_charge(args: ChargeArgs, ctx: ToolContext) -> dict[str, Any]:
    """Charge an account through the downstream service, under the idempotency key."""
    _hold(args)
    if ctx.lease_lost.is_set():
        # said in the result, so that the run's checker can tie the failure to the fault that
        # cut the lease's renewals (a Postgres crash in CI, 12-07, read as a failure no fault
        # explained)
        raise ToolError("not sent: this worker lost its lease before the request", lease_lost=True)
    body = {
        "key": ctx.idempotency_key,
        "account": args.account,
        "cents": args.cents,
        "execution_id": ctx.execution_id,
    }
    request = urllib.request.Request(  # noqa: S310 - the harness's service
        f"{_service()}/charge",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=3) as response:  # noqa: S310
            receipt: dict[str, Any] = json.loads(response.read())
    except (TimeoutError, urllib.error.URLError) as exc:
        raise OutcomeUnknown(f"the service did not answer: {exc}") from exc
    _hold(args)
    return receipt
