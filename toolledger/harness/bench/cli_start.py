"""CLI cold start: how long ``toolledger --help`` and ``toolledger show`` take from nothing to
exit, beside ``python -c pass`` (the floor no Python command goes under).

Each figure is the median wall time of ``RUNS`` fresh processes per round; the commands
alternate run by run, so that they share the machine's noise. ``show`` reads a real call
(pending approval, nothing enqueued) from a ledger already at head, embedded and, when a
Postgres server is given, on Postgres. Bytecode caches are written and used, as on a user's
second run: one unmeasured run of each command fills them first.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from toolledger.harness.bench.common import Figures
from toolledger.harness.processes import service_env

#: The issue's figure: ``toolledger --help`` and ``toolledger show`` under a quarter second.
GOAL_SECONDS = 0.25
RUNS = 10
SCOPE, CALL = "bench-cli", "cli-start"


def toolledger_argv() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m toolledger``."""
    script = Path(sys.executable).with_name("toolledger")
    return [str(script)] if script.exists() else [sys.executable, "-m", "toolledger"]


def commands(dbs: dict[str, str]) -> dict[str, list[str]]:
    """What is timed: name -> argv (``show_<label>`` for each ledger of ``dbs``)."""
    tl = toolledger_argv()
    out = {"python_pass": [sys.executable, "-c", "pass"], "help": [*tl, "--help"]}
    for label, url in dbs.items():
        out[f"show_{label}"] = [*tl, "--db", url, "show", "--scope", SCOPE, "--tool-call-id", CALL]
    return out


def run_cli_start(
    figures: Figures, dbs: dict[str, str], root: Path, runs: int = RUNS
) -> dict[str, float]:
    """One round: the median of ``runs`` starts of each command, added to ``figures``."""
    root.mkdir(parents=True, exist_ok=True)
    env = service_env(None, home=str(root / "home"), sandbox=str(root / "sandbox"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's CLI runs from its bytecode cache
    for url in dbs.values():  # submitting again is a replay: every round may do it
        args = '{"path": "cli-start.txt", "content": "x"}'
        submit = ["submit", "--scope", SCOPE, "--tool-call-id", CALL, "--tool", "write_file"]
        _timed([*toolledger_argv(), "--db", url, *submit, "--args", args], env)
    timed = commands(dbs)
    for argv in timed.values():
        _timed(argv, env)
    seconds: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(runs):
        for name, argv in timed.items():
            seconds[name].append(_timed(argv, env))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, median in medians.items():
        figures.add(f"cli_start/{name}/seconds", median)
    return medians


def _timed(argv: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(
            f"benchmark: {' '.join(argv[1:])} exited {done.returncode}: "
            f"{done.stderr.decode(errors='replace').strip()}"
        )
    return elapsed


def summarise(figures: Figures, runs: int = RUNS) -> dict[str, Any]:
    """Seconds (median of rounds, min-max) per command, each against the goal."""
    names = [
        k.split("/")[1]
        for k in figures.series
        if k.startswith("cli_start/") and k != "cli_start/python_pass/seconds"
    ]
    timed: dict[str, Any] = {}
    for name in names:
        s = figures[f"cli_start/{name}/seconds"].summary(3)
        timed[name] = {**s, "met": None if s["median"] is None else s["median"] <= GOAL_SECONDS}
    return {
        "goal_seconds": GOAL_SECONDS,
        "runs_per_round": runs,
        "python_pass": figures["cli_start/python_pass/seconds"].summary(3),
        "commands": timed,
        "met": all(c["met"] for c in timed.values()) if timed else None,
    }
