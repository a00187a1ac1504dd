"""A malformed message on the job queue (a body Celery cannot make a request of, no task id,
a task name that is not text, time limits that are not seconds): refused and dropped, the worker
consuming on — never stopped, never restarting its consumer for ever. Before 2026-12-07 a body
``"x"``, a list for a task name or a time limit ``["a", "b"]`` (prefork) stopped the worker
("Unrecoverable error"), a message without an id restarted its consumer once a second; either
way the message was restored, unacked, for the next worker to take: one message stopped the
fleet. Real worker, real Redis, raw messages published beside the job's."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from toolledger.config import Settings
from toolledger.harness.processes import service_env, stop_all, toolledger_argv, worker_process
from toolledger.worker.app import create_app

QUEUE = "toolledger"


def _headers(**change: Any) -> dict[str, Any]:
    headers = {"lang": "py", "task": "toolledger.execute", "id": str(uuid.uuid4()),
               "root_id": None, "parent_id": None, "group": None, "retries": 0, "eta": None,
               "expires": None, "timelimit": [None, None], "argsrepr": "", "kwargsrepr": "",
               "origin": "test", "ignore_result": True}  # fmt: skip
    headers.update(change)
    return headers


_GOOD = json.dumps([["s", "k", 1], {}, {"callbacks": None, "errbacks": None}])
POISON = {
    "a string body": ('"hello"', _headers()),
    "two parts": (json.dumps([1, 2]), _headers()),
    "no task id": (_GOOD, {k: v for k, v in _headers().items() if k != "id"}),
    "time limits of text": (_GOOD, _headers(timelimit=["a", "b"])),
    "a list for a task name": (_GOOD, _headers(task=["toolledger.execute"])),
}
#: Refused as an invalid task (the others: an unknown message, "Wrong destination")
INVALID = 4


def _publish(broker: str, prefix: str, body: str, headers: dict[str, Any]) -> None:
    exchange = Exchange(QUEUE, type="direct")
    with Connection(broker, transport_options={"global_keyprefix": prefix}) as conn:
        conn.Producer().publish(
            body.encode(), exchange=exchange, routing_key=QUEUE,
            declare=[Queue(QUEUE, exchange, routing_key=QUEUE)],
            content_type="application/json", content_encoding="utf-8", headers=headers,
        )  # fmt: skip


def redis_env(redis_server: str, redis_prefix: str, tmp_path: Path, **more: str) -> dict[str, str]:
    """A worker's and the CLI's environment: an embedded ledger, the Redis broker at this
    test's prefix, the queue QUEUE."""
    return service_env(
        db=f"sqlite:///{tmp_path / 'ledger.db'}",
        broker=redis_server,
        broker_prefix=redis_prefix,
        sandbox=str(tmp_path / "sandbox"),
        home=str(tmp_path / "home"),
        metrics="off",
        queue=QUEUE,
        **more,
    )


