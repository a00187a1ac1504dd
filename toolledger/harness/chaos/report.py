"""A chaos run's report: JSON for machines, a Markdown table for people, a PNG timeline."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from toolledger.harness.chaos.faults import FAILPOINT_COLOUR, KINDS
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.models import execution_events

FAULT_COLOURS = {k.name: k.colour for k in KINDS.values()} | {"failpoint": FAILPOINT_COLOUR}


def markdown(report: dict[str, Any]) -> str:
    inbox, fenced = report["inbox"], report["fenced"]
    lines = [
        f"# Chaos run {report['scope']}",
        "",
        f"{report['jobs']} jobs ({_counts(report['mix'])}), "
        f"{report['workers']} workers x {report['concurrency']} "
        f"({report.get('pool', 'prefork')} pool), "
        f"{sum(report['faults'].values())} faults over {report['fault_window_s']} s "
        f"(seed {report['seed']}, lease {report['lease_s']} s); code under test: "
        f"{report['code']}; recovered {report['recovered_s']} s after the last fault; "
        f"{report['duration_s']} s in all.",
        "",
        "| result | count |",
        "|---|---|",
        f"| duplicates (a second line, a second charge) | {report['duplicates']} |",
        f"| charges asked for again, answered as a replay by the service's dedupe | "
        f"{report.get('charges_requested_again', '-')} |",
        f"| effects of revoked executions that landed | {_measured(report)} |",
        f"| revoked executions that went on and met the fence: not started, commit refused "
        f"(of which with staged bytes) | {fenced['not_started']}, {fenced['refused_at_commit']} "
        f"({fenced['staged_refused']}) |",
        f"| shared paths not holding their last succeeded write | "
        f"{report['shared_path_mismatches']} |",
        f"| effects hidden behind failed/rejected/pending | {report['hidden_effects']} |",
        f"| succeeded calls whose effect is absent | {report['absent_effects']} |",
        f"| effects no call asked for (torn, foreign) | {report['foreign_effects']} |",
        f"| lost (never ran, never ended) | {report['lost']} |",
        f"| stuck (running after the final sweep) | {report['stuck']} |",
        f"| left in the humans' inbox (unknown or flagged) | {inbox['count']} "
        f"({100 * inbox['share']:.2f} %) |",
        f"| automatic retries (each after proof of absence) | {report['auto_retries']} |",
        f"| reconciled after a crash | {report['reconciled']} |",
        f"| operator actions | {_counts(report['operator']) or 0} |",
        f"| verify | {'ok' if report['verify_ok'] else 'DIFFERENCES'} |",
        "",
        "| fault | injected | struck an execution in flight |",
        "|---|---|---|",
        *[f"| {k} | {v} | {_met(report, k)} |" for k, v in sorted(report["faults"].items())],
        *[
            f"| {k} | **0 of {n} scheduled: no target** | - |"
            for k, n in sorted(report.get("faults_not_injected", {}).items())
            if k not in report["faults"]
        ],
        *[
            f"| {k} | **skipped: this run could not inject it** | - |"
            for k in report.get("fault_kinds_skipped", [])
        ],
        "",
        "| went unknown, because of | executions |",
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
    broken = [i for i in report["invariants"] if not i["ok"]]
    for inv in broken:
        lines += ["", f"**{inv['name']}** — examples:", *[f"- {x}" for x in inv["examples"]]]
    base = report.get("baseline")
    if base:
        lines += [
            "",
            "| same workload and faults | duplicates | charges asked for again (the service's "
            "dedupe answered a replay) | shared paths wrong | lost |",
            "|---|---|---|---|---|",
            f"| toolledger | {report['duplicates']} | "
            f"{report.get('charges_requested_again', '-')} | "
            f"{report['shared_path_mismatches']} | {report['lost']} |",
            f"| plain Celery tasks, acks_late, no ledger | {base['duplicates']} | "
            f"{base.get('duplicate_charges', '-')} | {base['shared_path_mismatches']} | "
            f"{base['lost']} |",
        ]
    return "\n".join(lines) + "\n"


def _met(report: dict[str, Any], kind: str) -> str:
    """How many faults of ``kind`` met an execution in flight: a failpoint fires in one, the
    broker's kinds are not measured; ``(n not injected)`` where some found no target."""
    missed = report.get("faults_not_injected", {}).get(kind)
    also = f" ({missed} more scheduled, no target)" if missed else ""
    if kind.startswith(("failpoint:", "stop:")):
        return "each (it fires in one)"
    met = report.get("faults_met_work", {}).get(kind)
    return ("not measured" if met is None else str(met)) + also


def _measured(report: dict[str, Any]) -> str:
    found = report["effects_after_revocation"]
    return "not measured (this version logs no landings)" if found is None else str(found)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items())


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
