"""After something went wrong: sweep, resolve, retry, repair."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from toolledger.cli.common import (
    EXIT_FAILURE,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Context,
    Seconds,
    answer_stream,
    call_options,
    json_option,
    pass_ctx,
    person_option_check,
)
from toolledger.config import MAX_SETTING_SECONDS
from toolledger.ledger.identity import check_scope, check_text_id
from toolledger.ledger.transitions import TERMINAL, Status
from toolledger.recovery.humans import resolve as resolve_call
from toolledger.recovery.humans import retry as retry_call
from toolledger.recovery.replay import FORMATS
from toolledger.recovery.sweep import sweep as run_sweep
from toolledger.recovery.transcript import read_transcript, repair_file, repair_transcript

DEFAULT_SCOPE = "default"


@click.command()
@click.option(
    "--grace",
    type=Seconds(min=0, max=MAX_SETTING_SECONDS),
    default=None,
    help="Seconds past lease expiry (DB clock) before running -> unknown "
    "[env TOOLLEDGER_SWEEP_GRACE, 5].",
)
@click.option(
    "--requeue-after",
    type=Seconds(min=0, max=MAX_SETTING_SECONDS),
    default=None,
    help="Re-publish approved work unclaimed this long [env TOOLLEDGER_REQUEUE_AFTER].",
)
@click.option("--no-requeue", is_flag=True, help="Do not touch the broker.")
@json_option
@pass_ctx
def sweep(c: Context, grace: float | None, requeue_after: float | None, no_requeue: bool) -> int:
    """One recovery pass: expired running -> unknown, reconcile, re-enqueue lost work.

    Exit 1 when the pass reported errors (a broker out of reach, so lost work was not
    re-published; an effect that could not be finished): the summary still lists them."""
    settings = c.settings
    sub = c.submitter
    publish = None if no_requeue else _publisher(c)
    try:
        summary = run_sweep(
            c.ledger,
            sub.registry,
            sub.sandbox,
            grace_seconds=settings.sweep_grace if grace is None else grace,
            requeue_after=settings.requeue_after if requeue_after is None else requeue_after,
            publish=publish,
            max_auto_retries=settings.max_auto_retries,
        )
    except SystemExit as exc:  # in this process, only a tool's code (a reconciler) raises it:
        # the pass ended there, and the command exited 0 saying nothing (a cold review)
        raise CliError(
            f"the pass stopped: a tool's code called sys.exit({exc.code!r}) (a reconciler?); "
            "what it had done is kept, the rest waits for the next pass",
            EXIT_FAILURE,
        ) from None
    c.emit(
        summary.to_json(),
        lambda d: ", ".join(
            f"{k} {v}"
            for k, v in d.items()
            if k
            in (
                "marked_unknown",
                "reconciled",
                "not_applied",
                "auto_retried",
                "retry_held",
                "still_unknown",
                "contradicted",
                "landed",
                "kept_aside",
                "requeued",
                "duration_s",
            )
        ),
    )  # its errors, strangers and busy paths: logged on stderr as the pass met them
    return EXIT_FAILURE if summary.errors else EXIT_OK


def _publisher(c: Context) -> Any:
    from toolledger.worker.tasks import publish

    return lambda scope, key, attempt: publish(c.submitter.app, c.settings, scope, key, attempt)


@click.command()
@click.option("--execution-id", required=True)
@click.option("--as", "as_", required=True, type=click.Choice([s.value for s in TERMINAL]))
@click.option("--by", required=True, callback=person_option_check, help="Who decided.")
@click.option("--evidence", required=True, help="What they saw that proves it.")
@click.option(
    "--review",
    is_flag=True,
    help="Settle the flag on this execution's call, which you have looked at (show, list "
    "--review). Without it, an execution no longer unknown is refused, exit 5.",
)
@click.option(
    "--seen",
    type=click.IntRange(0, 2**62),
    help="With --review: the seq of the call's newest event you looked at (show's last_seq, "
    "events). Refused, exit 5, if a flag the review would settle was raised since or the "
    "call changed since: look again. Without it, the review settles every flag waiting on "
    "the execution, including one raised after you looked.",
)
@json_option
@pass_ctx
def resolve(
    c: Context,
    execution_id: str,
    as_: str,
    by: str,
    evidence: str,
    review: bool,
    seen: int | None,
) -> None:
    """A human's resolution of an unknown execution, or review of a flagged call.

    Recorded with who decided and the evidence. A flagged call (list --review): look at it,
    then confirm or correct what a human or a reconciler decided, with --review. A call
    flagged not_landed: land its kept bytes by hand or leave them, then confirm its status
    with --review; the sweep removes the bytes. Give --seen (show's last_seq) with --review:
    the review is then refused if the call changed after you looked."""
    if seen is not None and not review:
        raise CliError("--seen goes with --review: it says what the review saw", EXIT_USAGE)
    # an unknown execution is resolved, not reviewed: no flag is settled, none to warn of (it
    # warned of flags "raised after you looked" on a call flagged for nothing: a cold review)
    check_text_id(execution_id, "execution_id", 64)  # refused as the resolution refuses it
    reviewing = review and c.recorded_ledger.execution(execution_id).status in TERMINAL
    out = resolve_call(
        c.recorded_ledger,
        execution_id,
        Status(as_),
        by=by,
        evidence=evidence,
        review=review,
        seen=seen,
    )
    if reviewing and seen is None:  # once it is given: a refusal stays one line on stderr
        out["warning"] = (
            "a review without --seen settles every flag waiting on this execution, including "
            "any raised after you looked: pass --seen with show's last_seq to be refused instead"
        )
    c.emit(out, lambda d: f"{d['status']}: {execution_id} resolved by {by}")
    if out.get("warning") and not c.json:  # on stderr, once (in the JSON under --json)
        c.warn(out["warning"])


@click.command()
@call_options
@click.option(
    "--by", required=True, callback=person_option_check, help="Who authorises the new attempt."
)
@click.option(
    "--accept-duplicate",
    is_flag=True,
    help="For a tool that is not idempotent: accept that its effect may happen twice.",
)
@click.option("--reason", help="Why.")
@click.option(
    "--attempt",
    type=click.IntRange(1, 2**31),
    help="The call's last attempt as you saw it (show's last_attempt, its authorized_attempts "
    "unless a withdrawal made an earlier one current): refused, exit 5, if there is a later "
    "one now.",
)
@json_option
@pass_ctx
def retry(
    c: Context,
    scope: str,
    tool_call_id: str,
    by: str,
    accept_duplicate: bool,
    reason: str | None,
    attempt: int | None,
) -> None:
    """A new attempt under the same key (unknown or failed calls), authorised by a person.

    Refused, exit 5, while a flag waits on the call (list --review): review it first
    (resolve --review)."""
    c.require_ledger()
    c.check_broker()
    sub = c.submitter
    out = retry_call(
        sub.ledger,
        sub.registry,
        sub.enqueue,
        scope,
        tool_call_id,
        by=by,
        accept_duplicate=accept_duplicate,
        reason=reason,
        attempt=attempt,
    )

    def human(d: dict[str, Any]) -> str:
        text = f"approved attempt {d['attempt']} of {scope}/{tool_call_id}, authorised by {by}"
        return text  # enqueue_error: logged on stderr as it failed

    c.emit(out, human)
    if out.get("warning") and not c.json:  # on stderr, once
        c.warn(out["warning"])


@click.command()
@click.argument("transcript", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--scope",
    default=lambda: os.environ.get("TOOLLEDGER_SCOPE", DEFAULT_SCOPE),
    help="Scope of the calls [env TOOLLEDGER_SCOPE, default].",
)
@click.option("--format", "fmt", type=click.Choice(FORMATS), help="Default: detected.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
    help="Write here ('-': stdout; with --json the summary then goes to stderr) instead of "
    "in place.",
)
@json_option
@pass_ctx
def repair(c: Context, transcript: Path, scope: str, fmt: str | None, out: Path | None) -> None:
    """Insert the missing tool results into a transcript, by replay (never re-execution).

    The file is read as bytes (strict UTF-8) and refused, untouched, with exit 6 if it is not
    a well-formed transcript; a symbolic link is never written to (pass its target)."""
    check_scope(scope)
    if not transcript.exists():  # not found, exit 4, as a call is (it was click's usage error)
        raise CliError(f"no transcript at {transcript}", EXIT_NOT_FOUND)
    if out is not None and str(out) == "-":
        # bytes in, bytes out: what repair wrote is what it read back, whatever the locale
        report = repair_transcript(
            read_transcript(transcript), c.recorded_ledger, scope, fmt, name=str(transcript)
        )
        click.echo(report.text.encode("utf-8"), nl=False, file=answer_stream())
        if c.json:  # stdout is the transcript's: the summary a script asked for goes to stderr
            data = {"transcript": str(transcript), "out": "-", **report.to_json()}
            click.echo(json.dumps(data, ensure_ascii=False, default=str), err=True)
        return
    report = repair_file(transcript, c.recorded_ledger, scope, fmt, out)
    data = {"transcript": str(transcript), "out": str(out or transcript), **report.to_json()}
    c.emit(
        data,
        lambda d: (
            f"{d['format'] or 'no tool calls'}: {d['calls']} calls, {d['answered_before']} had "
            f"results, {len(d['inserted'])} inserted"
            + "".join(
                f"\n  {i['tool_call_id']} ({i['tool']}): {i['status']}"
                + (f", flagged {i['review']}: a person reviews it" if i["review"] else "")
                for i in d["inserted"]
            )
        ),
    )
