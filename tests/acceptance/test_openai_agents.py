"""The OpenAI Agents SDK adapter against a real worker (embedded SQLite, offline: a scripted
model): a run's tool call has one effect, and the same turn run again after a crash gets the
first receipt back without running the tool; an approval-gated call pauses the run, and the
resumed run after ``RunState.approve`` has one effect; a call without a receipt in time is
answered with its status; the example runs, then replays."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CI

if not CI:  # under CI=true the extra must be installed: a missing one fails the import below
    pytest.importorskip("agents")

from agents import Agent, RunConfig, Runner
from agents.exceptions import AgentsException

from examples.openai_agents_loop import ScriptedModel
from tests.acceptance.conftest import Stack, landed
from toolledger import AsyncClient, Client
from toolledger.config import Settings
from toolledger.openai_agents import calls_waiting, ledger_function_tools, strict_schema_ok

ROOT = Path(__file__).resolve().parents[2]
NO_TRACE = RunConfig(tracing_disabled=True)


def always(*_: Any) -> str:
    return "policy"


APPEND = ("call_a1", "append_file", {"path": "notes/log.txt", "content": "once\n"})


async def one_turn(world: Stack, scope: str, approve: Any = always) -> tuple[Any, ScriptedModel]:
    model = ScriptedModel([APPEND])
    async with AsyncClient(world.settings()) as client:
        tools = ledger_function_tools(client, scope=scope, approve=approve, timeout=60)
        agent = Agent(name="t", model=model, tools=list(tools))
        result = await Runner.run(agent, "go", run_config=NO_TRACE)
    return result, model


def executions(world: Stack, scope: str, call_id: str) -> int:
    ledger = world.ledger()
    try:
        return len(ledger.get(scope, call_id).executions)
    finally:
        ledger.close()


def test_run__one_effect_then_replay_returns_the_first_receipt(world: Stack) -> None:
    first, model1 = asyncio.run(one_turn(world, "conv-1"))
    assert first.final_output == "Done: 1 tool results."
    log = world.sandbox / "conv-1" / "notes" / "log.txt"
    assert landed(log) == "once\n"
    seen_first = model1.seen["call_a1"]
    with Client(world.settings()) as client:
        receipt = client.receipt("conv-1", "call_a1")
    assert receipt is not None and receipt.text == seen_first and not receipt.is_error
    # "crash" and resume: the same scripted turn, same call id, same scope
    again, model2 = asyncio.run(one_turn(world, "conv-1"))
    assert again.final_output == first.final_output
    assert model2.seen["call_a1"] == seen_first  # the model saw the first receipt
    assert landed(log) == "once\n"  # appended once
    assert executions(world, "conv-1", "call_a1") == 1


def test_sync_client_and_scope_from_the_run_context(world: Stack) -> None:
    async def go() -> ScriptedModel:
        model = ScriptedModel([APPEND])
        with Client(world.settings()) as client:
            tools = ledger_function_tools(
                client, scope=lambda ctx: f"ctx-{ctx.context['session']}", approve=always
            )
            agent: Agent[Any] = Agent(name="t", model=model, tools=list(tools))
            await Runner.run(agent, "go", context={"session": "s1"}, run_config=NO_TRACE)
        return model

    model = asyncio.run(go())
    assert json.loads(model.seen["call_a1"])["path"] == "notes/log.txt"
    assert landed(world.sandbox / "ctx-s1" / "notes" / "log.txt") == "once\n"


def test_approval__pauses_the_run_and_resumes_with_one_effect(world: Stack) -> None:
    async def go() -> tuple[Any, Any, ScriptedModel]:
        model = ScriptedModel([APPEND])
        async with AsyncClient(world.settings()) as client:
            tools = ledger_function_tools(client, scope="conv-2", approve=None)
            agent = Agent(name="t", model=model, tools=list(tools))
            paused = await Runner.run(agent, "go", run_config=NO_TRACE)
            assert len(paused.interruptions) == 1
            assert paused.interruptions[0].raw_item.call_id == "call_a1"  # type: ignore[union-attr]
            with pytest.raises(Exception):  # noqa: B017 - nothing recorded while paused
                client.sync.status("conv-2", "call_a1")
            state = paused.to_state()
            state.approve(paused.interruptions[0])
            resumed = await Runner.run(agent, state, run_config=NO_TRACE)
        return paused, resumed, model

    _paused, resumed, model = asyncio.run(go())
    assert resumed.final_output == "Done: 1 tool results."
    assert landed(world.sandbox / "conv-2" / "notes" / "log.txt") == "once\n"
    assert executions(world, "conv-2", "call_a1") == 1
    ledger = world.ledger()
    try:
        op = ledger.get("conv-2", "call_a1").operation
    finally:
        ledger.close()
    assert op.decided_by == "openai-agents"
    # a replay after a crash needs no second approval: the ledger already has the call
    again, model2 = asyncio.run(one_turn(world, "conv-2", approve=None))
    assert not again.interruptions
    assert model2.seen["call_a1"] == model.seen["call_a1"]
    assert executions(world, "conv-2", "call_a1") == 1


def test_schema__strict_only_when_every_property_is_required() -> None:
    assert strict_schema_ok(
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    )
    assert not strict_schema_ok(
        {"type": "object", "properties": {"a": {"type": "string", "default": "x"}}}
    )


def test_example__runs_then_replays_without_running_again(world: Stack) -> None:
    argv = [sys.executable, str(ROOT / "examples" / "openai_agents_loop.py"), "--scope", "ex"]
    env = world.env()
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["final_output"] == "Done: 2 tool results."
    assert set(out["tool_outputs"]) == {"call_1", "call_2"}
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0 and again.stdout == first.stdout  # replayed, same bytes
    assert landed(world.sandbox / "ex" / "report" / "log.txt") == "checked\n"
    assert landed(world.sandbox / "ex" / "report" / "summary.txt") == "all good\n"


def test_example__a_pause_is_reported_not_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A call its policy does not approve pauses the run: the example printed final_output
    null and exited 0, the pause unsaid (a cold review); it says "paused: …", exit status 1."""
    import examples.openai_agents_loop as example

    for name, value in {
        "DB": f"sqlite:///{tmp_path / 'l.db'}",
        "HOME": str(tmp_path),
        "SANDBOX": str(tmp_path / "sb"),
        "BROKER": "redis://127.0.0.1:1/0",  # nothing submitted while paused: no worker
    }.items():
        monkeypatch.setenv(f"TOOLLEDGER_{name}", value)
    outside = ("call_x", "append_file", {"path": "outside/log.txt", "content": "x\n"})
    monkeypatch.setattr(example, "CALLS", [outside])
    with pytest.raises(SystemExit) as stopped:
        example.main(["--scope", "ex-pause"])
    assert str(stopped.value.code).startswith("paused: 1 call(s) wait for the SDK's approval: "
                                              "'call_x'"), stopped.value.code  # fmt: skip
    assert capsys.readouterr().out == ""  # no final output printed


