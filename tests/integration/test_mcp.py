"""``toolledger mcp serve`` and ``toolledger mcp proxy`` spoken to by a real MCP client.

Every test drives real processes over stdio with the ``mcp`` SDK's own ``ClientSession``:
the server under test is ``python -m toolledger mcp …`` on a ledger of the test's own, with a
real worker (``serve``) or a real upstream MCP server that counts its invocations
(``proxy``, ``tests/integration/mcp_upstream.py``). On both backends: SQLite with the embedded
broker, and Postgres with Redis.

What they prove:

- ``serve`` lists the registered tools with their pydantic schemas and their contracts as
  hints; the same ``_meta`` tool_call_id twice (and again from a new server process) is one
  effect and one execution, and every answer is the first one; ids, scopes and arguments from
  the wire go through the input rules (a refusal is a tool error, the server lives on);
  without ``_meta`` each request is its own call in a per-session scope; a call that has not
  finished is answered with its status, and later with its receipt;
- ``proxy`` forwards a call upstream exactly once with its idempotency key in ``_meta``, and
  answers the same call again (from the same or a new proxy) from the ledger, the upstream's
  result rebuilt; a proxy SIGKILLed mid-forward leaves the call ``running``, then the sweep
  makes it ``unknown`` (the tool is in no registry: the sweep neither crashes nor guesses),
  and a new proxy asked the same call answers with that status and never forwards again;
  upstream tool names the ledger cannot record stop the proxy at start (exit 2);
- ``toolledger --help`` does not import the ``mcp`` package; the example session runs and
  replays.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from tests.acceptance.conftest import Stack
from tests.helpers import COUNT_PUBLISH_IMPORTS
from toolledger.harness.processes import toolledger_argv
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.receipts import UNKNOWN_MESSAGE

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = str(Path(__file__).with_name("mcp_upstream.py"))
ID, SCOPE = "toolledger/tool_call_id", "toolledger/scope"


# ------------------------------------------------------------------------------ the world


@pytest.fixture(
    scope="module", params=["embedded", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A ledger, a broker, a sandbox and one real worker, for the whole module (every test
    uses scopes of its own)."""
    root = tmp_path_factory.mktemp(f"mcp-{request.param}")
    prefix = ""
    if request.param == "postgres":
        db = request.getfixturevalue("pg_url")
        broker = request.getfixturevalue("redis_server")
        prefix = f"tltest-{uuid.uuid4().hex[:10]}:"
    else:
        db = f"sqlite:///{root / 'ledger.db'}"
        broker = f"embedded+sqlite:///{root / 'broker.db'}"
    env = {
        "db": db,
        "broker": broker,
        "broker_prefix": prefix,
        "sandbox": str(root / "sandbox"),
        "tools": "toolledger.harness.probe",
        "effects_log": str(root / "effects.log"),
        "home": str(root / "home"),
    }
    s = Stack(db, broker, prefix, root, env)
    s.worker("w1", concurrency=2)
    yield s
    for proc in s.workers:
        proc.stop(warm=False)  # every check is done: no warm shutdown to wait for
    if prefix:
        import redis

        client = redis.Redis.from_url(broker)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def scope_of(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@contextlib.asynccontextmanager
async def mcp_server(world: Stack, *argv: str, **env: str) -> AsyncIterator[ClientSession]:
    """``toolledger mcp ARGV`` as an MCP host starts it (the world's settings, plus ``env``
    as it is), and an initialised session with it. Its stderr goes to the world's
    ``mcp-stderr.log``."""
    params = StdioServerParameters(
        command=sys.executable,
        args=[*toolledger_argv()[1:], "mcp", *argv],
        env={**world.env(), **env},
        cwd=str(ROOT),
    )
    with (world.root / "mcp-stderr.log").open("a") as errlog:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
        ):
            with anyio.fail_after(60):
                await session.initialize()
            yield session


def run_async(fn: Any, *args: Any) -> Any:
    return anyio.run(fn, *args)


def cli(world: Stack, *argv: str, **settings: str) -> subprocess.CompletedProcess[str]:
    """The real CLI against the world, with ``settings`` as TOOLLEDGER_* variables."""
    return subprocess.run(
        [*toolledger_argv(), *argv],
        env=world.env(**settings),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def text_of(result: Any) -> Any:
    (block,) = result.content
    return json.loads(block.text)


# ------------------------------------------------------------------------------ serve


def test_serve__lists_the_tools_with_their_schemas_and_contracts(world: Stack) -> None:
    async def go() -> Any:
        async with mcp_server(world, "serve") as s:
            return await s.list_tools()

    tools = {t.name: t for t in run_async(go).tools}
    assert {"write_file", "append_file", "read_file", "probe_write", "probe_append"} <= set(tools)
    write, append, read = tools["write_file"], tools["append_file"], tools["read_file"]
    assert write.input_schema["type"] == "object"
    assert set(write.input_schema["properties"]) == {"path", "content"}
    assert sorted(write.input_schema["required"]) == ["content", "path"]
    assert write.annotations is not None and append.annotations is not None
    assert read.annotations is not None
    # write_file: idempotent, so not destructive; append_file: neither, so destructive
    assert (write.annotations.read_only_hint, write.annotations.idempotent_hint) == (False, True)
    assert write.annotations.destructive_hint is False
    assert (append.annotations.idempotent_hint, append.annotations.destructive_hint) == (
        False,
        True,
    )
    assert (read.annotations.read_only_hint, read.annotations.destructive_hint) == (True, False)
    assert write.annotations.open_world_hint is False  # sandboxed: a closed world
    assert write.description and "atomically" in write.description


def test_serve__the_same_call_twice_is_one_effect_and_one_answer(world: Stack) -> None:
    scope = scope_of("serve")
    meta = {ID: "call_1", SCOPE: scope}
    line = {ID: "call_2", SCOPE: scope}

    async def go() -> list[Any]:
        async with mcp_server(world, "serve") as s:
            out = [await s.call_tool("write_file", {"path": "a.txt", "content": "hi"}, meta=meta)]
            out.append(
                await s.call_tool("write_file", {"path": "a.txt", "content": "hi"}, meta=meta)
            )
            out.append(
                await s.call_tool("append_file", {"path": "l.txt", "content": "x\n"}, meta=line)
            )
            out.append(
                await s.call_tool("append_file", {"path": "l.txt", "content": "x\n"}, meta=line)
            )
        async with mcp_server(world, "serve") as s:  # a new server process: a host restarted
            out.append(
                await s.call_tool("write_file", {"path": "a.txt", "content": "hi"}, meta=meta)
            )
            out.append(
                await s.call_tool("append_file", {"path": "l.txt", "content": "x\n"}, meta=line)
            )
        return out

    first, second, append1, append2, later, append3 = run_async(go)
    assert not first.is_error
    assert text_of(first)["path"] == "a.txt" and text_of(first)["bytes_written"] == 2
    assert first.meta["toolledger/status"] == "succeeded"
    assert first.meta["toolledger/scope"] == scope and first.meta[ID] == "call_1"
    assert second == first and later == first  # replayed, field for field
    assert append2 == append1 and append3 == append1 and not append1.is_error
    assert (world.sandbox / scope / "a.txt").read_text() == "hi"
    assert (world.sandbox / scope / "l.txt").read_text() == "x\n"  # appended once
    ledger = Ledger(world.db)
    try:
        for call in ("call_1", "call_2"):
            view = ledger.get(scope, call)
            assert len(view.executions) == 1 and view.operation.status.value == "succeeded"
            assert view.operation.decided_by == "mcp"
    finally:
        ledger.close()
    landed = [e for e in world.effects() if e.get("scope") == scope]
    assert len(landed) == 2  # one landing per call, across six answers


def test_serve__a_recorded_call_of_a_tool_gone_from_the_registry_is_replayed(
    world: Stack,
) -> None:
    """A tool renamed or dropped by a deploy since its call ran: the same call asked again
    was refused "unknown tool" before the ledger was looked in, so the model was told a call
    that took effect had failed (a cold review). A new call of that name is still refused."""
    from toolledger.ledger.transitions import Status

    scope = scope_of("gone")
    ledger = Ledger(world.db)
    try:
        ledger.submit(scope, "g1", "gone_tool", {}, approved_by="al")
        claim = ledger.claim(scope, "gone_tool:g1", 1, worker_id="w")
        assert claim is not None
        ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"done": 1})
    finally:
        ledger.close()

    async def go() -> tuple[Any, Any]:
        async with mcp_server(world, "serve") as s:
            replay = await s.call_tool("gone_tool", {}, meta={ID: "g1", SCOPE: scope})
            with pytest.raises(MCPError, match="unknown tool"):
                await s.call_tool("gone_tool", {}, meta={ID: "g2", SCOPE: scope})
            return replay, None

    replay, _ = run_async(go)
    assert not replay.is_error and text_of(replay) == {"done": 1}


def test_serve__input_from_the_wire_is_refused_as_a_tool_error(world: Stack) -> None:
    scope = scope_of("refused")

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with mcp_server(world, "serve") as s:
            args = {"path": "r.txt", "content": "r"}
            out["control"] = await s.call_tool(
                "write_file", args, meta={ID: "bad\u202eid", SCOPE: scope}
            )
            out["not_text"] = await s.call_tool("write_file", args, meta={ID: 42, SCOPE: scope})
            out["empty"] = await s.call_tool("write_file", args, meta={ID: " ", SCOPE: scope})
            out["scope"] = await s.call_tool("write_file", args, meta={ID: "c1", SCOPE: "../etc"})
            out["args"] = await s.call_tool(
                "write_file", {"path": "r.txt"}, meta={ID: "c2", SCOPE: scope}
            )
            out["path"] = await s.call_tool(
                "write_file", {"path": "../r", "content": "r"}, meta={ID: "c3", SCOPE: scope}
            )
            with pytest.raises(MCPError, match="unknown tool"):
                await s.call_tool("no_such_tool", {}, meta={ID: "c4", SCOPE: scope})
            out["ok"] = await s.call_tool("write_file", args, meta={ID: "c5", SCOPE: scope})
            other = {"path": "r.txt", "content": "other"}
            out["conflict"] = await s.call_tool("write_file", other, meta={ID: "c5", SCOPE: scope})
        return out

    out = run_async(go)
    for name in ("control", "not_text", "empty", "scope", "args", "path", "conflict"):
        result = out[name]
        assert result.is_error, name
        (block,) = result.content
        assert "\n" not in block.text, name  # one line
    assert "tool_call_id" in out["control"].content[0].text
    assert "scope" in out["scope"].content[0].text
    assert "conflict" in out["conflict"].content[0].text
    assert not out["ok"].is_error  # the server lived on
    ledger = Ledger(world.db)
    try:
        assert [c.tool_call_id for c in ledger.list_calls(scope=scope)] == ["c5"]
    finally:
        ledger.close()


