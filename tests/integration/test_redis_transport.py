"""The Redis transport of ``worker.redis_transport``: kombu's, with one client per channel.

Messages published and acked through it behave as through kombu's own (under the key prefix,
nothing left unacked), with one client built where kombu builds one per command; the count
is shown failing on kombu's own transport, and a replaced pool gets a client of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Consumer, Queue
from kombu.transport import redis as kombu_redis

from toolledger.config import Settings
from toolledger.worker import redis_transport
from toolledger.worker.app import create_app

MESSAGES = 20


@pytest.fixture
def clients_built(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every Redis client a kombu channel builds (kombu's own and ours)."""
    built: list[Any] = []
    original = kombu_redis.Channel._create_client

    def counted(self: Any, asynchronous: bool = False) -> Any:
        client = original(self, asynchronous)
        built.append(client)
        return client

    monkeypatch.setattr(kombu_redis.Channel, "_create_client", counted)
    yield built


def _publish_and_ack(url: str, prefix: str, *, ours: bool) -> tuple[int, int]:
    """Publish ``MESSAGES`` tasks, take and ack each: (messages seen, keys left unacked)."""
    settings = Settings.from_env({}, broker=url, broker_prefix=prefix, queue="q-transport")
    app = create_app(settings)
    if not ours:
        app.conf.broker_transport = None  # kombu's own, for the control
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, redis_transport.Transport) is ours
        for i in range(MESSAGES):
            app.send_task("t", args=[i], queue=settings.queue, connection=conn)
        seen: list[int] = []

        def take(body: Any, message: Any) -> None:
            seen.append(body[0][0])
            message.ack()

        with Consumer(conn, [Queue(settings.queue)], callbacks=[take], accept=["json"]):
            while len(seen) < MESSAGES:
                conn.drain_events(timeout=5)
    plain = redis.Redis.from_url(url)
    try:
        unacked = plain.hlen(f"{prefix}unacked") + plain.zcard(f"{prefix}unacked_index")
    finally:
        plain.close()
    assert sorted(seen) == list(range(MESSAGES))
    return len(seen), unacked


def test_transport__one_client_per_channel_every_message_through_and_acked(
    redis_server: str, redis_prefix: str, clients_built: list[Any]
):
    seen, unacked = _publish_and_ack(redis_server, redis_prefix, ours=True)
    assert (seen, unacked) == (MESSAGES, 0)
    assert len(clients_built) <= 3  # the shared one, BRPOP's async one: not one per command


def test_transport__the_count_fails_on_kombus_own(
    redis_server: str, redis_prefix: str, clients_built: list[Any]
):
    seen, unacked = _publish_and_ack(redis_server, redis_prefix, ours=False)
    assert (seen, unacked) == (MESSAGES, 0)
    assert len(clients_built) >= 2 * MESSAGES  # one per publish and one per ack


def test_transport__a_replaced_pool_gets_a_client_of_its_own(redis_server: str, redis_prefix):
    app = create_app(Settings.from_env({}, broker=redis_server, broker_prefix=redis_prefix))
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as again:
            assert first is again and first.connection_pool is channel.pool
        channel._disconnect_pools()  # what kombu does when the connection is reset
        with channel.conn_or_acquire() as after:
            assert after is not first and after.connection_pool is channel.pool
            assert after.ping()


# ---------------------------------------------------------------------------- publish


def _take_one(app: Any, queue: str) -> tuple[Any, dict[str, Any]]:
    """The first message on ``queue`` (body, headers), taken by a consumer that starts only
    now: nothing was listening when it was published."""
    got: list[tuple[Any, dict[str, Any]]] = []

    def take(body: Any, message: Any) -> None:
        got.append((body, dict(message.headers)))
        message.ack()

    with (
        app.connection_for_read() as conn,
        Consumer(conn, [Queue(queue)], callbacks=[take], accept=["json"]),
    ):
        while not got:
            conn.drain_events(timeout=5)
    return got[0]


