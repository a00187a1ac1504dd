"""The chaos run's fault log counts only faults that did something (helper-96: a Redis flush
of an idle queue, which has no key, and a Postgres crash that found no postmaster were
logged, and could meet "every fault kind at least once" and explain unknowns they did not
cause)."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import redis

from toolledger.harness.chaos.harness import ChaosRun


def test_redis_flush__of_nothing_is_no_fault(redis_server: str) -> None:
    prefix = f"tl-chaos-flush-{uuid.uuid4().hex[:8]}:"
    run: Any = SimpleNamespace(cfg=SimpleNamespace(broker=redis_server), prefix=prefix)
    assert ChaosRun._fault_redis_flush(run) is None
    client = redis.Redis.from_url(redis_server)
    try:
        client.rpush(f"{prefix}toolledger", b"message")
        client.set(f"{prefix}_kombu.binding.x", b"kept")  # the bindings are not flushed
        fault = ChaosRun._fault_redis_flush(run)
        assert fault is not None and fault.detail == {"keys_deleted": 1}, fault
        assert client.get(f"{prefix}_kombu.binding.x") == b"kept"
    finally:
        client.delete(f"{prefix}_kombu.binding.x", f"{prefix}toolledger")
        client.close()


def test_pg_crash__without_a_postmaster_is_no_fault() -> None:
    started: list[bool] = []
    cluster = SimpleNamespace(crash=lambda: None, start=lambda: started.append(True))
    run: Any = SimpleNamespace(cluster=cluster)
    assert ChaosRun._fault_pg_crash(run) is None
    assert started == [True]  # left running, as a crash's end leaves it
