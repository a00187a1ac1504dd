"""Helpers tests share (fixtures live in conftest.py)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

TABLES = ("operations", "tool_calls", "executions", "execution_events")


def row_counts(engine: sa.Engine) -> dict[str, Any]:
    """How many rows each ledger table holds (to prove that refused input wrote nothing)."""
    with engine.connect() as conn:
        return {t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar_one() for t in TABLES}


def run_cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """Run ``toolledger`` in-process: (exit code, stdout, stderr)."""
    import pytest

    from worker.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err