def test_serve__without_meta_each_request_is_its_own_call_in_a_session_scope(world: Stack) -> None:
    async def go() -> list[Any]:
        async with mcp_server(world, "serve") as s:
            args = {"path": "same.txt", "content": "same"}
            return [await s.call_tool("write_file", args), await s.call_tool("write_file", args)]

    one, two = run_async(go)
    assert not one.is_error and not two.is_error
    scope = one.meta[SCOPE]
    assert scope.startswith("mcp-") and two.meta[SCOPE] == scope
    session = scope.removeprefix("mcp-")
    ids = [one.meta[ID], two.meta[ID]]
    assert all(i.startswith(f"rpc-{session}-") for i in ids) and ids[0] != ids[1]
    assert (world.sandbox / scope / "same.txt").read_text() == "same"


def test_serve__a_call_not_finished_in_time_answers_its_status_then_its_receipt(
    world: Stack,
) -> None:
    scope = scope_of("slow")
    meta = {ID: "slow_1", SCOPE: scope}
    args = {"path": "s.txt", "content": "slow", "hold_ms": 3000}

    async def go() -> list[Any]:
        async with mcp_server(world, "serve", "--timeout", "0.3") as s:
            early = await s.call_tool("probe_write", args, meta=meta)
            unnamed = await s.call_tool("probe_write", {**args, "path": "u.txt"})
        async with mcp_server(world, "serve", "--timeout", "60") as s:
            return [early, unnamed, await s.call_tool("probe_write", args, meta=meta)]

    early, unnamed, done = run_async(go)
    assert not early.is_error
    status = text_of(early)
    assert status["finished"] is False and status["status"] in ("approved", "running")
    # named: the host may ask again with its id; the model is never invited to call again
    assert "Do not make a new call" in status["message"] and "'slow_1'" in status["message"]
    # a call the host did not name: asking again would be a new call, and the answer says so
    told = text_of(unnamed)["message"]
    assert "Do not call the tool again" in told and "same toolledger/tool_call_id" not in told
    assert unnamed.meta[ID] in told
    assert not done.is_error and done.meta["toolledger/status"] == "succeeded"
    ledger = Ledger(world.db)
    try:
        assert len(ledger.get(scope, "slow_1").executions) == 1
    finally:
        ledger.close()


@pytest.mark.postgres
@pytest.mark.parametrize("world", ["postgres"], indirect=True)
def test_serve__a_database_gone_at_the_submit_answers_unanswered_not_an_error(
    world: Stack,
) -> None:
    """The database gone when ``serve`` submits a call (refused connections: the commit's
    answer can be lost the same way): it answered a JSON-RPC error, "ledger unavailable",
    and a model reading an error calls again, under a new request id where the host names
    none, a second effect if the first had been recorded (the integrations' cold review). It
    answers the call pending, ``unanswered``, and says not to call again."""
    # (Postgres only: a proxy in front of it is what can go away here)
    from tests.integration.test_wait_frozen import Freezable

    proxy = Freezable(world.db)
    scope = scope_of("gone")

    async def go() -> Any:
        async with mcp_server(world, "serve", "--timeout", "5", TOOLLEDGER_DB=proxy.url) as s:
            proxy.gone()
            args = {"path": "g.txt", "content": "gone"}
            return await s.call_tool("probe_write", args, meta={SCOPE: scope})

    try:
        answer = run_async(go)
    finally:
        proxy.close()
    assert not answer.is_error
    said = text_of(answer)
    assert said["status"] == "unanswered" and said["finished"] is False, said
    assert "did not answer" in said["message"] and "Do not call the tool again" in said["message"]


@pytest.mark.postgres
@pytest.mark.parametrize("world", ["postgres"], indirect=True)
def test_serve__a_database_gone_during_the_wait_answers_unanswered(world: Stack) -> None:
    """The database gone once ``serve`` has submitted a call and waits for it (its re-reads
    refused until the timeout): it answered "it is running", the wait's last answer given as
    current; it answers ``unanswered`` now, and still says not to call again."""
    from tests.integration.test_wait_frozen import Freezable

    proxy = Freezable(world.db)
    scope = scope_of("wgone")
    args = {"path": "w.txt", "content": "wait", "hold_ms": 3000}

    async def go() -> Any:
        async with mcp_server(world, "serve", "--timeout", "2.5", TOOLLEDGER_DB=proxy.url) as s:
            ledger = Ledger(world.db)  # the database itself, not the proxy serve reads through

            async def recorded() -> None:
                while not ledger.list_calls(scope=scope):
                    await anyio.sleep(0.05)
                await anyio.sleep(0.5)  # serve's wait has read it (ms after the submit)
                proxy.gone()  # (gone before that, the wait's first read fails: unanswered too)

            try:
                with anyio.fail_after(30):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(recorded)
                        return await s.call_tool("probe_write", args, meta={SCOPE: scope})
            finally:
                ledger.close()

    try:
        answer = run_async(go)
    finally:
        proxy.close()
    assert not answer.is_error
    said = text_of(answer)
    assert said["status"] == "unanswered" and said["finished"] is False, said
    assert "Do not call the tool again" in said["message"]


# ------------------------------------------------------------------------------ proxy


def invocations(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def proxy_argv(*options: str) -> list[str]:
    return ["proxy", *options, "--", sys.executable, UPSTREAM]


HELLO = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {},
    "clientInfo": {"name": "raw", "version": "1"}}})  # fmt: skip
INITIALIZED = '{"jsonrpc":"2.0","method":"notifications/initialized"}'


