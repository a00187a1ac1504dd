"""An OpenAI Agents SDK agent on toolledger, with a scripted model (no network, no API key).

    pip install 'toolledger[agents]'
    toolledger worker &                               # a real worker (embedded default)
    python examples/openai_agents_loop.py --scope demo-1
    python examples/openai_agents_loop.py --scope demo-1   # the same call ids: replayed

The agent's tools are ``ledger_function_tools``: every call the model makes is submitted
under the SDK's tool call id in the scope, executed once by a worker, and answered with its
receipt. A policy approves writes under ``report/``; anything else would pause the run for
the SDK's human-in-the-loop approval (reported as ``paused: …``, exit status 1, as
``agent_loop.py`` reports a pause). Run it again with the same scope: the same calls are
found in the ledger, the same results come back, and ``report/log.txt`` gets its line once.
That is the scripted model's fixed call ids: a real model makes new ids on a new run, and the
SDK keeps none of a crashed run's (see the README: replay needs the ids kept by the app).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from agents import Agent, ModelSettings, RunConfig, Runner
from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem, TResponseStreamEvent
from agents.models.interface import Model, ModelTracing
from agents.tool import Tool
from agents.usage import Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from toolledger import AsyncClient
from toolledger.openai_agents import ledger_function_tools

Call = tuple[str, str, dict[str, Any]]


class ScriptedModel(Model):
    """A stand-in for the model: one turn of tool calls (fixed ids), then an answer.

    ``seen`` collects the tool outputs the model was handed, by call id."""

    def __init__(self, calls: list[Call]) -> None:
        self.calls = calls
        self.seen: dict[str, str] = {}

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: Any | None,
    ) -> ModelResponse:
        items: list[Any] = [] if isinstance(input, str) else list(input)
        outputs = {
            str(item["call_id"]): str(item["output"])
            for item in items
            if isinstance(item, dict) and item.get("type") == "function_call_output"
        }
        if not outputs:
            out: list[Any] = [
                ResponseFunctionToolCall(
                    id=f"fc_{call_id}",
                    call_id=call_id,
                    name=name,
                    arguments=json.dumps(args),
                    type="function_call",
                    status="completed",
                )
                for call_id, name, args in self.calls
            ]
            return ModelResponse(output=out, usage=Usage(), response_id=None)
        self.seen.update(outputs)
        text = f"Done: {len(outputs)} tool results."
        message = ResponseOutputMessage(
            id="msg_done",
            role="assistant",
            status="completed",
            type="message",
            content=[ResponseOutputText(text=text, type="output_text", annotations=[])],
        )
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: Any | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("the scripted model does not stream")


CALLS: list[Call] = [
    ("call_1", "write_file", {"path": "report/summary.txt", "content": "all good\n"}),
    ("call_2", "append_file", {"path": "report/log.txt", "content": "checked\n"}),
]


class Paused(Exception):
    """The run stopped for the SDK's approval of some calls (its interruptions)."""


def policy(tool: str, tool_call_id: str, args: dict[str, Any]) -> str | None:
    """Writes under report/ are approved; anything else pauses for the SDK's approval."""
    return "policy:report-writer" if str(args.get("path", "")).startswith("report/") else None


async def run(scope: str) -> dict[str, Any]:
    model = ScriptedModel(CALLS)
    async with AsyncClient() as client:
        tools = ledger_function_tools(client, scope=scope, approve=policy, timeout=60)
        agent = Agent(name="reporter", model=model, tools=list(tools))
        result = await Runner.run(
            agent, "Write the report.", run_config=RunConfig(tracing_disabled=True)
        )
    if result.interruptions:  # the run pauses: not a final output (it printed null, exit 0)
        ids = ", ".join(repr(getattr(i.raw_item, "call_id", i.name)) for i in result.interruptions)
        raise Paused(
            f"{len(result.interruptions)} call(s) wait for the SDK's approval: {ids}; approve "
            "them in the run's state (RunState.approve) and resume it"
        )
    return {"final_output": result.final_output, "tool_outputs": model.seen}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scope", default="agents-loop")
    args = parser.parse_args(argv)
    try:
        out = asyncio.run(run(args.scope))
    except Paused as paused:
        raise SystemExit(f"paused: {paused}") from None
    print(json.dumps(out, ensure_ascii=False, indent=2))


if __name__ == "__main__":
    main()
