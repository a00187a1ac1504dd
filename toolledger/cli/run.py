"""Running things: one call in this process (execute), a worker, the beat."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import click
import sqlalchemy as sa

from toolledger.cli.common import (
    EXIT_FAILURE,
    Context,
    Seconds,
    call_options,
    context_of,
    fail,
    json_option,
    pass_ctx,
)
from toolledger.ledger.errors import StateError
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.worker.runtime import Runtime, default_worker_id


@click.command()
@call_options
@json_option
@pass_ctx
def execute(c: Context, scope: str, tool_call_id: str) -> None:
    """Run an approved call now, in this process, through the same pipeline as a worker."""
    ledger = c.recorded_ledger
    op = ledger.get(scope, tool_call_id).operation
    if op.status is not Status.APPROVED:
        raise StateError(
            f"call {tool_call_id!r} is {op.status}: only an approved, unclaimed call can run"
        )
    # Like a worker: failpoints armed (TOOLLEDGER_FAILPOINTS, _FAILPOINT_LOG), bounded
    # database waits, the fenced sandbox, warnings on stderr.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rt = Runtime.build(c.settings)
    try:
        outcome = rt.executor(default_worker_id("cli")).execute(
            scope, op.idempotency_key, op.authorized_attempts
        )
        if outcome.state == "lost":
            raise StateError(
                f"call {tool_call_id!r} was not claimed: another executor has it, it is no "
                "longer approved, or it is flagged for review (toolledger list --review)"
            )
        data = _after(rt.ledger, scope, tool_call_id)
    finally:
        rt.close()
    data["outcome"] = outcome.state
    if outcome.landing is not None:
        data["landing"] = outcome.landing.to_json()
    c.emit(
        data,
        lambda d: (
            f"{d['outcome']}: {scope}/{tool_call_id} [{d.get('status', 'not known')}]\n"
            + json.dumps(d.get("receipt"), ensure_ascii=False, indent=2)
        ),
    )
    if outcome.state in ("unrecorded", "unsure"):  # it did not end on record: exit 0 said so
        said = outcome.state if outcome.kept else "unkept"
        fail(
            _NOT_ON_RECORD[said].format(call=f"{scope}/{tool_call_id}"),
            EXIT_FAILURE,
            c.json,
        )
    if data.get("review") == "not_landed":  # its receipt says done, the sandbox does not
        # (a cold review: exit 0 let a script take the file for written)
        fail(
            _NOT_ON_RECORD["not_landed"].format(call=f"{scope}/{tool_call_id}"),
            EXIT_FAILURE,
            c.json,
        )


#: What ``execute`` says on stderr (exit 1) of a call whose end is not on record.
_NOT_ON_RECORD = {
    "unrecorded": (
        "{call} ran, but the ledger could not take its outcome: it is kept on disk and the "
        "next sweep records it (toolledger wait)"
    ),
    "unkept": (
        "{call} ran, but neither the ledger nor the disk could take its outcome (full?): it "
        "is lost, and the sweep will find the call unknown, its effect possibly applied"
    ),
    "not_landed": (
        "{call} ended, but its effect did not land (kept aside): the call is flagged "
        "not_landed for a person (toolledger show; resolve --review)"
    ),
    "unsure": (
        "{call}: whether its claim was recorded could not be learned (the ledger out of "
        "reach); the tool did not run, and the sweep settles the claim"
    ),
}


def _after(ledger: Ledger, scope: str, tool_call_id: str) -> dict[str, Any]:
    """The call as the ledger now has it; {} if the ledger cannot be reached (the outcome
    is still reported: it is on disk, spooled, if the ledger did not take it)."""
    try:
        view = ledger.get(scope, tool_call_id)
        try:
            receipt = ledger.receipt(scope, tool_call_id)
        except StateError:
            receipt = None
    except sa.exc.SQLAlchemyError as exc:
        logging.getLogger("toolledger.worker").warning("cannot read the call back: %s", exc)
        return {}
    return view.to_json(receipt)


log_format_option = click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default=None,
    help="Log lines as text or JSON objects with the call's ids [env TOOLLEDGER_LOG_FORMAT, text].",
)


def _use_log_format(log_format: str | None) -> None:
    """The option wins over the environment; the pool's children inherit it."""
    if log_format is not None:
        os.environ["TOOLLEDGER_LOG_FORMAT"] = log_format


