"""``toolledger bench``: every benchmark, interleaved round by round, in one run."""

from __future__ import annotations

import contextlib
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from toolledger.harness.bench import cli_start
from toolledger.harness.bench.common import (
    CPU_PARTS,
    Figures,
    difference,
    durability,
    ratio,
    scratch_postgres,
)
from toolledger.harness.bench.e2e import E2E, VARIANTS, peer_databases
from toolledger.harness.bench.procs import Group
from toolledger.harness.bench.protocol import MINIMAL, QUEUED, impls, run_protocol
from toolledger.harness.bench.report import GOALS
from toolledger.harness.bench.roundtrip import run_roundtrip
from toolledger.harness.bench.sweep_bench import (
    populate,
    run_contention,
    run_sweep_round,
    sandboxes_for,
)
from toolledger.ledger.db import create_engine, upgrade

#: Sections that can also run alone (``toolledger bench --only NAME``): cli_start in
#: seconds, the two others in minutes rather than the whole bench's hour.
ALONE = ("cli_start", "e2e", "protocol")


@dataclass
class BenchConfig:
    pg: str
    redis: str
    out: Path
    quick: bool = False
    rounds: int = 3
    processes: tuple[int, ...] = (1, 2, 4, 8)
    protocol_jobs: int = 2000
    e2e_jobs: int = 1000
    sweep_sizes: dict[str, int] = field(default_factory=lambda: {"10k": 10_000, "1M": 1_000_000})
    stale: int = 1000
    contention_keys: int = 10_000
    roundtrip_calls: int = 100
    idle_seconds: float = 10.0
    cli_runs: int = cli_start.RUNS
    only: str | None = None  # one of ALONE: that section alone
    progress: Callable[[str], Any] = print

    def __post_init__(self) -> None:
        if self.quick:
            self.rounds, self.processes = min(self.rounds, 2), (1, 2)
            self.protocol_jobs, self.e2e_jobs, self.stale = 60, 30, 50
            self.sweep_sizes = {"10k": 1_000, "1M": 5_000}  # same keys, tiny sizes
            self.contention_keys = 300
            self.roundtrip_calls, self.idle_seconds = 10, 1.0
            self.cli_runs = 3


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    if cfg.only is not None:
        return run_alone(cfg)
    began = time.time()
    durable = durability(cfg.pg)
    figures = Figures()
    cfg.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="toolledger-bench-"))
    with contextlib.ExitStack() as stack:
        group, proto_dbs = _protocol_ledgers(cfg, stack, work)
        sweep_urls = {
            size: stack.enter_context(scratch_postgres(cfg.pg, f"sw{size.lower()}"))
            for size in cfg.sweep_sizes
        }
        sandboxes = sandboxes_for(work, list(cfg.sweep_sizes))
        for size, rows in cfg.sweep_sizes.items():
            cfg.progress(f"populating a ledger of {rows} finished calls + {cfg.stale} stale")
            populate(sweep_urls[size], rows, cfg.stale, sandboxes[size])
        peers_stack, e2e_dbs = peer_databases(cfg.pg)
        stack.enter_context(peers_stack)
        e2e = E2E(cfg.pg, cfg.redis, work / "e2e", cfg.e2e_jobs, cfg.progress)
        cli_dbs = {
            "embedded": f"sqlite:///{work / 'cli' / 'ledger.db'}",
            "postgres": stack.enter_context(scratch_postgres(cfg.pg, "cli")),
        }
        for r in range(cfg.rounds):
            _protocol_round(cfg, r, group, figures, proto_dbs, work)
            cfg.progress(f"round {r + 1}/{cfg.rounds}: end to end")
            e2e.round(figures, e2e_dbs)
            cfg.progress(f"round {r + 1}/{cfg.rounds}: sweep and claim contention")
            run_sweep_round(figures, sweep_urls, sandboxes, cfg.stale, cfg.progress)
            # Its own database: the claims it leaves running must not weigh on the protocol's.
            with scratch_postgres(cfg.pg, "race") as race_db:
                run_contention(group, figures, race_db, cfg.contention_keys)
            cfg.progress(f"round {r + 1}/{cfg.rounds}: round trip through the client")
            with scratch_postgres(cfg.pg, "rt") as rt_db:
                for label, env in _roundtrip_stacks(cfg, rt_db, work / "rt" / str(r)).items():
                    run_roundtrip(
                        figures,
                        label,
                        env,
                        work / "rt" / str(r),
                        cfg.roundtrip_calls,
                        cfg.progress,
                        cfg.idle_seconds,
                    )
            cfg.progress(f"round {r + 1}/{cfg.rounds}: CLI cold start")
            cli_start.run_cli_start(figures, cli_dbs, work / "cli", cfg.cli_runs)
        version = _pg_version(proto_dbs["postgres"])
    report = summarise(cfg, figures, e2e.missing)
    report["machine"] = {**_machine(version), "durability": durable}
    report["duration_s"] = round(time.time() - began, 1)
    return report


