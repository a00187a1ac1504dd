"""An agent loop on toolledger, with a scripted model (no network, no API key).

    toolledger worker &                      # a real worker (embedded default: no services)
    python examples/agent_loop.py --scope demo-1
    python examples/agent_loop.py --scope demo-1   # "after a crash": replayed, nothing re-runs

The model speaks OpenAI chat. Each assistant turn's tool calls go through
``Client.run_turn``: submitted in order (approved here by a policy function; a call the
policy does not approve would wait for a person), waited for — woken by the database, not by
polling — and returned as ``tool`` messages with the model's own ids, ready to append. Run it
again with the same scope and every call is found in the ledger: the same results come
back and no tool runs twice. ``--async`` runs the same loop on ``AsyncClient``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from typing import Any

from toolledger import AsyncClient, CallsWaiting, Client

Message = dict[str, Any]


def scripted_model() -> Callable[[list[Message]], Message]:
    """A stand-in for the model: two tool turns, then an answer that reads the results."""

    def call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
        fn = {"name": name, "arguments": json.dumps(args)}
        return {"id": f"call_{i}", "type": "function", "function": fn}

    def model(messages: list[Message]) -> Message:
        turns = sum(1 for m in messages if m["role"] == "assistant")
        if turns == 0:
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    call(1, "write_file", {"path": "report/summary.txt", "content": "all good\n"}),
                    call(2, "append_file", {"path": "report/log.txt", "content": "checked\n"}),
                ],
            }
        if turns == 1:
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [call(3, "read_file", {"path": "report/summary.txt"})],
            }
        results = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
        return {"role": "assistant", "content": f"Done: {len(results)} tool results."}

    return model


def policy(tool: str, tool_call_id: str, args: dict[str, Any]) -> str | None:
    """Who approves a call: this policy approves writes under report/; None leaves a call
    for a person: the turn then raises CallsWaiting (nothing is answered, never an invented
    result), and the same run, started again once a person decided, picks it up."""
    return "policy:report-writer" if str(args.get("path", "")).startswith("report/") else None


def run(scope: str) -> list[Message]:
    model = scripted_model()
    messages: list[Message] = [{"role": "user", "content": "Write the report."}]
    with Client() as client:
        while True:
            reply = model(messages)
            messages.append(reply)
            if not reply.get("tool_calls"):
                return messages
            messages.extend(client.run_turn(scope, reply, approve=policy, timeout=60))


async def run_async(scope: str) -> list[Message]:
    model = scripted_model()
    messages: list[Message] = [{"role": "user", "content": "Write the report."}]
    async with AsyncClient() as client:
        while True:
            reply = model(messages)
            messages.append(reply)
            if not reply.get("tool_calls"):
                return messages
            messages.extend(await client.run_turn(scope, reply, approve=policy, timeout=60))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scope", default="agent-loop")
    parser.add_argument("--async", dest="use_async", action="store_true")
    args = parser.parse_args(argv)
    try:
        messages = asyncio.run(run_async(args.scope)) if args.use_async else run(args.scope)
    except CallsWaiting as waiting:  # the run pauses; run it again once they are decided
        raise SystemExit(f"paused: {waiting}") from None
    print(json.dumps(messages, ensure_ascii=False, indent=2))


if __name__ == "__main__":
    main()
