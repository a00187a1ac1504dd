"""The harnesses: the demo, chaos and the benchmarks (chaos and bench need the extras
``toolledger[harness]`` / ``toolledger[bench]``; they are imported only when run)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from toolledger.cli.calls import human_list
from toolledger.cli.common import Context, Seconds, json_option, pass_ctx


@click.command()
@json_option
@pass_ctx
def demo(c: Context) -> int:
    """The showcase: an agent session, a worker crash, recovery — on the embedded default."""
    from toolledger.demo import render, run_demo

    out = (lambda _t: None) if c.json else (lambda t: click.echo(t, err=False))
    summary = run_demo(c.settings, out)
    if c.json:
        c.emit(summary)
    else:
        rows = c.ledger.list_calls(scope=summary["scope"])
        click.echo(render(summary, c.settings, human_list({"calls": [r.to_json() for r in rows]})))
    return 0 if summary["ok"] else 1


@click.command()
@click.option("--workers", type=click.IntRange(1, 32), default=2, show_default=True)
@click.option("--concurrency", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option(
    "--pool",
    type=click.Choice(["prefork", "threads"]),
    default="prefork",
    show_default=True,
    help="The workers' Celery pool (threads: one process each, no pool child to kill).",
)
@click.option("--jobs", type=click.IntRange(1), default=300, show_default=True)
@click.option(
    "--duration",
    type=Seconds(5),
    default=60.0,
    show_default=True,
    help="Seconds of fault injection (jobs are submitted over 85% of it).",
)
@click.option(
    "--faults",
    type=click.IntRange(0),
    default=0,
    help="External faults to inject [default: as many as the fleet can take while each meets "
    "work: about (workers - 1) * duration / (lease + 6 s) worker-disabling ones, the other "
    "kinds in proportion, two of each kind at least].",
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
    pool: str,
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
    from toolledger.harness.chaos import ChaosConfig, markdown, run_chaos

    settings = c.settings
    out = out or settings.home / "chaos" / time.strftime("%Y%m%d-%H%M%S")
    quiet = (lambda _t: None) if c.json else (lambda t: click.echo(t, err=True))
    cfg = ChaosConfig(
        out=out,
        db=settings.db,
        broker=settings.broker,
        workers=workers,
        concurrency=concurrency,
        pool=pool,
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


DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def _default(env: str, prefixes: tuple[str, ...], fallback: str) -> str:
    value = os.environ.get(env, "")
    return value if value.startswith(prefixes) else fallback


@click.command()
@click.option("--quick", is_flag=True, help="Tiny sizes, seconds: keeps the harness honest in CI.")
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True)
@click.option(
    "--pg",
    default=lambda: _default("TOOLLEDGER_DB", ("postgres",), DEFAULT_PG),
    help="A Postgres server where scratch databases may be created "
    "[TOOLLEDGER_DB if Postgres, else localhost].",
)
@click.option(
    "--redis",
    default=lambda: _default("TOOLLEDGER_BROKER", ("redis",), DEFAULT_REDIS),
    help="A Redis server [TOOLLEDGER_BROKER if Redis, else localhost].",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Report directory [default: bench/out/<time>].",
)
@click.option(
    "--only",
    type=click.Choice(["cli_start", "e2e", "protocol"]),
    default=None,
    help="Run this section alone, with its headline figures (cli_start: Postgres too "
    "unless --pg '').",
)
@json_option
@pass_ctx
def bench(
    c: Context,
    quick: bool,
    rounds: int,
    pg: str,
    redis: str,
    out: Path | None,
    only: str | None,
) -> int:
    """Benchmarks, every figure a median of interleaved rounds; JSON, Markdown and a PNG."""
    from toolledger.harness.bench.report import markdown, write_all
    from toolledger.harness.bench.runner import BenchConfig, run_bench

    out = out or Path("bench/out") / time.strftime("%Y%m%d-%H%M%S")
    say = (lambda _t: None) if c.json else (lambda t: click.echo(t, err=True))
    from toolledger.harness.bench.common import Bent

    config = BenchConfig(
        pg=pg, redis=redis, out=out, quick=quick, rounds=rounds, only=only, progress=say
    )
    try:
        report = run_bench(config)
    except Bent as exc:  # fsync or synchronous commit off: no figure would mean anything
        raise click.UsageError(str(exc)) from None
    report["files"] = write_all(report, out)
    names = ", ".join(Path(f).name for f in report["files"].values())
    c.emit(report, lambda r: markdown(r) + f"\nreport: {out} ({names})")
    return 0