@pytest.mark.parametrize("policy", [None, always], ids=["no-policy", "approving-policy"])
def test_recorded_earlier_and_waiting_for_a_person__the_run_pauses_as_for_a_new_call(
    world: Stack, policy: Any
) -> None:
    """A call already in the ledger, pending a person's approval: the model is told nothing
    (DESIGN §6); the run pauses with the SDK's own interruption, which keeps the model's call
    id, and the SDK's approval approves it in the ledger: one effect, the model's own id.
    An approving policy does not decide it: the policy approved it by its own name, run at
    once, and no person decided (a cold review; run_turn leaves it to the person too)."""
    scope = f"conv-3-{'policy' if policy else 'sdk'}"  # Postgres: one database a module
    with Client(world.settings()) as client:  # recorded earlier, waiting for a person
        client.submit(scope, "call_a1", "append_file", APPEND[2])

    async def go() -> tuple[Any, ScriptedModel]:
        model = ScriptedModel([APPEND])
        async with AsyncClient(world.settings()) as client:
            tools = ledger_function_tools(client, scope=scope, approve=policy)
            agent = Agent(name="t", model=model, tools=list(tools))
            paused = await Runner.run(agent, "go", run_config=NO_TRACE)
            assert [i.raw_item.call_id for i in paused.interruptions] == ["call_a1"]  # type: ignore[union-attr]
            assert client.sync.status(scope, "call_a1") == "pending_approval"
            state = paused.to_state()
            state.approve(paused.interruptions[0])
            return await Runner.run(agent, state, run_config=NO_TRACE), model

    resumed, model = asyncio.run(go())
    assert resumed.final_output == "Done: 1 tool results."
    assert set(model.seen) == {"call_a1"}  # nothing answered while it waited
    assert landed(world.sandbox / scope / "notes" / "log.txt") == "once\n"
    assert executions(world, scope, "call_a1") == 1
    ledger = world.ledger()
    try:
        assert ledger.get(scope, "call_a1").operation.decided_by == "openai-agents"
    finally:
        ledger.close()


