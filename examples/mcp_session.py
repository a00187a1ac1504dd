"""An MCP host's session with toolledger (no network, no API key).

    toolledger worker &                          # a real worker (embedded default: no services)
    python examples/mcp_session.py --scope mcp-demo-1
    python examples/mcp_session.py --scope mcp-demo-1   # "after a crash": replayed, not re-run

It starts ``toolledger mcp serve`` as an MCP host would (a child process speaking MCP over
stdio), lists the tools with their hints, and calls ``append_file`` twice with the same
``_meta["toolledger/tool_call_id"]`` — as a host does when it retries after a timeout or a
crash. The line is appended once: the second answer is the first one's receipt, replayed.
Run it again and the same happens across processes: the same answers, still one line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, cast

from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.types import RequestParamsMeta


def server() -> StdioServerParameters:
    """``toolledger mcp serve`` with this process's settings (``TOOLLEDGER_*``)."""
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "toolledger", "mcp", "serve", "--timeout", "30"],
        env=dict(os.environ),
    )


async def session(scope: str) -> dict[str, Any]:
    async with (
        stdio_client(server()) as (read, write),
        ClientSession(read, write) as mcp,
    ):
        await mcp.initialize()
        listed = await mcp.list_tools()
        # _meta is an open map (PEP 728's extra_items, which mypy does not read yet)
        meta = cast(
            RequestParamsMeta, {"toolledger/tool_call_id": "call_1", "toolledger/scope": scope}
        )
        args = {"path": "notes.txt", "content": "hello from MCP\n"}
        first = await mcp.call_tool("append_file", args, meta=meta)
        again = await mcp.call_tool("append_file", args, meta=meta)  # a host's retry
    return {
        "tools": {
            t.name: t.annotations.model_dump(by_alias=True, exclude_none=True)
            if t.annotations
            else {}
            for t in listed.tools
        },
        "first": first.model_dump(mode="json", by_alias=True, exclude_none=True),
        "replayed": first == again,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scope", default="mcp-demo", help="Where the calls are recorded.")
    out = asyncio.run(session(parser.parse_args().scope))
    print(json.dumps(out, ensure_ascii=False, indent=2))


if __name__ == "__main__":
    main()
