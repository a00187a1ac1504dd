"""A ledger statement whose answer never comes back while its connection stays open: a
middlebox (PgBouncer, a proxy) that hung once it had forwarded the claim or the terminal
write. The server committed; the worker hears nothing, and the middlebox's kernel still
acknowledges every packet and keepalive probe, so neither ``tcp_user_timeout`` nor keepalives
end the wait, nor does the server's ``statement_timeout`` (the statement is done).

A prefork child is cut by Celery's soft time limit; a threads worker has none, and its thread
waited for ever: the call's committed bytes never landed (finish) or its claim stayed running
until the sweep (claim), and once every thread was caught so the worker took no job again,
without a line in its log (a review, 2026-12-07). Real worker, real Postgres behind a proxy
started here that goes silent on one statement."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from tests.acceptance.conftest import Stack, landed, toolledger, wait_until
from toolledger.ledger.transitions import Status

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

#: What each statement's text holds (sent whole: a fresh connection prepares nothing yet).
MARKERS = {
    "claim": b"ON CONFLICT (scope, idempotency_key, attempt) DO NOTHING",
    "finish": b"pg_advisory_xact_lock",
    "submit": b"ON CONFLICT (scope, idempotency_key) DO NOTHING",
}


class SilentProxy:
    """A TCP proxy to Postgres that, on the first client packet holding ``marker``, forwards
    it and then never relays another byte either way, the connection left open."""

    def __init__(self, upstream: tuple[str, int], marker: bytes) -> None:
        self.upstream, self.marker = upstream, marker
        self.fired = threading.Event()
        self._armed = threading.Lock()
        self._server = socket.create_server(
            ("127.0.0.1", int(os.environ.get("TOOLLEDGER_TEST_PROXY_PORT", "0")))
        )
        self._sockets: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self._server.getsockname()[1])

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._server.accept()
                up = socket.create_connection(self.upstream)
                self._sockets += [client, up]
                silent = threading.Event()
                for a, b, watch in ((client, up, True), (up, client, False)):
                    args = (a, b, watch, silent)
                    threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, watch: bool, silent: Any) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if silent.is_set():
                    continue  # heard and dropped: the peer waits for ever
                if watch and self.marker in data and self._armed.acquire(blocking=False):
                    dst.sendall(data)  # the statement reaches the server, and commits
                    silent.set()
                    self.fired.set()
                    continue
                dst.sendall(data)

    def close(self) -> None:
        for s in self._sockets:  # shut down first: a close leaves a blocked accept() bound
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


@contextlib.contextmanager
def silent_on(stack: Stack, statement: str) -> Iterator[tuple[str, SilentProxy]]:
    """The URL of the stack's database through a proxy silent on ``statement``."""
    url = sa.make_url(stack.db)
    proxy = SilentProxy((url.host or "127.0.0.1", url.port or 5432), MARKERS[statement])
    try:
        yield url.set(host="127.0.0.1", port=proxy.port).render_as_string(False), proxy
    finally:
        proxy.close()


@pytest.fixture(params=["claim", "finish"])
def silent_db(stack: Stack, request: pytest.FixtureRequest) -> Iterator[tuple[str, SilentProxy]]:
    with silent_on(stack, request.param) as silent:
        yield silent


def test_threads_worker__a_statement_never_answered__the_call_ends_once_and_the_worker_serves_on(
    stack: Stack, scope: str, silent_db: tuple[str, SilentProxy]
) -> None:
    # Given a threads worker (one thread) whose database goes through a proxy that will fall
    # silent on the claim (or the terminal write) of the first call
    db, proxy = silent_db
    w = stack.worker("w1", concurrency=1, pool="threads", db=db, lease_seconds="8", metrics="off")
    sub, ledger = stack.submitter(), stack.ledger()
    # When a call runs into it
    sub.submit(sub.prepare(scope, "c1", "probe_write", {"path": "a", "content": "1"}),
               approved_by="al")  # fmt: skip
    assert proxy.fired.wait(15), w.log_text()[-3000:]
    # Then the worker gives up waiting, learns what committed, and ends the call once
    wait_until(
        lambda: ledger.get(scope, "c1").operation.status is Status.SUCCEEDED,
        15,
        "c1 to succeed:\n" + w.log_text()[-3000:],
    )
    assert landed(stack.sandbox / scope / "a", 10) == "1"
    # and it still serves
    sub.submit(sub.prepare(scope, "c2", "probe_write", {"path": "b", "content": "2"}),
               approved_by="al")  # fmt: skip
    wait_until(
        lambda: ledger.get(scope, "c2").operation.status is Status.SUCCEEDED,
        15,
        "c2 to succeed after the silent statement:\n" + w.log_text()[-3000:],
    )
    assert landed(stack.sandbox / scope / "b", 10) == "2"
    assert [len(ledger.get(scope, c).executions) for c in ("c1", "c2")] == [1, 1]
    assert sorted(e["key"] for e in stack.effects() if e["scope"] == scope) == [
        "probe_write:c1",
        "probe_write:c2",
    ]
    assert ledger.verify().ok
    sub.close()


def test_cli_submit__its_statement_never_answered__one_line_then_the_call_is_found_existing(
    stack: Stack, scope: str
) -> None:
    # Given the CLI's database behind a proxy that falls silent on the submit's statement
    args = ("submit", "--scope", scope, "--tool-call-id", "c1", "--tool", "probe_write",
            "--args", '{"path": "a", "content": "1"}', "--approved-by", "al")  # fmt: skip
    with silent_on(stack, "submit") as (db, proxy):
        # When a call is submitted: its statement commits, its answer never comes
        code, out, err = toolledger(stack, *args, db=db, lease_seconds="4")
        assert proxy.fired.is_set()
    # Then one line, exit 1 (it waited for ever), and the same submit again finds the call
    assert (code, out) == (1, ""), err
    assert err.startswith("toolledger: error: database unavailable: no answer in 2 s"), err
    assert len(err.strip().splitlines()) == 1, err
    code, out, err = toolledger(stack, *args)
    assert code == 0 and out.startswith("existing:"), (out, err)