def test_recorded_earlier_and_waiting_for_a_person__a_policy_never_approves_it_at_the_call(
    world: Stack,
) -> None:
    """Reached without the SDK's pause (the tool's policy answer forgotten, or the call
    recorded after it was asked), the policy's approval is not applied to a call waiting for
    a person: it waits for that person, as under run_turn."""
    from agents.tool_context import ToolContext

    with Client(world.settings()) as client:  # recorded earlier, waiting for a person
        client.submit("conv-5", "call_a1", "append_file", APPEND[2])
    args = json.dumps(APPEND[2])

    async def go() -> None:
        async with AsyncClient(world.settings()) as client:
            (tool,) = [
                t
                for t in ledger_function_tools(client, scope="conv-5", approve=always, timeout=1)
                if t.name == "append_file"
            ]
            ctx = ToolContext(None, tool_name="append_file", tool_call_id="call_a1",
                              tool_arguments=args)  # fmt: skip
            await tool.on_invoke_tool(ctx, args)

    with pytest.raises(TimeoutError) as stopped:
        asyncio.run(go())
    waiting = calls_waiting(stopped.value)
    assert waiting is not None and waiting.waiting == {"call_a1": "pending_approval"}
    ledger = world.ledger()
    try:
        op = ledger.get("conv-5", "call_a1").operation
    finally:
        ledger.close()
    assert (op.status.value, op.decided_by) == ("pending_approval", None)
    assert executions(world, "conv-5", "call_a1") == 0


def test_an_explicit_timeout__the_run_stops_with_calls_waiting(world: Stack) -> None:
    """With a timeout the run stops (the SDK wraps the error) and the model is told
    nothing; the call itself goes on and ends once."""
    held = ("call_h1", "probe_write", {"path": "held.txt", "content": "h", "hold_ms": 3000})

    async def go() -> None:
        async with AsyncClient(world.settings()) as client:
            tools = ledger_function_tools(client, scope="conv-4", approve=always, timeout=0.3)
            agent = Agent(name="t", model=ScriptedModel([held]), tools=list(tools))
            await Runner.run(agent, "go", run_config=NO_TRACE)

    with pytest.raises(AgentsException) as stopped:
        asyncio.run(go())
    waiting = calls_waiting(stopped.value)
    assert waiting is not None and list(waiting.waiting) == ["call_h1"]
    with Client(world.settings()) as client:
        assert client.wait("conv-4", "call_h1", timeout=60).status.value == "succeeded"
    assert executions(world, "conv-4", "call_h1") == 1


