"""The LangChain adapter records a call's arguments as the model sent them: the same call
``run_turn`` and ``repair`` read from the model's message (no worker: nothing runs here)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.conftest import CI

if not CI:  # under CI=true the extra must be installed: a missing one fails the import below
    pytest.importorskip("langchain_core")

from toolledger import Client
from toolledger.config import Settings
from toolledger.langchain import VALIDATED_UNTIL, ledger_tools
from toolledger.ledger.errors import NotFound
from toolledger.ledger.identity import args_sha256
from toolledger.ledger.models import operations
from toolledger.recovery.transcript import repair_transcript
from toolledger.registry import load_registry
from toolledger.turns import CallsWaiting


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[Client]:
    settings = Settings.from_env(
        {"TOOLLEDGER_DB": db_url, "TOOLLEDGER_HOME": str(tmp_path / "home"),
         "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
         "TOOLLEDGER_TOOLS": "tests.payment_tools",
         "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0"}  # no worker: nothing may be enqueued
    )  # fmt: skip
    with Client(settings) as c:
        yield c


def chat(call_id: str, arguments: str) -> list[dict[str, Any]]:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "charge", "arguments": arguments},
    }
    return [{"role": "user", "content": "pay"},
            {"role": "assistant", "content": None, "tool_calls": [call]}]  # fmt: skip


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_langchain__records_the_models_arguments_not_the_validated_ones(
    client: Client, scope: str, mode: str
) -> None:
    """``{"amount": 5.0}`` for an int field: LangChain validates it to 5, and the adapter
    recorded ``{"amount": 5}``; ``repair`` and ``run_turn`` read the model's ``5.0``, another
    call to them: a conflict, exit 3, and a call that took effect could not be repaired (a
    cold review). The model's arguments are recorded now."""
    (tool,) = ledger_tools(
        client, registry=load_registry("tests.payment_tools"), approve=lambda *_: None,
        tools=["charge"],
    )  # fmt: skip
    call = {"type": "tool_call", "id": f"lc-{mode}", "name": "charge", "args": {"amount": 5.0}}
    config = {"configurable": {"thread_id": scope}}
    with pytest.raises(CallsWaiting):  # nobody approved it: recorded, pending
        if mode == "sync":
            tool.invoke(call, config)
        else:
            asyncio.run(tool.ainvoke(call, config))
    op = client.ledger.get(scope, f"lc-{mode}").operation
    assert op.args == {"amount": 5.0} and op.args_sha256 == args_sha256({"amount": 5.0})
    text = json.dumps(chat(f"lc-{mode}", '{"amount": 5.0}'))
    with pytest.raises(Exception, match=r"no receipt|pending"):  # the same call: no conflict
        repair_transcript(text, client.ledger, scope)
    with pytest.raises(CallsWaiting):
        client.run_turn(scope, chat(f"lc-{mode}", '{"amount": 5.0}')[1], timeout=0.5)


def test_langchain__a_call_recorded_with_validated_arguments_is_still_replayed(
    client: Client, scope: str
) -> None:
    """A call an earlier version recorded with LangChain's validated arguments, asked again
    after the upgrade with the model's: found (its replay), not refused as a conflict."""
    client.submit(scope, "lc-old", "charge", {"amount": 5})
    with client.ledger.engine.begin() as conn:  # recorded by that version, before it ended
        conn.execute(
            sa.update(operations)
            .where(operations.c.scope == scope)
            .values(created_at=VALIDATED_UNTIL - timedelta(days=1))
        )
    (tool,) = ledger_tools(
        client, registry=load_registry("tests.payment_tools"), approve=lambda *_: None,
        tools=["charge"],
    )  # fmt: skip
    call = {"type": "tool_call", "id": "lc-old", "name": "charge", "args": {"amount": 5.0}}
    with pytest.raises(CallsWaiting):  # pending, as recorded: not a conflict
        tool.invoke(call, {"configurable": {"thread_id": scope}})
    message = tool.invoke(
        {**call, "args": {"amount": 6}}, {"configurable": {"thread_id": scope}}
    )  # other arguments under the id: refused as a conflict, a tool error the model reads
    assert message.status == "error" and "conflict" in message.content


