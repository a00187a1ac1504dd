"""The sweep as the worker runs it (Celery's tracer): a pass the ledger stops is told in one
line, a bug in full."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
from celery.app.trace import build_tracer

from toolledger.config import Settings
from toolledger.recovery import tasks
from toolledger.worker.app import SWEEP, create_app


def _run_sweep(settings: Settings) -> None:
    app = create_app(settings)
    task = app.tasks[SWEEP]
    tasks._parts = None  # this test's settings, not a pass's before
    tracer = build_tracer(SWEEP, task, app=app, eager=False, propagate=False)
    tracer(str(uuid.uuid4()), (), {}, request={"hostname": "test"})


def test_sweep_task__a_ledger_out_of_reach_is_one_line_not_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # While the database was down, every pass logged Celery's traceback of the driver's error
    # through SQLAlchemy: 120 lines an interval (a cold review of the observability).
    db = "postgresql+psycopg://postgres@127.0.0.1:1/nothing"  # refused at once
    settings = Settings(broker="redis://127.0.0.1:6379/0", db=db, sandbox=tmp_path / "sb")
    with caplog.at_level(logging.INFO):
        _run_sweep(settings)
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    [error] = errors
    said = error.getMessage()
    assert "\n" not in said and error.exc_info is None, said
    assert said.startswith(f"{SWEEP}: this pass stopped, the ledger out of reach"), said
    # Celery still records the task as failed (a dashboard counts it), at INFO, in one line
    failed = [r for r in caplog.records if r.name == "celery.app.trace"]
    assert len(failed) == 1 and failed[0].exc_info is None
    assert "raised expected: SweepFailed(" in failed[0].getMessage()


def test_sweep_task__a_statement_the_database_refuses_is_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a ledger file without its tables (a wrong TOOLLEDGER_DB): the database's word, one line
    (tmp_path / "l.db").touch()
    settings = Settings(
        broker="redis://127.0.0.1:6379/0", db=f"sqlite:///{tmp_path / 'l.db'}", sandbox=tmp_path
    )
    with caplog.at_level(logging.INFO):
        _run_sweep(settings)
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in errors] == [
        f"{SWEEP}: this pass stopped, the ledger refused it: OperationalError: no such table:"
        " executions; the next pass tries again"
    ]


def test_sweep_task__a_bug_keeps_its_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_a: object, **_k: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(tasks, "run_sweep", broken)
    settings = Settings(
        broker="redis://127.0.0.1:6379/0", db=f"sqlite:///{tmp_path / 'l.db'}", sandbox=tmp_path
    )
    with caplog.at_level(logging.INFO):
        _run_sweep(settings)
    failed = [r for r in caplog.records if r.name == "celery.app.trace"]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR
    assert failed[0].exc_info is not None  # the traceback a bug needs
