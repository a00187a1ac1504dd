"""An idle worker on the embedded broker stops when asked, not after two more drains."""

from __future__ import annotations

from typing import Any

import pytest
from celery.worker import state

from toolledger.worker import broker


@pytest.mark.parametrize(
    ("should_stop", "should_terminate", "stopping"),
    [
        (None, None, False),
        (False, None, False),
        (0, None, True),  # warm shutdown sets EX_OK, which is 0: it equals False, is not False
        (1, None, True),
        (None, 0, True),  # cold shutdown
    ],
)
def test_worker_stopping__reads_celerys_flags_as_celery_does(
    monkeypatch: pytest.MonkeyPatch, should_stop: Any, should_terminate: Any, stopping: bool
) -> None:
    monkeypatch.setattr(state, "should_stop", should_stop)
    monkeypatch.setattr(state, "should_terminate", should_terminate)
    assert broker._worker_stopping() is stopping


def test_drain_events__returns_to_celerys_loop_without_taking_a_job_once_stopping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Cycle:
        def get(self, *_: Any, **__: Any) -> None:
            raise AssertionError("a job was taken after the worker was asked to stop")

    transport = broker.Transport.__new__(broker.Transport)
    transport.cycle = Cycle()
    monkeypatch.setattr(state, "should_stop", 0)
    with pytest.raises(TimeoutError):  # socket.timeout: Celery's loop goes on to stop
        transport.drain_events(None, timeout=2.0)