def _protocol_ledgers(
    cfg: BenchConfig, stack: contextlib.ExitStack[Any], work: Path
) -> tuple[Group, dict[str, str]]:
    """The protocol's process group and its two ledgers (a scratch Postgres database, a
    migrated SQLite file), cleaned up with ``stack``."""
    group = Group(max(8, max(cfg.processes)))
    stack.callback(group.close)
    pg = stack.enter_context(scratch_postgres(cfg.pg, "proto"))
    sqlite = f"sqlite:///{work / 'ledger.db'}"
    engine = create_engine(sqlite)
    upgrade(engine)
    engine.dispose()
    return group, {"postgres": pg, "sqlite": sqlite}


def _protocol_round(
    cfg: BenchConfig, r: int, group: Group, figures: Figures, dbs: dict[str, str], work: Path
) -> None:
    cfg.progress(f"round {r + 1}/{cfg.rounds}: the ledger protocol")
    run_protocol(
        group, figures, dbs, cfg.processes, cfg.protocol_jobs, work / "sandbox", cfg.progress
    )


def run_alone(cfg: BenchConfig) -> dict[str, Any]:
    """One section of ``ALONE``, on ledgers of its own (cli_start: Postgres only if
    ``cfg.pg``), with the headline figures that section measures."""
    if cfg.only not in ALONE:
        raise ValueError(f"bench: {cfg.only!r} cannot run alone (one of {', '.join(ALONE)})")
    began = time.time()
    durable = durability(cfg.pg) if cfg.pg else None
    figures = Figures()
    cfg.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="toolledger-bench-"))
    report: dict[str, Any] = {"only": cfg.only}
    with contextlib.ExitStack() as stack:
        version = None
        if cfg.only == "cli_start":
            dbs = {"embedded": f"sqlite:///{work / 'cli' / 'ledger.db'}"}
            if cfg.pg:
                dbs["postgres"] = stack.enter_context(scratch_postgres(cfg.pg, "cli"))
                version = _pg_version(dbs["postgres"])
            for r in range(cfg.rounds):
                cfg.progress(f"round {r + 1}/{cfg.rounds}: CLI cold start")
                medians = cli_start.run_cli_start(figures, dbs, work / "cli", cfg.cli_runs)
                cfg.progress("  " + ", ".join(f"{k} {v:.3f}s" for k, v in medians.items()))
            report["cli_start"] = cli_start.summarise(figures, cfg.cli_runs)
        elif cfg.only == "e2e":
            peers_stack, e2e_dbs = peer_databases(cfg.pg)
            stack.enter_context(peers_stack)
            e2e = E2E(cfg.pg, cfg.redis, work / "e2e", cfg.e2e_jobs, cfg.progress)
            for r in range(cfg.rounds):
                cfg.progress(f"round {r + 1}/{cfg.rounds}: end to end")
                e2e.round(figures, e2e_dbs)
            report.update(_e2e_summary(figures, e2e.missing))
            report["raw"] = {
                "e2e": _e2e_raw(figures, e2e.missing),
                "e2e_cpu_over_peers": _e2e_gaps(figures, e2e.missing),
                "e2e_not_run": e2e.missing,
                "jobs": {"e2e": cfg.e2e_jobs},
            }
            version = _pg_version(e2e_dbs["toolledger"])
        else:  # protocol
            group, proto_dbs = _protocol_ledgers(cfg, stack, work)
            for r in range(cfg.rounds):
                _protocol_round(cfg, r, group, figures, proto_dbs, work)
            report.update(_protocol_summary(cfg, figures))
            report["raw"] = {
                "protocol_jobs_per_s": _protocol_raw(cfg, figures),
                "protocol_cpu_ms_per_job": _protocol_cpu(cfg, figures),
                "jobs": {"protocol": cfg.protocol_jobs},
            }
            version = _pg_version(proto_dbs["postgres"])
    report.update(
        quick=cfg.quick,
        rounds=cfg.rounds,
        machine={**_machine(version), "durability": durable},
        duration_s=round(time.time() - began, 1),
    )
    return report


#: The distributions whose speed the figures depend on: two runs compare only with these.
PACKAGES = (
    "celery",
    "kombu",
    "redis",
    "psycopg",
    "psycopg-binary",
    "SQLAlchemy",
    "procrastinate",
    "dbos",
)


def _machine(postgres: str | None) -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "postgres": postgres,
        "platform": platform.platform(),
        "packages": _versions(PACKAGES),
    }


