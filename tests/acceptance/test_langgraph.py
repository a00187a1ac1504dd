"""LangGraph on the ledger, against a real worker: a ToolNode of ``ledger_tools`` runs each
ToolCall once; re-running the tools node (resumed after an interrupt, re-run from its
checkpoint, or after a crash inside it) replays the receipts instead of running again; a
call nobody approved comes back as pending and nothing runs; the example runs and replays."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.conftest import CI

if not CI:  # under CI=true the extra must be installed: a missing one fails the import below
    pytest.importorskip("langgraph")

from langchain_core.messages import HumanMessage, ToolCall, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import MemorySaver
from langgraph.graph import MessagesState
from langgraph.prebuilt import ToolNode

from examples.langgraph_agent import ScriptedModel, build_graph
from tests.acceptance.conftest import Stack, landed
from toolledger import Client
from toolledger.langchain import MissingCallIdentity, NotDurable, ledger_tools
from toolledger.ledger.errors import NotFound
from toolledger.turns import CallsWaiting

ROOT = Path(__file__).resolve().parents[2]


def calls(tag: str) -> list[ToolCall]:
    return [
        ToolCall(
            name="append_file",
            args={"path": f"{tag}/log.txt", "content": "one line\n"},
            id=f"{tag}_append",
            type="tool_call",
        ),
        ToolCall(
            name="write_file",
            args={"path": f"{tag}/a.txt", "content": "hello\n"},
            id=f"{tag}_write",
            type="tool_call",
        ),
    ]


def tool_messages(state: dict[str, Any]) -> list[ToolMessage]:
    return [m for m in state["messages"] if isinstance(m, ToolMessage)]


def executions(world: Stack, scope: str, call_id: str) -> int:
    ledger = world.ledger()
    try:
        return len(ledger.get(scope, call_id).executions)
    finally:
        ledger.close()


def receipt_texts(world: Stack, scope: str, ids: list[str]) -> list[str]:
    ledger = world.ledger()
    try:
        return [ledger.receipt(scope, i).text for i in ids]
    finally:
        ledger.close()


@pytest.mark.parametrize("world", ["embedded", "postgres"], indirect=True)
def test_interrupted_before_tools__resumed_then_rerun_from_checkpoint_replays(
    world: Stack,
) -> None:
    """interrupt_before=["tools"]: nothing has run; resuming runs each call once; running
    the tools node again from the same checkpoint (same thread, same ToolCall ids) gets
    the same ToolMessages from the ledger and runs nothing."""
    tag = "intr"
    thread: RunnableConfig = {"configurable": {"thread_id": "lg-thread-1"}}
    with Client(world.settings()) as client:
        graph = build_graph(
            ScriptedModel(calls=calls(tag)),
            ledger_tools(client),
            MemorySaver(),
            interrupt_before=["tools"],
        )
        graph.invoke({"messages": [HumanMessage("go")]}, thread, durability="sync")
        before_tools = graph.get_state(thread)
        assert before_tools.next == ("tools",)
        assert not (world.sandbox / "lg-thread-1").exists()  # interrupted: nothing ran

        first = graph.invoke(None, thread, durability="sync")  # resume
        # the tools node again, same ids
        again = graph.invoke(None, before_tools.config, durability="sync")
    ids = [f"{tag}_append", f"{tag}_write"]
    expected = receipt_texts(world, "lg-thread-1", ids)
    for state in (first, again):
        msgs = tool_messages(state)
        assert [m.tool_call_id for m in msgs] == ids
        assert [m.content for m in msgs] == expected
        assert [m.status for m in msgs] == ["success", "success"]
        assert state["messages"][-1].content == "Done: 2 tool results, 0 failed."
    log = world.sandbox / "lg-thread-1" / tag / "log.txt"
    assert landed(log) == "one line\n"  # appended once across both runs
    assert [executions(world, "lg-thread-1", i) for i in ids] == [1, 1]


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize("world", ["embedded"], indirect=True)
def test_crash_inside_the_tools_node__resume_replays_not_reruns(world: Stack) -> None:
    """The tools node crashes after its tools ran, before LangGraph checkpointed its
    writes; resuming the thread runs the node again: the receipts come back, nothing runs."""
    tag = "crash"
    scope = "lg-crash"
    thread: RunnableConfig = {"configurable": {"thread_id": scope}}
    seen: list[list[ToolMessage]] = []
    with Client(world.settings()) as client:
        node = ToolNode(ledger_tools(client))

        def crashing_tools(state: MessagesState, config: RunnableConfig) -> Any:
            out = node.invoke(state, config)
            seen.append([m for m in out["messages"] if isinstance(m, ToolMessage)])
            if len(seen) == 1:
                raise Crash("the process died after the tools ran")
            return out

        graph = build_graph(
            ScriptedModel(calls=calls(tag)), [], MemorySaver(), tools_node=crashing_tools
        )
        with pytest.raises(Crash):
            graph.invoke({"messages": [HumanMessage("go")]}, thread, durability="sync")
        assert graph.get_state(thread).next == ("tools",)  # its writes were never saved
        final = graph.invoke(None, thread, durability="sync")
    ids = [f"{tag}_append", f"{tag}_write"]
    expected = receipt_texts(world, scope, ids)
    assert [[m.content for m in run] for run in seen] == [expected, expected]
    assert [m.content for m in tool_messages(final)] == expected
    assert landed(world.sandbox / scope / tag / "log.txt") == "one line\n"
    assert [executions(world, scope, i) for i in ids] == [1, 1]


@pytest.mark.parametrize("handle_tool_errors", [False, True])
@pytest.mark.parametrize("world", ["embedded"], indirect=True)
def test_not_approved__the_run_stops_and_nothing_runs_until_a_person_decides(
    world: Stack, handle_tool_errors: bool
) -> None:
    """approve returns None: the call is recorded pending_approval and the tool raises
    CallsWaiting (DESIGN §6: nothing true to tell the model; no ToolMessage is made up);
    the graph stops at its checkpoint, runs nothing, and a re-run stops the same way. Once a
    person approved, the same checkpoint run again gets the receipt: one effect."""
    scope = f"lg-pending-{handle_tool_errors}"
    thread: RunnableConfig = {"configurable": {"thread_id": scope}}
    with Client(world.settings()) as client:
        tools = ledger_tools(client, approve=lambda *_: None, tools=["append_file"])
        graph = build_graph(
            ScriptedModel(calls=calls("pend")[:1]),
            tools,
            MemorySaver(),
            # a ToolNode that hands every tool error to the model must let this one through
            tools_node=ToolNode(tools, handle_tool_errors=handle_tool_errors),
            interrupt_before=["tools"],
        )
        graph.invoke({"messages": [HumanMessage("go")]}, thread, durability="sync")
        before_tools = graph.get_state(thread)
        for _ in range(2):
            with pytest.raises(CallsWaiting) as waiting:
                graph.invoke(None, before_tools.config, durability="sync")
            assert waiting.value.waiting == {"pend_append": "pending_approval"}
        assert client.status(scope, "pend_append") == "pending_approval"
        assert not tool_messages(graph.get_state(thread).values)  # nothing answered
        assert not (world.sandbox / scope).exists()
        assert executions(world, scope, "pend_append") == 0
        client.approve(scope, "pend_append", by="alice")
        done = graph.invoke(None, before_tools.config, durability="sync")
    (msg,) = tool_messages(done)
    assert msg.status == "success" and json.loads(str(msg.content))["path"] == "pend/log.txt"
    assert executions(world, scope, "pend_append") == 1


@pytest.mark.parametrize("world", ["embedded"], indirect=True)
def test_failed_or_refused_calls_are_error_tool_messages(world: Stack) -> None:
    """A receipt that is an error (the tool failed) gives ToolMessage status="error"; so
    does a call the ledger refuses (a path outside the sandbox, the same id with other
    arguments), and then nothing is recorded and nothing runs. ``ainvoke`` replays too."""
    config: RunnableConfig = {"configurable": {"thread_id": "lg-err"}}
    with Client(world.settings()) as client:
        read, write = ledger_tools(client, tools=["read_file", "write_file"])
        call = ToolCall(name="read_file", args={"path": "nope.txt"}, id="r1", type="tool_call")
        msg = read.invoke(call, config)
        assert isinstance(msg, ToolMessage) and msg.status == "error"
        assert msg.tool_call_id == "r1" and "no such file" in str(msg.content)

        escape = {"path": "../out.txt", "content": "x"}
        call = ToolCall(name="write_file", args=escape, id="w1", type="tool_call")
        msg = write.invoke(call, config)
        assert isinstance(msg, ToolMessage) and msg.status == "error"
        assert "toolledger refused the call" in str(msg.content)
        with pytest.raises(NotFound):
            client.status("lg-err", "w1")

        ok = ToolCall(name="write_file", args={"path": "a.txt", "content": "a"}, id="w2")
        assert write.invoke({**ok, "type": "tool_call"}, config).status == "success"
        first = write.invoke({**ok, "type": "tool_call"}, config)
        replayed = asyncio.run(write.ainvoke({**ok, "type": "tool_call"}, config))  # async too
        assert replayed.content == first.content and replayed.status == "success"
        other = {**ok, "args": {"path": "a.txt", "content": "b"}, "type": "tool_call"}
        msg = write.invoke(other, config)
        assert msg.status == "error" and "toolledger refused the call" in str(msg.content)
    assert landed(world.sandbox / "lg-err" / "a.txt") == "a"
    assert not (world.root / "out.txt").exists()
    assert executions(world, "lg-err", "w2") == 1


@pytest.mark.parametrize("world", ["embedded"], indirect=True)
def test_no_call_id_or_no_thread__a_clear_error_and_nothing_recorded(world: Stack) -> None:
    with Client(world.settings()) as client:
        (append,) = ledger_tools(client, tools=["append_file"])
        args = {"path": "x.txt", "content": "x\n"}
        with pytest.raises(MissingCallIdentity, match="ToolCall that has an id"):
            append.invoke(args, {"configurable": {"thread_id": "lg-id"}})
        no_id: Any = {"type": "tool_call", "id": None, "name": "append_file", "args": args}
        with pytest.raises(MissingCallIdentity, match="ToolCall that has an id"):
            append.invoke(no_id, {"configurable": {"thread_id": "lg-id"}})
        call = ToolCall(name="append_file", args=args, id="c1", type="tool_call")
        with pytest.raises(MissingCallIdentity, match="thread id"):
            append.invoke(call)
        with pytest.raises(NotFound):
            client.status("lg-id", "c1")
    assert not world.sandbox.exists() or not any(world.sandbox.iterdir())


@pytest.mark.parametrize("world", ["embedded"], indirect=True)
def test_example_langgraph_agent__runs_then_replays_without_running_again(world: Stack) -> None:
    argv = [sys.executable, str(ROOT / "examples" / "langgraph_agent.py"), "--thread", "ex-lg"]
    env = world.env()
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    messages = json.loads(first.stdout)
    assert messages[-1] == {"type": "ai", "content": "Done: 2 tool results, 0 failed."}
    results = [m for m in messages if m["type"] == "tool"]
    assert [m["tool_call_id"] for m in results] == ["call_1", "call_2"]
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0 and again.stdout == first.stdout  # replayed, same bytes
    log = world.sandbox / "ex-lg" / "report" / "log.txt"
    assert landed(log) == "checked\n"  # appended once across both runs
    assert landed(world.sandbox / "ex-lg" / "report" / "summary.txt") == "all good\n"


@pytest.mark.parametrize(
    ("durability", "saver", "handle_errors"),
    [(None, True, False), ("async", True, False), ("exit", True, False), (None, False, False),
     (None, True, True)],
    ids=["default", "async", "exit", "no-checkpointer", "handle-tool-errors"],
)  # fmt: skip
@pytest.mark.parametrize("world", ["embedded"], indirect=True)
def test_not_durable__a_graph_that_would_not_give_the_ids_back_is_refused(
    world: Stack, durability: str | None, saver: bool, handle_errors: bool
) -> None:
    """LangGraph's default durability ("async") saves the model's message while the tools
    node already runs: a crash before the save, and the model called again under new ids, a
    second effect (a cold review). In a graph the tools run only under a checkpointer and
    durability="sync"; refused, nothing is recorded. (This also holds the config keys the
    check reads to the installed LangGraph: were one renamed, every graph would pass.)"""
    scope = f"lg-dur-{durability}-{saver}-{handle_errors}"
    thread: RunnableConfig = {"configurable": {"thread_id": scope}}
    with Client(world.settings()) as client:
        tools = ledger_tools(client, tools=["append_file"])
        graph = build_graph(
            ScriptedModel(calls=calls("dur")[:1]),
            tools,
            MemorySaver() if saver else None,
            # a ToolNode handing every tool error to the model lets this one through: the
            # graph's developer is told, not the model (it ended the graph "normally")
            tools_node=ToolNode(tools, handle_tool_errors=True) if handle_errors else None,
        )
        kw: dict[str, Any] = {} if durability is None else {"durability": durability}
        with pytest.raises(NotDurable, match="durability='sync'" if saver else "checkpointer"):
            graph.invoke({"messages": [HumanMessage("go")]}, thread, **kw)
        with pytest.raises(NotFound):
            client.status(scope, "dur_append")
    assert not (world.sandbox / scope).exists()


class _Unreachable:
    """A handle whose wait meets a database that stopped answering after the submit."""

    def __init__(self, handle: Any) -> None:
        self.status = handle.status

    def result(self, timeout: float | None = None) -> Any:
        raise sa.exc.OperationalError("SELECT", {}, Exception("connection refused"))


def _lost_answer(*_: Any, **__: Any) -> Any:
    raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed the connection"))


@pytest.mark.parametrize("where", ["submit", "wait"])
@pytest.mark.parametrize("world", ["postgres"], indirect=True)
def test_database_gone_after_the_submit__the_run_stops_and_the_model_is_told_nothing(
    world: Stack, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The database failed after the submit committed (its answer lost, or during the wait):
    a ToolNode with handle_tool_errors=True gave the model the OperationalError; the model
    called again under a new id, and the effect happened twice (a cold review). The run
    stops with CallsWaiting, the call "unanswered"; run again from the checkpoint, its
    receipt comes back, one effect."""
    scope = f"lg-db-gone-{where}"
    thread: RunnableConfig = {"configurable": {"thread_id": scope}}
    with Client(world.settings()) as client:
        tools = ledger_tools(client, tools=["append_file"])
        graph = build_graph(
            ScriptedModel(calls=calls("gone")[:1]),
            tools,
            MemorySaver(),
            tools_node=ToolNode(tools, handle_tool_errors=True),
        )
        submit = client.submit
        if where == "wait":
            monkeypatch.setattr(client, "submit", lambda *a, **k: _Unreachable(submit(*a, **k)))
        else:  # committed, and then its answer was lost
            monkeypatch.setattr(client, "submit", lambda *a, **k: _lost_answer(submit(*a, **k)))
        with pytest.raises(CallsWaiting) as waiting:
            graph.invoke({"messages": [HumanMessage("go")]}, thread, durability="sync")
        assert waiting.value.waiting == {"gone_append": "unanswered"}
        assert waiting.value.unanswered == {"gone_append"}
        assert isinstance(waiting.value.__cause__, sa.exc.OperationalError)
        assert not tool_messages(graph.get_state(thread).values)  # the model was told nothing
        monkeypatch.setattr(client, "submit", submit)
        done = graph.invoke(None, thread, durability="sync")
    (msg,) = tool_messages(done)
    assert msg.status == "success" and msg.tool_call_id == "gone_append"
    assert landed(world.sandbox / scope / "gone" / "log.txt") == "one line\n"
    assert executions(world, scope, "gone_append") == 1
