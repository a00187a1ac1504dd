"""The calls: submit, the human decision, and reading them back (show, events, list)."""

from __future__ import annotations

import json
from typing import Any

import click

from toolledger.cli.common import (
    EXIT_FAILURE,
    EXIT_TIMEOUT,
    CliError,
    Context,
    Seconds,
    call_options,
    json_option,
    parse_json_object,
    pass_ctx,
    person_option_check,
    scope_option_check,
)
from toolledger.ledger.errors import InvalidStatus, StateError
from toolledger.ledger.inputs import shown_id
from toolledger.ledger.lightreads import CallReads, events_page
from toolledger.ledger.receipts import receipt_for
from toolledger.ledger.records import Receipt
from toolledger.ledger.transitions import Status, parse_status


@click.command()
@call_options
@click.option("--tool", required=True, help="Tool name.")
@click.option("--args", "raw_args", required=True, help="Arguments: JSON object, @file or -.")
@click.option("--key", help="Idempotency key [default: TOOL:TOOL_CALL_ID].")
@click.option(
    "--approved-by",
    callback=person_option_check,
    help="Approve at once, in this person's name.",
)
@click.option("--reason", help="Why it was approved.")
@json_option
@pass_ctx
def submit(
    c: Context,
    scope: str,
    tool_call_id: str,
    tool: str,
    raw_args: str,
    key: str | None,
    approved_by: str | None,
    reason: str | None,
) -> None:
    """Record a call; approved at once with --approved-by, else pending_approval."""
    if reason is not None and approved_by is None:  # it would be dropped in silence
        raise click.UsageError("--reason says why a call was approved: give --approved-by too")
    # as the HTTP API's bodies: the arguments' cap as JSON may spell it, and some room
    args = parse_json_object(raw_args, "--args", c.settings.max_args_bytes * 6 + 64 * 1024)
    # before any write; with no ledger's file yet there is no earlier call to replay, and a
    # refused call must not make one (exit 6 says nothing was recorded: a cold review)
    fresh = c.missing_ledger() is not None
    if approved_by is not None:
        c.check_broker()  # it will be enqueued: a broker URL no enqueue can use is refused now
    call = c.submitter.prepare(scope, tool_call_id, tool, args, key, replay=not fresh)
    out = c.submitter.submit(call, approved_by=approved_by, reason=reason)
    c.emit(out, _human_submit)
    if out.get("warning") and not c.json:  # on stderr, once (it was on stdout: a cold review)
        c.warn(out["warning"])
    if out["outcome"] == "read_only" and out["status"] == "failed":
        raise click.exceptions.Exit(EXIT_FAILURE)  # its result (printed) says why


def _call_named(d: dict[str, Any]) -> str:
    """``scope/tool_call_id`` as a person must read it to tell it from another: ``n16 `` and
    ``n16`` read the same until 2026-12-07 (``shown_id``: ``n16\\u0020``)."""
    return f"{shown_id(d['scope'])}/{shown_id(str(d['tool_call_id']))}"


def _human_submit(d: dict[str, Any]) -> str:
    call = _call_named(d)
    line = f"{d['outcome']}: {call} -> {shown_id(d['idempotency_key'])} [{d['status']}]"
    # a warning (the approval not applied) or enqueue_error (logged as it failed, the sweep
    # will publish it) is told on stderr, not here on stdout
    if "result" in d:
        line += "\n" + json.dumps(d["result"], ensure_ascii=False, indent=2)
    return line


def _decision(name: str, approve: bool) -> click.Command:
    @call_options
    @click.option("--by", required=True, callback=person_option_check, help="Who decided.")
    @click.option("--reason", help="Why.")
    @json_option
    @pass_ctx
    def command(c: Context, scope: str, tool_call_id: str, by: str, reason: str | None) -> None:
        c.require_ledger()
        if approve:
            c.check_broker()
        out = c.submitter.decide(scope, tool_call_id, by, reason, approve=approve)
        c.emit(out, _human_submit)
        if out.get("warning") and not c.json:
            c.warn(out["warning"])

    command.__doc__ = f"The human decision: {name} a pending call."
    return click.command(name)(command)


