"""Recovery commands: sweep, beat, resolve, retry, repair."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import click

from ledger.identity import check_scope
from ledger.transitions import TERMINAL, Status
from recovery.humans import resolve as resolve_call
from recovery.humans import retry as retry_call
from recovery.replay import FORMATS
from recovery.sweep import sweep as run_sweep
from recovery.transcript import repair_file
from worker.cli import Context, call_options, cli, json_option, pass_ctx

DEFAULT_SCOPE = "default"


@cli.command()
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds past lease expiry (DB clock) before running -> unknown "
    "[env TOOLLEDGER_SWEEP_GRACE, 5].",
)
@click.option(
    "--requeue-after",
    type=click.FloatRange(min=0),
    default=None,
    help="Re-publish approved work unclaimed this long [env TOOLLEDGER_REQUEUE_AFTER].",
)
@click.option("--no-requeue", is_flag=True, help="Do not touch the broker.")
@json_option
@pass_ctx
def sweep(c: Context, grace: float | None, requeue_after: float | None, no_requeue: bool) -> None:
    """One recovery pass: expired running -> unknown, reconcile, re-enqueue lost work."""
    settings = c.settings
    sub = c.submitter
    publish = None if no_requeue else _publisher(c)
    summary = run_sweep(
        c.ledger,
        sub.registry,
        sub.sandbox,
        grace_seconds=settings.sweep_grace if grace is None else grace,
        requeue_after=settings.requeue_after if requeue_after is None else requeue_after,
        publish=publish,
        max_auto_retries=settings.max_auto_retries,
    )
    c.emit(
        summary.to_json(),
        lambda d: (
            ", ".join(
                f"{k} {v}"
                for k, v in d.items()
                if k
                in (
                    "marked_unknown",
                    "reconciled",
                    "not_applied",
                    "auto_retried",
                    "still_unknown",
                    "landed",
                    "requeued",
                    "duration_s",
                )
            )
            + "".join(f"\nwarning: {e}" for e in d["errors"])
        ),
    )


def _publisher(c: Context) -> Any:
    from worker.tasks import publish

    return lambda scope, key, attempt: publish(c.submitter.app, c.settings, scope, key, attempt)


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=None,
    help="Seconds between sweeps [env TOOLLEDGER_SWEEP_INTERVAL, 10].",
)
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
@pass_ctx
def beat(c: Context, interval: float | None, celery_args: tuple[str, ...]) -> None:
    """Run the one beat that schedules the sweep on its own queue (Celery beat options pass
    through). Run exactly one; two are safe, only wasteful."""
    from worker.app import check_worker_start, create_app

    settings = c.settings.with_(sweep_interval=interval)
    check_worker_start(settings)
    app = create_app(settings)
    args = list(celery_args)
    if not any(a in ("-l", "--loglevel") or a.startswith("--loglevel=") for a in args):
        args += ["--loglevel", "INFO"]
    settings.home.mkdir(parents=True, exist_ok=True)
    app.start(["beat", *args])


@cli.command()
@click.option("--execution-id", required=True)
@click.option("--as", "as_", required=True, type=click.Choice([s.value for s in TERMINAL]))
@click.option("--by", required=True, help="Who decided.")
@click.option("--evidence", required=True, help="What they saw that proves it.")
@json_option
@pass_ctx
def resolve(c: Context, execution_id: str, as_: str, by: str, evidence: str) -> None:
    """A human's resolution of an unknown execution, recorded with its evidence."""
    out = resolve_call(c.submitter, execution_id, Status(as_), by=by, evidence=evidence)
    c.emit(out, lambda d: f"{d['status']}: {execution_id} resolved by {by}")


@cli.command()
@call_options
@click.option("--by", required=True, help="Who authorises the new attempt.")
@click.option(
    "--accept-duplicate",
    is_flag=True,
    help="For a tool that is not idempotent: accept that its effect may happen twice.",
)
@click.option("--reason", help="Why.")
@json_option
@pass_ctx
def retry(
    c: Context, scope: str, tool_call_id: str, by: str, accept_duplicate: bool, reason: str | None
) -> None:
    """A new attempt under the same key (unknown or failed calls), authorised by a person."""
    out = retry_call(
        c.submitter, scope, tool_call_id, by=by, accept_duplicate=accept_duplicate, reason=reason
    )

    def human(d: dict[str, Any]) -> str:
        text = f"approved attempt {d['attempt']} of {scope}/{tool_call_id}, authorised by {by}"
        if d.get("warning"):
            text += f"\nwarning: {d['warning']}"
        if d.get("enqueue_error"):
            text += f"\nwarning: not enqueued ({d['enqueue_error']}); the sweep will re-enqueue it"
        return text

    c.emit(out, human)


