"""A wait's timeout holds behind a database server that does not answer.

A frozen server (SIGSTOP, a paused VM) still has its kernel acknowledge every packet, so no TCP
timeout fires, and a statement timeout is the server's to enforce: a read sent to it waited
until it woke, and the wait's timeout with it (``wait --timeout 5`` exited 7 after 42 s behind a
40 s freeze). Here the server is a TCP proxy to Postgres (``harness.chaos.proxy``) stopped with
SIGSTOP, which its clients cannot tell from a frozen server; it is continued before the test
ends. Each wait runs where a test can give up on it (a thread, a child process): without the
bound it would wait for the freeze to end, and the test fails instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from toolledger import AsyncClient, Client, ReceiptTimeout
from toolledger.client import UNANSWERED
from toolledger.config import Settings
from toolledger.ledger.ledger import Ledger

pytestmark = pytest.mark.postgres

#: How long past its timeout a test lets a wait run before calling it unbounded: the freeze
#: lasts until the test ends, so a wait that is not bounded never returns before this.
SLACK = 15.0


class Freezable:
    """A TCP proxy to the Postgres of ``url``; ``freeze()`` stops it (SIGSTOP)."""

    def __init__(self, url: str) -> None:
        with Ledger(url).engine.connect() as conn:
            sockets = conn.exec_driver_sql("SHOW unix_socket_directories").scalar_one()
            port = conn.exec_driver_sql("SHOW port").scalar_one()
        unix = f"{sockets.split(',')[0].strip()}/.s.PGSQL.{port}"
        argv = [sys.executable, "-m", "toolledger.harness.chaos.proxy", "--listen", "127.0.0.1:0"]
        self.proc = subprocess.Popen([*argv, "--unix", unix], stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline().decode().split()
        assert ready[:2] == ["proxy", "ready"], ready
        host, listen_port = ready[2].rsplit(":", 1)
        self.url = sa.make_url(url).set(host=host, port=int(listen_port)).render_as_string(False)

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def gone(self) -> None:
        """The server gone: its connections reset, new ones refused (a restart, a crash)."""
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def frozen(pg_url: str) -> Iterator[Freezable]:
    proxy = Freezable(pg_url)
    try:
        yield proxy
    finally:
        proxy.close()


#: The settings' db_timeout here: how long past a wait's timeout a read may take to answer.
GRACE = "2"


def settings(url: str, tmp_path: Path) -> Settings:
    return Settings.from_env(
        {"TOOLLEDGER_DB": url, "TOOLLEDGER_HOME": str(tmp_path / "home"),
         "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"), "TOOLLEDGER_DB_TIMEOUT": GRACE}
    )  # fmt: skip


def in_thread(fn: Any) -> dict[str, Any]:
    """``fn()`` in a thread, given ``timeout + SLACK``; what it returned or raised."""
    out: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc
        out["took"] = time.monotonic() - started

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(3.0 + SLACK)
    assert not t.is_alive(), "the wait did not end: its timeout waited on the frozen server"
    return out


def test_wait__a_frozen_server_times_out_with_the_last_status_it_said(
    frozen: Freezable, tmp_path: Path
) -> None:
    with Client(settings(frozen.url, tmp_path)) as client:
        client.submit("fz", "c1", "write_file", {"path": "a.txt", "content": "x"})  # a person's
        get, answered = client.ledger.get, []

        def then_freeze(*args: Any, **kwargs: Any) -> Any:
            view = get(*args, **kwargs)
            answered.append(view)
            if len(answered) == 2:  # the wait has read, listens and read again: the freeze
                frozen.freeze()  # (a timer of 1 s froze it before the first read, under load)
            return view

        client.ledger.get = then_freeze  # type: ignore[method-assign]
        out = in_thread(lambda: client.wait("fz", "c1", timeout=3.0))
        exc = out["error"]
        assert isinstance(exc, ReceiptTimeout), exc
        assert exc.unanswered and exc.status == "pending_approval"
        assert "the database did not answer (it was pending_approval at its last answer)" in str(
            exc
        )


def test_wait__a_frozen_server_before_any_answer_is_unanswered(
    frozen: Freezable, tmp_path: Path
) -> None:
    with Client(settings(frozen.url, tmp_path)) as client:
        client.submit("fz", "c2", "write_file", {"path": "b.txt", "content": "x"})
        frozen.freeze()  # the client's pooled connection is open: its first read is sent
        out = in_thread(lambda: client.wait("fz", "c2", timeout=1.0))
        exc = out["error"]
        assert isinstance(exc, ReceiptTimeout), exc
        assert exc.unanswered and exc.status == UNANSWERED
        assert str(exc).endswith("the database did not answer")


@pytest.mark.parametrize("side", ["sync", "async"])
def test_wait__a_connect_timed_out_early_does_not_end_the_wait_before_its_timeout(
    frozen: Freezable, tmp_path: Path, side: str
) -> None:
    """helper-94: a fresh connection to a frozen server timed out (libpq's connect timeout,
    TOOLLEDGER_DB_TIMEOUT = 2 s) and the wait ended "unanswered" 2 s into a 6 s wait; the
    async wait raised the driver's OperationalError. Both wait their time out now."""
    timeout = 6.0

    def scenario() -> tuple[BaseException | None, float]:
        if side == "sync":
            with Client(settings(frozen.url, tmp_path)) as client:
                client.submit("fz", f"e{side}", "write_file", {"path": "e.txt", "content": "x"})
                client.ledger.engine.dispose()  # the next read connects anew
                frozen.freeze()
                began = time.monotonic()
                try:
                    client.wait("fz", f"e{side}", timeout=timeout)
                except BaseException as exc:  # noqa: BLE001 - returned
                    return exc, time.monotonic() - began
                return None, time.monotonic() - began

        async def run() -> tuple[BaseException | None, float]:
            async with AsyncClient(settings(frozen.url, tmp_path)) as client:
                await client.submit("fz", f"e{side}", "write_file",
                                    {"path": "e.txt", "content": "x"})  # fmt: skip
                client.sync.ledger.engine.dispose()
                frozen.freeze()
                began = time.monotonic()
                try:
                    await client.wait("fz", f"e{side}", timeout=timeout)
                except BaseException as exc:  # noqa: BLE001 - returned
                    return exc, time.monotonic() - began
                return None, time.monotonic() - began

        return asyncio.run(run())

    exc, took = in_thread(scenario)["value"]
    assert isinstance(exc, ReceiptTimeout) and exc.unanswered, exc
    assert took >= timeout  # not before its own timeout (no upper bound asserted)


