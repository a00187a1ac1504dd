"""The benchmark's report: bench.json, bench.md and bench.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolledger.harness.bench.common import CPU_PARTS

#: Each headline figure and its goal, in the report's order.
GOALS: dict[str, tuple[str, float]] = {
    "ledger_vs_handwritten": (">=", 0.7),
    "sqlite_vs_handwritten": (">=", 0.7),
    "celery_vs_noop": (">=", 0.6),
    "vs_celery_write": (">=", 0.6),
    "added_cpu_ms_per_call": ("<=", 1.2),
    "vs_procrastinate": (">=", 1.0),
    "threads_vs_procrastinate": (">=", 1.0),
    "production_vs_procrastinate": (">=", 1.0),
    "vs_dbos": (">=", 1.0),
    "sweep_1m_vs_10k": ("<=", 1.5),
}
HEADLINES = tuple(GOALS)
#: Which worker pool a headline's toolledger ran on. Threads is the pool the README
#: recommends for I/O-bound tools, but at the bench's shape (2 workers of 2 threads on the job
#: and sweep queues, no sweeper, no beat), not the production configuration (a cold review).
POOL_LABELS = {
    "vs_procrastinate": " (prefork, Celery's default)",
    "threads_vs_procrastinate": " (threads, 2 workers of 2; not the production configuration)",
    "production_vs_procrastinate": " (production configuration: threads at 8, sweeper, beat)",
}


def _fmt(summary: dict[str, Any] | None, unit: str = "") -> str:
    if not summary or summary.get("median") is None:
        return "-"
    return f"{summary['median']}{unit} ({summary['min']}-{summary['max']})"


def _at(headline: dict[str, Any], table: str) -> Any:
    """``headline[table]`` at the headline's process count: an int key in a fresh report, a
    string one in a report read back from JSON (its two rows were dropped, a cold review)."""
    by = headline.get(table) or {}
    n = headline.get("processes")
    return by.get(n) or by.get(str(n))


def markdown(r: dict[str, Any]) -> str:
    """Every section the report holds (all of them, or the one run with ``--only``)."""
    raw = r.get("raw", {})
    lines: list[str] = []
    headlines = [name for name in HEADLINES if name in r]
    if headlines:
        lines += ["| ratio (median of rounds, min-max) | value | goal | met |", "|---|---|---|---|"]
    for name in headlines:
        h = r[name]
        met = {True: "yes", False: "**no**", None: "-"}[h["met"]]
        note = f" {h['why']}" if h.get("why") else ""
        label = f"{name} ({h['processes']} processes)" if "processes" in h else name
        label += POOL_LABELS.get(name, "")
        lines.append(f"| {label} | {_fmt(h)}{note} | {h['goal']} | {met} |")
        queued = _at(h, "vs_handwritten_queued_by_processes")
        if queued:  # the same ratio, the loop given the writers' queue too (no goal)
            lines.append(f"| {label}, against the loop in turn too | {_fmt(queued)} | | |")
        minimal = _at(h, "vs_minimal_by_processes")
        if minimal:  # against statements written from scratch: the ledger's SQL's cost too
            lines.append(
                f"| {label}, against the minimal SQL written from scratch | {_fmt(minimal)} | | |"
            )
    if "protocol_jobs_per_s" in raw:
        lines += [
            "",
            "Ledger protocol, jobs/s (claim + running, atomic file write, terminal + result):",
            "",
            "| backend | processes | toolledger | hand-written | hand-written, in turn "
            "(the writers' queue) | hand-written, minimal SQL | bare INSERT |",
            "|---|---|---|---|---|---|---|",
        ]
        proto = raw["protocol_jobs_per_s"]
        for dialect in ("postgres", "sqlite"):
            for p in proto[f"{dialect}/toolledger"]:
                lines.append(
                    f"| {dialect} | {p} | "
                    + " | ".join(
                        _fmt(proto[f"{dialect}/{impl}"][p]) if f"{dialect}/{impl}" in proto else "-"
                        for impl in (
                            "toolledger",
                            "handwritten",
                            "handwritten_queued",
                            "handwritten_minimal",
                            "insert",
                        )
                    )
                    + " |"
                )
    if "protocol_cpu_ms_per_job" in raw:
        lines += ["", *_protocol_cpu(raw["protocol_cpu_ms_per_job"])]
    if "e2e" in raw:
        head = "End to end, 2 worker processes of concurrency 2, the same file write"
        if "toolledger_production" in raw["e2e"]:
            head += " (toolledger_production: of 8 threads each, with a sweeper and a beat)"
        lines += [
            "",
            head + ":",
            "",
            "| system | calls/s | p50 ms | p99 ms | CPU ms/call (all processes) |",
            "|---|---|---|---|---|",
        ]
        for name, e in raw["e2e"].items():
            lines.append(
                f"| {name} | {_fmt(e['throughput'])} | {_fmt(e['p50_ms'])} | "
                f"{_fmt(e['p99_ms'])} | {_fmt(e.get('cpu_ms_per_call'))} |"
            )
        for name, why in raw["e2e_not_run"].items():
            lines.append(f"| {name} | {why} | | | |")
        lines += [
            "",
            "Where that CPU goes, ms per call (producer: the bench process, which submits and "
            "polls; other: what no part accounts for, the kernel's threads among it):",
            "",
            "| system | " + " | ".join(CPU_PARTS) + " |",
            "|---|" + "---|" * len(CPU_PARTS),
        ]
        for name, e in raw["e2e"].items():
            parts = e.get("cpu_parts_ms_per_call", {})
            cells = " | ".join(_fmt(parts.get(p)) for p in CPU_PARTS)
            lines.append(f"| {name} | {cells} |")
    if gaps := raw.get("e2e_cpu_over_peers"):
        lines += ["", *_gaps(gaps)]
    if "sweep" in raw:
        lines += [
            "",
            f"Sweep of {r['sweep_1m_vs_10k']['stale_rows']} stale rows:",
            "",
            "| ledger size | seconds | mark rows/s | reconcile rows/s |",
            "|---|---|---|---|",
        ]
        for size, s in raw["sweep"].items():
            lines.append(
                f"| {size} | {_fmt(s['seconds'])} | {_fmt(s['mark_rows_per_s'])} | "
                f"{_fmt(s['reconcile_rows_per_s'])} |"
            )
    if "claim_contention" in raw:
        c = raw["claim_contention"]
        lines += [
            "",
            f"Claim contention: {c['processes']} processes over the same {c['keys']} keys: "
            f"{_fmt(c['attempts_per_s'])} attempts/s, exactly {c['keys']} wins.",
        ]
    if "cli_start" in r:
        lines += ["", *_cli_start(r["cli_start"])]
    if packages := r.get("machine", {}).get("packages"):
        versions = ", ".join(f"{n} {v}" for n, v in packages.items() if v)
        lines += ["", f"Packages: {versions}."]
    if durable := r.get("machine", {}).get("durability"):
        said = "; ".join(
            f"{side}: " + ", ".join(f"{k} {v}" for k, v in values.items())
            for side, values in durable.items()
        )
        lines += [f"Postgres durability, as each side's sessions saw it: {said}."]
    return "\n".join(lines).lstrip("\n") + "\n"


def _protocol_cpu(cpu: dict[str, Any]) -> list[str]:
    """Where the protocol's gap is: CPU a job, toolledger's against the hand-written loop's."""
    lines = [
        "Where a protocol job's time goes: CPU ms a job in the processes that ran it, user / "
        "system (SQLite runs in them, so both sides' statements are in it; Postgres's server "
        "is not). What is not CPU is waiting: fsyncs, and the write lock on SQLite.",
        "",
        "| backend | processes | toolledger user / sys | hand-written user / sys |",
        "|---|---|---|---|",
    ]
    for dialect in ("postgres", "sqlite"):
        ours, hand = cpu[f"{dialect}/toolledger"], cpu[f"{dialect}/handwritten"]
        for p in ours:
            cells = [f"{_fmt(side[p]['user'])} / {_fmt(side[p]['sys'])}" for side in (ours, hand)]
            lines.append(f"| {dialect} | {p} | {' | '.join(cells)} |")
    return lines


