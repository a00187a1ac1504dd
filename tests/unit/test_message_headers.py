"""Every header ``publish`` sends reaches the task as ``message_headers`` reads it, the
task's request built as Celery's trace builds it from a protocol 2 message's headers (its
custom headers in ``request.headers``, each an attribute too). A label lost on the way costs
silently: without the tool's header, a worker reads the call before every claim
(``Executor._leaves``); without the others, spans and the schedule-to-start histogram lose
theirs."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context

from toolledger.config import Settings
from toolledger.worker.tasks import PUBLISHED_AT, TOOL, TOOL_CALL_ID, message_headers, publish


def _sent(**labels: Any) -> dict[str, Any]:
    app, sent = Celery(set_as_current=False), {}
    app.send_task = lambda name, **kw: sent.update(kw)  # type: ignore[method-assign]
    publish(app, Settings.from_env({}), "s", "k", 1, **labels)
    return dict(sent["headers"])


@pytest.mark.parametrize("header", [PUBLISHED_AT, TOOL_CALL_ID, TOOL])
def test_a_header_publish_sends__the_task_reads_it(header: str) -> None:
    headers = _sent(tool_call_id="call_1", tool="write_file")
    assert header in headers
    # As Celery's trace builds the task's request from the message's headers
    request = Context({**headers, "id": "task-1", "task": "toolledger.execute"})
    assert message_headers(request)[header] == headers[header]


def test_labels_not_given__are_not_sent() -> None:
    headers = _sent()
    assert TOOL not in headers and TOOL_CALL_ID not in headers