def test_langchain__the_policy_gets_its_own_copy_of_the_arguments(
    client: Client, scope: str
) -> None:
    """The adapter handed the approval policy the dict it then recorded: a policy that wrote
    into it (a stamp) changed the call the model made, and the same call asked again after a
    crash was a conflict, told to the model as a refusal (a cold review). run_turn gave it a
    copy already."""

    def stamping(_tool: str, _call_id: str, args: dict[str, Any]) -> None:
        args["amount"] = 999  # a policy's own bookkeeping, or a bug: never the call's
        return None

    (tool,) = ledger_tools(
        client, registry=load_registry("tests.payment_tools"), approve=stamping,
        tools=["charge"],
    )  # fmt: skip
    call = {"type": "tool_call", "id": "lc-stamp", "name": "charge", "args": {"amount": 5}}
    config = {"configurable": {"thread_id": scope}}
    for _ in range(2):  # asked again after a crash: the same call, still pending
        with pytest.raises(CallsWaiting):
            tool.invoke(call, config)
    assert client.ledger.get(scope, "lc-stamp").operation.args == {"amount": 5}


def test_langchain__concurrent_async_calls_wait_on_the_loop_not_a_thread_each(
    client: Client, scope: str
) -> None:
    """``ainvoke`` ran the sync tool in the loop's default executor, whose thread it held for
    the whole wait: a ToolNode's concurrent calls past the executor's threads (min(32, CPUs +
    4)) were not even submitted until an earlier call's wait ended (carried from a cold
    review). Here the executor has 2 threads and 4 calls wait (nobody runs them): all 4 are
    recorded while every one still waits."""
    (tool,) = ledger_tools(
        client, registry=load_registry("tests.payment_tools"), approve=lambda *_: "policy",
        tools=["charge"], timeout=60.0,
    )  # fmt: skip
    config = {"configurable": {"thread_id": scope}}
    ids = [f"lc-conc-{i}" for i in range(4)]

    def recorded() -> list[str]:
        found = []
        for call_id in ids:
            with contextlib.suppress(NotFound):
                found.append(client.ledger.get(scope, call_id).operation.status.value)
        return found

    async def scenario() -> tuple[list[str], list[bool]]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))

        def call(call_id: str) -> dict[str, Any]:
            return {"type": "tool_call", "id": call_id, "name": "charge", "args": {"amount": 1}}

        calls = [asyncio.create_task(tool.ainvoke(call(call_id), config)) for call_id in ids]
        seen: list[str] = []
        for _ in range(300):  # up to ~15 s; a call held behind a wait is recorded after 60 s
            seen = recorded()  # (read here: the executor's threads may all be held)
            if len(seen) == len(ids):
                break
            await asyncio.sleep(0.05)
        waiting = [not c.done() for c in calls]
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        return seen, waiting

    seen, waiting = asyncio.run(scenario())
    assert seen == ["approved"] * 4, seen  # every call submitted, none run
    assert all(waiting), waiting  # and every one still waiting for its receipt


@pytest.mark.parametrize(
    "replayed", [{"amount": "5"}, {"amount": 5.0}, {"amount": 5, "note": "ignored"}]
)
def test_langchain__a_replay_differing_only_by_a_coerced_type_or_an_ignored_key_is_a_conflict(
    client: Client, scope: str, replayed: dict[str, Any]
) -> None:
    """A call recorded with ``{"amount": 5}`` (the model's own arguments, as this version
    records them) asked again under its id with arguments LangChain validates to the same
    (``"5"``, ``5.0``, a key the model ignores): run_turn and repair refuse it (DESIGN §2.4,
    another ``args_sha256``), but the tool's fallback for calls recorded by the version that
    recorded validated arguments took it, and answered the model with the receipt of a call
    it had not made. Only a call recorded before that version ended is still replayed so."""
    (tool,) = ledger_tools(
        client, registry=load_registry("tests.payment_tools"), approve=lambda *_: None,
        tools=["charge"],
    )  # fmt: skip
    config = {"configurable": {"thread_id": scope}}
    call_id = f"lc-coerced-{len(json.dumps(replayed))}"
    call = {"type": "tool_call", "id": call_id, "name": "charge", "args": {"amount": 5}}
    with pytest.raises(CallsWaiting):  # recorded, pending
        tool.invoke(call, config)
    with pytest.raises(Exception, match="conflict"):
        client.run_turn(scope, chat(call_id, json.dumps(replayed))[1], timeout=0.5)
    message = tool.invoke({**call, "args": replayed}, config)
    assert message.status == "error" and "conflict" in message.content
    assert client.ledger.get(scope, call_id).operation.args == {"amount": 5}