@pytest.mark.parametrize("async_client", [True, False], ids=["async", "sync"])
def test_a_read_only_tool__answers_its_result(tmp_path: Path, async_client: bool) -> None:
    """A read-only call runs at once and is not recorded: its handle holds its receipt. With
    an AsyncClient the tool waited in the ledger instead, and told the model "no call"."""
    settings = Settings.from_env(
        {
            "TOOLLEDGER_DB": f"sqlite:///{tmp_path / 'l.db'}",
            "TOOLLEDGER_HOME": str(tmp_path),
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sb"),
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
        }
    )  # fmt: skip  (no worker: a read-only call needs none)
    (tmp_path / "sb" / "ro").mkdir(parents=True)
    (tmp_path / "sb" / "ro" / "x.txt").write_text("hello from the sandbox")

    async def go() -> ScriptedModel:
        model = ScriptedModel([("call_r1", "read_file", {"path": "x.txt"})])
        client: Any = AsyncClient(settings) if async_client else Client(settings)
        try:
            tools = ledger_function_tools(client, scope="ro", approve=always, timeout=5)
            await Runner.run(Agent(name="t", model=model, tools=list(tools)), "go",
                             run_config=NO_TRACE)  # fmt: skip
        finally:
            await client.close() if async_client else client.close()
        return model

    model = asyncio.run(go())
    assert "hello from the sandbox" in model.seen["call_r1"], model.seen


def test_arguments__read_by_the_input_rules_as_run_turn_and_repair_read_them(
    tmp_path: Path,
) -> None:
    """A key given twice was taken by ``json.loads`` (the last won) and the call ran; then
    ``repair`` and ``run_turn`` refused the transcript holding it (a cold review). Refused at
    once now, nothing recorded."""
    from agents.tool_context import ToolContext

    settings = Settings.from_env(
        {
            "TOOLLEDGER_DB": f"sqlite:///{tmp_path / 'l.db'}",
            "TOOLLEDGER_HOME": str(tmp_path),
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sb"),
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
        }
    )  # fmt: skip  (nothing is published: every call here is refused)
    twice = '{"path": "a.txt", "content": "first", "content": "second"}'

    async def go() -> list[str]:
        said = []
        async with AsyncClient(settings) as client:
            (tool,) = [
                t
                for t in ledger_function_tools(client, scope="dup", approve=always, timeout=5)
                if t.name == "write_file"
            ]
            for i, args in enumerate((twice, "[1]", "{not json")):
                ctx = ToolContext(None, tool_name="write_file", tool_call_id=f"c{i}",
                                  tool_arguments=args)  # fmt: skip
                said.append(str(await tool.on_invoke_tool(ctx, args)))
        return said

    said = asyncio.run(go())
    assert said[0] == "error: arguments: duplicate key 'content' in one object", said
    assert said[1].startswith("error: arguments: must be a JSON object"), said
    assert said[2].startswith("error: arguments: "), said
    from toolledger.ledger.ledger import Ledger

    ledger = Ledger(settings.db)
    try:
        assert ledger.list_calls(scope="dup") == []  # nothing recorded
    finally:
        ledger.close()


@pytest.mark.parametrize("how", ["replace", "assigned"])
def test_the_sdks_own_timeout__refused_before_anything_is_submitted(
    tmp_path: Path, how: str
) -> None:
    """The SDK's ``timeout_seconds`` stops waiting, not the call: the model was told "timed
    out" while the call went on and ran, and it called again under a new id, two effects (a
    cold review). Refused at the call, however it was set, nothing recorded."""
    import dataclasses

    settings = Settings.from_env(
        {
            "TOOLLEDGER_DB": f"sqlite:///{tmp_path / 'l.db'}",
            "TOOLLEDGER_HOME": str(tmp_path),
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sb"),
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
        }
    )  # fmt: skip  (nothing may be submitted: no worker)

    async def go() -> None:
        async with AsyncClient(settings) as client:
            tools = ledger_function_tools(client, scope="sdk-timeout", approve=always)
            if how == "replace":
                tools = [dataclasses.replace(t, timeout_seconds=2.0) for t in tools]
            else:
                for t in tools:
                    t.timeout_seconds = 2.0
            agent = Agent(name="t", model=ScriptedModel([APPEND]), tools=list(tools))
            await Runner.run(agent, "go", run_config=NO_TRACE)

    with pytest.raises(AgentsException) as stopped:
        asyncio.run(go())
    assert "ledger_function_tools(timeout=" in str(stopped.value), stopped.value
    from toolledger.ledger.ledger import Ledger

    ledger = Ledger(settings.db)
    try:
        assert ledger.list_calls(scope="sdk-timeout") == []  # nothing recorded
    finally:
        ledger.close()


