"""Invariant 3 under real concurrency: 8 processes race over the same 1,000 keys."""

from __future__ import annotations

import multiprocessing
import random
import time

import sqlalchemy as sa

from toolledger.ledger.ledger import Ledger

PROCESSES, KEYS = 8, 1000


def _racer(
    url: str, scope: str, index: int, start_at: float, count: int = KEYS
) -> tuple[list[str], int, list[str], float]:
    ledger = Ledger(url)
    keys = [f"write_file:c{i}" for i in range(count)]
    random.Random(index).shuffle(keys)
    won, lost, errors = [], 0, []
    while time.time() < start_at:  # all processes start together
        time.sleep(0.001)
    began = time.perf_counter()
    for key in keys:
        try:
            claim = ledger.claim(scope, key, 1, worker_id=f"p{index}")
        except Exception as exc:  # noqa: BLE001 - every error is a finding here
            errors.append(repr(exc))
            continue
        if claim is None:
            lost += 1
        else:
            won.append(key)
    elapsed = time.perf_counter() - began
    ledger.close()
    return won, lost, errors, elapsed


def test_claim_race__exactly_one_winner_per_key(db_url, scope, record_property):
    ledger = Ledger(db_url)
    for i in range(KEYS):
        ledger.submit(
            scope, f"c{i}", "write_file", {"path": f"f{i}", "content": "x"}, approved_by="a"
        )
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 3.0
    with ctx.Pool(PROCESSES) as pool:
        results = pool.starmap(_racer, [(db_url, scope, i, start_at) for i in range(PROCESSES)])
    won = [key for w, _, _, _ in results for key in w]
    lost = sum(r[1] for r in results)
    errors = [e for r in results for e in r[2]]
    assert errors == []
    assert len(won) == KEYS and len(set(won)) == KEYS  # exactly 1,000 wins, no key twice
    assert lost == (PROCESSES - 1) * KEYS  # every other attempt a clean lost claim
    with ledger.engine.connect() as conn:
        executions = conn.execute(
            sa.text("SELECT count(*) FROM executions WHERE scope = :s"), {"s": scope}
        ).scalar_one()
        running_events = conn.execute(
            sa.text("SELECT count(*) FROM execution_events WHERE scope = :s AND kind = 'running'"),
            {"s": scope},
        ).scalar_one()
    assert executions == KEYS and running_events == KEYS
    wall = max(r[3] for r in results)
    rate = PROCESSES * KEYS / wall
    record_property("claim_attempts_per_s", round(rate))
    print(
        f"\nclaim race: {PROCESSES}x{KEYS} attempts in {wall:.2f}s = {rate:.0f} attempts/s, "
        f"{KEYS} wins, {lost} lost, wins per process {[len(r[0]) for r in results]}"
    )
    ledger.close()


def test_claim_race__a_database_that_defaults_to_serializable(pg_server, pg_template, scope):
    """A DBA's ``default_transaction_isolation = serializable``: the protocol's statements
    are written for READ COMMITTED, and under SERIALIZABLE 136 of 1,200 racing claims failed
    with serialization errors. Every ledger connection now asks for READ COMMITTED, and a
    connection a ``verify`` used went back to the pool SERIALIZABLE (SQLAlchemy restores the
    level it read at the first connect): it now restores READ COMMITTED (a cold review)."""
    import psycopg

    from tests.conftest import fresh_pg_database

    processes, keys = 4, 300
    with fresh_pg_database(pg_server, pg_template) as url:
        with psycopg.connect(pg_server.replace("+psycopg", ""), autocommit=True) as admin:
            name = url.rsplit("/", 1)[1]
            admin.execute(f"ALTER DATABASE {name} SET default_transaction_isolation = serializable")
        ledger = Ledger(url)
        for i in range(keys):
            ledger.submit(
                scope, f"c{i}", "write_file", {"path": f"f{i}", "content": "x"}, approved_by="a"
            )
        ledger.close()
        start_at = time.time() + 3.0
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            results = pool.starmap(
                _racer, [(url, scope, i, start_at, keys) for i in range(processes)]
            )
        ledger = Ledger(url, timeout=7)
        try:  # a verify (REPEATABLE READ) gives its connection back at READ COMMITTED
            assert ledger.verify().ok
            with ledger.engine.connect() as conn:
                level = conn.exec_driver_sql("SHOW transaction_isolation").scalar()
            assert level == "read committed"
        finally:
            ledger.close()
    assert [e for r in results for e in r[2]] == []
    won = [key for w, _, _, _ in results for key in w]
    assert len(won) == keys and len(set(won)) == keys
