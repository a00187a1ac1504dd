"""A wait left pending in an event loop that was closed without cancelling it (a loop run by
hand, ``asyncio.wait``'s pending tasks never cancelled) kept its wake-up registered: the
next receipt for its call made the listener call into the closed loop, whose RuntimeError
ended the embedded listener's thread (every later wait of the client found its receipt at a
fallback read, 10 s late) and sent the Postgres listener reconnecting, again at every ring."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import pytest

from toolledger import AsyncClient, Client


@pytest.fixture
def client(pending_client: Any) -> Any:
    return pending_client


def abandon_wait(client: Client, scope: str, tool_call_id: str) -> tuple[Any, Any]:
    """A wait for the call, watching it, in an event loop then closed without cancelling it:
    the call's key and the wait's task."""
    key = (scope, client.ledger.get(scope, tool_call_id).operation.idempotency_key)
    loop = asyncio.new_event_loop()
    task = loop.create_task(AsyncClient.of(client).wait(scope, tool_call_id, timeout=600))
    for _ in range(300):
        loop.run_until_complete(asyncio.sleep(0.05))
        if key in client.notifier._watchers:
            break
    assert key in client.notifier._watchers
    loop.close()
    return key, task


def test_wait__a_closed_loops_wait_leaves_the_listener_waking_others(
    client: Client, scope: str
) -> None:
    # Given a wait watching a call in a loop closed without cancelling it
    client.submit(scope, "abandoned", "write_file", {"path": "a.txt", "content": "x"})
    client.submit(scope, "other", "write_file", {"path": "b.txt", "content": "y"})
    _, task = abandon_wait(client, scope, "abandoned")
    # When its call gets a receipt, and then another watched call does
    woken = client.notifier.woken
    client.reject(scope, "abandoned", by="alice")
    for _ in range(600):  # the listener has called the abandoned wait's wake-up
        if client.notifier.woken > woken:
            break
        time.sleep(0.05)
    other = (scope, client.ledger.get(scope, "other").operation.idempotency_key)
    rung = threading.Event()
    with client.notifier.watch(other, rung.set):
        client.reject(scope, "other", by="alice")
        # Then the listener still wakes the other call's waiter
        assert rung.wait(30)
    del task


def test_wait__a_closed_loops_wait_is_forgotten_once_nothing_holds_it(
    client: Client, scope: str
) -> None:
    # A wait abandoned in a closed loop held itself alive through its own wake-up (the
    # notifier's callback held its event, whose waiter's callback held the task): its
    # watcher, its task and the loop stayed for the process's life, one set per such wait.
    client.submit(scope, "forgotten", "write_file", {"path": "a.txt", "content": "x"})
    key, task = abandon_wait(client, scope, "forgotten")
    del task
    for _ in range(200):  # a read it had started on a thread may still hold it a moment
        gc.collect()
        if key not in client.notifier._watchers:
            break
        time.sleep(0.05)
    assert key not in client.notifier._watchers