@pytest.mark.parametrize("broker", ["redis", "embedded"])
def test_publish__leaves_the_declaration_to_kombu_on_every_message(
    broker: str, redis_server: str, redis_prefix: str, tmp_path: Any, monkeypatch: Any
) -> None:
    """Every message hands the job queue to kombu's ``maybe_declare``, which declares it
    wherever its connection has not (a new connection, one re-established inside a
    publish's retries). Skipping that per-message check was tried for 7 % of a submit's CPU
    and dropped: two cold reviews lost messages with it (RabbitMQ drops a message to an
    undeclared queue). Every message reaches a consumer that starts afterwards."""
    import kombu.messaging

    from toolledger.worker.tasks import publish

    declared: list[str] = []
    original = kombu.messaging.maybe_declare

    def counted(entity: Any, *args: Any, **kwargs: Any) -> Any:
        declared.append(entity.name)
        return original(entity, *args, **kwargs)

    monkeypatch.setattr(kombu.messaging, "maybe_declare", counted)
    url = redis_server if broker == "redis" else f"embedded+sqlite:///{tmp_path}/broker.db"
    queue = f"q-declared-{broker}"
    settings = Settings.from_env({}, broker=url, broker_prefix=redis_prefix, queue=queue)
    app = create_app(settings)
    try:
        with app.producer_or_acquire() as producer:
            for i in range(3):
                publish(app, settings, "s1", f"write_file:c{i}", 1, producer=producer)
        assert declared == [queue] * 3
        got = [_take_one(app, queue)[0][0][1] for _ in range(3)]
    finally:
        app.close()
    assert sorted(got) == [f"write_file:c{i}" for i in range(3)]


class _One(enum.IntEnum):
    ONE = 1


@pytest.mark.parametrize(
    ("key", "attempt"),
    [
        ("write_file:c1", 2),
        ("it's", 2),
        ("back\\slash", 2),
        ("nbsp\u00a0here", 2),
        ("zw\u200bsp", 2),
        ("\U000e0001" * 512, 2),
        ("k" * 577, 2),
        ("k" * 1100, 2),
        ("write_file:c1", _One.ONE),
        ("write_file:c1", True),
    ],
)
def test_publish__shows_the_arguments_as_celery_would(
    key: str, attempt: int, redis_server: str, redis_prefix: str
) -> None:
    """The message's log representation is made by hand only where it is what Celery's
    ``saferepr`` makes; any other key (quotes, escapes, past 1,024 characters) or attempt
    (not a plain int) is left to Celery."""
    from celery.utils.saferepr import saferepr

    from toolledger.worker.tasks import publish

    settings = Settings.from_env({}, broker=redis_server, broker_prefix=redis_prefix, queue="q-r")
    app = create_app(settings)
    try:
        publish(app, settings, "s1", key, attempt)
        body, headers = _take_one(app, "q-r")
    finally:
        app.close()
    assert body[0] == ["s1", key, attempt] and body[1] == {}
    assert headers["argsrepr"] == saferepr(("s1", key, attempt), 1024)
    assert headers["kwargsrepr"] == "{}"


def test_publish__a_queue_routed_through_a_topic_exchange_is_still_declared(
    redis_server: str, redis_prefix: str
) -> None:
    """A queue an operator binds to a topic exchange is reached through its binding, which
    the first message declares (a message published without it is lost)."""
    from kombu import Exchange

    from toolledger.worker.tasks import publish

    settings = Settings.from_env({}, broker=redis_server, broker_prefix=redis_prefix, queue="q-t")
    app = create_app(settings)
    app.conf.task_queues = [Queue("q-t", Exchange("x-topic", type="topic"), routing_key="q.#")]
    app.conf.task_routes = {"toolledger.execute": {"queue": "q-t", "routing_key": "q.run"}}
    try:
        publish(app, settings, "s1", "write_file:c1", 1)
        body, _ = _take_one(app, "q-t")
    finally:
        app.close()
    assert body[0] == ["s1", "write_file:c1", 1]
