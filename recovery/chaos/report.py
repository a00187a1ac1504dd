"""A chaos run's report: JSON for machines, a Markdown table for people, a PNG timeline."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ledger.ledger import Ledger
from ledger.models import execution_events

FAULT_COLOURS = {
    "kill_main": "tab:red",
    "kill_child": "tab:orange",
    "zombie": "tab:purple",
    "redis_flush": "tab:brown",
    "pg_terminate": "tab:blue",
    "duplicate": "tab:gray",
    "failpoint": "tab:olive",
}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Chaos run {report['scope']}",
        "",
        f"{report['jobs']} jobs, {report['workers']} workers x {report['concurrency']}, "
        f"{sum(report['faults'].values())} faults over {report['fault_window_s']} s "
        f"(seed {report['seed']}); recovered {report['recovered_s']} s after the last fault; "
        f"{report['duration_s']} s in all.",
        "",
        "| result | count |",
        "|---|---|",
        f"| duplicates (a second physical effect) | {report['duplicates']} |",
        f"| lost (never ran, never ended) | {report['lost']} |",
        f"| stuck (running after the final sweep) | {report['stuck']} |",
        f"| unknown (left for a human) | {report['unknown']['count']} |",
        f"| reconciled after a crash | {report['reconciled']} |",
        f"| verify | {'ok' if report['verify_ok'] else 'DIFFERENCES'} |",
        "",
        "| fault | injected |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in sorted(report["faults"].items())],
        "",
        "| unknown, because of | calls |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in sorted(report["unknown"]["reasons"].items())],
        "",
        "| invariant | holds | violations |",
        "|---|---|---|",
        *[
            f"| {i['name']} | {'yes' if i['ok'] else '**NO**'} | {i['violations']} |"
            for i in report["invariants"]
        ],
    ]
    base = report.get("baseline")
    if base:
        lines += [
            "",
            "| same jobs and faults | duplicates | lost |",
            "|---|---|---|",
            f"| toolledger | {report['duplicates']} | {report['lost']} |",
            f"| plain Celery task, acks_late, no ledger | {base['duplicates']} "
            f"({base['duplicate_effects']} extra effects) | {base['lost']} |",
        ]
    return "\n".join(lines) + "\n"


def timeline(
    ledger: Ledger,
    scope: str,
    began: float,
    faults: list[dict[str, Any]],
    firings: list[dict[str, Any]],
    path: Path,
) -> None:
    """Completions per second, with every fault marked where it struck."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with ledger.engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                execution_events.c.kind, execution_events.c.at, execution_events.c.detail
            ).where(
                execution_events.c.scope == scope,
                execution_events.c.kind.in_(["succeeded", "failed", "unknown"]),
            )
        ).all()
    done: Counter[int] = Counter()
    reconciled: Counter[int] = Counter()
    for kind, at, detail in rows:
        second = int(at.timestamp() - began)
        if kind in ("succeeded", "failed"):
            (reconciled if detail.get("reconciled") else done)[second] += 1
    last_fault = max([f["t"] - began for f in faults] + [0.0])
    end = int(max([*done, *reconciled, last_fault, 1])) + 2
    xs = list(range(end))
    fig, ax = plt.subplots(figsize=(11, 4.2), dpi=110)
    ax.plot(xs, [done[x] for x in xs], color="tab:green", lw=1.2, label="finished by a worker")
    ax.bar(xs, [reconciled[x] for x in xs], color="tab:cyan", label="reconciled by the sweep")
    marks = [(f["t"] - began, f["kind"]) for f in faults] + [
        (f["t"] - began, "failpoint") for f in firings
    ]
    seen: set[str] = set()
    for t, kind in marks:
        ax.axvline(
            t,
            color=FAULT_COLOURS.get(kind, "k"),
            alpha=0.55,
            lw=0.9,
            label=None if kind in seen else kind.replace("_", " "),
        )
        seen.add(kind)
    ax.set_xlabel("seconds since the first job")
    ax.set_ylabel("calls per second")
    ax.set_title(f"chaos run {scope}: throughput and faults")
    ax.legend(loc="upper right", fontsize=7, ncol=3)
    ax.set_xlim(0, end)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_all(report: dict[str, Any], out: Path) -> dict[str, str]:
    files = {"json": out / "report.json", "markdown": out / "report.md"}
    files["json"].write_text(json.dumps(report, indent=2, default=str) + "\n")
    files["markdown"].write_text(markdown(report))
    return {k: str(v) for k, v in files.items()}
