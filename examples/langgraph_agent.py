"""A LangGraph agent on toolledger, with a scripted chat model (no network, no API key).

    pip install 'toolledger[langgraph]'
    toolledger worker &                          # a real worker (embedded default: no services)
    python examples/langgraph_agent.py --thread demo-1
    python examples/langgraph_agent.py --thread demo-1   # "after a crash": replayed

The graph is the usual one: an ``agent`` node (the model) and a ``ToolNode`` of
``ledger_tools(client)``, looping until the model answers, compiled with a checkpointer. Each
ToolCall goes through the ledger: its id is the ledger's tool_call_id and the thread id is
the scope, approved here by a policy function (a call it does not approve would wait for a
person, and the model would read that, never an invented result). Run it again with the same
thread: the model sends the same ToolCalls, every one is found in the ledger, the same
ToolMessages come back and no tool runs twice.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolCall, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import MemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from toolledger import Client
from toolledger.langchain import ledger_tools


class ScriptedModel(BaseChatModel):
    """A stand-in for the model: one turn of tool calls, then an answer that counts the
    results. Deterministic: the same conversation gets the same ToolCall ids."""

    calls: list[ToolCall]

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        results = [m for m in messages if isinstance(m, ToolMessage)]
        if not any(isinstance(m, AIMessage) for m in messages):
            reply = AIMessage(content="", tool_calls=list(self.calls))
        else:
            failed = sum(1 for m in results if m.status == "error")
            reply = AIMessage(content=f"Done: {len(results)} tool results, {failed} failed.")
        return ChatResult(generations=[ChatGeneration(message=reply)])


def report_calls() -> list[ToolCall]:
    return [
        ToolCall(
            name="write_file",
            args={"path": "report/summary.txt", "content": "all good\n"},
            id="call_1",
            type="tool_call",
        ),
        ToolCall(
            name="append_file",
            args={"path": "report/log.txt", "content": "checked\n"},
            id="call_2",
            type="tool_call",
        ),
    ]


def build_graph(
    model: BaseChatModel,
    tools: list[BaseTool],
    checkpointer: BaseCheckpointSaver[Any] | None,
    *,
    tools_node: Any = None,
    interrupt_before: list[str] | None = None,
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """agent -> tools -> agent … -> END. ``tools_node``: another node in the ToolNode's place
    (a test wraps it); ``interrupt_before=["tools"]`` stops before any tool runs."""

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", tools_node if tools_node is not None else ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer, interrupt_before=interrupt_before)


def policy(tool: str, tool_call_id: str, args: dict[str, Any]) -> str | None:
    """Who approves a call: writes under report/ by this policy; None leaves it for a person."""
    return "policy:report-writer" if str(args.get("path", "")).startswith("report/") else None


def as_dict(message: BaseMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"type": message.type, "content": message.content}
    if isinstance(message, AIMessage) and message.tool_calls:
        out["tool_calls"] = [{"id": c["id"], "name": c["name"]} for c in message.tool_calls]
    if isinstance(message, ToolMessage):
        out.update(tool_call_id=message.tool_call_id, status=message.status)
    return out


def run(thread: str) -> list[dict[str, Any]]:
    with Client() as client:
        tools = ledger_tools(client, approve=policy, timeout=60)
        graph = build_graph(ScriptedModel(calls=report_calls()), tools, MemorySaver())
        state = graph.invoke(
            {"messages": [("user", "Write the report.")]},
            {"configurable": {"thread_id": thread}},
            durability="sync",  # the model's calls saved before they run (ledger_tools asks it)
        )
    return [as_dict(m) for m in state["messages"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--thread", default="langgraph-agent")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.thread), ensure_ascii=False, indent=2))


if __name__ == "__main__":
    main()
