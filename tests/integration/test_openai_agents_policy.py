"""The OpenAI Agents SDK adapter's approval policy, answered with something other than an
approver's name or None: refused before anything is recorded, as run_turn refuses it. No
worker: what matters is what the ledger records (or not)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CI

if not CI:  # under CI=true the extra must be installed: a missing one fails the import below
    pytest.importorskip("agents")

from agents import Agent, RunConfig, Runner
from agents.exceptions import AgentsException

from examples.openai_agents_loop import ScriptedModel
from toolledger import AsyncClient, Client
from toolledger.config import Settings
from toolledger.ledger.errors import InputError, NotFound
from toolledger.openai_agents import ledger_function_tools


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Iterator[Settings]:
    yield Settings.from_env(
        {"TOOLLEDGER_DB": db_url, "TOOLLEDGER_HOME": str(tmp_path / "home"),
         "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
         "TOOLLEDGER_BROKER": f"embedded+sqlite:///{tmp_path / 'broker.db'}"}
    )  # fmt: skip


@pytest.mark.parametrize("answer", [False, "", "  ", 0])
def test_a_falsy_policy_answer_is_refused_not_taken_as_the_sdks_approval(
    settings: Settings, scope: str, answer: Any
) -> None:
    """A policy that said False or "" (meant: not approved) paused nothing, and the call was
    recorded approved by "openai-agents", which nobody said, and ran."""

    def policy(_tool: str, _call_id: str, _args: dict[str, Any]) -> Any:
        return answer

    async def go() -> str:
        model = ScriptedModel([("call_f1", "append_file", {"path": "x.txt", "content": "x\n"})])
        async with AsyncClient(settings) as client:
            tools = ledger_function_tools(client, scope=scope, approve=policy, timeout=1)
            agent = Agent(name="t", model=model, tools=list(tools))
            with pytest.raises(AgentsException) as stopped:  # the SDK wraps what stopped it
                await Runner.run(agent, "go", run_config=RunConfig(tracing_disabled=True))
        return str(stopped.value)

    said = asyncio.run(go())
    with Client(settings) as client, pytest.raises(NotFound):
        client.status(scope, "call_f1")  # nothing recorded, nothing run
    assert "approver of call 'call_f1'" in said, said


def test_a_nan_timeout_is_refused_before_any_call_is_recorded(
    settings: Settings, scope: str
) -> None:
    """ledger_function_tools(timeout=nan) was refused at the wait, once the call had been
    recorded and approved: the run stopped with a plain error while its worker ran it."""

    async def go() -> None:
        model = ScriptedModel([("call_n1", "append_file", {"path": "x.txt", "content": "x\n"})])
        async with AsyncClient(settings) as client:
            tools = ledger_function_tools(
                client, scope=scope, approve=lambda *_: "policy", timeout=float("nan")
            )
            agent = Agent(name="t", model=model, tools=list(tools))
            await Runner.run(agent, "go", run_config=RunConfig(tracing_disabled=True))

    with pytest.raises((ValueError, AgentsException), match="timeout is nan"):
        asyncio.run(go())
    with Client(settings) as client, pytest.raises(NotFound):
        client.status(scope, "call_n1")


def test_langchain__a_nan_timeout_is_refused_before_any_call_is_recorded(
    settings: Settings, scope: str
) -> None:
    """As above, for ledger_tools: a ToolNode(handle_tool_errors=True) handed the late
    ValueError to the model, which called again under a new id while the first call ran."""
    pytest.importorskip("langchain_core")
    from toolledger.langchain import ledger_tools

    call = {"type": "tool_call", "id": "lc_n1", "name": "append_file",
            "args": {"path": "x.txt", "content": "x\n"}}  # fmt: skip
    with Client(settings) as client:
        with pytest.raises(ValueError, match="timeout is nan"):
            tools = ledger_tools(client, timeout=float("nan"), tools=["append_file"])
            tools[0].invoke(call, {"configurable": {"thread_id": scope}})
        with pytest.raises(NotFound):
            client.status(scope, "lc_n1")


@pytest.mark.parametrize("approver", ["", " ", "a\nb"])
def test_an_sdk_approver_the_ledger_refuses_is_refused_when_the_tools_are_made(
    settings: Settings, scope: str, approver: str
) -> None:
    """approved_by="" was refused only at the submit of a call the SDK's person approved: the
    model read "error: approver ...", a refusal nobody made."""

    async def go() -> Any:
        model = ScriptedModel([("call_s1", "append_file", {"path": "x.txt", "content": "x\n"})])
        async with AsyncClient(settings) as client:
            tools = ledger_function_tools(client, scope=scope, approved_by=approver, timeout=1)
            agent = Agent(name="t", model=model, tools=list(tools))
            paused = await Runner.run(agent, "go", run_config=RunConfig(tracing_disabled=True))
            state = paused.to_state()
            state.approve(paused.interruptions[0])
            return await Runner.run(agent, state, run_config=RunConfig(tracing_disabled=True))

    with pytest.raises(InputError, match="approved_by"):
        asyncio.run(go())


@pytest.mark.parametrize("answer", [False, "", "  ", 0])
def test_langchain__a_falsy_policy_answer_stops_the_run_nothing_recorded(
    settings: Settings, scope: str, answer: Any
) -> None:
    """As the SDK's adapter and run_turn: a policy that said False or "" is refused before
    anything is recorded, and the run stops. The LangChain tool handed the submit's refusal
    to the model as a tool error ("toolledger refused the call: approver ..."), a refusal
    nobody made, and a model told "refused" calls again or gives up on a call a person
    would have approved."""
    pytest.importorskip("langchain_core")
    from langchain_core.messages import AIMessage
    from langgraph.checkpoint.memory import MemorySaver
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    from toolledger.langchain import ledger_tools

    call = {"type": "tool_call", "id": "lc_f1", "name": "append_file",
            "args": {"path": "x.txt", "content": "x\n"}}  # fmt: skip
    config = {"configurable": {"thread_id": scope}}
    with Client(settings) as client:
        tools = ledger_tools(client, approve=lambda *_: answer, tools=["append_file"])
        with pytest.raises(InputError, match="approver of call 'lc_f1'"):
            tools[0].invoke(call, config)
        # a ToolNode that hands every tool error to the model lets this one through too
        graph = StateGraph(MessagesState)
        graph.add_node("tools", ToolNode(tools, handle_tool_errors=True))
        graph.add_edge(START, "tools")
        app = graph.compile(checkpointer=MemorySaver())
        with pytest.raises(InputError, match="approver of call 'lc_f1'"):
            app.invoke({"messages": [AIMessage("", tool_calls=[call])]}, config, durability="sync")
        with pytest.raises(NotFound):
            client.status(scope, "lc_f1")