@cli.command()
@click.argument("transcript", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--scope",
    default=lambda: os.environ.get("TOOLLEDGER_SCOPE", DEFAULT_SCOPE),
    help="Scope of the calls [env TOOLLEDGER_SCOPE, default].",
)
@click.option("--format", "fmt", type=click.Choice(FORMATS), help="Default: detected.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
    help="Write here ('-': stdout) instead of in place.",
)
@json_option
@pass_ctx
def repair(c: Context, transcript: Path, scope: str, fmt: str | None, out: Path | None) -> None:
    """Insert the missing tool results into a transcript, by replay (never re-execution)."""
    check_scope(scope)
    to_stdout = out is not None and str(out) == "-"
    if to_stdout:
        from recovery.transcript import repair_transcript

        report = repair_transcript(transcript.read_text(encoding="utf-8"), c.ledger, scope, fmt)
        click.echo(report.text, nl=False)
        return
    report = repair_file(transcript, c.ledger, scope, fmt, out)
    data = {"transcript": str(transcript), "out": str(out or transcript), **report.to_json()}
    c.emit(
        data,
        lambda d: (
            f"{d['format'] or 'no tool calls'}: {d['calls']} calls, {d['answered_before']} had "
            f"results, {len(d['inserted'])} inserted"
            + "".join(
                f"\n  {i['tool_call_id']} ({i['tool']}): {i['status']}" for i in d["inserted"]
            )
        ),
    )


@cli.command()
@json_option
@pass_ctx
def demo(c: Context) -> int:
    """The showcase: an agent session, a worker crash, recovery — on the embedded default."""
    from recovery.demo import render, run_demo

    out = (lambda _t: None) if c.json else (lambda t: click.echo(t, err=False))
    summary = run_demo(c.settings, out)
    if c.json:
        c.emit(summary)
    else:
        from worker.cli import _human_list

        rows = c.ledger.list_calls(scope=summary["scope"])
        click.echo(render(summary, c.settings, _human_list({"calls": [r.to_json() for r in rows]})))
    return 0 if summary["ok"] else 1


@cli.command()
@click.option("--workers", type=click.IntRange(1, 32), default=2, show_default=True)
@click.option("--concurrency", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option("--jobs", type=click.IntRange(1), default=300, show_default=True)
@click.option(
    "--duration",
    type=click.FloatRange(5),
    default=60.0,
    show_default=True,
    help="Seconds of fault injection (jobs are submitted over 85% of it).",
)
@click.option(
    "--faults",
    type=click.IntRange(0),
    default=0,
    help="External faults to inject [default: max(24, duration/2.5)].",
)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Report directory [default: HOME/chaos/<time>].",
)
@click.option(
    "--baseline",
    is_flag=True,
    help="Then run the same jobs and faults on a plain Celery task, no ledger.",
)
@click.option("--keep-db", is_flag=True, help="Keep the run's database for inspection.")
@click.option(
    "--code",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="A checkout of another toolledger version to put under test (e.g. a git worktree); "
    "its workers, agent, operator and sweep run that code; the harness and checker this one.",
)
@json_option
@pass_ctx
def chaos(
    c: Context,
    workers: int,
    concurrency: int,
    jobs: int,
    duration: float,
    faults: int,
    seed: int,
    out: Path | None,
    baseline: bool,
    keep_db: bool,
    code: Path | None,
) -> int:
    """Kill, freeze, partition and crash the world mid-task; check nothing was duplicated,
    lost, stuck, landed after its revocation or hidden from the model."""
    from recovery.chaos import ChaosConfig, markdown, run_chaos

    settings = c.settings
    out = out or settings.home / "chaos" / time.strftime("%Y%m%d-%H%M%S")
    quiet = (lambda _t: None) if c.json else (lambda t: click.echo(t, err=True))
    cfg = ChaosConfig(
        out=out,
        db=settings.db,
        broker=settings.broker,
        workers=workers,
        concurrency=concurrency,
        jobs=jobs,
        duration=duration,
        faults=faults,
        seed=seed,
        keep_db=keep_db,
        code=code.resolve() if code else None,
        progress=quiet,
    )
    if not settings.broker.startswith(("redis://", "rediss://")):
        raise click.UsageError(
            "chaos needs Redis as the broker (--broker redis://…) and "
            "Postgres as the ledger (--db postgresql://…)"
        )
    try:
        report = run_chaos(cfg, baseline=baseline)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    c.emit(
        report, lambda r: markdown(r) + f"\nreport: {out}  (report.json, report.md, timeline.png)"
    )
    return 0 if report["ok"] else 1
