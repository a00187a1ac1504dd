"""The Celery app: settings per DESIGN §7, from TOOLLEDGER_*
(``celery -A toolledger.worker.app`` works).

- acks_late + reject_on_worker_lost: a message is acked only after the task ran, and requeued
  when its child dies. Redeliveries are harmless because the ledger claim decides who runs.
- prefetch 1: a worker holds no message it is not about to run.
- one visibility timeout, set in every place Redis reads it (celery#7651, kombu#337), and
  checked at start against lease and time limits: soft < hard < lease < visibility timeout.
- running tasks are NOT cancelled when the broker connection is lost (DESIGN §7 asks for it;
  its one purpose is to keep a redelivered message from running twice, which the claim does):
  cancelled, every tool running on a prefork worker died at each broker blip, its call left
  unknown or not applied (helper-89). They run on; their messages come back, the claim refuses.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery, signals

from toolledger.config import ConfigError, Settings
from toolledger.ledger.db import create_engine, ensure_schema, misconfigured
from toolledger.registry import load_registry
from toolledger.worker import (
    broker,  # registers the embedded transport
    redis_transport,
)
from toolledger.worker.tasks import GuardedTask, publish, register_tasks

log = logging.getLogger("toolledger.worker")

#: Where the worker's tasks live. The sweep registers from recovery (``toolledger.sweep``),
#: which the worker does not import: Celery imports it in the worker and beat processes.
INCLUDE = ["toolledger.recovery.tasks"]
SWEEP = "toolledger.sweep"  # the name recovery.tasks registers; tests check the two agree


#: Seconds a Redis broker's socket may stay silent (a read, a connect) before the command fails.
BROKER_SOCKET_TIMEOUT = 10.0


def transport_options(settings: Settings) -> dict[str, Any]:
    """Options for the broker's transport, only those it understands (kombu's SQLAlchemy
    transport hands every option it does not know to create_engine)."""
    scheme = settings.broker.split("://", 1)[0]
    options: dict[str, Any] = {}
    if scheme in ("redis", "rediss", "redis+socket", "sentinel", "sqs"):
        options["visibility_timeout"] = int(settings.visibility_timeout)
    if scheme in ("redis", "rediss", "redis+socket", "sentinel"):
        # kombu waits for ever by default: a Redis that stops answering (frozen, partitioned,
        # a half-open connection) held every publish, and with them every thread of `serve`
        # (a cold review: 40 approvals committed, no answer for 13 minutes). Bounded, the
        # publish fails and the outbox leaves the call to the sweep. Consumers' BRPOP waits
        # brpop_timeout (1 s) at a time, well within it.
        options["socket_timeout"] = BROKER_SOCKET_TIMEOUT
        options["socket_connect_timeout"] = BROKER_SOCKET_TIMEOUT
    if scheme == f"{broker.ALIAS}+sqlite":
        # its SQLite busy timeout, as the ledger's own: a process frozen holding the broker
        # file's write lock held each publish's try 30 s (a CLI's submit 61 s: a cold review)
        options[broker.BUSY_TIMEOUT_OPTION] = settings.db_timeout
    if settings.broker_prefix and scheme in ("redis", "rediss", "redis+socket", "sentinel"):
        options["global_keyprefix"] = settings.broker_prefix
    return options


def celery_config(settings: Settings) -> dict[str, Any]:
    transport = transport_options(settings)
    plain_redis = settings.broker.startswith("redis://")
    return {
        # kombu's Redis transport less a client built per command (worker.redis_transport)
        "broker_transport": redis_transport.NAME if plain_redis else None,
        "broker_transport_options": transport,
        "result_backend_transport_options": dict(transport),
        "visibility_timeout": int(settings.visibility_timeout),
        # a message Celery cannot read is refused, never a worker stopped (worker.consumer)
        "worker_consumer": "toolledger.worker.consumer:Consumer",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_soft_time_limit": settings.soft_time_limit,
        "task_time_limit": settings.time_limit,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_default_queue": settings.queue,
        "task_routes": {SWEEP: {"queue": settings.sweep_queue}},
        # The beat: one sweep per interval on its own queue; a sweep message that waited
        # too long is dropped (the next one is on its way). Its expiry is the beat's clock
        # read by the sweeper's: at 0.9 of the interval (9 s by default) a beat whose clock
        # was 10 s behind had every sweep dropped, recovery off without a word (a cold
        # review); SWEEP_EXPIRES_AT_LEAST tolerates a skew that large, a backlog bounded by it.
        "beat_schedule": {
            "toolledger-sweep": {
                "task": SWEEP,
                "schedule": settings.sweep_interval,
                "options": {
                    "queue": settings.sweep_queue,
                    "expires": round(max(settings.sweep_interval * 0.9, SWEEP_EXPIRES_AT_LEAST), 3),
                },
            }
        },
        "beat_schedule_filename": str(settings.home / "celerybeat-schedule"),
        "broker_connection_retry_on_startup": True,
        "enable_utc": True,
    }


#: The least time a sweep message waits before it is dropped (seconds): the clock skew
#: between the beat's host and the sweepers' it tolerates.
SWEEP_EXPIRES_AT_LEAST = 300.0

#: How long a starting worker waits for an unreachable database before it gives up.
START_WAIT_SECONDS = 120.0


def forks_children(worker: Any) -> bool:
    """Whether the worker's pool runs tasks in forked children (prefork), where tracing is
    set up in each child (worker_process_init); other pools (threads, solo) run them in the
    process that starts, which is where it must be set up then."""
    from celery.concurrency import get_implementation

    pool = getattr(worker, "pool_cls", None) or "prefork"
    if isinstance(pool, str):  # not resolved yet when worker_init is sent
        pool = get_implementation(pool)
    return str(getattr(pool, "__module__", "")).endswith(".prefork")


#: Seconds a prefork worker's main process may stay, its shutdown begun, once a child of its
#: pool was killed by a signal: past them its exit is stuck, not slow (exit_when_stuck).
#: Three times what Celery's warm shutdown gives each broker write (SHUTDOWN_SOCKET_TIMEOUT).
EXIT_GRACE = 15.0


def _pool_processes(worker: Any) -> list[Any]:
    """The prefork pool's child processes (billiard's), none once the pool is stopped."""
    pool = getattr(getattr(worker, "pool", None), "_pool", None)
    return list(getattr(pool, "_pool", None) or ())


def _killed(process: Any) -> bool:
    """Whether a pool child died of a signal: by the status billiard reaped, or, dead and not
    reaped yet (a zombie), by the wait status /proc gives. Never reaps: billiard does."""
    code = getattr(getattr(process, "_popen", None), "returncode", None)
    if code is not None:
        return bool(code < 0)
    pid = getattr(process, "pid", None)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, TypeError):  # gone (reaped: the status above, next look), no /proc
        return False
    # fields[0] is field 3 of proc(5), the state; field 52, exit_code, is fields[49]
    return fields[0] == b"Z" and len(fields) > 49 and int(fields[49]) & 0x7F != 0


class ShutdownBegun:
    """Set, from the signal handler, when the worker's shutdown begins, with its exit code.
    (A thread is not started in a signal handler: it would take threading's own locks,
    which the interrupted main thread may hold.)"""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.exitcode = 0

    def set(self, exitcode: int) -> None:
        self.exitcode = exitcode
        self.event.set()


def exit_when_stuck(
    worker: Any, begun: ShutdownBegun, grace: float = EXIT_GRACE, tick: float = 0.5
) -> threading.Thread:
    """Once ``begun`` is set, leave the process with its exit code if, ``grace`` seconds
    after a child of ``worker``'s prefork pool was seen killed by a signal, it is still here.

    SIGTERM to the worker's whole process group (systemd's default ``KillMode=control-group``,
    ``timeout``, ``kill -TERM -- -PGID``) kills the pool's children where they stand. One
    dies holding a lock of a queue billiard's pool shares, and the main process waits for
    that lock for ever, in the pool's join (its task handler putting the stop sentinels) or
    in its exit finalizer (``Pool._help_stuff_finish``), as does a child exiting beside it:
    a worker that never exited, 8 times in 8 on the embedded broker here. Nothing is left
    to wait for: what the children ran is in the ledger (the sweep settles it), what they
    did not is still on the broker (acks late) or, on the embedded broker, re-published by
    the sweep's outbox, as after a SIGKILL. A warm shutdown whose children end as they
    should (SIGTERM to the main process alone), however long their tasks, is left alone.

    Since worker.prefork's locks are released when their holder dies, that lock no longer
    holds anyone (10 group SIGTERMs in 10 left in 0.7-2.2 s, none through here): this stays
    as the backstop for a pool it was not swapped into, or a wait no one has seen yet."""

    def leave() -> None:
        # The pool's children as last seen before the shutdown began: a child the same group
        # signal killed may be reaped and out of the pool's list by the first look after it
        # (the test failed so once in CI), and its status is read from what was seen here.
        seen: dict[int, Any] = {}
        while not begun.event.wait(tick):
            seen = {id(p): p for p in _pool_processes(worker)}
        killed_at: float | None = None
        while killed_at is None or time.monotonic() - killed_at < grace:
            # every child seen since: a dead one may leave the pool's list
            seen.update((id(p), p) for p in _pool_processes(worker))
            if killed_at is None and any(_killed(p) for p in seen.values()):
                killed_at = time.monotonic()
            time.sleep(tick)
        log.warning(
            "a child of the worker's pool was killed by a signal %g s ago and the worker's "
            "main process is still here, waiting for a lock of the pool's queues the child "
            "died holding (SIGTERM sent to the whole process group?): leaving now, exit "
            "code %d",
            grace,
            begun.exitcode,
        )
        for handler in logging.getLogger().handlers + log.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(begun.exitcode)

    thread = threading.Thread(target=leave, name="toolledger-exit-when-stuck", daemon=True)
    thread.start()
    return thread


def check_worker_start(settings: Settings) -> None:
    """Refuse to start on inconsistent limits or a schema not at head (created if embedded).
    A database that does not answer yet (restarting, a partition healing) is waited for:
    a supervisor restarting a worker in a loop would only add load."""
    settings.check()
    load_registry(settings.tools)  # a tool module that does not load stops us here (exit 2)
    check_sandbox_format(settings)
    engine = create_engine(settings.db, timeout=settings.db_timeout)
    deadline, pause = time.monotonic() + START_WAIT_SECONDS, 0.5
    try:
        while True:
            try:
                ensure_schema(engine)
                warn_if_not_durable(engine)
                return
            except sa.exc.DBAPIError as exc:
                wrong = misconfigured(exc)
                if wrong is not None:  # nothing to wait for: the URL's options are wrong
                    raise ConfigError(f"TOOLLEDGER_DB: {wrong}") from None
                if time.monotonic() > deadline or not isinstance(exc, sa.exc.OperationalError):
                    raise
                log.warning("waiting for the database: %s", str(exc.orig).splitlines()[0])
                time.sleep(pause)
                pause = min(pause * 2, 5.0)
    finally:
        engine.dispose()  # no connection may cross the fork into pool children


def warn_if_not_durable(engine: sa.Engine) -> str | None:
    """A WARNING (returned, and logged) when the ledger's Postgres runs with ``fsync`` off:
    a crash of its host may then lose commits it acknowledged, the executor's own terminal
    commit among them, after its bytes landed; the sweep would revoke that execution and the
    fence call it "not applied". ``synchronous_commit`` off is overridden in every ledger
    session (``lightreads.pg_session_settings``); ``fsync`` is the server's alone. A warning,
    not a refusal: a throwaway server for tests is often run so."""
    if engine.dialect.name != "postgresql":
        return None  # SQLite: synchronous=FULL on every connection (ledger.db)
    with engine.connect() as conn:
        fsync = str(conn.exec_driver_sql("SHOW fsync").scalar_one())
    if fsync == "on":
        return None
    said = (
        f"the ledger's Postgres runs with fsync {fsync}: a crash of its host can lose commits "
        "it acknowledged, an execution's terminal commit among them after its effect landed, "
        "and the sweep would then call that effect not applied; turn fsync on in production"
    )
    log.warning(said)
    return said


def check_sandbox_format(settings: Settings) -> None:
    """Refuse a sandbox a later version has marked: its landers may rely on what this one
    does not do (``effects.FORMAT``)."""
    from toolledger.effects import effects_of
    from toolledger.sandbox import Sandbox

    effects_of(Sandbox.configured(settings)).check_format()


def check_broker_url(url: str) -> None:
    """ConfigError unless kombu can read ``url``: it takes the URL's query as keywords of its
    Connection, and one it does not take (``redis://h/0?socket_timeout=5``) failed every
    enqueue, "the sweep will re-enqueue it", the call recorded and never published, and a
    worker's start as an internal error (a cold review). Nothing is connected."""
    from kombu.connection import Connection

    broker.register()
    try:
        Connection(url)  # type: ignore[no-untyped-call]
    except (TypeError, KeyError, ValueError) as exc:  # never the URL: it may hold a password
        raise ConfigError(
            f"TOOLLEDGER_BROKER: an option in its query is not one kombu takes ({exc})"
        ) from None


def create_app(settings: Settings | None = None) -> Celery:
    settings = settings or Settings.from_env()
    check_broker_url(settings.broker)
    if settings.broker.startswith(f"{broker.ALIAS}+"):
        Path(settings.broker.split(":///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
    app = Celery(
        "toolledger",
        broker=settings.broker,
        include=INCLUDE,
        set_as_current=False,
        task_cls=GuardedTask,  # a malformed message is dropped, never a worker stopped
    )
    app.conf.update(celery_config(settings))
    # What a task registered from elsewhere (the sweep) needs from this app.
    app.toolledger_settings = settings
    app.toolledger_publish = functools.partial(publish, app, settings)
    register_tasks(app, settings)

    @signals.worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
    def _check(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        from toolledger.ledger import db, writers

        if not forks_children(sender):  # a connection each thread, for its life (fastpath)
            db.reserve_threads(int(getattr(sender, "concurrency", 0) or 0))
        # On SQLite, a worker's writers wait for their turn as long as it takes: an order,
        # not an error, behind a writer frozen in its turn (ledger.writers)
        writers.set_blocking()
        try:
            check_worker_start(settings)
        except Exception as exc:
            log.critical("toolledger worker cannot start: %s", exc)
            raise SystemExit(2) from exc

    @signals.worker_ready.connect(weak=False)  # type: ignore[untyped-decorator]
    def _settle(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            settle_at_start(settings)

    begun: list[ShutdownBegun] = []  # this process's worker's, if its pool forks

    @signals.worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
    def _watch_exit(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            from toolledger.worker.prefork import use_robust_prefork

            use_robust_prefork(sender)  # a killed child no longer takes the queues' locks
        if getattr(sender, "app", None) is app and forks_children(sender):
            begun.append(ShutdownBegun())
            exit_when_stuck(sender, begun[0])

    @signals.worker_shutting_down.connect(weak=False)  # type: ignore[untyped-decorator]
    def _shutting_down(exitcode: int | None = None, **_: Any) -> None:
        for b in begun:  # sent in the main process, from its signal handler
            if not b.event.is_set():
                b.set(int(exitcode or 0))

    @signals.task_revoked.connect(weak=False)  # type: ignore[untyped-decorator]
    def _sweep_expired(sender: Any = None, expired: bool = False, **_: Any) -> None:
        if expired and getattr(sender, "name", None) == SWEEP and sender.app is app:
            log.warning(
                "a sweep message expired before it ran (its expiry is the beat's clock, read "
                "by this worker's): if every sweep expires, recovery is off — the beat's "
                "clock is behind this worker's by more than %g s, or the sweepers are that "
                "far behind",
                max(settings.sweep_interval * 0.9, SWEEP_EXPIRES_AT_LEAST),
            )

    observe(app, settings)
    return app


def observe(app: Celery, settings: Settings) -> None:
    """Metrics, traces and log format for this app's worker and beat processes.

    The worker's main process opens the metrics endpoint of its whole process group before
    the pool forks (the children count into multiprocess files); each child sets up its own
    tracer (an exporter thread does not survive a fork). TOOLLEDGER_LOG_FORMAT=json makes
    Celery's handlers write JSON lines with the call's ids."""
    from toolledger.observability import logs, metrics, tracing

    fmt = logs.log_format()
    bound: list[int] = []

    @signals.worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
    def _metrics(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            beat = None
            if (getattr(sender, "options", None) or {}).get("beat"):  # -B: a beat in the group
                beat = metrics.EmbeddedBeat(
                    settings.db, settings.db_timeout, settings.sweep_interval, settings.sweep_grace
                )
            port = metrics.start_worker_metrics(beat=beat)
            if port is not None:
                bound.append(port)
            if not forks_children(sender):
                tracing.configure()  # the executions run in this process (threads, solo)

    @signals.worker_ready.connect(weak=False)  # type: ignore[untyped-decorator]
    def _say_metrics(sender: Any = None, **_: Any) -> None:
        # The endpoint opened before Celery set up its logging, which dropped the line saying
        # where (a port of 0 is any free one): said again once the worker is ready.
        if getattr(sender, "app", None) is app:
            for port in bound:
                metrics.log.info("metrics at %s", metrics.endpoint(port, metrics.metrics_addr()))

    @signals.worker_process_init.connect(weak=False)  # type: ignore[untyped-decorator]
    def _child(**_: Any) -> None:
        tracing.configure()

    @signals.worker_process_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
    def _child_exit(pid: int | None = None, **_: Any) -> None:
        metrics.worker_child_exited(pid or os.getpid())
        tracing.flush()  # the child leaves by os._exit: its batch of spans, or they are lost

    @signals.beat_init.connect(weak=False)  # type: ignore[untyped-decorator]
    def _beat(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            from toolledger.ledger.ledger import Ledger

            tracing.configure()
            if metrics.beat_served_by_group():
                return  # worker -B: the worker's endpoint serves this beat's gauges
            ledger = Ledger(settings.db, timeout=settings.db_timeout)
            metrics.start_beat_metrics(
                ledger, settings.sweep_interval, sweep_grace=settings.sweep_grace
            )

    @signals.after_setup_logger.connect(weak=False)  # type: ignore[untyped-decorator]
    @signals.after_setup_task_logger.connect(weak=False)  # type: ignore[untyped-decorator]
    def _logs(logger: logging.Logger | None = None, **_: Any) -> None:
        if logger is not None and fmt == "json":  # text: Celery's own format, unchanged
            logs.restyle(fmt, logger)


def settle_at_start(settings: Settings) -> None:
    """What a crash of this host left in the sandbox: spooled results recorded, committed
    effects landed, revoked ones dropped (the sweep does it too, every interval)."""
    from toolledger.effects import effects_of
    from toolledger.ledger.ledger import Ledger
    from toolledger.sandbox import Sandbox

    ledger = Ledger(settings.db, timeout=settings.db_timeout)
    try:
        landing = effects_of(Sandbox.configured(settings)).settle(ledger, actor="worker-start")
        if any(landing.to_json().values()):
            log.info("settled the sandbox at start: %s", landing.to_json())
    except Exception as exc:  # noqa: BLE001 - the sweep settles later; the worker still starts
        log.warning("could not settle the sandbox at start: %s", exc)
    finally:
        ledger.close()


def __getattr__(name: str) -> Celery:
    """``celery -A toolledger.worker.app``: the app from the environment, made on first use —
    importing this module creates nothing and reads no environment."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    global _app
    if _app is None:
        _app = create_app()
    return _app


_app: Celery | None = None
