"""A worker's engine (one built with a timeout) leaves room for the connections the fast path
keeps per thread, and never waits longer than the timeout for one from the pool."""

from __future__ import annotations

from toolledger.ledger.db import create_engine

URL = "postgresql://nobody@127.0.0.1:1/none"  # never connected to: the pool's settings only


def test_engine__a_workers_pool_has_room_for_its_threads_and_a_bounded_wait() -> None:
    worker = create_engine(URL, timeout=7.5)
    assert worker.pool.timeout() == 7.5  # not SQLAlchemy's 30 s: a renewal waits no longer
    assert worker.pool.size() + worker.pool._max_overflow >= 44  # type: ignore[attr-defined]


def test_engine__a_clients_engine_keeps_four_idle_and_room_for_its_threads() -> None:
    """An agent's Client: each thread submitting keeps a connection (the fast path), so 4 + 8
    failed a thirteenth thread after 30 s; overflow connections close when given back."""
    client = create_engine(URL)
    assert client.pool.size() == 4  # kept idle
    assert client.pool.size() + client.pool._max_overflow >= 44  # type: ignore[attr-defined]


def test_engine__a_callers_own_pool_sizes_stand() -> None:
    """The API's reader chose 8 + 16; forcing 40 overflow on it (a cold review) let one
    process take 48 of the server's 100 connections."""
    reader = create_engine(URL, pool_size=8, max_overflow=16)
    assert (reader.pool.size(), reader.pool._max_overflow) == (8, 16)  # type: ignore[attr-defined]