def _versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """Installed versions (None: not installed)."""
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _roundtrip_stacks(cfg: BenchConfig, pg: str, root: Path) -> dict[str, dict[str, str]]:
    common = {"sandbox": str(root / "sandbox"), "home": str(root / "home")}
    return {
        "postgres": {
            **common,
            "db": pg,
            "broker": cfg.redis,
            "broker_prefix": f"rt-{os.getpid()}-{time.time_ns()}:",
        },
        "embedded": {
            **common,
            "db": f"sqlite:///{root / 'ledger.db'}",
            "broker": f"embedded+sqlite:///{root / 'broker.db'}",
        },
    }


def _pg_version(url: str) -> str:
    engine = create_engine(url)
    with engine.connect() as conn:
        version = str(conn.execute(sa.text("SHOW server_version")).scalar_one())
    engine.dispose()
    return version


def _goal(name: str, value: dict[str, Any] | None, missing: str | None = None) -> dict[str, Any]:
    op, target = GOALS[name]
    if value is None or value.get("median") is None:
        return {
            "median": None,
            "goal": f"{op} {target}",
            "met": None,
            "why": missing or "not measured",
        }
    median = value["median"]
    met = median >= target if op == ">=" else median <= target
    return {**value, "goal": f"{op} {target}", "met": met}


def _protocol_summary(cfg: BenchConfig, f: Figures) -> dict[str, Any]:
    n = 4 if 4 in cfg.processes else max(cfg.processes)
    by_processes = {
        dialect: {
            p: ratio(f[f"{dialect}/toolledger/{p}"], f[f"{dialect}/handwritten/{p}"])
            for p in cfg.processes
        }
        for dialect in ("postgres", "sqlite")
    }
    return {
        "ledger_vs_handwritten": {
            **_goal("ledger_vs_handwritten", by_processes["postgres"][n]),
            "processes": n,
            "by_processes": by_processes["postgres"],
            "sqlite_by_processes": by_processes["sqlite"],
            # no goal: the same ratio against the protocol's simplest statements, written from
            # scratch: the handwritten loop runs the ledger's own SQL, so what that SQL costs
            # shows here only
            "vs_minimal_by_processes": {
                p: ratio(f[f"postgres/toolledger/{p}"], f[f"postgres/{MINIMAL}/{p}"])
                for p in cfg.processes
            },
        },
        "sqlite_vs_handwritten": {
            **_goal("sqlite_vs_handwritten", by_processes["sqlite"][n]),
            "processes": n,
            "by_processes": by_processes["sqlite"],
            # no goal: the same ratio against the loop given the writers' queue too
            "vs_handwritten_queued_by_processes": {
                p: ratio(f[f"sqlite/toolledger/{p}"], f[f"sqlite/{QUEUED}/{p}"])
                for p in cfg.processes
            },
        },
    }


def _protocol_raw(cfg: BenchConfig, f: Figures) -> dict[str, Any]:
    return {
        f"{d}/{impl}": {p: f[f"{d}/{impl}/{p}"].summary() for p in cfg.processes}
        for d in ("postgres", "sqlite")
        for impl in impls(d)
    }


def _e2e_summary(f: Figures, missing: dict[str, str]) -> dict[str, Any]:
    tl = "e2e/toolledger/throughput"
    return {
        "celery_vs_noop": _goal("celery_vs_noop", ratio(f[tl], f["e2e/celery_noop/throughput"])),
        "vs_celery_write": _goal("vs_celery_write", ratio(f[tl], f["e2e/celery_write/throughput"])),
        # The whole machine's busy CPU per call, toolledger's minus the plain Celery write's:
        # what the ledger adds across producer, workers, Postgres and Redis.
        "added_cpu_ms_per_call": _goal(
            "added_cpu_ms_per_call",
            difference(f["e2e/toolledger/cpu_ms_per_call"], f["e2e/celery_write/cpu_ms_per_call"]),
        ),
        "vs_procrastinate": _goal(
            "vs_procrastinate",
            ratio(f[tl], f["e2e/procrastinate/throughput"]),
            missing.get("procrastinate"),
        ),
        # The threads pool, the configuration for I/O-bound tools (docs/operations.md).
        "threads_vs_procrastinate": _goal(
            "threads_vs_procrastinate",
            ratio(f["e2e/toolledger_threads/throughput"], f["e2e/procrastinate/throughput"]),
            missing.get("procrastinate"),
        ),
        # The goal as worded: the README's production configuration (threads at 8 a
        # worker on the job queue alone, a sweeper, a beat) against Procrastinate's 2 of 2.
        "production_vs_procrastinate": _goal(
            "production_vs_procrastinate",
            ratio(f["e2e/toolledger_production/throughput"], f["e2e/procrastinate/throughput"]),
            missing.get("procrastinate"),
        ),
        "vs_dbos": _goal("vs_dbos", ratio(f[tl], f["e2e/dbos/throughput"]), missing.get("dbos")),
    }