def test_async_wait__a_frozen_server_times_out(frozen: Freezable, tmp_path: Path) -> None:
    async def scenario() -> ReceiptTimeout:
        async with AsyncClient(settings(frozen.url, tmp_path)) as client:
            await client.submit("fz", "c3", "write_file", {"path": "c.txt", "content": "x"})
            asyncio.get_running_loop().call_later(1.0, frozen.freeze)  # see the test above
            try:
                await client.wait("fz", "c3", timeout=3.0)
            except ReceiptTimeout as exc:
                return exc
            raise AssertionError("a receipt, from a frozen server")

    out = in_thread(lambda: asyncio.run(asyncio.wait_for(scenario(), 3.0 + SLACK - 1)))
    exc = out.get("error") or out["value"]
    assert isinstance(exc, ReceiptTimeout), exc
    assert exc.unanswered and exc.status == "pending_approval"


def _listening(url: str, within: float = 30.0) -> None:
    """Until a client's receipt listener is connected to ``url``'s database: a wait started
    there has read the call and listens (a fixed sleep froze the server before a CLI loaded
    under load had read anything: it said "database unavailable", exit 1)."""
    from toolledger.client import LISTENER_NAME

    engine = sa.create_engine(url)
    try:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                n = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                        "current_database() AND application_name = :name"
                    ),
                    {"name": LISTENER_NAME},
                ).scalar_one()
            if n:
                return
            time.sleep(0.05)
        raise AssertionError(f"no receipt listener within {within} s")
    finally:
        engine.dispose()


