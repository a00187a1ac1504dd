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

    from toolledger.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err


def land(sandbox: Any, scope: str, path: str, data: bytes, kind: str = "write") -> Any:
    """Stage and land one effect with no ledger behind it (tests of the sandbox alone): what
    an execution's own commit does, as if every other staged effect had been revoked."""
    from toolledger.effects import Commit, effects_of
    from toolledger.ledger.identity import new_execution_id

    eid = new_execution_id()
    staging = effects_of(sandbox).staging(scope, eid, None)
    write = staging.write_atomic if kind == "write" else staging.append
    staged = [write(scope, path, data)]
    staging.seal()
    return effects_of(sandbox).publish(Commit(eid, 1, scope, "k", 1), staged, NO_LEDGER)


class NoLedger:
    """A ledger that knows of no other execution (tests of the sandbox alone)."""

    def effect_states(self, execution_ids: list[str]) -> dict[str, Any]:
        return {}

    def record_not_landed(self, execution_id: str, detail: dict[str, Any]) -> None:
        pass


NO_LEDGER = NoLedger()


def pending_files(sandbox: Any) -> list[str]:
    """What waits in the sandbox's pending area (staged bytes, spooled results)."""
    from toolledger.effects import effects_of

    pending = effects_of(sandbox).pending_dir
    return sorted(p.name for p in pending.iterdir()) if pending.is_dir() else []


#: The start of a script whose publishes each write (to the file ``argv[1]``) the Celery,
#: kombu and amqp modules imported while they ran (``Submitter.enqueue`` wrapped).
COUNT_PUBLISH_IMPORTS = """
import json, sys
from toolledger.worker import submit
enqueue, out = submit.Submitter.enqueue, sys.argv[1]
def counted(self, *args, **kwargs):
    before = set(sys.modules)
    try:
        return enqueue(self, *args, **kwargs)
    finally:
        new = [m for m in set(sys.modules) - before if m.split(".")[0] in ("celery", "kombu", "amqp")]
        with open(out, "a") as f:
            f.write(json.dumps(sorted(new)) + "\\n")
submit.Submitter.enqueue = counted
"""