def _given(args: tuple[str, ...], *names: str) -> bool:
    return any(a in names or a.startswith(tuple(f"{n}=" for n in names)) for a in args)


def _help_with_celerys(ctx: click.Context) -> None:
    """``worker --help``: ours, then Celery's worker options (they pass through). Needs no
    settings: help is asked for to find out how to give them."""
    from celery import Celery

    click.echo(ctx.get_help())
    click.echo("\nCelery's worker options, passed through:\n")
    try:
        Celery("toolledger", set_as_current=False).worker_main(["worker", "--help"])
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise


def _refuse_unknown_celery_args(ctx: click.Context, which: str, args: tuple[str, ...]) -> None:
    """A Celery option that does not exist (or lacks its value, or an extra argument) is a
    usage error said before anything is made: Celery's own parsing came after the start's
    checks, which had made the embedded ledger (``worker --workdir X`` in a folder with no
    ledger left a new one there, and ``list`` then answered "no calls", not "no ledger at")."""
    if which == "worker":
        from celery.bin.worker import worker as command
    else:
        from celery.bin.beat import beat as command
    try:
        _opts, extra, _order = command.make_parser(click.Context(command)).parse_args(list(args))
    except click.UsageError as exc:
        raise click.UsageError(exc.format_message(), ctx=ctx) from None
    if extra:
        raise click.UsageError(f"Got unexpected extra argument ({' '.join(extra)})", ctx=ctx)


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@log_format_option
@json_option
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def worker(ctx: click.Context, log_format: str | None, celery_args: tuple[str, ...]) -> None:
    """Run a Celery worker with toolledger's app and defaults.

    Celery's worker options pass through (--concurrency, --pool, --loglevel, -n, -Q, …);
    by default it consumes the job queue and the sweep queue, at loglevel INFO.
    """
    if _given(celery_args, "-h", "--help"):
        _help_with_celerys(ctx)
        return
    from toolledger.worker.app import check_worker_start, create_app

    c = context_of(ctx)
    _refuse_unknown_celery_args(ctx, "worker", celery_args)
    _use_log_format(log_format)
    settings = c.settings
    check_worker_start(settings)
    app = create_app(settings)
    argv = ["worker"]
    if not _given(celery_args, "-Q", "--queues"):
        argv += ["--queues", f"{settings.queue},{settings.sweep_queue}"]
    if not _given(celery_args, "-l", "--loglevel"):
        argv += ["--loglevel", "INFO"]
    app.worker_main([*argv, *celery_args])


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option(
    "--interval",
    # the setting's own bounds (config: sweep_interval), said here as --interval's: past a
    # day it was refused as "sweep_interval=1e+300: …", a name the user never typed
    type=Seconds(min=0.1, max=86_400),
    default=None,
    help="Seconds between sweeps [env TOOLLEDGER_SWEEP_INTERVAL, 10].",
)
@log_format_option
@json_option
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
@pass_ctx
def beat(
    c: Context, interval: float | None, log_format: str | None, celery_args: tuple[str, ...]
) -> None:
    """Run the one beat that schedules the sweep on its own queue (Celery beat options pass
    through). Run exactly one; two are safe, only wasteful."""
    from toolledger.worker.app import check_worker_start, create_app

    _refuse_unknown_celery_args(click.get_current_context(), "beat", celery_args)
    _use_log_format(log_format)
    settings = c.settings.with_(sweep_interval=interval)
    check_worker_start(settings)
    app = create_app(settings)
    args = list(celery_args)
    if not any(a in ("-l", "--loglevel") or a.startswith("--loglevel=") for a in args):
        args += ["--loglevel", "INFO"]
    settings.home.mkdir(parents=True, exist_ok=True)
    app.start(["beat", *args])
