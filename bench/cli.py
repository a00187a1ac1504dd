"""``toolledger bench``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from worker.cli import Context, cli, json_option, pass_ctx

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def _default(env: str, prefixes: tuple[str, ...], fallback: str) -> str:
    value = os.environ.get(env, "")
    return value if value.startswith(prefixes) else fallback


@cli.command()
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
@json_option
@pass_ctx
def bench(c: Context, quick: bool, rounds: int, pg: str, redis: str, out: Path | None) -> int:
    """Benchmarks, every figure a median of interleaved rounds; JSON, Markdown and a PNG."""
    from bench.report import markdown, write_all
    from bench.runner import BenchConfig, run_bench

    out = out or Path("bench/out") / time.strftime("%Y%m%d-%H%M%S")
    say = (lambda _t: None) if c.json else (lambda t: click.echo(t, err=True))
    report = run_bench(
        BenchConfig(pg=pg, redis=redis, out=out, quick=quick, rounds=rounds, progress=say)
    )
    report["files"] = write_all(report, out)
    c.emit(report, lambda r: markdown(r) + f"\nreport: {out} (bench.json, bench.md, bench.png)")
    return 0
