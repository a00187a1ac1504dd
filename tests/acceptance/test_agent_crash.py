"""An agent process SIGKILLed in the middle of a turn, then started again at once (as a
supervisor restarts it): the same turn gets every call's receipt back from the ledger, each
call run once, nothing left waiting for the sweep."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from tests.acceptance.conftest import Stack, wait_until
from tests.helpers import COUNT_PUBLISH_IMPORTS
from toolledger import AsyncClient, Client
from toolledger.ledger.errors import NotFound

AGENT = """
import json, sys
from toolledger import Client
with Client() as client:
    client.run_turn(sys.argv[1], json.loads(sys.argv[2]), approve=lambda *_: "policy")
"""


#: A LangChain tool's call, outside a graph (its caller keeps the ToolCall's id).
LANGCHAIN_AGENT = """
import json, sys
from toolledger import Client
from toolledger.langchain import ledger_tools
with Client() as client:
    (tool,) = ledger_tools(client, tools=["append_file"])
    tool.invoke(json.loads(sys.argv[2]), {"configurable": {"thread_id": sys.argv[1]}})
"""


#: An agent's first turn whose publishes each write (to the file ``argv[1]``) the Celery, kombu
#: and amqp modules imported while they ran.
COUNTING_AGENT = (
    COUNT_PUBLISH_IMPORTS
    + """
from toolledger import Client
from toolledger.turns import CallsWaiting
with Client() as client:
    try:
        client.run_turn(sys.argv[2], json.loads(sys.argv[3]), approve=lambda *_: "p", timeout=0.2)
    except CallsWaiting:
        pass
"""
)


def turn(tag: str) -> dict[str, Any]:
    args = json.dumps({"path": f"{tag}.txt", "content": "once\n"})
    call = {
        "id": f"{tag}_0",
        "type": "function",
        "function": {"name": "append_file", "arguments": args},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """A Redis URL whose server accepts the connection and never answers: a publish hangs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))  # a port of its own: the cases run side by side
        listener.listen(16)
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/12"


def executions(stack: Stack, scope: str, call_id: str) -> int:
    ledger = stack.ledger()
    try:
        return len(ledger.get(scope, call_id).executions)
    finally:
        ledger.engine.dispose()


@pytest.mark.parametrize("mode", ["sync", "async", "langchain"])
def test_agent_killed_between_the_submits_commit_and_its_publish__restarted_at_once_gets_its_receipt(
    stack: Stack, silent_broker: str, mode: str
) -> None:
    """Given an agent whose publish hangs once its call is committed (approved, stamped as
    published), when it is SIGKILLed there and started again at once with the same turn,
    then the call runs once and the turn gets its receipt well within its timeout. The replay
    of a call stamped less than REPUBLISH_AFTER (5 s) ago published nothing, and the wait never
    publishes: the restarted agent waited out its whole timeout (the sweep re-publishes after
    120 s), though a worker stood idle."""
    stack.worker("w1", concurrency=1)
    scope, message = f"crash-publish-{mode}", turn("pub")
    tool_call = {"type": "tool_call", "id": "pub_0", "name": "append_file",
                 "args": json.loads(message["tool_calls"][0]["function"]["arguments"])}  # fmt: skip
    script, given = (LANGCHAIN_AGENT, tool_call) if mode == "langchain" else (AGENT, message)
    agent = subprocess.Popen(
        [sys.executable, "-c", script, scope, json.dumps(given)],
        env=stack.env(broker=silent_broker),
    )
    try:
        ledger = stack.ledger()
        wait_until(lambda: _recorded(ledger, scope, "pub_0"), timeout=30, what="the call recorded")
        os.kill(agent.pid, signal.SIGKILL)  # committed, its publish hanging
        assert agent.wait(10) == -signal.SIGKILL
        assert ledger.get(scope, "pub_0").operation.status.value == "approved"
        ledger.engine.dispose()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    started = time.monotonic()
    if mode == "sync":  # started again at once, the same turn
        with Client(stack.settings()) as client:
            (result,) = client.run_turn(scope, message, approve=lambda *_: "policy", timeout=15)
    elif mode == "langchain":
        from toolledger.langchain import ledger_tools

        with Client(stack.settings()) as client:
            (tool,) = ledger_tools(client, tools=["append_file"], timeout=15)
            answer = tool.invoke(tool_call, {"configurable": {"thread_id": scope}})
        result = {"tool_call_id": answer.tool_call_id, "content": answer.content}
    else:

        async def again() -> list[dict[str, Any]]:
            async with AsyncClient(stack.settings()) as client:
                return await client.run_turn(
                    scope, message, approve=lambda *_: "policy", timeout=15
                )

        (result,) = asyncio.run(again())
    assert time.monotonic() - started < 12
    assert result["tool_call_id"] == "pub_0" and "bytes_appended" in result["content"]
    assert executions(stack, scope, "pub_0") == 1
    assert (stack.sandbox / scope / "pub.txt").read_text() == "once\n"


def _recorded(ledger: Any, scope: str, call_id: str) -> bool:
    try:
        ledger.get(scope, call_id)
    except (NotFound, sa.exc.OperationalError):
        return False
    return True


def test_agent_first_turn__its_publish_imports_nothing_between_a_calls_commit_and_its_send(
    stack: Stack,
) -> None:
    """A new agent process's first run_turn imported Celery and the broker's transport
    (0.4-0.5 s here) between its first call's commit and its publish: an agent SIGKILLed then
    left the call approved and never published (12 kills 0.3-2.5 s into a turn: 1 call so,
    repair then saying "approved: there is no receipt yet" 328 times, for the sweep to publish
    it 120 s later). They are imported before the turn's first commit now, as ``mcp serve``
    does."""
    imported = stack.root / "imported.jsonl"
    scope, message = "first-turn", turn("first")
    agent = subprocess.run(
        [sys.executable, "-c", COUNTING_AGENT, str(imported), scope, json.dumps(message)],
        env=stack.env(),
        timeout=60,
    )
    assert agent.returncode == 0
    assert [json.loads(line) for line in imported.read_text().splitlines()] == [[]]