class RawHost:
    """A host speaking to ``toolledger mcp`` line by line, no SDK in between: what it sends
    is sent as it is, malformed or cut short, and its stdin closes when the test says."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None
        self.proc, self.stdin = proc, proc.stdin

    def send(self, *lines: str | dict[str, Any], close: bool = False) -> None:
        """Each line as given (a dict as its JSON; a lone surrogate as the raw byte it
        escapes), flushed; then stdin closed if ``close``."""
        text = "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines)
        self.stdin.write(text.encode("utf-8", "surrogateescape"))
        self.stdin.flush()
        if close:
            self.stdin.close()

    def hello(self) -> None:
        """The MCP handshake, its answer read."""
        self.send(HELLO, INITIALIZED)
        assert self.reply()["id"] == 1

    def reply(self) -> Any:
        """The next message the server writes (None at its output's end)."""
        assert self.proc.stdout is not None
        return json.loads(self.proc.stdout.readline() or "null")

    def rest(self) -> list[Any]:
        """Every message it writes until its output ends."""
        assert self.proc.stdout is not None
        return [json.loads(line) for line in self.proc.stdout.read().splitlines()]


@contextlib.contextmanager
def raw_host(
    world: Stack,
    argv: list[str],
    env: dict[str, str] | None = None,
    *,
    kill_after: float = 90,
    read: bool = True,
) -> Iterator[RawHost]:
    """``toolledger mcp ARGV`` on the world (``env`` instead of its settings, if given),
    spoken to by a :class:`RawHost`; killed after ``kill_after`` seconds, so that a reply or
    an exit that never comes fails the test instead of hanging it, and killed at the end.
    Its stderr goes to the world's ``mcp-stderr.log``; its stdout is read unless ``read`` is
    false."""
    with (world.root / "mcp-stderr.log").open("a") as errlog:
        proc = subprocess.Popen(
            [*toolledger_argv(), "mcp", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if read else subprocess.DEVNULL,
            stderr=errlog,
            env=world.env() if env is None else env,
            cwd=ROOT,
        )
        killer = threading.Timer(kill_after, proc.kill)
        killer.start()
        try:
            yield RawHost(proc)
        finally:
            killer.cancel()
            proc.kill()
            proc.wait()


def exchanged(
    world: Stack, command: str, lines: list[str], answers: int
) -> tuple[list[Any], list[tuple[Any, int]]]:
    """``lines`` sent raw to ``mcp serve`` or ``mcp proxy``, then stdin closed: its first
    ``answers`` replies, and the (id, code) of each error among them."""
    argv = ["serve"] if command == "serve" else proxy_argv()
    with raw_host(world, argv, kill_after=60) as host:
        host.send(*lines)
        replies = [host.reply() for _ in range(answers)]
        host.send(close=True)
        host.proc.wait(60)
    return replies, [(r["id"], r["error"]["code"]) for r in replies if r and "error" in r]


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_malformed_lines__answered_as_json_rpc_asks_and_the_session_goes_on(
    world: Stack, command: str
) -> None:
    """A line that is not JSON gets -32700, JSON that is no message -32600, each with id null
    (JSON-RPC 2.0 §5.1); the SDK dropped both without a word. A line that breaks the input
    rules gets -32700 saying which: not strict UTF-8 (the SDK put U+FFFD in the arguments and
    ran the call), a key twice in one object (it ran the second ``name``'s tool). The next
    request is answered."""
    lines = [
        HELLO,
        INITIALIZED,
        "not json {",
        '{"jsonrpc":"2.0","id":5,"method":42}',
        '{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"name":"write_file",'
        '"name":"append_file","arguments":{"path":"d.txt","content":"x"}}}',
        '{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"write_file",'
        '"arguments":{"path":"a\udcffb.txt","content":"x"}}}',  # the raw byte 0xff
        # an id MCP does not allow: read as a notification, never answered (a cold review)
        '{"jsonrpc":"2.0","id":7.5,"method":"ping"}',
        '{"jsonrpc":"2.0","id":true,"method":"ping"}',
        '{"jsonrpc":"2.0","id":null,"method":"ping"}',
        '{"jsonrpc":"2.0","id":2,"method":"ping"}',
    ]
    replies, errors = exchanged(world, command, lines, 9)
    # a request whose id can be read is answered under it (JSON-RPC 2.0 §5: null only when
    # it cannot): its method no string, id 5
    assert (
        errors
        == [(None, -32700), (5, -32600), (None, -32700), (None, -32700)] + [(None, -32600)] * 3
    ), replies
    said = [r["error"]["message"] for r in replies if r and "error" in r]
    assert said[2] == "Parse error: duplicate key 'name' in one object", said
    assert said[3].startswith("Parse error: not UTF-8 (byte "), said
    assert said[4:] == [
        f"Invalid Request: an id is a string or an integer, not {kind}"
        for kind in ("float", "bool", "NoneType")
    ], said
    assert {"jsonrpc": "2.0", "id": 2, "result": {}} in replies, replies


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_batches_and_refused_requests__answered_under_their_own_ids_nothing_run(
    world: Stack, command: str
) -> None:
    """A JSON-RPC batch (MCP removed them in 2025-06-18; the SDK reads none) gets one -32600
    for each request in it, under that request's id; a request the SDK refuses whose id can
    be read (an escaped lone surrogate, nested past the SDK's depth) is answered under its id.
    Each was one error with id null: the host never heard about its requests and waited on
    them for ever (a cold review). Nothing in a batch runs; the session goes on."""
    scope = scope_of("batch")
    call = {"jsonrpc": "2.0", "id": "c", "method": "tools/call", "params": {
        "name": "charge" if command == "proxy" else "write_file",
        "arguments": {"amount": 1} if command == "proxy" else {"path": "b.txt", "content": "x"},
        "_meta": {ID: "batched", SCOPE: scope}}}  # fmt: skip
    lines = [
        HELLO,
        INITIALIZED,
        json.dumps([{"jsonrpc": "2.0", "id": 7, "method": "ping"}, call, json.loads(INITIALIZED)]),
        json.dumps([json.loads(INITIALIZED)]),  # notifications alone: one error, id null
        '{"jsonrpc":"2.0","id":8,"method":"ping","params":{"a":"\\udcff"}}',
        '{"jsonrpc":"2.0","id":9,"method":"ping","params":' + "[" * 300 + "]" * 300 + "}",
        '{"jsonrpc":"2.0","id":2,"method":"ping"}',
    ]
    replies, errors = exchanged(world, command, lines, 7)
    assert errors == [(7, -32600), ("c", -32600), (None, -32600), (8, -32700), (9, -32700)], replies
    assert "batch is not supported" in replies[1]["error"]["message"], replies
    assert {"jsonrpc": "2.0", "id": 2, "result": {}} in replies, replies
    assert world.ledger().list_calls(scope=scope) == []  # nothing in the batch ran


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_stdin_closed__the_calls_in_flight_are_answered_before_the_server_exits(
    world: Stack, tmp_path: Path, command: str
) -> None:
    """A host that sends a call and closes stdin at once (MCP's way to stop a stdio server,
    and ``… | toolledger mcp serve``) gets the call's receipt, then the server exits 0. The
    session was cancelled at the input's end: the call was answered "Connection closed" (an
    error that invites the host to issue it again) though it ran to its end, on ``proxy`` its
    forward cut off and recorded unknown."""
    scope = scope_of(f"eof-{command}")
    release = tmp_path / "release"
    if command == "serve":
        argv = ["serve"]
        params = {
            "name": "probe_write",
            "arguments": {"path": "eof.txt", "content": "x", "hold_ms": 1500},
            "_meta": {ID: "e1", SCOPE: scope},
        }
    else:
        argv = proxy_argv()
        params = {
            "name": "slow_charge",
            "arguments": {"amount": 5},
            "_meta": {ID: "e1", SCOPE: scope},
        }
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}
    env = {**world.env(), "MCP_UPSTREAM_LOG": str(tmp_path / "upstream.log"),
           "MCP_UPSTREAM_RELEASE": str(release)}  # fmt: skip
    releaser = threading.Timer(1.5, release.touch)  # the upstream answers 1.5 s later
    with raw_host(world, argv, env) as host:
        try:
            host.hello()
            host.send(call, close=True)  # at once: the call is in flight
            releaser.start()
            replies = host.rest()
            code = host.proc.wait(60)
        finally:
            releaser.cancel()
    assert code == 0
    (reply,) = replies
    assert reply["id"] == 2 and "result" in reply, reply  # not -32000 "Connection closed"
    assert not reply["result"]["isError"], reply
    assert reply["result"]["_meta"]["toolledger/status"] == "succeeded", reply


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_stdin_closed__a_call_still_running_is_answered_its_status_and_the_server_exits(
    world: Stack, tmp_path: Path, command: str
) -> None:
    """The calls in flight at the input's end are waited for DRAIN_SECONDS, not their
    ``--timeout`` (unbounded: ``--timeout 600`` kept ``serve`` up ten minutes after the host
    closed stdin, a cold review); then each is answered with where it stands, not finished
    yet, and the server exits 0."""
    from toolledger.mcp.common import CUT_GRACE, DRAIN_SECONDS

    scope = scope_of(f"cut-{command}")
    if command == "serve":
        argv = ["serve", "--timeout", "600"]
        args = {"path": "cut.txt", "content": "x", "hold_ms": int(DRAIN_SECONDS * 1000 + 4000)}
        params = {"name": "probe_write", "arguments": args, "_meta": {ID: "k1", SCOPE: scope}}
    else:  # the upstream is never released: the forward never ends
        argv = proxy_argv("--timeout", "600")
        params = {
            "name": "slow_charge",
            "arguments": {"amount": 1},
            "_meta": {ID: "k1", SCOPE: scope},
        }
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}
    env = {**world.env(), "MCP_UPSTREAM_LOG": str(tmp_path / "upstream.log"),
           "MCP_UPSTREAM_RELEASE": str(tmp_path / "never")}  # fmt: skip
    with raw_host(world, argv, env, kill_after=120) as host:
        host.hello()
        host.send(call, close=True)
        closed = time.monotonic()
        reply = host.reply()
        took = time.monotonic() - closed
        if command == "proxy":  # its forward goes on (up to --time-limit) until the
            host.proc.terminate()  # host's SIGTERM, which records it unknown: as before
        rest = host.rest()
        code = host.proc.wait(60)
    assert "result" in reply, reply
    said = json.loads(reply["result"]["content"][0]["text"])
    assert said["finished"] is False and said["status"] == "running", said
    assert took < DRAIN_SECONDS + CUT_GRACE + 20, took  # not --timeout's 600 s
    assert not rest  # one answer
    if command == "serve":
        assert code == 0


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_reinitialize__after_a_call_is_refused_so_request_ids_never_name_two_calls(
    world: Stack, command: str, tmp_path: Path
) -> None:
    """A call the host does not name is ``rpc-<session>-<request id>``. The SDK accepted a
    second ``initialize`` on one connection, and a host's new session counts its ids again:
    its first call, id 3 with the same arguments, was answered the earlier call's result,
    nothing run (a cold review). Once a call has been made, a second handshake is refused
    (-32600, its own id) and the session goes on; before any call it is harmless, answered."""
    log = tmp_path / "upstream.log"
    scope = scope_of("reinit")
    if command == "serve":
        argv, tool = ["serve", "--scope", scope], "append_file"
        args: dict[str, Any] = {"path": "r.txt", "content": "x\n"}
    else:
        argv, tool, args = ["proxy", "--scope", scope, *proxy_argv()[1:]], "charge", {"amount": 5}
    again = json.loads(HELLO)
    call = {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
            "params": {"name": tool, "arguments": args}}  # fmt: skip
    env = {**world.env(), "MCP_UPSTREAM_LOG": str(log)}
    with raw_host(world, argv, env, kill_after=60) as host:
        # a call before any handshake (refused by the SDK), then two: both answered
        host.send({**call, "id": 0}, HELLO, {**again, "id": 2}, INITIALIZED)
        early = [host.reply() for _ in range(3)]
        assert [r["id"] for r in early] == [0, 1, 2] and "error" in early[0], early
        assert all("result" in r for r in early[1:]), early
        host.send(call)
        first = host.reply()
        host.send({**again, "id": 4})
        refused = host.reply()
        host.send('{"jsonrpc":"2.0","id":5,"method":"ping"}', close=True)
        rest = host.rest()
    assert first["id"] == 3 and not first["result"]["isError"], first
    assert refused["id"] == 4 and refused["error"]["code"] == -32600, refused
    assert "initialized" in refused["error"]["message"], refused
    assert {"jsonrpc": "2.0", "id": 5, "result": {}} in rest, rest
    if command == "proxy":
        assert len(invocations(log)) == 1
    else:
        assert (world.sandbox / scope / "r.txt").read_text() == "x\n"


def test_proxy__forwards_once_with_the_key_and_replays_the_upstream_result(
    world: Stack, tmp_path: Path
) -> None:
    log = tmp_path / "upstream.log"
    scope = scope_of("proxy")
    meta = {ID: "call_1", SCOPE: scope}
    refused = {ID: "call_2", SCOPE: scope}
    # another conversation's call_1: another call, whose key upstream must differ (the key
    # alone went, and an upstream deduplicating by it gave this call the first one's receipt)
    elsewhere = {ID: "call_1", SCOPE: scope_of("proxy-other")}

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with mcp_server(world, *proxy_argv(), MCP_UPSTREAM_LOG=str(log)) as s:
            out["tools"] = {t.name: t for t in (await s.list_tools()).tools}
            out["first"] = await s.call_tool("charge", {"amount": 5}, meta=meta)
            out["second"] = await s.call_tool("charge", {"amount": 5}, meta=meta)
            out["elsewhere"] = await s.call_tool("charge", {"amount": 7}, meta=elsewhere)
            out["refused"] = await s.call_tool("refuse", {}, meta=refused)
        argv = proxy_argv("--idempotent", "charge")
        async with mcp_server(world, *argv, MCP_UPSTREAM_LOG=str(log)) as s:
            out["relisted"] = {t.name: t for t in (await s.list_tools()).tools}
            out["later"] = await s.call_tool("charge", {"amount": 5}, meta=meta)
            out["refused_again"] = await s.call_tool("refuse", {}, meta=refused)
        return out

    out = run_async(go)
    assert set(out["tools"]) == {"charge", "slow_charge", "refuse", "crash"}
    # the upstream hints that charge is idempotent; the proxy believes --idempotent only
    assert out["tools"]["charge"].annotations.idempotent_hint is False
    assert out["relisted"]["charge"].annotations.idempotent_hint is True
    first = out["first"]
    assert not first.is_error and first.content[0].text == "charged 5"
    key = f"{scope}/mcp.charge:call_1"
    assert first.structured_content == {"charged": 5, "key": key}
    assert first.meta["toolledger/status"] == "succeeded"  # the upstream's forged one: not
    assert first.meta["example.com/served-by"] == "upstream"  # its own _meta: passed on
    assert "toolledger/verified" not in first.meta  # nothing under toolledger/ but ours
    assert out["second"] == first and out["later"] == first  # replayed, not forwarded
    assert out["refused"].is_error and out["refused"].content[0].text == "no"
    assert out["refused_again"] == out["refused"]
    calls = invocations(log)
    assert [c["tool"] for c in calls] == ["charge", "charge", "refuse"]  # once each call
    assert calls[0]["meta"] == {
        "toolledger/idempotency_key": "mcp.charge:call_1",  # as it always went
        "toolledger/service_key": key,
    }
    assert calls[1]["meta"]["toolledger/service_key"] == f"{elsewhere[SCOPE]}/mcp.charge:call_1"
    assert out["elsewhere"].structured_content == {
        "charged": 7,
        "key": calls[1]["meta"]["toolledger/service_key"],
    }
    assert calls[0]["arguments"] == {"amount": 5}
    ledger = Ledger(world.db)
    try:
        view = ledger.get(scope, "call_1")
        assert view.operation.tool == "mcp.charge"  # never a registered tool's name
        (ex,) = view.executions
        assert ex.status.value == "succeeded" and ex.worker_id.startswith("mcp-proxy@")
        assert ex.result == {
            "content": [{"type": "text", "text": "charged 5"}],
            "isError": False,
            "structuredContent": {"charged": 5, "key": key},
            "_meta": {"example.com/served-by": "upstream"},  # dropped until 2026-12-06
        }
        assert ledger.get(scope, "call_2").operation.status.value == "failed"
    finally:
        ledger.close()


