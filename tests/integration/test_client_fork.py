"""A client made before a fork (a prefork agent server: gunicorn's ``--preload``, Celery's
prefork pool, ``multiprocessing``'s fork) waits in the child as it does in the parent: woken
by the database, not found by its fallback read 10 s later. The child inherited the parent's
listener as started, its thread gone: no wake-up ever reached the child's waiters."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from toolledger import Client

#: How long the child waits for a wake-up before it reports that none came.
WAKE_WAIT = 30.0


@pytest.fixture
def client(pending_client: Any) -> Any:
    return pending_client


def _child(client: Client, scope: str, call_id: str, ready: int, report: int) -> None:
    """In the forked child: watch the call as a wait does, tell the parent, report whether a
    wake-up came, by the notifier and by a wait."""
    import threading

    out: dict[str, Any] = {}
    try:
        key = (scope, client.ledger.get(scope, call_id).operation.idempotency_key)
        out["live"] = client.notifier.start()
        rung = threading.Event()
        with client.notifier.watch(key, rung.set):
            os.write(ready, b"w")
            out["rung"] = rung.wait(WAKE_WAIT)
        out["status"] = client.wait(scope, call_id, timeout=WAKE_WAIT).status.value
        out["found_by_poll"] = client.stats.found_by_poll
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out["error"] = repr(exc)
    os.write(report, json.dumps(out).encode())


def test_client__a_forked_child_is_woken_by_the_database(client: Client, scope: str) -> None:
    # Given a client whose listener started in the parent (a wait that timed out)
    client.submit(scope, "before", "write_file", {"path": "a.txt", "content": "x"})
    with pytest.raises(TimeoutError):
        client.wait(scope, "before", timeout=0.2)
    client.submit(scope, "after", "write_file", {"path": "b.txt", "content": "y"})
    ready_r, ready_w = os.pipe()
    report_r, report_w = os.pipe()
    # When a forked child watches a call and the parent rejects it (a receipt)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _child(client, scope, "after", ready_w, report_w)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(report_w)
    try:
        assert os.read(ready_r, 1) == b"w"
        client.reject(scope, "after", by="alice")
        report = b""
        while chunk := os.read(report_r, 65536):
            report += chunk
    finally:
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(report_r)
    # Then the child's listener rang, and its wait was answered without a fallback read
    out = json.loads(report)
    assert out == {"live": True, "rung": True, "status": "rejected", "found_by_poll": 0}