approve = _decision("approve", approve=True)
reject = _decision("reject", approve=False)


@click.command()
@call_options
@json_option
@pass_ctx
def show(c: Context, scope: str, tool_call_id: str) -> None:
    """One call: its action, every attempt and the receipt the model would get."""
    c.emit(c.reading(lambda reads: _shown(reads, scope, tool_call_id)), _human_show)


def _shown(reads: CallReads, scope: str, tool_call_id: str) -> dict[str, Any]:
    view = reads.get(scope, tool_call_id)
    history = None
    if view.operation.review:
        # the history first, then the call as it stands: last_seq then covers nothing the
        # page does not show (read the other way, a correction committed between the two
        # reads was in last_seq but not on the page, and a review --seen it let through
        # settled the flag that correction raised: a cold review)
        history = reads.events(scope, tool_call_id)
        view = reads.get(scope, tool_call_id)
    try:  # from the view just read, as Ledger.receipt would after reading it again
        receipt: Receipt | None = receipt_for(view.operation, view.current, flags=view.flags)
    except StateError:
        receipt = None
    data = view.to_json(receipt)
    data["last_seq"] = None
    if history is not None:  # both versions, side by side, from the flag's event
        flags = [e for e in history if e.kind == "flagged"]
        data["review_detail"] = flags[-1].detail if flags else None
        # what a review says it looked at (resolve --review --seen)
        data["last_seq"] = history[-1].seq if history else None
    return data


def _human_show(d: dict[str, Any]) -> str:
    flag = f"  REVIEW: {d['review']}" if d.get("review") else ""
    lines = [
        f"{_call_named(d)}  {d['tool']}  [{d['status']}]{flag}",
        f"  key     {shown_id(d['idempotency_key'])}",
        f"  sha256  {d['args_sha256']}",
        f"  args    {json.dumps(d['args'], ensure_ascii=False)[:200]}",
    ]
    for e in d["executions"]:
        mark = " (reconciled)" if e["reconciled"] else ""
        lines.append(f"  attempt {e['attempt']}  {e['execution_id']}  {e['status']}{mark}")
        if e["result"] is not None:
            lines.append(f"    result {json.dumps(e['result'], ensure_ascii=False)[:200]}")
    if d["receipt"] is not None:
        lines.append(f"  receipt {json.dumps(d['receipt'], ensure_ascii=False)[:300]}")
    if d.get("review_detail"):
        lines.append(f"  review  {json.dumps(d['review_detail'], ensure_ascii=False)[:600]}")
    if d.get("last_seq") is not None:  # what a review of it saw: resolve --review --seen
        lines.append(f"  seen    {d['last_seq']} (the newest event: resolve --review --seen)")
    return "\n".join(lines)


@click.command()
@call_options
@click.option(
    "--after",
    type=click.IntRange(min=0, max=2**62),
    default=0,
    metavar="SEQ",
    help="Only the events past this seq (the last one a page showed).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0, max=2**62),
    default=0,
    show_default=True,
    help="At most this many events, oldest first; 0 for all. JSON 'more' says if some were "
    "left: ask again with --after the last seq.",
)
@json_option
@pass_ctx
def events(c: Context, scope: str, tool_call_id: str, after: int, limit: int) -> None:
    """The call's event history, in order."""
    page = c.reading(lambda r: events_page(r, scope, tool_call_id, after=after, limit=limit))
    if page["more"]:  # on stderr, as list's: a JSON object under --json, never bare text
        last = page["events"][-1]["seq"]
        c.warn(f"more than {limit} events; ask again with --after {last}")
    c.emit(
        page,
        lambda d: "\n".join(
            f"{e['seq']:>6}  {e['at']}  {e['kind']:<16} {shown_id(e['actor']):<20} "
            f"{(e['execution_id'] or '-'):<36}  {json.dumps(e['detail'], ensure_ascii=False)[:120]}"
            for e in d["events"]
        ),
    )


def _status_option(value: str | None) -> Status | None:
    """``--status`` as a Status; a bad one is a bad option, exit 2, as ``resolve --as bogus``
    is (it was exit 6, "input refused": a cold review). '' is refused as 'done' is: a
    script's empty "$STATUS" listed every call (a cold review)."""
    try:
        return parse_status(value) if value is not None else None
    except InvalidStatus as exc:
        raise click.BadParameter(str(exc), param_hint="'--status'") from None