def _settle_running(world: Stack, scope: str) -> None:
    """The forwards ``scope`` left running (their proxy lost its database before it could
    record their end) marked unknown: the module's ledger is shared, and a later test's
    sweep found them expired and counted them (CI run 2)."""
    ledger = Ledger(world.db)
    try:
        for row in ledger.list_calls(scope=scope):
            for ex in ledger.get(scope, row.tool_call_id).executions:
                if ex.status.value == "running":
                    ledger.mark_unknown(ex.execution_id, reason="its proxy lost the database",
                                        actor="test")  # fmt: skip
    finally:
        ledger.close()


@pytest.mark.postgres
@pytest.mark.parametrize("world", ["postgres"], indirect=True)
def test_proxy__a_database_gone_mid_forward_answers_unanswered_not_an_error(
    world: Stack, tmp_path: Path
) -> None:
    """The proxy's database gone while it waits for a call it forwards: it answered a JSON-RPC
    error, and a model reading an error calls again, under a new request id where the host
    names none, forwarded again: two charges (a cold review of the day's diff). It answers
    the call not finished, ``unanswered`` (whether the failure met the wait's first read or
    its re-reads, until 2026-12-07 said "running", the last answer), told not to call again;
    the upstream ran it once."""
    # (Postgres only: a proxy in front of it is what can go away here)
    from tests.integration.test_wait_frozen import Freezable

    log, release = tmp_path / "upstream.log", tmp_path / "release"
    db = Freezable(world.db)
    scope = scope_of("pgone")
    env = {"MCP_UPSTREAM_LOG": str(log), "MCP_UPSTREAM_RELEASE": str(release),
           "TOOLLEDGER_DB": db.url}  # fmt: skip

    async def go() -> list[Any]:
        answers: list[Any] = []
        async with mcp_server(world, *proxy_argv("--timeout", "20"), **env) as s:

            async def call() -> None:  # its scope named, its id not: the request's
                answers.append(await s.call_tool("slow_charge", {"amount": 3}, meta={SCOPE: scope}))

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    while not invocations(log):  # forwarded: the upstream runs it
                        await anyio.sleep(0.05)
                    db.gone()
            release.touch()  # the upstream finishes; the proxy's record of it waits
        return answers

    try:
        (answer,) = run_async(go)
    finally:
        release.touch()
        db.close()
        _settle_running(world, scope)
    assert not answer.is_error
    said = text_of(answer)
    assert said["status"] == "unanswered" and said["finished"] is False, said
    assert "Do not call the tool again" in said["message"]
    assert len(invocations(log)) == 1


def test_proxy__killed_mid_forward_the_call_becomes_unknown_and_is_never_forwarded_again(
    world: Stack, tmp_path: Path
) -> None:
    log, release = tmp_path / "upstream.log", tmp_path / "release"
    scope = scope_of("cut")
    meta = {ID: "cut_1", SCOPE: scope}
    env = {"MCP_UPSTREAM_LOG": str(log), "MCP_UPSTREAM_RELEASE": str(release)}
    upstream_pids: list[int] = []

    async def cut_off() -> dict[str, Any]:
        outcome: dict[str, Any] = {}
        async with mcp_server(world, *proxy_argv("--lease", "1"), **env) as s:

            async def call() -> None:
                try:
                    outcome["result"] = await s.call_tool("slow_charge", {"amount": 7}, meta=meta)
                except Exception as exc:  # noqa: BLE001 - the connection died with the proxy
                    outcome["error"] = exc

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    while not invocations(log):  # the upstream is running the call
                        await anyio.sleep(0.05)
                    (line,) = invocations(log)
                    upstream_pids.append(line["pid"])
                    os.kill(line["ppid"], signal.SIGKILL)  # the proxy, mid-forward
        return outcome

    async def ask_again(*options: str, **more: str) -> Any:
        async with mcp_server(world, *proxy_argv(*options), **env, **more) as s:
            return await s.call_tool("slow_charge", {"amount": 7}, meta=meta)

    try:
        outcome = run_async(cut_off)
        assert "result" not in outcome  # no answer was invented for the host
        ledger = Ledger(world.db)
        try:
            view = ledger.get(scope, "cut_1")
            assert view.operation.status.value == "running"
            # still running (its lease not yet expired, or not yet swept): not forwarded again
            pending = run_async(
                partial(ask_again, "--timeout", "0.5", TOOLLEDGER_SWEEP_GRACE="600")
            )
            assert not pending.is_error and text_of(pending)["status"] == "running"
            assert len(invocations(log)) == 1
            time.sleep(1.5)  # past the 1 s lease
            # a proxy asked about it marks it unknown itself, as the sweep would: a proxy alone
            # has no sweep, and the host was told "not finished yet" for good (a cold review)
            marked = run_async(partial(ask_again, "--timeout", "0.5", TOOLLEDGER_SWEEP_GRACE="0"))
            assert marked.is_error and text_of(marked)["status"] == "unknown"
            assert ledger.get(scope, "cut_1").operation.status.value == "unknown"
            (event,) = [e for e in ledger.events(scope, "cut_1") if e.kind == "unknown"]
            assert event.actor == "mcp-proxy" and event.detail["reason"] == "lease expired"
            swept = cli(world, "--json", "sweep", sweep_grace="0")
            assert swept.returncode == 0, swept.stderr
            summary = json.loads(swept.stdout)
            assert summary["marked_unknown"] == 0 and not summary["errors"]  # done already
            assert ledger.get(scope, "cut_1").operation.status.value == "unknown"
            again = cli(world, "--json", "sweep", sweep_grace="0")
            assert again.returncode == 0, again.stderr  # no reconciler guesses: still unknown
            assert ledger.get(scope, "cut_1").operation.status.value == "unknown"

            answer = run_async(ask_again)
            assert answer.is_error  # unknown: it may have happened, never read as a success
            assert text_of(answer)["status"] == "unknown"
            assert text_of(answer)["message"] == UNKNOWN_MESSAGE
            assert answer.meta["toolledger/status"] == "unknown"
            assert len(invocations(log)) == 1  # never forwarded again
            (ex,) = ledger.get(scope, "cut_1").executions
            assert ex.status.value == "unknown" and ex.result is None

            # for a human: retry needs the tool in a registry (refused, nothing changes);
            # resolve does not, and its decision is what the next answer says
            retry = cli(world, "retry", "--scope", scope, "--tool-call-id", "cut_1", "--by", "al")
            assert retry.returncode == 4 and "unknown tool 'mcp.slow_charge'" in retry.stderr
            assert "the MCP proxy forwards" in retry.stderr
            resolved = cli(
                world, "resolve", "--execution-id", ex.execution_id, "--as", "failed",
                "--by", "al", "--evidence", "no charge upstream",
            )  # fmt: skip
            assert resolved.returncode == 0, resolved.stderr
            decided = run_async(ask_again)
            assert decided.is_error and decided.meta["toolledger/status"] == "failed"
            assert decided.meta["toolledger/reconciled"] is True
            assert decided.meta["toolledger/review"] is None  # no flag waits on it
            assert len(invocations(log)) == 1
        finally:
            ledger.close()
        verify = cli(world, "verify")
        assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        release.touch()  # the orphaned upstream finishes (its answer has nowhere to go)
        for pid in upstream_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_proxy__an_upstream_that_dies_mid_call_leaves_it_unknown_and_stops_the_proxy(
    world: Stack, tmp_path: Path
) -> None:
    log = tmp_path / "upstream.log"
    scope = scope_of("crash")
    meta = {ID: "crash_1", SCOPE: scope}
    errlog = world.root / "mcp-stderr.log"
    before = errlog.read_text() if errlog.exists() else ""

    async def crash() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with mcp_server(world, *proxy_argv(), MCP_UPSTREAM_LOG=str(log)) as s:
            try:
                out["result"] = await s.call_tool("crash", {}, meta=meta)
            except MCPError as exc:  # the proxy stopped before it could answer
                out["error"] = exc
        return out

    async def ask_again() -> Any:
        async with mcp_server(world, *proxy_argv(), MCP_UPSTREAM_LOG=str(log)) as s:
            return await s.call_tool("crash", {}, meta=meta)

    out = run_async(crash)
    if "result" in out:  # answered before the proxy stopped: the unknown receipt
        assert out["result"].meta["toolledger/status"] == "unknown"
    said = (errlog.read_text() if errlog.exists() else "")[len(before) :]
    assert "exited; the proxy stops with it" in said
    answer = run_async(ask_again)
    assert answer.is_error and text_of(answer)["status"] == "unknown"
    assert [c["tool"] for c in invocations(log)] == ["crash"]  # never forwarded again
    ex, marked = unknown_event(world, scope, "crash_1")
    assert ex.status.value == "unknown"
    assert "upstream gave no result" in marked.detail["reason"]
    assert marked.actor.startswith("mcp-proxy@")  # the proxy said so at once, no sweep