def test_cli_wait__exits_7_behind_a_frozen_server(
    frozen: Freezable, tmp_path: Path, pg_url: str
) -> None:
    env = {**os.environ, "TOOLLEDGER_DB": frozen.url, "TOOLLEDGER_HOME": str(tmp_path / "h"),
           "TOOLLEDGER_SANDBOX": str(tmp_path / "sb"), "TOOLLEDGER_DB_TIMEOUT": GRACE}  # fmt: skip
    cli = [sys.executable, "-m", "toolledger"]
    call = ["--scope", "fz", "--tool-call-id", "c4"]
    args = ["--tool", "write_file", "--args", '{"path": "d.txt", "content": "x"}']
    subprocess.run([*cli, "submit", *call, *args], env=env, check=True, capture_output=True)
    wait = subprocess.Popen(
        [*cli, "--json", "wait", *call, "--timeout", "8"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _listening(pg_url)  # it has connected, read, and listens: inside its 8 s
    frozen.freeze()
    try:
        _, err = wait.communicate(timeout=8 + SLACK)
    except subprocess.TimeoutExpired:
        wait.kill()
        wait.communicate()
        raise AssertionError(
            "wait --timeout 8 did not exit: it waited on the frozen server"
        ) from None
    assert wait.returncode == 7, err
    assert "the database did not answer" in err, err


def test_wait__a_slow_healthy_database_is_waited_for_past_the_timeout(pg_url, tmp_path):
    """A read takes what the database takes, up to db_timeout past the wait's timeout: a
    fixed quarter second gave up on a healthy database 50 ms away, and ``wait(timeout=0)``
    (the MCP server's look at a call after a cut) said "unanswered" for a call that had its
    receipt (a cold review). Here every read takes 0.6 s."""
    with Client(settings(pg_url, tmp_path)) as client:
        client.submit("slow", "c5", "write_file", {"path": "e.txt", "content": "x"})
        client.reject("slow", "c5", by="al")
        get = client.ledger.get

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.6)
            return get(*args, **kwargs)

        client.ledger.get = slow  # type: ignore[method-assign]
        assert client.wait("slow", "c5", timeout=0).status.value == "rejected"

        async def scenario() -> str:
            async with AsyncClient(settings(pg_url, tmp_path)) as aclient:
                aclient.sync.ledger.get = slow  # type: ignore[method-assign]
                return (await aclient.wait("slow", "c5", timeout=0)).status.value

        assert asyncio.run(scenario()) == "rejected"


def test_wait__a_receipt_read_before_the_freeze_is_returned(frozen: Freezable, tmp_path: Path):
    """The first read's receipt was not looked at: the wait went on to start its listener
    and read again, and the server freezing between the two made a rejected call "did not
    answer (it was rejected …)" (a cold review)."""
    with Client(settings(frozen.url, tmp_path)) as client:
        client.submit("fz", "c6", "write_file", {"path": "f.txt", "content": "x"})
        client.reject("fz", "c6", by="al")
        start = client.notifier.start

        def freeze_then_start(wait: float = 5.0) -> bool:
            frozen.freeze()  # after the first read, before the second
            return start(wait)

        client.notifier.start = freeze_then_start  # type: ignore[method-assign]
        out = in_thread(lambda: client.wait("fz", "c6", timeout=1.0))
        assert out.get("value") is not None, out.get("error")
        assert out["value"].status.value == "rejected"


def test_run_turn__a_frozen_server_costs_one_grace_not_one_a_call(
    frozen: Freezable, tmp_path: Path
) -> None:
    """Once the turn's timeout has passed, each later call waited with timeout 0, each read
    given the whole grace again: 4 calls, timeout 1 s, 9 s (a cold review). After one wait
    the database did not answer, the later calls are not read again: their status is their
    submit's."""
    import json

    from toolledger.turns import CallsWaiting

    calls = [
        {"id": f"t{i}", "type": "function",
         "function": {"name": "write_file",
                      "arguments": json.dumps({"path": f"t{i}.txt", "content": "x"})}}
        for i in range(4)
    ]  # fmt: skip
    message = {"role": "assistant", "content": None, "tool_calls": calls}
    with Client(settings(frozen.url, tmp_path)) as client:
        waited: list[str] = []
        wait = client.wait

        def spy(scope: str, tool_call_id: str, **kwargs: Any) -> Any:
            if not waited:
                frozen.freeze()  # every call submitted, pending a person: the freeze begins
            waited.append(tool_call_id)
            return wait(scope, tool_call_id, **kwargs)

        client.wait = spy  # type: ignore[method-assign]
        out = in_thread(lambda: client.run_turn("fz-turn", message, timeout=1.0))
        exc = out["error"]
        assert isinstance(exc, CallsWaiting), exc
        assert exc.waiting == {
            "t0": "unanswered",
            **{f"t{i}": "pending_approval" for i in (1, 2, 3)},
        }
        assert waited == ["t0"]
        # their statuses are what the database last said, and said so (said as current)
        assert exc.unanswered == {"t0", "t1", "t2", "t3"}
        assert "'t0' (unanswered)" in str(exc), exc
        assert "'t1' (pending_approval, when the database last answered" in str(exc), exc


def test_async_wait__a_receipt_read_before_the_freeze_is_returned(
    frozen: Freezable, tmp_path: Path
) -> None:
    async def scenario() -> str:
        async with AsyncClient(settings(frozen.url, tmp_path)) as client:
            await client.submit("fz", "c7", "write_file", {"path": "g.txt", "content": "x"})
            await client.reject("fz", "c7", by="al")
            start = client.sync.notifier.start

            def freeze_then_start(wait: float = 5.0) -> bool:
                frozen.freeze()  # after the first read, before the second
                return start(wait)

            client.sync.notifier.start = freeze_then_start  # type: ignore[method-assign]
            return (await client.wait("fz", "c7", timeout=1.0)).status.value

    out = in_thread(lambda: asyncio.run(asyncio.wait_for(scenario(), 3.0 + SLACK - 1)))
    assert out.get("value") == "rejected", out.get("error")


def test_async_run_turn__says_which_statuses_the_database_did_not_confirm(
    frozen: Freezable, tmp_path: Path
) -> None:
    """The calls of a turn, waited together behind a frozen server: CallsWaiting named the
    status each had when the database last answered as if it were where the call stands."""
    import json

    from toolledger.turns import CallsWaiting

    calls = [
        {"id": f"a{i}", "type": "function",
         "function": {"name": "write_file",
                      "arguments": json.dumps({"path": f"a{i}.txt", "content": "x"})}}
        for i in range(2)
    ]  # fmt: skip
    message = {"role": "assistant", "content": None, "tool_calls": calls}

    async def scenario() -> BaseException | None:
        async with AsyncClient(settings(frozen.url, tmp_path)) as client:
            wait = client.wait

            async def spy(scope: str, tool_call_id: str, **kwargs: Any) -> Any:
                frozen.freeze()  # every call submitted, pending a person: the freeze begins
                return await wait(scope, tool_call_id, **kwargs)

            client.wait = spy  # type: ignore[method-assign]
            try:
                await client.run_turn("fz-aturn", message, timeout=1.0)
            except CallsWaiting as exc:
                return exc
            return None

    exc = in_thread(lambda: asyncio.run(scenario()))["value"]
    assert isinstance(exc, CallsWaiting), exc
    assert exc.unanswered == {"a0", "a1"} and set(exc.waiting) == {"a0", "a1"}


def _turn(prefix: str, n: int) -> dict[str, Any]:
    import json

    calls = [
        {"id": f"{prefix}{i}", "type": "function",
         "function": {"name": "write_file",
                      "arguments": json.dumps({"path": f"{prefix}{i}.txt", "content": "x"})}}
        for i in range(n)
    ]  # fmt: skip
    return {"role": "assistant", "content": None, "tool_calls": calls}


@pytest.mark.parametrize("where", ["wait", "submit"])
def test_run_turn__a_database_gone_after_a_submit_is_calls_waiting_not_its_error(
    frozen: Freezable, tmp_path: Path, where: str
) -> None:
    """The database gone once a call was submitted (refused connections, not silence): the
    turn raised the database's own error, which an agent loop could hand to the model, who
    called again under a new id, the effect twice (a cold review of the integrations). It is
    CallsWaiting, the call whose submit or wait failed ``unanswered``, chained to the error."""
    from toolledger.turns import CallsWaiting

    with Client(settings(frozen.url, tmp_path)) as client:
        if where == "wait":
            wait = client.wait

            def gone_then_wait(scope: str, tool_call_id: str, **kwargs: Any) -> Any:
                frozen.gone()  # every call submitted, pending a person
                return wait(scope, tool_call_id, **kwargs)

            client.wait = gone_then_wait  # type: ignore[method-assign]
        else:
            submit = client.submit_checked

            def gone_on_second(prepared: Any, **kwargs: Any) -> Any:
                if prepared.tool_call_id == "g1":
                    frozen.gone()
                return submit(prepared, **kwargs)

            client.submit_checked = gone_on_second  # type: ignore[method-assign]
        out = in_thread(lambda: client.run_turn("gone-turn", _turn("g", 2), timeout=1.0))
    exc = out["error"]
    assert isinstance(exc, CallsWaiting), exc
    assert isinstance(exc.__cause__, sa.exc.OperationalError), exc.__cause__
    if where == "wait":  # each wait made: a failure at once costs no grace
        assert exc.waiting == {"g0": "unanswered", "g1": "unanswered"}
        assert exc.unanswered == {"g0", "g1"}
    else:
        assert exc.waiting == {"g0": "pending_approval", "g1": "unanswered"}
        assert exc.unanswered == {"g1"}


def test_async_run_turn__a_database_gone_during_the_waits_is_calls_waiting(
    frozen: Freezable, tmp_path: Path
) -> None:
    from toolledger.turns import CallsWaiting

    async def scenario() -> BaseException | None:
        async with AsyncClient(settings(frozen.url, tmp_path)) as client:
            wait = client.wait

            async def gone_then_wait(scope: str, tool_call_id: str, **kwargs: Any) -> Any:
                if frozen.proc.returncode is None:
                    frozen.gone()
                return await wait(scope, tool_call_id, **kwargs)

            client.wait = gone_then_wait  # type: ignore[method-assign]
            try:
                await client.run_turn("gone-async", _turn("h", 2), timeout=1.0)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                return exc
            return None

    out = in_thread(lambda: asyncio.run(asyncio.wait_for(scenario(), 3.0 + SLACK - 1)))
    exc = out.get("value")
    assert isinstance(exc, CallsWaiting), (exc, out.get("error"))
    assert isinstance(exc.__cause__, sa.exc.OperationalError), exc.__cause__
    assert exc.waiting == {"h0": "unanswered", "h1": "unanswered"}


@pytest.mark.parametrize("side", ["sync", "async"])
def test_wait__a_server_gone_during_the_wait_times_out_unanswered(
    frozen: Freezable, tmp_path: Path, side: str
) -> None:
    """A wait whose re-reads the database refused (it went away after the wait's reads) said
    at its timeout "it is pending_approval", as if it had read that: now "the database did
    not answer (it was pending_approval at its last answer)", ``unanswered`` set."""

    def gone_after_two_reads(client: Client) -> None:
        get, answered = client.ledger.get, []

        def then_gone(*args: Any, **kwargs: Any) -> Any:
            view = get(*args, **kwargs)
            answered.append(view)
            if len(answered) == 2:  # the wait has read, listens and read again
                frozen.gone()
            return view

        client.ledger.get = then_gone  # type: ignore[method-assign]

    def scenario() -> BaseException | None:
        if side == "sync":
            with Client(settings(frozen.url, tmp_path)) as client:
                client.submit("fz", f"g{side}", "write_file", {"path": "g.txt", "content": "x"})
                gone_after_two_reads(client)
                try:
                    client.wait("fz", f"g{side}", timeout=2.0)
                except BaseException as exc:  # noqa: BLE001 - returned
                    return exc
                return None

        async def run() -> BaseException | None:
            async with AsyncClient(settings(frozen.url, tmp_path)) as client:
                await client.submit("fz", f"g{side}", "write_file",
                                    {"path": "g.txt", "content": "x"})  # fmt: skip
                gone_after_two_reads(client.sync)
                try:
                    await client.wait("fz", f"g{side}", timeout=2.0)
                except BaseException as exc:  # noqa: BLE001 - returned
                    return exc
                return None

        return asyncio.run(run())

    exc = in_thread(scenario)["value"]
    assert isinstance(exc, ReceiptTimeout), exc
    assert exc.unanswered and exc.status == "pending_approval", (exc.unanswered, exc.status)
    assert str(exc).endswith(
        "the database did not answer (it was pending_approval at its last answer)"
    )
