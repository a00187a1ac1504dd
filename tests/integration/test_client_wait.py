"""A wait's own pauses never run past its timeout: starting the listener, and the pause
between reads while the database does not answer (each could add up to 5 s and 1 s to a
short timeout). Checked by what the wait asked for, not by a clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import toolledger.client as client_module
from toolledger import Client, ReceiptTimeout
from toolledger.config import Settings


@pytest.fixture
def client(sqlite_url: str, tmp_path: Path) -> Any:
    settings = Settings.from_env(
        {"TOOLLEDGER_DB": sqlite_url, "TOOLLEDGER_HOME": str(tmp_path / "home"),
         "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox")}
    )  # fmt: skip
    with Client(settings) as c:
        yield c


def test_wait__the_listener_start_is_bounded_by_the_timeout(client: Any, monkeypatch: Any) -> None:
    client.submit("w", "p1", "write_file", {"path": "p.txt", "content": "x"})  # a person's
    asked: list[float] = []
    start = client_module.Notifier.start

    def spy(self: Any, wait: float = 5.0) -> bool:
        asked.append(wait)
        return start(self, wait)

    monkeypatch.setattr(client_module.Notifier, "start", spy)
    with pytest.raises(ReceiptTimeout):
        client.wait("w", "p1", timeout=0.25)
    assert asked and max(asked) <= 0.25


def test_wait__a_database_out_of_reach_pauses_no_longer_than_the_timeout(
    client: Any, monkeypatch: Any, caplog: Any
) -> None:
    client.submit("w", "p2", "write_file", {"path": "q.txt", "content": "x"})
    get, calls = client.ledger.get, {"n": 0}
    said = "server closed the connection unexpectedly\n\tThis probably means the server..."

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > 2:  # the two reads before the wait answer; then it is gone
            raise sa.exc.OperationalError("SELECT", {}, Exception(said))  # as libpq says it
        return get(*args, **kwargs)

    monkeypatch.setattr(client.ledger, "get", unreachable)
    pauses: list[float] = []
    monkeypatch.setattr(client_module.time, "sleep", pauses.append)
    with pytest.raises(ReceiptTimeout):
        client.wait("w", "p2", timeout=0.3)
    assert pauses and all(p <= 0.3 for p in pauses)
    warned = [r.getMessage() for r in caplog.records if "waiting for w/p2" in r.getMessage()]
    assert warned and all("\n" not in m for m in warned), warned  # one line each


@pytest.mark.postgres
def test_wait__a_wake_up_naming_a_call_outside_ascii_on_a_sql_ascii_database(pg_server, caplog):
    """On SQL_ASCII (a cluster initialised under the C locale) the listener decoded a payload
    as ASCII: a call id outside it failed the decode, and the listener reconnected (its
    waiters woken by the reconnect, late) instead of waking them. It now reads UTF-8."""
    import logging
    import threading

    import psycopg

    from toolledger.harness import scratch

    with scratch.scratch_database(pg_server, "tl_t", encoding="SQL_ASCII") as url:
        notifier = client_module.Notifier(url)
        try:
            assert notifier.start()
            woken = threading.Event()
            key = ("s", "write_file:ü日本")
            caplog.set_level(logging.WARNING, logger="toolledger")
            with notifier.watch(key, woken.set):
                sender = psycopg.connect(
                    url.replace("+psycopg", ""), autocommit=True, client_encoding="UTF8"
                )
                with sender:
                    # the payload as the receipt trigger builds it (non-ASCII kept as it is)
                    notify = "SELECT pg_notify(%s, json_build_array(%s::text, %s::text)::text)"
                    sender.execute(notify, [client_module.CHANNEL, *key])
                assert woken.wait(10)
            assert "receipt listener" not in caplog.text  # woken by the payload, not a reconnect
        finally:
            notifier.close()


@pytest.fixture
def any_client(db_url: str, tmp_path: Path) -> Any:
    settings = Settings.from_env(
        {"TOOLLEDGER_DB": db_url, "TOOLLEDGER_HOME": str(tmp_path / "home"),
         "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
         "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0"}  # nothing is enqueued: all pending
    )  # fmt: skip
    with Client(settings) as c:
        yield c


@pytest.mark.parametrize("forever", [float("inf"), 1e10])
def test_wait__a_timeout_past_any_clock_waits_without_one(
    any_client: Any, scope: str, forever: float
) -> None:
    """``inf`` and ``1e10`` raised OverflowError from every wait on Postgres (threading's
    limit), at once, and ``run_turn`` could never answer its turn (a cold review): they wait
    as ``None`` now, sync and async, a receipt in hand or one that comes later."""
    import asyncio
    import threading

    from toolledger import AsyncClient

    client = any_client
    client.submit(scope, "done", "write_file", {"path": "d.txt", "content": "x"})
    client.ledger.reject(scope, "done", by="ann", reason="no")
    assert client.wait(scope, "done", timeout=forever).status == "rejected"

    async def in_async() -> str:
        async with AsyncClient(client.settings) as ac:
            return (await ac.wait(scope, "done", timeout=forever)).status

    assert asyncio.run(in_async()) == "rejected"
    client.submit(scope, "later", "write_file", {"path": "l.txt", "content": "x"})
    decide = threading.Timer(
        0.5, client.ledger.reject, (scope, "later"), {"by": "a", "reason": "n"}
    )
    decide.start()
    try:
        assert client.wait(scope, "later", timeout=forever).status == "rejected"
    finally:
        decide.join()


def test_wait__nan_is_refused_before_anything_is_read_or_recorded(
    any_client: Any, scope: str
) -> None:
    """``nan``: the async waits read the database as fast as it answered, for ever (8,333
    reads in 5 s), and sync ``run_turn`` timed out at once (a cold review)."""
    import asyncio

    from toolledger import AsyncClient

    client = any_client
    client.submit(scope, "p", "write_file", {"path": "p.txt", "content": "x"})
    with pytest.raises(ValueError, match="nan"):
        client.wait(scope, "p", timeout=float("nan"))
    turn = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "t1", "type": "function",
        "function": {"name": "write_file", "arguments": '{"path": "t.txt", "content": "x"}'},
    }]}  # fmt: skip
    with pytest.raises(ValueError, match="nan"):
        client.run_turn(scope, turn, timeout=float("nan"))

    async def in_async() -> None:
        async with AsyncClient(client.settings) as ac:
            with pytest.raises(ValueError, match="nan"):
                await ac.wait(scope, "p", timeout=float("nan"))
            with pytest.raises(ValueError, match="nan"):
                await ac.run_turn(scope, turn, timeout=float("nan"))

    asyncio.run(in_async())
    assert [v.tool_call_id for v in client.ledger.list_calls(scope=scope)] == ["p"]