def test_proxy__an_upstream_gone_answers_the_calls_in_flight_and_exits_with_stdin_open(
    world: Stack, tmp_path: Path
) -> None:
    """The upstream dies while a call is in flight. The call is answered from the ledger,
    its receipt (unknown: nothing came back), not JSON-RPC's "Connection closed" (which told
    a host that a call which may have taken effect had failed, inviting it again); and the
    proxy then exits, 1, though the host keeps stdin open (it neither answered nor exited
    before: a cold review)."""
    log = tmp_path / "upstream.log"
    scope = scope_of("gone")
    params = {"name": "slow_charge", "arguments": {"amount": 3}, "_meta": {ID: "g2", SCOPE: scope}}
    slow = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}
    env = {**world.env(), "MCP_UPSTREAM_LOG": str(log),
           "MCP_UPSTREAM_RELEASE": str(tmp_path / "never")}  # fmt: skip
    with raw_host(world, proxy_argv("--timeout", "20"), env) as host:
        host.hello()
        host.send(slow)
        deadline = time.monotonic() + 30
        while not invocations(log) and time.monotonic() < deadline:
            time.sleep(0.05)  # forwarded, waiting upstream
        (upstream,) = [c["pid"] for c in invocations(log)]
        os.kill(upstream, signal.SIGKILL)  # it crashed: no answer, its stdout ends
        replies = {2: host.reply()}
        code = host.proc.wait(60)  # stdin still open
    assert code == 1
    assert "result" in replies[2], replies[2]  # a receipt, not a JSON-RPC error
    result = replies[2]["result"]
    assert result["isError"] and json.loads(result["content"][0]["text"])["status"] == "unknown"
    assert [c["tool"] for c in invocations(log)] == ["slow_charge"]


def test_proxy__an_upstream_gone_a_recorded_call_asked_again_gets_its_receipt(
    world: Stack, tmp_path: Path
) -> None:
    """Once its upstream has exited, the proxy answers the calls in flight before it stops.
    A call asked again meanwhile that had run was answered a JSON-RPC error, "the upstream
    server has exited: nothing was sent to it": untrue of that call, and an error a model
    reads invites the action again under a new id (a cold review). It is answered its
    receipt; a new call is still refused."""
    log = tmp_path / "upstream.log"
    scope = scope_of("gone-replay")
    ledger = Ledger(world.db)
    try:  # a call another proxy holds: asked, it keeps this one's session in flight
        ledger.submit(scope, "held", "mcp.charge", {"amount": 1}, approved_by="test")
        claim = ledger.claim(scope, "mcp.charge:held", 1, worker_id="test", lease_seconds=120)
        assert claim is not None
    finally:
        ledger.close()

    def call(rid: int, name: str, call_id: str, amount: int | None = None) -> dict[str, Any]:
        args = {} if amount is None else {"amount": amount}
        meta = {ID: call_id, SCOPE: scope}
        return {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                "params": {"name": name, "arguments": args, "_meta": meta}}  # fmt: skip

    env = {**world.env(), "MCP_UPSTREAM_LOG": str(log)}
    with raw_host(world, proxy_argv("--timeout", "15"), env) as host:
        host.hello()
        host.send(call(2, "charge", "done", 5))
        done = host.reply()
        host.send(call(3, "charge", "held", 1), call(4, "crash", "boom"))
        replies = {r["id"]: r for r in (host.reply(),)}  # the crash: unknown
        time.sleep(1.5)  # the upstream seen gone (its exit is polled, its stdout drained)
        host.send(call(5, "charge", "done", 5), call(6, "charge", "new", 7))
        for _ in range(3):
            reply = host.reply()
            replies[reply["id"]] = reply
        code = host.proc.wait(60)
    assert code == 1
    assert done["id"] == 2 and not done["result"]["isError"], done
    assert "result" in replies[5], replies[5]  # its receipt, not an error
    assert replies[5]["result"] == done["result"]
    assert replies[6]["error"]["message"].startswith("the upstream server has exited"), replies
    assert json.loads(replies[3]["result"]["content"][0]["text"])["finished"] is False
    assert [c["tool"] for c in invocations(log)] == ["charge", "crash"]


def test_proxy__an_upstream_that_dies_while_its_child_holds_its_stdout_is_seen_gone(
    world: Stack, tmp_path: Path
) -> None:
    """The upstream dies mid-call, but a child it left behind (a wrapper's background job,
    npx's grandchild) keeps its stdout open: no EOF. Its exit alone was never noticed (a cold
    review): the call stayed running, its lease renewed, the host was told "not finished
    yet", and the proxy outlived stdin's close until the orphan exited. Its exit is watched
    now: the call is answered unknown, and the proxy exits 1 with stdin still open."""
    log, orphan = tmp_path / "upstream.log", tmp_path / "orphan.pid"
    scope = scope_of("orphan")
    params = {"name": "crash", "arguments": {}, "_meta": {ID: "o1", SCOPE: scope}}
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}
    script = f"sleep 300 & echo $! > {orphan}; exec {sys.executable} {UPSTREAM}"
    argv = ["proxy", "--timeout", "30", "--", "sh", "-c", script]
    env = {**world.env(), "MCP_UPSTREAM_LOG": str(log)}
    try:
        with raw_host(world, argv, env) as host:
            host.hello()
            host.send(call)
            reply = host.reply()
            code = host.proc.wait(60)  # stdin still open
    finally:
        if orphan.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(orphan.read_text()), signal.SIGKILL)
    assert "result" in reply, reply
    said = json.loads(reply["result"]["content"][0]["text"])
    assert said["status"] == "unknown", said  # not "not finished yet": it was still running
    assert code == 1
    _, marked = unknown_event(world, scope, "o1")
    assert "upstream gave no result" in marked.detail["reason"]
    assert marked.actor.startswith("mcp-proxy@")  # the proxy said so at once, no sweep
    assert [c["tool"] for c in invocations(log)] == ["crash"]


def test_proxy__a_recorded_call_of_a_tool_the_upstream_no_longer_lists_is_replayed(
    world: Stack, tmp_path: Path
) -> None:
    """The upstream, upgraded, no longer lists a tool whose call the ledger holds. The same
    call asked again got JSON-RPC's "unknown tool" instead of its receipt (a cold review), as
    if it had never run; ``mcp serve`` replays one of a tool gone from its registry. It is
    answered from the ledger now, nothing sent; a new call of that tool is still refused."""
    log = tmp_path / "upstream.log"
    scope = scope_of("dropped")
    meta = {ID: "d1", SCOPE: scope}

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with mcp_server(world, *proxy_argv(), MCP_UPSTREAM_LOG=str(log)) as s:
            out["first"] = await s.call_tool("charge", {"amount": 5}, meta=meta)
        env = {"MCP_UPSTREAM_LOG": str(log), "MCP_UPSTREAM_DROP": "charge"}
        async with mcp_server(world, *proxy_argv(), **env) as s:
            out["listed"] = [t.name for t in (await s.list_tools()).tools]
            out["again"] = await s.call_tool("charge", {"amount": 5}, meta=meta)
            for name, args, call in [("new", {"amount": 5}, {ID: "d2", SCOPE: scope}),
                                     ("other_args", {"amount": 6}, meta)]:  # fmt: skip
                with pytest.raises(MCPError) as refused:
                    await s.call_tool("charge", args, meta=call)
                out[name] = refused.value
        return out

    out = run_async(go)
    assert "charge" not in out["listed"]
    assert out["first"].meta["toolledger/status"] == "succeeded"
    assert out["again"] == out["first"]  # its receipt, replayed
    for name in ("new", "other_args"):
        assert out[name].code == -32602 and "unknown tool 'charge'" in out[name].message
    assert [c["tool"] for c in invocations(log)] == ["charge"]  # sent once, never again


def test_proxy__a_call_never_sent_of_a_tool_no_longer_listed_is_failed_after_the_tool_wait(
    world: Stack, tmp_path: Path
) -> None:
    """A proxy killed between its record of a call and its claim leaves it approved (the
    call is recorded here as that proxy did, the window being a few milliseconds wide). If
    the upstream no longer lists the tool, a proxy asked the call again answered "not
    finished, approved" each time, for ever: it sends nothing it cannot list, the sweep
    publishes no proxy's call, and no person's command takes an approved call (a cold
    review). Within ``TOOLLEDGER_TOOL_WAIT`` of its approval it is still left (the upstream
    may list it again); past it, the proxy asked claims it and fails it, never sent, and
    every answer after is that receipt. Nothing is ever sent upstream."""
    log = tmp_path / "upstream.log"
    scope = scope_of("never-sent")
    meta = {ID: "n1", SCOPE: scope}
    world.ledger().submit(scope, "n1", "mcp.charge", {"amount": 5}, approved_by="mcp",
                          actor="mcp-proxy")  # fmt: skip
    env = {"MCP_UPSTREAM_LOG": str(log), "MCP_UPSTREAM_DROP": "charge"}

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with mcp_server(world, *proxy_argv("--timeout", "1"), **env) as s:
            out["within"] = await s.call_tool("charge", {"amount": 5}, meta=meta)
        async with mcp_server(
            world, *proxy_argv("--timeout", "1"), **env, TOOLLEDGER_TOOL_WAIT="0.5"
        ) as s:
            out["past"] = await s.call_tool("charge", {"amount": 5}, meta=meta)
            out["again"] = await s.call_tool("charge", {"amount": 5}, meta=meta)
        return out

    out = run_async(go)
    assert out["within"].meta["toolledger/status"] == "approved", out["within"]
    assert out["past"].meta["toolledger/status"] == "failed", out["past"]
    assert out["past"].is_error
    assert "no longer lists the tool 'charge'" in out["past"].content[0].text
    assert out["again"] == out["past"]
    assert world.ledger().receipt(scope, "n1").status.value == "failed"
    assert invocations(log) == []  # never sent