def _gaps(gaps: dict[str, Any]) -> list[str]:
    """What is left end to end: CPU ms a call over each peer, by part (every variant is
    CPU-bound on this machine, so calls/s follows CPU a call)."""
    lines = [
        "What is left against each peer: toolledger's CPU ms a call minus the peer's, by "
        "part, round by round (positive: toolledger spends more there):",
        "",
        "| toolledger - peer | " + " | ".join(CPU_PARTS) + " | total |",
        "|---|" + "---|" * (len(CPU_PARTS) + 1),
    ]
    for name, parts in gaps.items():
        cells = " | ".join(_fmt(parts[p]) for p in (*CPU_PARTS, "total"))
        lines.append(f"| {name} | {cells} |")
    return lines


def _cli_start(c: dict[str, Any]) -> list[str]:
    lines = [
        f"CLI cold start, seconds (median of {c['runs_per_round']} starts per round; "
        "median of rounds, min-max):",
        "",
        "| command | seconds | goal | met |",
        "|---|---|---|---|",
        f"| python -c pass | {_fmt(c['python_pass'])} | | |",
    ]
    for name, s in c["commands"].items():
        met = {True: "yes", False: "**no**", None: "-"}[s["met"]]
        label = "toolledger --help" if name == "help" else f"toolledger show ({name[5:]})"
        lines.append(f"| {label} | {_fmt(s)} | <= {c['goal_seconds']} | {met} |")
    return lines


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw = r["raw"]
    gaps = raw.get("e2e_cpu_over_peers") or {}
    fig, axes = plt.subplots(1, 4 if gaps else 3, figsize=(19 if gaps else 14, 4.2), dpi=110)
    ax = axes[0]
    for dialect, style in (("postgres", "-"), ("sqlite", "--")):
        for impl, colour in (
            ("toolledger", "tab:green"),
            ("handwritten", "tab:blue"),
            ("handwritten_queued", "tab:cyan"),
            ("handwritten_minimal", "tab:purple"),
            ("insert", "tab:gray"),
        ):
            series = raw["protocol_jobs_per_s"].get(f"{dialect}/{impl}")
            if series is None:  # the writers' queue is SQLite's, the minimal SQL Postgres's
                continue
            xs = [int(p) for p in series]
            ax.plot(
                xs,
                [series[p]["median"] for p in series],
                style,
                color=colour,
                marker="o",
                ms=3,
                label=f"{impl} ({dialect})",
            )
    ax.set_xlabel("processes")
    ax.set_ylabel("jobs/s")
    ax.set_yscale("log")
    ax.set_title("ledger protocol")
    ax.legend(fontsize=6, handlelength=3)  # long enough to tell dashes (SQLite) apart
    ax = axes[1]
    names = list(raw["e2e"])
    medians = [raw["e2e"][n]["throughput"]["median"] for n in names]
    errs = [
        [m - raw["e2e"][n]["throughput"]["min"] for n, m in zip(names, medians, strict=True)],
        [raw["e2e"][n]["throughput"]["max"] - m for n, m in zip(names, medians, strict=True)],
    ]
    colours = ["tab:green" if n.startswith("toolledger") else "tab:gray" for n in names]
    ax.bar(names, medians, yerr=errs, color=colours, capsize=3)
    ax.set_ylabel("calls/s")
    ax.set_title("end to end, 2 workers x 2")
    ax.tick_params(axis="x", labelrotation=25, labelsize=7)
    ax = axes[2]
    sizes = list(raw["sweep"])
    secs = [raw["sweep"][s]["seconds"]["median"] for s in sizes]
    ax.bar([f"ledger of {s}" for s in sizes], secs, color="tab:cyan")
    ax.set_ylabel("seconds")
    ax.set_title(f"sweep of {r['sweep_1m_vs_10k']['stale_rows']} stale rows")
    if gaps:
        _plot_gaps(axes[3], gaps)
    fig.suptitle("toolledger bench" + (" (quick)" if r["quick"] else ""))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_gaps(ax: Any, gaps: dict[str, Any]) -> None:
    """What is left end to end: CPU ms a call over each peer, part by part (median, min-max)."""
    labels = [*CPU_PARTS, "total"]
    width = 0.8 / len(gaps)
    for i, (name, parts) in enumerate(gaps.items()):
        xs = [x + (i - (len(gaps) - 1) / 2) * width for x in range(len(labels))]
        medians = [parts[p]["median"] for p in labels]
        errs = [
            [m - parts[p]["min"] for p, m in zip(labels, medians, strict=True)],
            [parts[p]["max"] - m for p, m in zip(labels, medians, strict=True)],
        ]
        ax.bar(xs, medians, width, yerr=errs, capsize=2, label=name.replace(" - ", " over "))
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("CPU ms a call, toolledger minus peer")
    ax.set_title("what is left: CPU over each peer")
    ax.legend(fontsize=7)


def write_all(r: dict[str, Any], out: Path) -> dict[str, str]:
    files = {"json": out / "bench.json", "markdown": out / "bench.md", "png": out / "bench.png"}
    files["json"].write_text(json.dumps(r, indent=2, default=str) + "\n")
    files["markdown"].write_text(markdown(r))
    if r.get("only"):  # one section alone: no plot
        del files["png"]
    else:
        plot(r, files["png"])
    return {k: str(v) for k, v in files.items()}