@pytest.mark.parametrize("where", ["submit", "wait", "wait-record"])
def test_a_database_error_once_submitted__the_run_stops_with_calls_waiting(
    tmp_path: Path, where: str
) -> None:
    """A database that stops answering during or after the submit (which may have committed):
    the SDK ended the run with an ordinary error, ``calls_waiting`` said None, so nothing
    told the app a call was in flight; the run again made a new id, two effects (a cold
    review). It stops as for a timeout now, the call's status ``unanswered``. A
    ``LedgerError`` once the call is recorded (a record the ledger calls corrupt) ends the run
    as itself: it was handed to the model as a refusal, and "unanswered" would say the
    database had not answered (a cold review of the day's diff)."""
    import sqlalchemy as sa

    from toolledger.ledger.errors import CorruptRecord

    settings = Settings.from_env(
        {
            "TOOLLEDGER_DB": f"sqlite:///{tmp_path / 'l.db'}",
            "TOOLLEDGER_HOME": str(tmp_path),
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sb"),
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
        }
    )  # fmt: skip  (recorded, never run: no worker)
    blip = sa.exc.OperationalError("SELECT", {}, Exception("server closed the connection"))

    async def go() -> None:
        async with AsyncClient(settings) as client:
            submit = client.sync.submit

            def submit_then_blip(*a: Any, **kw: Any) -> Any:
                submit(*a, **kw)  # committed
                raise blip

            async def wait_blip(*_a: Any, **_kw: Any) -> Any:
                if where == "wait-record":  # a LedgerError once recorded: as itself
                    raise CorruptRecord("a terminal status without a result")
                raise blip

            if where == "submit":
                client.sync.submit = submit_then_blip  # type: ignore[method-assign]
            else:
                client.wait = wait_blip  # type: ignore[method-assign]
            tools = ledger_function_tools(client, scope="blip", approve=always)
            agent = Agent(name="t", model=ScriptedModel([APPEND]), tools=list(tools))
            await Runner.run(agent, "go", run_config=NO_TRACE)

    with pytest.raises(AgentsException) as stopped:
        asyncio.run(go())
    waiting = calls_waiting(stopped.value)
    if where == "wait-record":  # the run ends, the model is told nothing, said as it is
        assert waiting is None and isinstance(stopped.value.__cause__, CorruptRecord)
    else:
        assert waiting is not None and waiting.waiting == {"call_a1": "unanswered"}
        assert waiting.unanswered == {"call_a1"}
    with Client(settings) as client:
        assert client.status("blip", "call_a1") == "approved"  # in flight: it was committed


@pytest.mark.parametrize("answer", ["policy:async", None], ids=["approves", "a-person"])
def test_an_async_policy__awaited(tmp_path: Path, answer: str | None) -> None:
    """An async policy (AsyncClient.run_turn takes one) was never awaited: its coroutine was
    taken for the approver's name and the model read "error: approver: must be a string, not
    coroutine" (a cold review). Its answer decides now: an approval is recorded by its name,
    None pauses the run for the SDK's approval, nothing recorded."""
    settings = Settings.from_env(
        {
            "TOOLLEDGER_DB": f"sqlite:///{tmp_path / 'l.db'}",
            "TOOLLEDGER_HOME": str(tmp_path),
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sb"),
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
        }
    )  # fmt: skip  (recorded, never run: no worker)

    async def policy(_tool: str, _call_id: str, _args: dict[str, Any]) -> str | None:
        await asyncio.sleep(0)
        return answer

    async def go() -> Any:
        async with AsyncClient(settings) as client:
            tools = ledger_function_tools(client, scope="async", approve=policy, timeout=0.2)
            agent = Agent(name="t", model=ScriptedModel([APPEND]), tools=list(tools))
            return await Runner.run(agent, "go", run_config=NO_TRACE)

    from toolledger.ledger.ledger import Ledger

    ledger = Ledger(settings.db)
    try:
        if answer is None:
            paused = asyncio.run(go())
            assert [i.raw_item.call_id for i in paused.interruptions] == ["call_a1"]  # type: ignore[union-attr]
            assert ledger.list_calls(scope="async") == []
        else:
            with pytest.raises(AgentsException) as stopped:  # no worker: it waits, recorded
                asyncio.run(go())
            assert calls_waiting(stopped.value) is not None, stopped.value
            assert ledger.get("async", "call_a1").operation.decided_by == "policy:async"
    finally:
        ledger.close()