def _protocol_cpu(cfg: BenchConfig, f: Figures) -> dict[str, Any]:
    """CPU ms a job in the processes that ran it, user and system: where the protocol's gap
    is (on SQLite both sides run the same statements in-process)."""
    return {
        f"{d}/{impl}": {
            p: {t: f[f"cpu/{d}/{impl}/{p}/{t}"].summary(3) for t in ("user", "sys")}
            for p in cfg.processes
        }
        for d in ("postgres", "sqlite")
        for impl in ("toolledger", "handwritten")
    }


#: What is left against each peer, part by part: (toolledger's variant, the peer's).
GAPS = (("toolledger_threads", "procrastinate"), ("toolledger", "celery_write"))


def _e2e_gaps(f: Figures, missing: dict[str, str]) -> dict[str, Any]:
    """CPU ms a call that toolledger spends over each peer, by part, round by round: with
    every variant CPU-bound, calls/s follows CPU a call, so this is what a ratio lacks."""
    return {
        f"{ours} - {peer}": {
            label: difference(f[f"e2e/{ours}/cpu_{part}"], f[f"e2e/{peer}/cpu_{part}"])
            for label, part in (*((p, p) for p in CPU_PARTS), ("total", "ms_per_call"))
        }
        for ours, peer in GAPS
        if ours not in missing and peer not in missing
    }


def _e2e_raw(f: Figures, missing: dict[str, str]) -> dict[str, Any]:
    return {
        v: {
            **{
                m: f[f"e2e/{v}/{m}"].summary(2 if m == "cpu_ms_per_call" else 1)
                for m in ("throughput", "p50_ms", "p99_ms", "cpu_ms_per_call")
            },
            "cpu_parts_ms_per_call": {p: f[f"e2e/{v}/cpu_{p}"].summary(2) for p in CPU_PARTS},
        }
        for v in VARIANTS
        if v not in missing
    }


def summarise(cfg: BenchConfig, f: Figures, missing: dict[str, str]) -> dict[str, Any]:
    sizes = list(cfg.sweep_sizes)
    big, small = sizes[-1], sizes[0]
    protocol, e2e = _protocol_summary(cfg, f), _e2e_summary(f, missing)
    report: dict[str, Any] = {
        **{name: {**protocol, **e2e}[name] for name in GOALS if name in protocol | e2e},
        "sweep_1m_vs_10k": {
            **_goal(
                "sweep_1m_vs_10k", ratio(f[f"sweep/{big}/seconds"], f[f"sweep/{small}/seconds"])
            ),
            "sizes": cfg.sweep_sizes,
            "stale_rows": cfg.stale,
        },
        "roundtrip": {
            label: {
                "client_p50_ms": f[f"roundtrip/{label}/client/p50_ms"].summary(),
                "client_p99_ms": f[f"roundtrip/{label}/client/p99_ms"].summary(),
                "polling_p50_ms": f[f"roundtrip/{label}/polling/p50_ms"].summary(),
                "polling_p99_ms": f[f"roundtrip/{label}/polling/p99_ms"].summary(),
                "client_vs_polling_p50": ratio(
                    f[f"roundtrip/{label}/client/p50_ms"], f[f"roundtrip/{label}/polling/p50_ms"]
                ),
                "goal_client_p50_ms": goal,
                "met": (f[f"roundtrip/{label}/client/p50_ms"].summary().get("median") or 1e9)
                <= goal,
                "idle_100_waiters_cpu_pct": f[
                    f"roundtrip/{label}/idle_100_waiters_cpu_pct"
                ].summary(2),
                "found_by_poll": f[f"roundtrip/{label}/found_by_poll"].summary(0),
                "calls": cfg.roundtrip_calls,
            }
            for label, goal in (("postgres", 8.0), ("embedded", 15.0))
        },
        "cli_start": cli_start.summarise(f, cfg.cli_runs),
        "quick": cfg.quick,
        "rounds": cfg.rounds,
        "raw": {
            "protocol_jobs_per_s": _protocol_raw(cfg, f),
            "protocol_cpu_ms_per_job": _protocol_cpu(cfg, f),
            "e2e": _e2e_raw(f, missing),
            "e2e_cpu_over_peers": _e2e_gaps(f, missing),
            "e2e_not_run": missing,
            "sweep": {
                s: {
                    m: f[f"sweep/{s}/{m}"].summary(3)
                    for m in ("seconds", "mark_rows_per_s", "reconcile_rows_per_s")
                }
                for s in cfg.sweep_sizes
            },
            "claim_contention": {
                "processes": 8,
                "keys": cfg.contention_keys,
                "attempts_per_s": f["contention/attempts_per_s"].summary(),
            },
            "jobs": {"protocol": cfg.protocol_jobs, "e2e": cfg.e2e_jobs},
        },
    }
    return report
