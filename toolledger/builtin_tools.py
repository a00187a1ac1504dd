"""The built-in tools: write_file (idempotent, reconcilable), append_file, read_file.

All of their effects go through the sandbox, so all are ``sandboxed``: a revoked execution
of any of them provably left nothing. write_file also retries itself (``auto_retry``) when
its target is missing: applying it then overwrites nobody's bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from toolledger.ledger.transitions import Status
from toolledger.sandbox import SandboxError, refuse_invisible
from toolledger.tools import Absent, Evidence, Finding, Tool, ToolContext, ToolError, make_tool


class FileArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Path relative to the scope's sandbox directory.")


class ContentArgs(FileArgs):
    content: str = Field(description="UTF-8 text.")


def check_file(args: FileArgs, ctx: ToolContext, kind: str = "write") -> None:
    """Submit time: the path must be safe now for ``kind`` (``Sandbox.check``: a name that
    would alias a sibling is refused; to append or read, so is a hard-linked file), the
    content under the cap. Refused here, a call is never recorded (exit 6)."""
    refuse_invisible(args.path)  # at submit only: a call recorded before runs as approved
    ctx.sandbox.check(ctx.scope, args.path, kind=kind)
    if isinstance(args, ContentArgs):
        ctx.sandbox.check_content(args.content.encode("utf-8"))


def check_append(args: ContentArgs, ctx: ToolContext) -> None:
    """``check_file`` for an append: it goes through the file, so a hard link is refused."""
    check_file(args, ctx, "append")


def check_read(args: FileArgs, ctx: ToolContext) -> None:
    """``check_file`` for a read: it goes through the file, so a hard link is refused."""
    check_file(args, ctx, "read")


def write_file(args: ContentArgs, ctx: ToolContext) -> dict[str, Any]:
    """Set a file's content (create or replace it), atomically. Idempotent: the same content
    twice leaves the same file."""
    data = args.content.encode("utf-8")
    facts = ctx.sandbox.write_atomic(ctx.scope, args.path, data)
    return {"path": args.path, "bytes_written": facts.size, "sha256": facts.sha256}


def reconcile_write_file(args: ContentArgs, ctx: ToolContext) -> Finding:
    """Bytes for the path staged or committed, not landed yet (a newer call's write, say):
    cannot tell yet, whatever the file holds now — it does not say what the path will hold (a
    cold review: an automatic retry authorised on a missing file then landed after that newer
    write, over it; helper-88: a file still holding the request's bytes read "succeeded" while
    a newer call's committed write waited behind a frozen lander, which then landed over it,
    the receipt untrue for good, where the fence would have proved it not applied). Else: the
    file's bytes equal the request's (SHA-256): succeeded; the file is missing: the effect is
    absent, and writing it now overwrites nothing; different bytes: cannot tell what is right
    (someone may have written them since): a human decides. Reads only."""
    from toolledger.effects import effects_of  # not at import: the CLI's start

    data = args.content.encode("utf-8")
    wanted = hashlib.sha256(data).hexdigest()
    if not ctx.sandbox.attached:
        return None  # a sandbox this process cannot see proves nothing
    effects = effects_of(ctx.sandbox)
    try:
        # Asked before the file is read: bytes committed before this question wait now
        # (cannot tell) or have landed, where the read sees them; asked again after a file
        # found missing, for bytes staged meanwhile. Asked only after the read (as it was),
        # a newer write that landed between the read and the question was seen by neither,
        # and the automatic retry's older bytes landed over it (a cold review).
        waiting = effects.pending_on(ctx.scope, args.path, ctx.effect_states)
        found = ctx.sandbox.sha256(ctx.scope, args.path)
        if found is None and not waiting:
            waiting = effects.pending_on(ctx.scope, args.path, ctx.effect_states)
    except (OSError, SandboxError):  # e.g. a hard link now: not what a write leaves; or the
        return None  # pending area cannot be looked at: cannot tell
    if waiting:
        return None
    if found is None:
        return Absent({"method": "target file is missing", "path": args.path})
    if found != wanted:
        return None
    return Evidence(
        status=Status.SUCCEEDED,
        result={"path": args.path, "bytes_written": len(data), "sha256": wanted},
        detail={"method": "file bytes equal the requested content", "sha256": found},
    )


def append_file(args: ContentArgs, ctx: ToolContext) -> dict[str, Any]:
    """Append text to a file. Not idempotent (twice is two lines) and not reconcilable by
    content; but an append whose execution was revoked provably never landed."""
    facts = ctx.sandbox.append(ctx.scope, args.path, args.content.encode("utf-8"))
    return {"path": args.path, "bytes_appended": facts.size, "sha256": facts.sha256}


def read_file(args: FileArgs, ctx: ToolContext) -> dict[str, Any]:
    """Read a UTF-8 text file. Read-only: needs no approval and takes no claim."""
    data = ctx.sandbox.read(ctx.scope, args.path)
    if data is None:
        raise ToolError(f"no such file: {args.path}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{args.path} is not UTF-8 text") from None
    return {
        "path": args.path,
        "content": text,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


BUILTINS: list[Tool] = [
    make_tool(
        write_file,
        idempotent=True,
        reconcile=reconcile_write_file,
        check=check_file,
        sandboxed=True,
        auto_retry=True,
    ),
    make_tool(append_file, idempotent=False, check=check_append, sandboxed=True),
    make_tool(read_file, read_only=True, check=check_read),
]