def test_policy__asked_once_a_call_on_its_own_copy_of_the_arguments(world: Stack) -> None:
    """The policy was asked when the SDK asked whether the call needs approval and again when
    it ran, and the second answer decided: a policy that approves one call a run recorded the
    SDK's approval, which nobody gave; and it was handed the dict recorded and run, so a
    policy that stamped it changed the call the model made (a cold review)."""
    asked: list[str] = []

    def budget(_tool: str, call_id: str, args: dict[str, Any]) -> str | None:
        asked.append(call_id)
        args["content"] = "stamped by the policy\n"
        return "policy:budget" if len(asked) == 1 else None

    result, _model = asyncio.run(one_turn(world, "conv-policy", approve=budget))
    assert not result.interruptions and asked == ["call_a1"]
    ledger = world.ledger()
    try:
        view = ledger.get("conv-policy", "call_a1")
    finally:
        ledger.close()
    assert view.operation.decided_by == "policy:budget"
    assert view.operation.args == APPEND[2]  # the model's arguments, recorded and run
    assert landed(world.sandbox / "conv-policy" / "notes" / "log.txt") == "once\n"


def test_parallel_calls_through_a_sync_client__their_waits_hold_no_executor_thread(
    tmp_path: Path,
) -> None:
    """The SDK runs a turn's tool calls at once. Through a ``Client`` each call's wait held a
    thread of the event loop's default executor (6 on 2 cores) for as long as it waited: a
    turn of 6 slow calls left the application's own ``asyncio.to_thread`` work, and any
    later call's submit, queued behind the waits (a cold review). The wait is on the loop
    now, as with an AsyncClient (and as the LangChain adapter's ``_arun``)."""
    import concurrent.futures

    from agents.tool_context import ToolContext

    from toolledger.ledger.ledger import Ledger

    settings = Settings.from_env(
        {
            "TOOLLEDGER_DB": f"sqlite:///{tmp_path / 'l.db'}",
            "TOOLLEDGER_HOME": str(tmp_path),
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sb"),
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
        }
    )  # fmt: skip  (no worker: every call waits out its timeout)
    calls = [f"c{i}" for i in range(6)]

    async def go(client: Client, ledger: Ledger) -> tuple[str, list[Any]]:
        loop = asyncio.get_running_loop()
        # a default executor of 2 threads: what 6 are on 2 cores, on any machine; the test's
        # own reads in a thread of their own
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        own = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        (tool,) = [
            t
            for t in ledger_function_tools(client, scope="par", approve=always, timeout=15)
            if t.name == "write_file"
        ]

        async def one(call_id: str) -> str:
            args = json.dumps({"path": f"{call_id}.txt", "content": "x"})
            ctx = ToolContext(None, tool_name="write_file", tool_call_id=call_id,
                              tool_arguments=args)  # fmt: skip
            return str(await tool.on_invoke_tool(ctx, args))

        def recorded() -> list[str]:
            return sorted(str(c.tool_call_id) for c in ledger.list_calls(scope="par"))

        running = [asyncio.create_task(one(c)) for c in calls]
        for _ in range(100):  # every call recorded (10 s at most), its wait begun
            if await loop.run_in_executor(own, recorded) == calls:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        try:  # while the 6 wait, the application's own work in a thread
            answer = await asyncio.wait_for(asyncio.to_thread(lambda: "answered"), 5)
        except TimeoutError:
            answer = "queued behind the waits"
        ended = await asyncio.gather(*running, return_exceptions=True)
        own.shutdown()
        return answer, ended

    with Client(settings) as client:
        ledger = Ledger(settings.db)
        try:
            answer, ended = asyncio.run(go(client, ledger))
        finally:
            ledger.close()
    assert answer == "answered"
    assert [calls_waiting(e) is not None for e in ended] == [True] * len(calls), ended