def cli_of(env: dict[str, str]) -> Callable[..., dict]:
    """``toolledger --json ARGV`` in ``env``, its JSON answer (exit 0 asserted)."""

    def cli(*argv: str) -> dict:
        done = subprocess.run([*toolledger_argv(), "--json", *argv], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    return cli


def submit_write(cli: Callable[..., dict], content: str) -> None:
    """Call c1 of scope s, a write of ``content`` to a.txt, submitted approved."""
    args = json.dumps({"path": "a.txt", "content": content})
    cli("submit", "--scope", "s", "--tool-call-id", "c1", "--tool", "write_file",
        "--args", args, "--approved-by", "al")  # fmt: skip


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_worker__a_malformed_message_is_dropped_and_the_worker_goes_on(
    redis_server: str,
    redis_prefix: str,
    tmp_path: Path,
    pool: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = redis_env(redis_server, redis_prefix, tmp_path)

    cli = cli_of(env)
    worker = worker_process("poison", env, tmp_path / "logs", pool=pool, concurrency=2)
    worker.start()
    try:
        worker.wait_ready(60)
        for body, headers in POISON.values():
            _publish(redis_server, redis_prefix, body, headers)
        submit_write(cli, "after")
        # and the same job again from a finalized app, as the sweep's re-publication is sent:
        # Celery adds the app's own time limits to it, which a worker must take
        for name, value in env.items():
            if name.startswith("TOOLLEDGER_"):
                monkeypatch.setenv(name, value)
        app = create_app(Settings.from_env())
        app.loader.import_default_modules()
        app.finalize()
        app.toolledger_publish("s", "write_file:c1", 1)
        got = cli("wait", "--scope", "s", "--tool-call-id", "c1", "--timeout", "20")
        assert got["status"] == "succeeded", (got, worker.log_text()[-3000:])
        time.sleep(1.5)  # a consumer restart (the KeyError) comes a second after the last
        log = worker.log_text()
        assert worker.alive(), log[-3000:]
        assert "Unrecoverable error" not in log
        assert "Connection to broker lost" not in log, log[-3000:]
        assert log.count("Received invalid task message: malformed") == INVALID, log[-3000:]
        assert "Received and deleted unknown message" in log
        assert "write_file:c1#1: not claimed" in log, log[-3000:]  # the finalized app's copy
        client = redis.Redis.from_url(redis_server)
        try:  # dropped, not restored to the queue for the next worker
            assert client.llen(f"{redis_prefix}{QUEUE}") == 0
        finally:
            client.close()
    finally:
        stop_all([worker])


#: Items pushed onto the queue's Redis list as they are, not kombu messages: before
#: 2026-12-07 each stopped the worker that popped it ("Unrecoverable error": a
#: JSONDecodeError, or a KeyError/TypeError building the message), one worker per item.
RAW = [
    b"garbage",
    b"[" * 50_000,
    b'"x"',
    b"{}",
    b'{"properties": 5}',
    b'{"body": "x", "properties": {}}',
    b'{"body": "x", "headers": 5, "properties": {"delivery_tag": "t", "body_encoding": "base64"}}',
    b'{"body": "x", "properties": {"delivery_tag": "t", "body_encoding": "rot13"}}',
]


def each_raw_item_dropped(cli: Callable[..., dict], worker: Any) -> str:
    """After RAW went onto the queue: an approved call still runs, the worker is up and said
    one line an item; its log."""
    submit_write(cli, "after")
    got = cli("wait", "--scope", "s", "--tool-call-id", "c1", "--timeout", "30")
    log: str = worker.log_text()
    assert got["status"] == "succeeded", (got, log[-3000:])
    assert worker.alive(), log[-3000:]
    assert "Unrecoverable error" not in log, log[-3000:]
    assert log.count("that is not a kombu message") == len(RAW), log[-3000:]
    return log


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_worker__an_item_that_is_no_kombu_message_is_dropped_and_the_worker_goes_on(
    redis_server: str, redis_prefix: str, tmp_path: Path, pool: str
) -> None:
    env = redis_env(redis_server, redis_prefix, tmp_path)

    cli = cli_of(env)
    worker = worker_process("raw", env, tmp_path / "logs", pool=pool, concurrency=2)
    worker.start()
    client = redis.Redis.from_url(redis_server)
    try:
        worker.wait_ready(60)
        client.lpush(f"{redis_prefix}{QUEUE}", *RAW)  # popped from the right: in this order
        log = each_raw_item_dropped(cli, worker)
        assert "garbage" not in log  # one line each, never the item's contents
        assert client.llen(f"{redis_prefix}{QUEUE}") == 0
    finally:
        client.close()
        stop_all([worker])


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_embedded_worker__a_row_that_is_no_kombu_message_is_dropped_and_the_worker_goes_on(
    tmp_path: Path, pool: str
) -> None:
    broker_db = tmp_path / "broker.db"
    env = service_env(
        db=f"sqlite:///{tmp_path / 'ledger.db'}",
        broker=f"embedded+sqlite:///{broker_db}",
        sandbox=str(tmp_path / "sandbox"),
        home=str(tmp_path / "home"),
        metrics="off",
        queue=QUEUE,
    )

    cli = cli_of(env)
    worker = worker_process("rows", env, tmp_path / "logs", pool=pool, concurrency=2)
    worker.start()
    try:
        worker.wait_ready(60)
        with contextlib.closing(sqlite3.connect(broker_db, timeout=30)) as db:
            (queue_id,) = db.execute(
                "SELECT id FROM kombu_queue WHERE name = ?", (QUEUE,)
            ).fetchone()
            db.executemany(
                "INSERT INTO kombu_message (visible, timestamp, payload, version, queue_id)"
                " VALUES (1, datetime('now'), ?, 1, ?)",
                [(raw.decode(), queue_id) for raw in RAW],
            )
            db.commit()
        each_raw_item_dropped(cli, worker)
    finally:
        stop_all([worker])


def _its_job_sent_with(
    cli: Callable[..., dict], redis_server: str, redis_prefix: str, headers: dict[str, Any]
) -> None:
    """Call c1 submitted approved, its own job taken off the queue and sent again with
    ``headers``: the only message the worker will see."""
    submit_write(cli, "x")
    client = redis.Redis.from_url(redis_server)
    try:
        client.delete(f"{redis_prefix}{QUEUE}")
    finally:
        client.close()
    body = json.dumps([["s", "write_file:c1", 1], {}, {"callbacks": None, "errbacks": None}])
    _publish(redis_server, redis_prefix, body, headers)


def test_worker__a_message_s_time_limits_are_not_the_worker_s(
    redis_server: str, redis_prefix: str, tmp_path: Path
) -> None:
    """An approved call's job with ``timelimit`` [0.5, 1] (forged, or sent by an app with other
    settings: the sweep's re-publications carry the sending app's): before 2026-12-07 the
    prefork child was killed 0.5 s into the tool, the call left running, then unknown."""
    env = redis_env(redis_server, redis_prefix, tmp_path, failpoints="before_effect=sleep(2)")

    cli = cli_of(env)
    _its_job_sent_with(cli, redis_server, redis_prefix, _headers(timelimit=[0.5, 1]))
    worker = worker_process("limits", env, tmp_path / "logs", pool="prefork", concurrency=1)
    worker.start()
    try:
        worker.wait_ready(60)
        got = cli("wait", "--scope", "s", "--tool-call-id", "c1", "--timeout", "30")
        log = worker.log_text()
        assert got["status"] == "succeeded", (got, log[-3000:])
        assert "Hard time limit" not in log, log[-3000:]
        assert (tmp_path / "sandbox" / "s" / "a.txt").read_text() == "x"
    finally:
        stop_all([worker])


@pytest.mark.parametrize("change", ["eta", "expires"])
def test_worker__a_message_s_schedule_is_not_the_worker_s(
    redis_server: str, redis_prefix: str, tmp_path: Path, change: str
) -> None:
    """An approved call's job with an ``eta`` a day away, or an ``expires`` already past
    (toolledger sends neither: forged, or sent by hand with Celery's options): before
    2026-12-07 the first was held unacked in the worker's memory for a day, the second dropped
    as revoked; either way the call waited, approved, for the sweep. It runs at once now."""
    env = redis_env(redis_server, redis_prefix, tmp_path)

    cli = cli_of(env)
    when = time.time() + (86_400 if change == "eta" else -3_600)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(when))
    _its_job_sent_with(cli, redis_server, redis_prefix, _headers(**{change: stamp}))
    worker = worker_process("schedule", env, tmp_path / "logs", pool="threads", concurrency=1)
    worker.start()
    try:
        worker.wait_ready(60)
        got = cli("wait", "--scope", "s", "--tool-call-id", "c1", "--timeout", "15")
        assert got["status"] == "succeeded", (got, worker.log_text()[-3000:])
        assert (tmp_path / "sandbox" / "s" / "a.txt").read_text() == "x"
    finally:
        stop_all([worker])