#: An upstream speaking JSON-RPC by hand: its one tool, ``charge``, logged to ``argv[1]`` and
#: answered with a ``result`` of null (JSON-RPC allows any value; MCP wants an object).
_NULL_RESULT_UPSTREAM = """
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message or "method" not in message:
        continue
    method, result = message["method"], {}
    if method == "initialize":
        result = {"protocolVersion": message["params"]["protocolVersion"],
                  "capabilities": {"tools": {}}, "serverInfo": {"name": "raw", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": [{"name": "charge", "inputSchema": {"type": "object"}}]}
    elif method == "tools/call":
        with open(sys.argv[1], "a") as log:
            log.write(json.dumps(message["params"]) + "\\n")
        result = None
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
"""


def test_proxy__an_upstream_answer_the_sdk_cannot_read_is_recorded_unknown_at_once(
    world: Stack, tmp_path: Path
) -> None:
    """An upstream answered a call with ``"result": null``: the SDK's reader dropped the
    answer, and the forward waited out ``--time-limit`` (an hour by default), its lease
    renewed, while every ask was answered "running" (a cold review). The answer is taken
    for an error of the request it names: the call is recorded unknown at once (the
    upstream answered: whether it ran is not known), never sent again, and the proxy goes
    on."""
    log = tmp_path / "upstream.log"
    scope = scope_of("null-result")
    argv = ["proxy", "--timeout", "5", "--", sys.executable, "-c", _NULL_RESULT_UPSTREAM, str(log)]

    async def go() -> list[Any]:
        async with mcp_server(world, *argv) as s:
            first = await s.call_tool("charge", {}, meta={ID: "c1", SCOPE: scope})
            again = await s.call_tool("charge", {}, meta={ID: "c1", SCOPE: scope})
            await s.send_ping()
            return [first, again]

    first, again = run_async(go)
    assert first.meta["toolledger/status"] == "unknown", first
    assert first.is_error and again == first
    assert len(invocations(log)) == 1  # sent once
    events = world.ledger().events(scope, "c1")
    assert any("could not be read" in json.dumps(e.detail) for e in events), events


def test_proxy__the_agents_sdks_retry_of_a_call_named_by_mcp_call_meta_is_sent_once(
    world: Stack, tmp_path: Path
) -> None:
    """The OpenAI Agents SDK's own MCP client gives a request 5 s by default and, with
    ``max_retry_attempts``, sends a call that timed out again as a new JSON-RPC request: to
    the proxy a new call, and the upstream charged twice (a cold review). Named by
    ``mcp_call_meta`` (the SDK's tool call id in ``_meta``), the retry is the same call: sent
    upstream once, and the run gets its result."""
    pytest.importorskip("agents")
    from agents.mcp import MCPServerStdio
    from agents.mcp.util import MCPUtil
    from agents.tool_context import ToolContext

    from toolledger.openai_agents import mcp_call_meta

    log, release = tmp_path / "upstream.log", tmp_path / "release"
    scope = scope_of("agents-mcp")
    env = {
        **world.env(),
        "MCP_UPSTREAM_LOG": str(log),
        "MCP_UPSTREAM_RELEASE": str(release),
        "MCP_UPSTREAM_CANCELS": str(tmp_path / "cancels"),
    }
    params = {"command": sys.executable, "args": [*toolledger_argv()[1:], "mcp", *proxy_argv()],
              "env": env, "cwd": str(ROOT)}  # fmt: skip

    async def go() -> Any:
        server = MCPServerStdio(
            params=params,  # type: ignore[arg-type]
            client_session_timeout_seconds=2,  # the SDK's 5 s, shorter
            max_retry_attempts=1,
            retry_backoff_seconds_base=1.0,
            tool_meta_resolver=mcp_call_meta(scope),
        )
        async with server:
            (tool,) = [t for t in await server.list_tools() if t.name == "wait_charge"]
            ctx = ToolContext(context=None, tool_name="wait_charge", tool_call_id="call_1",
                              tool_arguments='{"amount": 3}')  # fmt: skip
            # released after the first request timed out: the retry waits for the result
            threading.Timer(4, release.touch).start()
            with anyio.fail_after(60):
                return await MCPUtil.invoke_mcp_tool(server, tool, ctx, '{"amount": 3}')

    out = run_async(go)
    calls = invocations(log)
    assert len(calls) == 1, calls  # twice without the id: the retry was a new call
    assert calls[0]["meta"]["toolledger/service_key"] == f"{scope}/mcp.wait_charge:call_1"
    assert "charged 3" in json.dumps(out, default=str)


def test_proxy__an_upstream_tools_meta_never_names_the_calls_a_host_sends_with_it(
    world: Stack, tmp_path: Path
) -> None:
    """The OpenAI Agents SDK sends a listed tool's ``_meta`` with each of its calls, over its
    own keys (``mcp_call_meta``'s). An upstream that listed ``toolledger/tool_call_id`` there
    named every call alike: the second call, another action, was answered the first's
    result, never sent (a cold review). The proxy lists the upstream's ``_meta`` without keys
    under ``toolledger/``, as it passes on a result's."""
    pytest.importorskip("agents")
    from agents.mcp import MCPServerStdio
    from agents.mcp.util import MCPUtil
    from agents.tool_context import ToolContext

    from toolledger.openai_agents import mcp_call_meta

    log = tmp_path / "upstream.log"
    scope = scope_of("tool-meta")
    forged = {ID: "forged", SCOPE: scope_of("forged"), "example.com/owner": "upstream"}
    env = {**world.env(), "MCP_UPSTREAM_LOG": str(log),
           "MCP_UPSTREAM_TOOL_META": json.dumps(forged)}  # fmt: skip
    params = {"command": sys.executable, "args": [*toolledger_argv()[1:], "mcp", *proxy_argv()],
              "env": env, "cwd": str(ROOT)}  # fmt: skip

    async def go() -> tuple[Any, list[Any]]:
        server = MCPServerStdio(params=params, tool_meta_resolver=mcp_call_meta(scope))  # type: ignore[arg-type]
        async with server:
            (tool,) = [t for t in await server.list_tools() if t.name == "charge"]
            # as an Agent's run invokes it: the tool's _meta sent with each call
            function_tool = MCPUtil.to_function_tool(tool, server, False)
            out = []
            for call_id in ("call_1", "call_2"):  # two actions, equal arguments
                ctx = ToolContext(context=None, tool_name="charge", tool_call_id=call_id,
                                  tool_arguments='{"amount": 3}')  # fmt: skip
                with anyio.fail_after(60):
                    out.append(await function_tool.on_invoke_tool(ctx, '{"amount": 3}'))
            return tool, out

    tool, _out = run_async(go)
    assert tool.meta == {"example.com/owner": "upstream"}  # the upstream's own, listed
    keys = [c["meta"]["toolledger/service_key"] for c in invocations(log)]
    assert keys == [f"{scope}/mcp.charge:call_1", f"{scope}/mcp.charge:call_2"], keys


