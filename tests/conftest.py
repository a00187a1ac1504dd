"""Shared fixtures: real Postgres and Redis, a fresh database per test module, both backends.

- Postgres: one migrated template per session, cloned per module (CREATE DATABASE … TEMPLATE).
- SQLite: one migrated template file per session, copied per module.
- ``db_url`` is parametrised over both backends: a test written once runs on both.
- Redis: a key prefix per test (kombu's ``global_keyprefix``), deleted afterwards.
- A service that does not answer: testcontainers if a Docker engine runs here; otherwise a
  loud skip locally, and a failure under CI=true.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from toolledger.harness import scratch
from toolledger.ledger.db import create_engine, upgrade
from toolledger.ledger.ledger import Ledger

CI = os.environ.get("CI", "").lower() == "true"
PG_URL = os.environ.get("TOOLLEDGER_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TOOLLEDGER_TEST_REDIS", "redis://127.0.0.1:6379/0")


def missing_service(name: str, reason: str) -> None:
    """Skip loudly, or fail under CI=true: a missing service is never a silent pass."""
    message = f"{name} is not reachable ({reason})"
    if CI:
        pytest.fail(f"{message}; under CI=true a missing service is a failure", pytrace=False)
    pytest.skip(f"{message}; start it (see README) - skipped locally, fails under CI=true")


def docker_engine_runs() -> bool:
    if not shutil.which("docker"):
        return False
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    return False


# ---------------------------------------------------------------------------- Postgres


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """A URL of a Postgres where we may create databases."""
    try:
        engine = create_engine(PG_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        engine.dispose()
        yield PG_URL
        return
    except sa.exc.OperationalError as exc:
        reason = str(exc.orig).strip().splitlines()[0]
    if docker_engine_runs():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:15.8-alpine", driver="psycopg") as container:
            yield container.get_connection_url()
        return
    missing_service("PostgreSQL", reason)


@pytest.fixture(scope="session")
def pg_template(pg_server: str) -> Iterator[str]:
    """A migrated database that every module's database is cloned from."""
    name = scratch.new_name("tl_tpl")
    scratch.create_database(pg_server, name, migrate=True)
    yield name
    scratch.drop_database(pg_server, name)


def fresh_pg_database(server: str, template: str) -> contextlib.AbstractContextManager[str]:
    return scratch.scratch_database(server, "tl_t", template=template)


@pytest.fixture(scope="module")
def pg_url(pg_server: str, pg_template: str) -> Iterator[str]:
    """A fresh, migrated Postgres database for this test module."""
    with fresh_pg_database(pg_server, pg_template) as url:
        yield url


@pytest.fixture(scope="session")
def pgbouncer(pg_server: str) -> Iterator[str]:
    """A PgBouncer in session pooling mode in front of ``pg_server``, on a port of its own:
    the URL of the same server through it (a database's name may be swapped in)."""
    import pwd
    import socket
    import time

    exe = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if Path(p).is_file()), None
    )
    if exe is None:
        missing_service("PgBouncer", "no pgbouncer executable: apt-get install pgbouncer")
    server = sa.make_url(pg_server)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Not under pytest's base temp (0700, root's): the server's user must reach its files.
    home = Path(tempfile.mkdtemp(prefix="toolledger-pgbouncer-"))
    # A server that asks for a password (a testcontainers one): PgBouncer logs in with the one
    # in its auth file, and asks clients for it; trust otherwise (this machine's server).
    password = server.password or ""
    quoted = [str(v).replace('"', '""') for v in (server.username, password)]
    (home / "users.txt").write_text(f'"{quoted[0]}" "{quoted[1]}"\n')
    (home / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={server.host or '127.0.0.1'} port={server.port or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = {'plain' if password else 'trust'}\nauth_file = {home / 'users.txt'}\n"
        "pool_mode = session\nmax_client_conn = 400\ndefault_pool_size = 60\n"
    )
    argv = [exe, str(home / "pgbouncer.ini")]
    if os.geteuid() == 0:  # PgBouncer will not run as root: as the server's own user
        user = pwd.getpwnam("postgres")
        for path in (home, *home.iterdir()):
            os.chown(path, user.pw_uid, user.pw_gid)
        argv[1:1] = ["-u", "postgres"]
    log = (home / "pgbouncer.log").open("wb")  # its log goes to stderr, opened here
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                said = (home / "pgbouncer.log").read_text(errors="replace").strip()
                pytest.fail(f"PgBouncer did not start: {said or 'no port'}")
            time.sleep(0.05)
        yield server.set(port=port).render_as_string(hide_password=False)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(home, ignore_errors=True)


# ---------------------------------------------------------------------------- SQLite


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "ledger.db"
    engine = create_engine(f"sqlite:///{path}")
    upgrade(engine)
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    engine.dispose()
    return path


def fresh_sqlite_database(template: Path, directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "ledger.db"
    shutil.copyfile(template, path)
    return f"sqlite:///{path}"


@pytest.fixture(scope="module")
def sqlite_url(sqlite_template: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh, migrated SQLite database (WAL) for this test module."""
    return fresh_sqlite_database(sqlite_template, tmp_path_factory.mktemp("sqlite"))


# ---------------------------------------------------------------------------- both


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def db_url(backend: str, request: pytest.FixtureRequest) -> str:
    """A fresh ledger database for this module, on each backend in turn."""
    return str(request.getfixturevalue("pg_url" if backend == "postgres" else "sqlite_url"))


@pytest.fixture(scope="module")
def ledger(db_url: str) -> Iterator[Ledger]:
    led = Ledger(db_url)
    yield led
    led.close()


@pytest.fixture
def fresh_db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of its own for one test (global checks such as verify or list)."""
    if backend == "postgres":
        server = request.getfixturevalue("pg_server")
        template = request.getfixturevalue("pg_template")
        with fresh_pg_database(server, template) as url:
            yield url
    else:
        yield fresh_sqlite_database(request.getfixturevalue("sqlite_template"), tmp_path / "db")


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A CLI run in-process (``toolledger execute`` calls ``logging.basicConfig``) points the
    root logger at that test's captured stderr; a later test's warnings must not go to that
    closed stream ("--- Logging error ---" in its own stderr)."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if type(h) is logging.StreamHandler and h not in before:
            root.removeHandler(h)
    root.setLevel(level)


_scopes = itertools.count(1)


@pytest.fixture
def scope() -> str:
    """A scope no other test uses: tests sharing a module database never see each other."""
    return f"t{next(_scopes)}-{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------------------- Redis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
    try:
        client.ping()
        yield REDIS_URL
        return
    except redis.RedisError as exc:
        reason = str(exc)
    finally:
        client.close()
    if docker_engine_runs():
        from testcontainers.redis import RedisContainer

        with RedisContainer("redis:7.2-alpine") as container:
            host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
            yield f"redis://{host}:{port}/0"
        return
    missing_service("Redis", reason)


@pytest.fixture
def redis_prefix(redis_server: str) -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    import redis

    prefix = f"tltest-{uuid.uuid4().hex[:10]}:"
    yield prefix
    client = redis.Redis.from_url(redis_server)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()
