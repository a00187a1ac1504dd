"""The agent's API against real workers, on both backends: a turn in each message format
gives back what ``repair`` would insert, byte for byte after parsing; waits time out with the
call's status and end at a decision; 200 async waiters are all woken by the database (none by
the fallback read); ``toolledger wait`` keeps its exit codes; the example agent loop runs,
and a second run replays instead of executing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.conftest import Stack, landed, toolledger, wait_until
from toolledger import AsyncClient, Client, ReceiptTimeout
from toolledger.ledger.transitions import Status
from toolledger.recovery.transcript import repair_transcript
from toolledger.turns import CallsWaiting

ROOT = Path(__file__).resolve().parents[2]


def always(*_: Any) -> str:
    return "policy"


def openai_turn(n: int, tag: str) -> dict[str, Any]:
    calls = []
    for i in range(n):
        args = json.dumps({"path": f"{tag}/{i}.txt", "content": f"héllo {i}\u2028"})
        fn = {"name": "write_file", "arguments": args}
        calls.append({"id": f"{tag}_{i}", "type": "function", "function": fn})
    return {"role": "assistant", "content": None, "tool_calls": calls}


def anthropic_turn(n: int, tag: str) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": "on it"}]
    for i in range(n):
        args = {"path": f"{tag}/{i}.txt", "content": f"hello {i}"}
        blocks.append({"type": "tool_use", "id": f"{tag}_{i}", "name": "write_file", "input": args})
    return {"role": "assistant", "content": blocks}


def responses_turn(n: int, tag: str) -> list[dict[str, Any]]:
    return [
        {
            "type": "function_call",
            "call_id": f"{tag}_{i}",
            "name": "write_file",
            "arguments": json.dumps({"path": f"{tag}/{i}.txt", "content": f"hello {i}"}),
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("form", ["openai", "anthropic", "responses"])
def test_run_turn__returns_what_repair_would_insert(world: Stack, form: str) -> None:
    tag = f"turn_{form}"
    user = (
        {"type": "message", "role": "user", "content": "go"}
        if form == "responses"
        else {"role": "user", "content": "go"}
    )
    turn: Any = {"openai": openai_turn, "anthropic": anthropic_turn, "responses": responses_turn}[
        form
    ](3, tag)
    with Client(world.settings()) as client:
        results = client.run_turn("conv", turn, approve=always, timeout=60)
        assert client.stats.found_by_poll == 0
    turn_items = turn if isinstance(turn, list) else [turn]
    transcript = {"messages": [user, *turn_items]} if form != "responses" else [user, *turn_items]
    ledger = world.ledger()
    report = repair_transcript(json.dumps(transcript).encode(), ledger, "conv")
    ledger.close()
    repaired = json.loads(report.text)
    items = repaired["messages"] if isinstance(repaired, dict) else repaired
    assert items == [user, *turn_items, *results]
    statuses = [json.loads(_text(r))["path"] for r in _results(results)]
    assert statuses == [f"{tag}/{i}.txt" for i in range(3)]


def test_run_turn__a_call_without_a_receipt_is_never_answered(world: Stack) -> None:
    """DESIGN §6: a call waiting for a person has nothing true to tell the model. The turn
    answers nothing and raises CallsWaiting naming it; run again once decided, the same
    turn gets every receipt, and nothing ran twice."""
    turn = openai_turn(2, "wait")
    first_only = {"wait_0": "policy"}

    def policy(_tool: str, call_id: str, _args: Any) -> str | None:
        return first_only.get(call_id)  # wait_1 is left for a person

    with Client(world.settings()) as client:
        with pytest.raises(CallsWaiting) as waiting:
            client.run_turn("conv", turn, approve=policy, timeout=1)
        assert waiting.value.waiting == {"wait_1": "pending_approval"}
        assert isinstance(waiting.value, TimeoutError) and "wait_1" in str(waiting.value)
        client.approve("conv", "wait_1", by="alice")
        results = client.run_turn("conv", turn, approve=policy, timeout=60)
    assert [r["tool_call_id"] for r in results] == ["wait_0", "wait_1"]
    assert [json.loads(r["content"])["path"] for r in results] == ["wait/0.txt", "wait/1.txt"]
    ledger = world.ledger()
    try:
        for call in ("wait_0", "wait_1"):
            assert len(ledger.get("conv", call).executions) == 1  # ran once each
    finally:
        ledger.close()


def _results(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if items and items[0].get("role") == "user":  # anthropic: one message of blocks
        return list(items[0]["content"])
    return items


def _text(item: dict[str, Any]) -> str:
    return str(item.get("content", item.get("output")))


def test_result__times_out_with_pending_approval_then_returns_after_approve(world: Stack) -> None:
    with Client(world.settings()) as client:
        handle = client.submit("conv", "p1", "write_file", {"path": "p.txt", "content": "x"})
        with pytest.raises(ReceiptTimeout) as timed_out:
            handle.result(timeout=0.5)
        assert timed_out.value.status == "pending_approval"
        assert isinstance(timed_out.value, TimeoutError)
        client.approve("conv", "p1", by="alice")
        receipt = handle.result(timeout=60)
        assert receipt.status is Status.SUCCEEDED and not receipt.is_error
        assert receipt.to_openai()["tool_call_id"] == "p1"
        assert receipt.to_anthropic()["tool_use_id"] == "p1"
        rejected = client.submit("conv", "p2", "write_file", {"path": "q.txt", "content": "x"})
        client.reject("conv", "p2", by="alice", reason="not today")
        receipt = rejected.result(timeout=60)
        assert receipt.status is Status.REJECTED and receipt.is_error
        assert receipt.to_anthropic()["is_error"] is True
        assert client.stats.found_by_poll == 0


def test_async__200_waiters_all_woken_by_the_database(world: Stack) -> None:
    async def go() -> tuple[list[Any], Any]:
        # a fallback read every 10 minutes: within this test, only a wake-up can end a wait
        async with AsyncClient(world.settings(), poll_interval=600) as client:
            handles = [
                await client.submit(
                    "many", f"c{i}", "write_file", {"path": f"m/{i}.txt", "content": "x"}
                )
                for i in range(200)
            ]
            waits = [asyncio.create_task(h.result(timeout=300)) for h in handles]
            await asyncio.sleep(0.2)  # every waiter registered before the approvals
            for i in range(200):
                await client.approve("many", f"c{i}", by="bulk")
            return list(await asyncio.gather(*waits)), client.stats

    receipts, stats = asyncio.run(go())
    assert {r.status for r in receipts} == {Status.SUCCEEDED}
    assert stats.found_by_poll == 0 and stats.fallback_reads == 0
    assert stats.woken == 200


def test_wait_cli__exit_0_with_the_receipt_7_on_timeout_4_when_unknown(world: Stack) -> None:
    with Client(world.settings()) as client:
        client.submit(
            "conv", "w1", "write_file", {"path": "w.txt", "content": "x"}, approved_by="a"
        )
        client.submit("conv", "w2", "write_file", {"path": "v.txt", "content": "x"})
    code, out, err = toolledger(world, "wait", "--scope", "conv", "--tool-call-id", "w1", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert (data["status"], data["tool_call_id"]) == ("succeeded", "w1")
    code, out, err = toolledger(
        world, "wait", "--scope", "conv", "--tool-call-id", "w2", "--timeout", "0.5"
    )
    assert code == 7 and "pending_approval" in err and out == ""
    code, _, err = toolledger(world, "wait", "--scope", "conv", "--tool-call-id", "nope")
    assert code == 4 and "no call" in err


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_example_agent_loop__runs_then_replays_without_running_again(
    world: Stack, mode: str
) -> None:
    argv = [sys.executable, str(ROOT / "examples" / "agent_loop.py"), "--scope", f"ex-{mode}"]
    argv += ["--async"] if mode == "async" else []
    env = world.env()
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    messages = json.loads(first.stdout)
    assert messages[-1] == {"role": "assistant", "content": "Done: 3 tool results."}
    tool_results = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
    assert tool_results[2]["content"] == "all good\n"  # read_file read what write_file wrote
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0 and again.stdout == first.stdout  # replayed, same bytes
    log = world.sandbox / f"ex-{mode}" / "report" / "log.txt"
    assert landed(log) == "checked\n"  # appended once across both runs


@pytest.mark.parametrize("world", ["postgres"], indirect=True)  # LISTEN/NOTIFY is Postgres's
def test_listener__a_killed_listen_connection_reconnects_and_misses_nothing(
    world: Stack,
) -> None:
    """Postgres: the listener's connection is terminated while a call is waited for and
    finishes; the reconnect wakes every waiter to look, so the receipt is not left to the
    fallback read."""
    import sqlalchemy as sa

    from toolledger.client import LISTENER_NAME
    from toolledger.ledger.db import create_engine

    admin = create_engine(world.db)
    with Client(world.settings(), poll_interval=600) as client:
        handle = client.submit("conv", "k1", "write_file", {"path": "k.txt", "content": "x"})
        assert client.notifier.start()
        client.notifier.reconnect_pause = 3.0  # the call ends while nobody listens
        waiting = concurrent.futures.ThreadPoolExecutor(1).submit(handle.result, 60)
        time.sleep(0.5)  # the waiter has read (no receipt) and waits for a wake-up
        with admin.connect() as conn:
            killed = conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = :name AND datname = current_database()"
                ),  # this test's database only: another test's listeners are not its own
                {"name": LISTENER_NAME},
            ).all()
        assert killed == [(True,)]
        client.approve("conv", "k1", by="alice")
        wait_until(lambda: client.receipt("conv", "k1"), 30, "the call to finish")
        assert not waiting.done()  # its NOTIFY went to nobody
        receipt = waiting.result(timeout=60)  # woken by the reconnect, not by a poll
        assert receipt.status is Status.SUCCEEDED
        assert client.stats.found_by_poll == 0
    admin.dispose()


def test_read_after_receipt__sees_a_write_committed_but_not_yet_landed(world: Stack) -> None:
    """A receipt is given at the commit; the bytes land a moment later. A read-only call that
    follows the receipt lands what was committed first: here the worker dies between its
    commit and the landing, so without that the read would find no file."""
    for proc in world.workers:
        proc.stop()
    world.worker("w2", failpoints="before_publish=exit(23)")
    with Client(world.settings()) as client:
        wrote = client.submit(
            "conv", "r1", "write_file", {"path": "r.txt", "content": "new"}, approved_by="a"
        ).result(timeout=60)
        assert wrote.status is Status.SUCCEEDED
        assert not (world.sandbox / "conv" / "r.txt").exists()  # committed, not landed
        read = client.submit("conv", "r2", "read_file", {"path": "r.txt"}).result()
        assert read.status is Status.SUCCEEDED and read.content["content"] == "new"