@click.command("list")
@click.option("--status", help="Only calls in this status (e.g. unknown: the humans' inbox).")
@click.option(
    "--review",
    is_flag=True,
    help="Only calls flagged for a human's review (a contradiction, or two attempts ran).",
)
@click.option("--scope", callback=scope_option_check, help="Only this scope.")
@click.option(
    "--limit",
    type=click.IntRange(min=0, max=2**62),
    default=0,
    show_default=True,
    help="At most this many rows, oldest first; 0 for all. JSON 'more' says if rows were left.",
)
@json_option
@pass_ctx
def list_(c: Context, status: str | None, review: bool, scope: str | None, limit: int) -> None:
    """Calls from current state (never from the history)."""
    wanted = _status_option(status)
    rows = c.recorded_ledger.list_calls(
        status=wanted, scope=scope, limit=limit + 1 if limit else 0, review=review
    )
    more = bool(limit) and len(rows) > limit
    rows = rows[:limit] if more else rows
    if more:  # on stderr as the errors are: a JSON object under --json, never bare text
        c.warn(f"more than {limit} calls; these are the oldest {limit}")
    out = {"count": len(rows), "calls": [r.to_json() for r in rows], "more": more}
    c.emit(out, human_list)


def human_list(d: dict[str, Any]) -> str:
    # the ids as a person must read them to tell them apart (``n16\u0020``), and aligned so
    calls = [
        {**r, "scope": shown_id(r["scope"]), "tool_call_id": _listed_id(r["tool_call_id"])}
        for r in d["calls"]
    ]
    w_scope = max([5, *(len(r["scope"]) for r in calls)])
    w_call = max([12, *(len(str(r["tool_call_id"])) for r in calls)])
    lines = [
        f"{'scope':<{w_scope}} {'tool_call_id':<{w_call}} {'tool':<14} {'status':<17} "
        "attempt execution_id"
    ]
    for r in calls:
        mark = " (reconciled)" if r["reconciled"] else ""
        if r.get("review"):
            mark += f" [review: {r['review']}]"
        lines.append(
            f"{r['scope']:<{w_scope}} {r['tool_call_id']!s:<{w_call}} {r['tool']:<14} "
            f"{r['status']:<17} {r['attempt']:>7} {r['execution_id'] or '-'}{mark}"
        )
    return "\n".join(lines)


def _listed_id(tool_call_id: str | None) -> str | None:
    return None if tool_call_id is None else shown_id(tool_call_id)


@click.command()
@call_options
@click.option(
    "--timeout",
    type=Seconds(min=0),
    default=None,
    help="Seconds to wait at most [default: for ever]; exit 7 if no receipt by then.",
)
@json_option
@pass_ctx
def wait(c: Context, scope: str, tool_call_id: str, timeout: float | None) -> None:
    """Wait for the call's receipt (woken by the database) and print it."""
    from toolledger.client import Client, ReceiptTimeout
    from toolledger.tools import Registry

    c.require_ledger()
    # a read: the user's tools are not loaded (a module that fails to import failed it, exit 2)
    client = Client(c.settings, registry=Registry())
    try:
        receipt = client.wait(scope, tool_call_id, timeout=timeout)
    except ReceiptTimeout as exc:
        raise CliError(str(exc), EXIT_TIMEOUT) from None
    finally:
        client.close()
    c.emit(receipt.to_json(), _human_receipt)


def _human_receipt(d: dict[str, Any]) -> str:
    mark = " (reconciled)" if d["reconciled"] else ""
    head = f"{_call_named(d)}  [{d['status']}]{mark}  {d['execution_id'] or ''}"
    body = head.rstrip() + "\n" + json.dumps(d["content"], ensure_ascii=False, indent=2)
    if d.get("review"):  # a script reading the status alone was misled (a cold review)
        why = (
            "the ledger holds another version of this outcome"
            if d["review"] == "contradicted"
            else "a person must look at this call"
        )
        body += f"\nflagged {d['review']}: {why}; this receipt may change (toolledger show)"
    return body
