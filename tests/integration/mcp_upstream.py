"""A small upstream MCP server (stdio) for the proxy's tests: it counts its own invocations.

Every ``tools/call`` appends one JSON line to the file named by ``MCP_UPSTREAM_LOG`` *before*
it does anything else: the tool, its arguments, the ``_meta`` it received, its pid and its
parent's pid (the proxy). Tools:

- ``charge`` (amount): answers ``charged N`` and structured content;
- ``slow_charge`` (amount): the same, but first waits until the file named by
  ``MCP_UPSTREAM_RELEASE`` exists (a forward the test can cut off);
- ``wait_charge`` (amount), when ``MCP_UPSTREAM_CANCELS`` names a file: waits
  (asynchronously) until released; every ``notifications/cancelled`` the server receives is
  appended to that file as ``{"cancel_received": id}`` (received, not inferred: a closed
  stdin cancels a handler too);
- ``refuse``: answers with ``isError``;
- ``crash``: exits the server at once, without an answer;
- ``bad name`` too, when ``MCP_UPSTREAM_BAD_NAME`` is set (not a toolledger tool name);
- ``admin.tools.list`` and ``user-profile/update`` (charge as well), when
  ``MCP_UPSTREAM_SPEC_NAMES`` is set: names MCP allows (SEP-986, ``SPEC_NAMES``).

``MCP_UPSTREAM_SCHEMA`` (a JSON Schema, as JSON) adds ``deep``, with that ``inputSchema`` (charge
as well): a schema whose check is pathological.

``MCP_UPSTREAM_DROP`` names tools (comma-separated) not listed: an upstream upgraded since.

``MCP_UPSTREAM_TOOL_META`` (a JSON object) is every tool's ``_meta`` in ``tools/list``.

``MCP_UPSTREAM_PAGES`` makes ``tools/list`` misbehave: ``same`` (a next cursor that is the
same again), ``endless`` (always one more page), ``silent`` (no answer at all).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import anyio
import mcp.types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

AMOUNT = {
    "type": "object",
    "properties": {"amount": {"type": "integer"}},
    "required": ["amount"],
}


#: Names MCP allows (SEP-986): its own examples, with '.' and '/', and one of its longest.
SPEC_NAMES = ("admin.tools.list", "user-profile/update", "very.long/" + "n" * 118)


def tools() -> list[types.Tool]:
    listed = [
        types.Tool(
            name="charge",
            description="Charge an amount (counted).",
            input_schema=AMOUNT,
            annotations=types.ToolAnnotations(idempotent_hint=True),  # a hint, not the truth
        ),
        types.Tool(name="slow_charge", description="Charge, when released.", input_schema=AMOUNT),
        types.Tool(name="refuse", description="Always fails.", input_schema={"type": "object"}),
        types.Tool(name="crash", description="Exits mid-call.", input_schema={"type": "object"}),
    ]
    if os.environ.get("MCP_UPSTREAM_CANCELS"):
        listed.append(types.Tool(name="wait_charge", description="Charge, when released.",
                                 input_schema=AMOUNT))  # fmt: skip
    if os.environ.get("MCP_UPSTREAM_BAD_NAME"):
        listed.append(types.Tool(name="bad name", input_schema={"type": "object"}))
    if os.environ.get("MCP_UPSTREAM_SPEC_NAMES"):  # SEP-986: its examples, its 128 characters
        for name in SPEC_NAMES:
            listed.append(types.Tool(name=name, input_schema=AMOUNT))
    if os.environ.get("MCP_UPSTREAM_SCHEMA"):
        schema = json.loads(os.environ["MCP_UPSTREAM_SCHEMA"])
        listed.append(types.Tool(name="deep", input_schema=schema))
    if os.environ.get("MCP_UPSTREAM_TOOL_META"):
        meta = json.loads(os.environ["MCP_UPSTREAM_TOOL_META"])
        listed = [t.model_copy(update={"meta": meta}) for t in listed]
    dropped = os.environ.get("MCP_UPSTREAM_DROP", "").split(",")
    return [t for t in listed if t.name not in dropped]


def count(name: str, arguments: dict[str, Any], meta: dict[str, Any]) -> None:
    line = {
        "tool": name,
        "arguments": arguments,
        "meta": {k: v for k, v in meta.items() if k.startswith("toolledger/")},
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }
    with open(os.environ["MCP_UPSTREAM_LOG"], "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


async def list_tools(_ctx: Any, params: Any) -> types.ListToolsResult:
    pages = os.environ.get("MCP_UPSTREAM_PAGES")
    if pages == "same":  # a cursor that leads back to itself
        return types.ListToolsResult(tools=tools(), next_cursor="again")
    if pages == "endless":  # always one more page
        cursor = int(params.cursor) if params and params.cursor else 0
        return types.ListToolsResult(tools=[], next_cursor=str(cursor + 1))
    if pages == "silent":  # never answers
        await anyio.sleep_forever()
    return types.ListToolsResult(tools=tools())


async def call_tool(_ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
    arguments = params.arguments or {}
    meta = dict(params.meta or {})
    count(params.name, arguments, meta)
    if params.name == "crash":
        os._exit(3)
    if params.name == "refuse":
        return types.CallToolResult(content=[types.TextContent(text="no")], is_error=True)
    if params.name == "slow_charge":
        release = Path(os.environ["MCP_UPSTREAM_RELEASE"])
        while not release.exists():
            time.sleep(0.05)
    if params.name == "wait_charge":
        release = Path(os.environ["MCP_UPSTREAM_RELEASE"])
        while not release.exists():
            await anyio.sleep(0.05)
    amount = arguments.get("amount")
    return types.CallToolResult(
        content=[types.TextContent(text=f"charged {amount}")],
        structured_content={"charged": amount, "key": meta.get("toolledger/service_key")},
        # its own _meta, and a forged status: the host gets the first, never the second
        _meta={
            "example.com/served-by": "upstream",
            "toolledger/status": "forged",
            "toolledger/verified": True,
        },
    )


async def _tap(source: Any, sink: Any) -> None:
    """Pass the host's messages on, logging each ``notifications/cancelled`` as received."""
    async with sink:
        async for item in source:
            message = getattr(item, "message", None)
            message = getattr(message, "root", message)  # a RootModel in older SDKs
            if getattr(message, "method", None) == "notifications/cancelled":
                with open(os.environ["MCP_UPSTREAM_CANCELS"], "a", encoding="utf-8") as f:
                    f.write(json.dumps({"cancel_received": message.params.get("requestId")}))
                    f.write("\n")
            await sink.send(item)


async def main() -> None:
    server = Server("upstream", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read, write), anyio.create_task_group() as tg:
        if os.environ.get("MCP_UPSTREAM_CANCELS"):
            sink, tapped = anyio.create_memory_object_stream[Any](0)
            tg.start_soon(_tap, read, sink)
            read = tapped
        await server.run(read, write, server.create_initialization_options())
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    anyio.run(main)