def test_proxy__a_call_cancelled_by_its_host_is_still_sent_once_recorded(
    world: Stack, tmp_path: Path
) -> None:
    """A host cancelling a call (``notifications/cancelled``) right after sending it: cut
    between its submit and its claim, 11 of 60 stayed approved, never sent, and the sweep's
    re-publishing then had a worker fail them "unknown tool" (a cold review). Every call
    recorded is now sent: none is left approved."""
    from toolledger.ledger.transitions import Status

    log = tmp_path / "upstream.log"
    scope = scope_of("cancel")
    lines: list[str | dict[str, Any]] = [HELLO, INITIALIZED]
    for n in range(100, 140):
        params = {
            "name": "charge",
            "arguments": {"amount": n},
            "_meta": {ID: f"k{n}", SCOPE: scope},
        }
        lines.append({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": params})
        cancel = {"requestId": n, "reason": "the host gave up"}
        lines.append({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": cancel})
    env = {**world.env(), "MCP_UPSTREAM_LOG": str(log)}
    with raw_host(world, proxy_argv(), env, read=False) as host:
        for line in lines:
            host.send(line)
            time.sleep(0.002)
        time.sleep(3)
        host.send(close=True)
        host.proc.wait(60)
    ledger = Ledger(world.db)
    try:
        calls = ledger.list_calls(scope=scope, limit=0)
        left = [c.tool_call_id for c in calls if c.status is Status.APPROVED]
        assert not left, left
        assert len(invocations(log)) == len(calls)  # each recorded call sent, once
    finally:
        ledger.close()


def test_proxy__arguments_the_upstream_schema_refuses_are_refused_with_nothing_recorded(
    world: Stack, tmp_path: Path
) -> None:
    """Recorded and forwarded, a call with arguments the upstream's own inputSchema refuses
    would spend its key on a call that can never run. It is refused in one line instead,
    before anything is recorded or sent; the same id with good arguments then runs."""
    log = tmp_path / "upstream.log"
    scope = scope_of("schema")

    async def go() -> list[Any]:
        async with mcp_server(world, *proxy_argv(), MCP_UPSTREAM_LOG=str(log)) as s:
            return [
                await s.call_tool("charge", {"amount": "five"}, meta={ID: "s1", SCOPE: scope}),
                await s.call_tool("charge", {}, meta={ID: "s1", SCOPE: scope}),
                await s.call_tool("charge", {"amount": 5}, meta={ID: "s1", SCOPE: scope}),
            ]

    wrong_type, missing, good = run_async(go)
    assert wrong_type.is_error and wrong_type.meta is None
    (text,) = [b.text for b in wrong_type.content]
    assert (
        text
        == "arguments refused by 'charge''s inputSchema at 'amount': 'five' is not of type 'integer'"
    )
    assert missing.is_error and "'amount' is a required property" in missing.content[0].text
    assert good.meta["toolledger/status"] == "succeeded"  # the id was not spent
    assert [c["arguments"] for c in invocations(log)] == [{"amount": 5}]


#: An ``anyOf`` of two over a ``$ref`` cycle: each level of a list that fails at its leaf is
#: tried twice, 2^depth keywords applied (30 levels: days of a core).
RECURSIVE = {"type": "object", "properties": {"t": {"$ref": "#/$defs/n"}},
             "$defs": {"n": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/n"}},
                                       {"type": "array", "items": {"$ref": "#/$defs/n"}}]}}}  # fmt: skip


def deep_call(scope: str, depth: int = 30) -> dict[str, Any]:
    """``deep`` called with a list ``depth`` levels deep, around a leaf RECURSIVE refuses."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    params = {"name": "deep", "arguments": {"t": value}, "_meta": {ID: "d1", SCOPE: scope}}
    return {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}


def cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def test_proxy__a_recursive_schema_past_the_check_bound_is_refused_then_burns_nothing_and_exits(
    world: Stack, tmp_path: Path
) -> None:
    """Refused at the check's 5 s, a call of a recursive schema's tool went on being checked:
    the proxy burnt a core after the refusal, and after its host closed stdin it still ran,
    its exit waiting for a check of hours (a cold review). The check stops at its bound now:
    the CPU it burns with it, and the proxy exits once its stdin closes."""
    log = tmp_path / "upstream.log"
    env = {**world.env(), "MCP_UPSTREAM_LOG": str(log),
           "MCP_UPSTREAM_SCHEMA": json.dumps(RECURSIVE)}  # fmt: skip
    with raw_host(world, proxy_argv(), env, kill_after=120) as host:
        host.hello()
        began = time.monotonic()
        host.send(deep_call(scope_of("deep")))
        reply = host.reply()
        took = time.monotonic() - began
        time.sleep(1.0)  # the check's next step is past its deadline: it has ended by now
        before = cpu_seconds(host.proc.pid)
        time.sleep(2.0)
        burnt = cpu_seconds(host.proc.pid) - before
        host.send(close=True)
        closed = time.monotonic()
        try:
            code: int | None = host.proc.wait(20)
        except subprocess.TimeoutExpired:
            code = None
        exit_took = time.monotonic() - closed
    seen = (
        f"refused after {took:.1f} s, {burnt:.2f} CPU s in 2 s after, exit after {exit_took:.1f} s"
    )
    (text,) = [b["text"] for b in reply["result"]["content"]]
    assert reply["result"]["isError"] and text == (
        "arguments could not be checked against 'deep''s inputSchema within 5 s: refused"
    ), seen
    assert took < 15, seen
    assert burnt < 0.5, seen
    assert code == 0, seen  # not "still running 20 s after its stdin closed"
    assert invocations(log) == []


def test_proxy__sigterm_mid_check_of_a_recursive_schema_stops_it_at_once(
    world: Stack, tmp_path: Path
) -> None:
    """SIGTERM while a recursive schema's check ran: the check went on in its thread, and
    the proxy's exit waited for it, for hours (a cold review). The check is cut short as the
    proxy stops: it exits as a proxy with nothing to check does."""
    env = {**world.env(), "MCP_UPSTREAM_LOG": str(tmp_path / "upstream.log"),
           "MCP_UPSTREAM_SCHEMA": json.dumps(RECURSIVE)}  # fmt: skip
    with raw_host(world, proxy_argv(), env, kill_after=120) as host:
        host.hello()
        host.send(deep_call(scope_of("deep-term")))
        time.sleep(1.0)  # within the check's 5 s
        host.proc.terminate()
        stopped = time.monotonic()
        try:
            code: int | None = host.proc.wait(20)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - stopped
    assert code is not None and took < 10, f"still running {took:.1f} s after SIGTERM"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped has stopped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def unknown_event(world: Stack, scope: str, tool_call_id: str) -> Any:
    ledger = Ledger(world.db)
    try:
        (ex,) = ledger.get(scope, tool_call_id).executions
        (marked,) = [e for e in ledger.events(scope, tool_call_id) if e.kind == "unknown"]
        return ex, marked
    finally:
        ledger.close()


def test_proxy__an_upstream_that_never_answers_is_cancelled_at_the_time_limit_and_unknown(
    world: Stack, tmp_path: Path
) -> None:
    """Without a limit, a hung upstream kept the call running forever (its lease renewed,
    out of the sweep's reach). With ``--time-limit 1`` the call is unknown at once, said by
    the proxy, and the proxy serves on."""
    log, release = tmp_path / "upstream.log", tmp_path / "release"
    scope = scope_of("hung")
    env = {"MCP_UPSTREAM_LOG": str(log), "MCP_UPSTREAM_RELEASE": str(release)}

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with mcp_server(
            world, *proxy_argv("--time-limit", "1", "--timeout", "20"), **env
        ) as s:
            started = time.monotonic()
            with anyio.fail_after(30):
                out["hung"] = await s.call_tool(
                    "slow_charge", {"amount": 3}, meta={ID: "h1", SCOPE: scope}
                )
            out["took"] = time.monotonic() - started
            release.touch()  # the upstream (blocked, not reading) can go on
            with anyio.fail_after(30):
                out["next"] = await s.call_tool(
                    "charge", {"amount": 4}, meta={ID: "h2", SCOPE: scope}
                )
            out["again"] = await s.call_tool(
                "slow_charge", {"amount": 3}, meta={ID: "h1", SCOPE: scope}
            )
        return out

    out = run_async(go)
    hung = out["hung"]
    assert hung.is_error and hung.meta["toolledger/status"] == "unknown"
    assert out["took"] < 15  # the limit, not the host's 20 s wait
    assert out["again"] == hung  # replayed, never forwarded again
    assert out["next"].meta["toolledger/status"] == "succeeded"
    assert [c["tool"] for c in invocations(log)] == ["slow_charge", "charge"]
    ex, marked = unknown_event(world, scope, "h1")
    assert ex.status.value == "unknown"
    assert "no answer within the time limit of 1 s" in marked.detail["reason"]
    assert marked.actor.startswith("mcp-proxy@")  # the proxy said so, no sweep


def sigterm_mid_forward(
    world: Stack, env: dict[str, str], log: Path, tool: str, scope: str, pids: dict[str, int]
) -> dict[str, Any]:
    """``tool`` called as ``t1`` through a proxy, which gets SIGTERM once the upstream has the
    call; then until the proxy and the upstream are gone (20 s at most). What the call got
    (``result`` or ``error``) and whether each process is still alive; ``pids`` filled in for
    the caller's cleanup."""

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with mcp_server(world, *proxy_argv(), **env) as s:

            async def call() -> None:
                try:
                    out["result"] = await s.call_tool(
                        tool, {"amount": 9}, meta={ID: "t1", SCOPE: scope}
                    )
                except Exception as exc:  # noqa: BLE001 - the proxy went away
                    out["error"] = exc

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    while not invocations(log):
                        await anyio.sleep(0.05)
                    (line,) = invocations(log)
                    pids.update(upstream=line["pid"], proxy=line["ppid"])
                    os.kill(line["ppid"], signal.SIGTERM)
                    deadline = time.monotonic() + 20
                    while (alive(pids["proxy"]) or alive(pids["upstream"])) and (
                        time.monotonic() < deadline
                    ):
                        await anyio.sleep(0.05)
                    out["proxy_alive"] = alive(pids["proxy"])
                    out["upstream_alive"] = alive(pids["upstream"])
                    tg.cancel_scope.cancel()
        return out

    return run_async(go)


def test_proxy__sigterm_mid_forward_records_the_call_unknown_and_stops_the_upstream(
    world: Stack, tmp_path: Path
) -> None:
    """SIGTERM used to end the proxy at once: the call stayed running until a sweep, and an
    upstream that does not read its stdin ran on, orphaned. Now the proxy records the call
    unknown itself and takes its upstream down with it."""
    log, release = tmp_path / "upstream.log", tmp_path / "release"
    scope = scope_of("term")
    env = {"MCP_UPSTREAM_LOG": str(log), "MCP_UPSTREAM_RELEASE": str(release)}
    pids: dict[str, int] = {}
    try:
        out = sigterm_mid_forward(world, env, log, "slow_charge", scope, pids)
        assert "result" not in out or out["result"].meta["toolledger/status"] == "unknown"
        assert not out["proxy_alive"]
        assert not out["upstream_alive"]  # stopped with its proxy, though it reads nothing
        ex, marked = unknown_event(world, scope, "t1")
        assert ex.status.value == "unknown"  # at once, by the proxy: no lease to wait out
        assert "the proxy was stopped while the upstream ran it" in marked.detail["reason"]
        assert marked.actor.startswith("mcp-proxy@")
        assert len(invocations(log)) == 1
    finally:
        release.touch()
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def unread(pipe: Any) -> int:
    """Bytes waiting in ``pipe``, unread."""
    return struct.unpack("i", fcntl.ioctl(pipe.fileno(), termios.FIONREAD, b"\0" * 4))[0]


def fill_its_stdout(host: RawHost) -> None:
    """Thousands of pings, their answers never read, until the process's stdout pipe is
    full and its write blocked in it (a hung host: it writes but no longer reads)."""
    pings = [{"jsonrpc": "2.0", "id": n, "method": "ping"} for n in range(2, 5002)]

    def flood() -> None:  # blocks once the process stops reading; broken once it has exited
        with contextlib.suppress(BrokenPipeError):
            host.send(*pings)

    threading.Thread(target=flood, daemon=True).start()
    assert host.proc.stdout is not None
    deadline, waiting = time.monotonic() + 60, [-1, 0]
    while waiting[-5:] != [waiting[-1]] * 5 and time.monotonic() < deadline:
        time.sleep(0.5)  # until nothing more gets into the pipe for 2 s
        waiting.append(unread(host.proc.stdout))
    assert waiting[-1] > 60_000, waiting  # a 64 KiB pipe, full


def test_proxy__sigterm_stops_it_while_the_host_reads_none_of_its_output(
    world: Stack, tmp_path: Path
) -> None:
    """A host that writes but no longer reads (hung on its side): thousands of pings fill the
    proxy's stdout pipe. SIGTERM left the proxy and its upstream running until the host read
    again (a cold review): the SDK wrote stdout from a worker thread no cancellation stops.
    The proxy and its upstream are gone soon after SIGTERM now, the host still not reading."""
    from toolledger.harness.processes import children_of

    env = {**world.env(), "MCP_UPSTREAM_LOG": str(tmp_path / "upstream.log")}
    with raw_host(world, proxy_argv(), env, kill_after=120) as host:
        host.hello()
        (upstream,) = children_of(host.proc.pid)
        fill_its_stdout(host)
        host.proc.terminate()
        try:
            code: int | None = host.proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        upstream_alive = alive(upstream)
    assert code is not None, "still running 30 s after SIGTERM"
    assert not upstream_alive


@pytest.mark.parametrize(
    ("signum", "exit_codes"),
    # SIGINT: 130, or 1 when the unwinding meets a message on its way (the SDK's relay
    # raises BrokenResourceError, the KeyboardInterrupt is lost in its ExceptionGroup): a race
    # of its own, as often with the host reading, not this test's matter
    [(signal.SIGTERM, {-signal.SIGTERM}), (signal.SIGINT, {130, 1})],
    ids=["SIGTERM", "SIGINT"],
)
def test_serve__a_stop_signal_ends_it_while_the_host_reads_none_of_its_output(
    world: Stack, signum: signal.Signals, exit_codes: set[int]
) -> None:
    """The proxy's block (a write stuck in a full stdout pipe held the stop: see the proxy's
    test above), asked of ``serve``, whose host is as likely to hang. SIGTERM ends it at once:
    ``serve`` catches no SIGTERM, so nothing has to unwind past the stuck write (a handler
    that cancels, as the proxy's does, would need StdoutLines too). SIGINT (Ctrl-C reaches a
    host's children too) unwinds, and left serve running until the host read again (still up
    90 s after it); it writes through StdoutLines now, and exits as with its stdout read.
    Bounded at 15 s, then killed: a process held by the write never exits."""
    with raw_host(world, ["serve"], kill_after=120) as host:
        host.hello()
        fill_its_stdout(host)
        stopped = time.monotonic()
        host.proc.send_signal(signum)
        try:
            code: int | None = host.proc.wait(15)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - stopped
    assert code is not None, f"still running 15 s after {signum.name}, its stdout unread"
    assert code in exit_codes, (code, took)  # as with its stdout read


#: ``mcp serve`` whose publishes each write (to the file ``argv[1]``) the Celery, kombu and
#: amqp modules imported while they ran.
_COUNTING_SERVE = (
    COUNT_PUBLISH_IMPORTS
    + """
sys.argv = ["toolledger", "mcp", "serve"]
from toolledger.entry import main
main()
"""
)


def test_serve__the_first_calls_publish_imports_nothing_between_its_commit_and_its_send(
    world: Stack, tmp_path: Path
) -> None:
    """A new ``serve``'s first call imported Celery, its amqp and events parts and the
    broker's transport (~380 modules, 1.2-1.4 s) between its commit and its publish: a host
    that killed the server then (11 of 12 SIGKILLs 0-0.8 s after the call) left the call
    approved and unpublished, and a server started again within 5 s answered it "approved"
    after its whole --timeout, the sweep publishing it 120 s later (a cold review). They are
    imported while the host starts its session, calls waiting on them: the publish imports
    none of them."""
    imported = tmp_path / "imported.jsonl"
    scope = scope_of("warm")
    call = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
        "name": "write_file", "arguments": {"path": "w.txt", "content": "x"},
        "_meta": {ID: "first", SCOPE: scope}}}  # fmt: skip
    with (world.root / "mcp-stderr.log").open("a") as errlog:
        proc = subprocess.Popen(
            [sys.executable, "-c", _COUNTING_SERVE, str(imported)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errlog,
            env=world.env(),
            cwd=ROOT,
        )
        killer = threading.Timer(90, proc.kill)
        killer.start()
        try:
            host = RawHost(proc)
            host.hello()
            host.send(call, close=True)
            reply = host.reply()
            assert proc.wait(60) == 0
        finally:
            killer.cancel()
            proc.kill()
            proc.wait()
    assert reply["result"]["_meta"]["toolledger/status"] == "succeeded", reply
    assert [json.loads(line) for line in imported.read_text().splitlines()] == [[]]


def test_serve__a_read_only_tool_is_bounded_by_the_timeout(world: Stack, tmp_path: Path) -> None:
    """helper-93: a read-only tool ran inline in the submit, past ``--timeout`` (an 8 s read
    answered after 8 s with --timeout 2), and held serve's exit after stdin closed. It runs
    apart now, given up at the timeout with an answer that says so."""
    done = tmp_path / "read-done"

    async def go() -> Any:
        async with mcp_server(
            world, "serve", "--timeout", "2", TOOLLEDGER_TOOLS="tests.external_tools"
        ) as s:
            with anyio.fail_after(30):
                result = await s.call_tool(
                    "slow_read", {"seconds": 8, "done_file": str(done)},
                    meta={ID: "r1", SCOPE: scope_of("ro")},
                )  # fmt: skip
            return result, done.exists()

    result, finished = run_async(go)
    assert not finished  # answered before the read ended
    assert result.is_error and "did not finish within 2 s" in result.content[0].text, result

    async def at_once() -> Any:  # --timeout 0: a read's result in hand, not bounded by it
        async with mcp_server(
            world, "serve", "--timeout", "0", TOOLLEDGER_TOOLS="tests.external_tools"
        ) as s:
            with anyio.fail_after(30):
                return await s.call_tool(
                    "slow_read", {"seconds": 0.2, "done_file": str(done) + "0"},
                    meta={ID: "r0", SCOPE: scope_of("ro")},
                )  # fmt: skip

    result = run_async(at_once)
    assert not result.is_error and result.structured_content["slept"] == 0.2, result


def test_proxy__sigterm_cancels_the_forward_upstream_as_its_record_says(
    world: Stack, tmp_path: Path
) -> None:
    """helper-93: at SIGTERM the call was recorded "cancelled upstream", but the upstream
    never got a ``notifications/cancelled``: the whole run was cancelled at once, the SDK's
    writer with it. The forwards are cancelled first now, the rest a moment later."""
    log, release, cancels = tmp_path / "upstream.log", tmp_path / "release", tmp_path / "cancels"
    scope = scope_of("termc")
    env = {"MCP_UPSTREAM_LOG": str(log), "MCP_UPSTREAM_RELEASE": str(release),
           "MCP_UPSTREAM_CANCELS": str(cancels)}  # fmt: skip
    pids: dict[str, int] = {}
    try:
        sigterm_mid_forward(world, env, log, "wait_charge", scope, pids)
        assert invocations(cancels), "no notifications/cancelled reached the upstream"
        _, marked = unknown_event(world, scope, "t1")
        assert "cancelled upstream" in marked.detail["reason"]
    finally:
        release.touch()
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_proxy__tool_names_with_the_dot_and_slash_mcp_allows(world: Stack, tmp_path: Path) -> None:
    """SEP-986 allows '.' and '/' in a tool name (its examples: admin.tools.list,
    user-profile/update) and 1 to 128 characters; the proxy refused to start on such an
    upstream (on a dot or a slash until 12-05, past 60 characters until migration 0006)."""
    from tests.integration.mcp_upstream import SPEC_NAMES

    log = tmp_path / "upstream.log"
    scope = scope_of("names")
    env = {"MCP_UPSTREAM_LOG": str(log), "MCP_UPSTREAM_SPEC_NAMES": "1"}
    assert len(SPEC_NAMES[-1]) == 128

    async def go() -> list[Any]:
        async with mcp_server(world, *proxy_argv(), **env) as s:
            listed = {t.name for t in (await s.list_tools()).tools}
            assert set(SPEC_NAMES) <= listed
            return [
                await s.call_tool(name, {"amount": 1}, meta={ID: f"n{i % 3}", SCOPE: scope})
                for i, name in enumerate(SPEC_NAMES * 2)
            ]

    results = run_async(go)
    assert [r.is_error for r in results] == [False] * 6 and results[3:] == results[:3]
    assert [c["tool"] for c in invocations(log)] == list(SPEC_NAMES)
    ledger = Ledger(world.db)
    try:
        assert ledger.get(scope, "n1").operation.tool == "mcp.user-profile/update"
        assert ledger.get(scope, "n1").operation.idempotency_key == "mcp.user-profile/update:n1"
        assert ledger.get(scope, "n2").operation.tool == "mcp." + SPEC_NAMES[-1]
    finally:
        ledger.close()


def test_proxy__refuses_upstream_tools_it_cannot_record(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLLEDGER_")}
    env.update(
        TOOLLEDGER_HOME=str(tmp_path / "home"),
        MCP_UPSTREAM_LOG=str(tmp_path / "upstream.log"),
    )

    def run(*argv: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*toolledger_argv(), "mcp", *argv],
            env={**env, **extra},
            input="",
            capture_output=True,
            text=True,
            timeout=120,
        )

    bad = run(*proxy_argv(), MCP_UPSTREAM_BAD_NAME="1")
    assert bad.returncode == 2, bad.stderr
    assert "'bad name' is not a toolledger tool name" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    unknown = run(*proxy_argv("--idempotent", "nope"))
    assert unknown.returncode == 2 and "--idempotent 'nope'" in unknown.stderr
    missing = run("proxy", "--", str(tmp_path / "no-such-server"))
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    # a tools/list that never ends, or never answers, stopped the start for ever
    # (the pages' cases get a long start timeout: 100 round trips with a Python upstream took
    # over 2 s on a loaded 2-core CI machine, and the timeout, not the page limit, spoke)
    for pages, timeout, says in (
        ("same", "60", "gave the cursor 'again' twice"),
        ("endless", "60", "has more than 100 pages"),
        ("silent", "2", "did not answer within 2 s"),
    ):
        stuck = run(*proxy_argv("--start-timeout", timeout), MCP_UPSTREAM_PAGES=pages)
        assert stuck.returncode == 1 and says in stuck.stderr, (pages, stuck.stderr)
        assert "Traceback" not in stuck.stderr
    assert not (tmp_path / "upstream.log").exists()  # nothing was called


# ------------------------------------------------------------------------------ the rest


def test_cli__help_does_not_import_mcp() -> None:
    code = (
        "import sys\n"
        "from toolledger.cli import cli\n"
        "try:\n    cli.main(['--help'], standalone_mode=False)\n"
        "except SystemExit:\n    pass\n"
        "assert not [m for m in sys.modules if m == 'mcp' or m.startswith('mcp.')], 'mcp loaded'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert " mcp " in done.stdout
    sub = subprocess.run(
        [*toolledger_argv(), "mcp", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "serve" in sub.stdout and "proxy" in sub.stdout


def test_example_mcp_session__runs_then_replays_without_running_again(world: Stack) -> None:
    scope = scope_of("example")
    argv = [sys.executable, str(ROOT / "examples" / "mcp_session.py"), "--scope", scope]
    first = subprocess.run(
        argv, env=world.env(), capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["replayed"] is True and out["first"]["isError"] is False
    assert out["tools"]["append_file"]["destructiveHint"] is True
    again = subprocess.run(
        argv, env=world.env(), capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert again.returncode == 0 and again.stdout == first.stdout  # the same answers
    assert (world.sandbox / scope / "notes.txt").read_text() == "hello from MCP\n"  # once
