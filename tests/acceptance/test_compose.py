"""docker-compose.yml, validated by Debian's docker-compose (`make compose-test` runs it for real)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import missing_service
from toolledger.config import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    if not shutil.which("docker-compose"):
        missing_service("docker-compose", "apt-get install docker-compose")
    proc = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_compose__validates_with_the_services_of_the_stack(compose):
    assert set(compose["services"]) == {
        "postgres",
        "redis",
        "db-roles",
        "migrate",
        "sandbox-init",
        "worker",
        "sweeper",
        "beat",
        "serve",
        "prometheus",
    }
    # Prometheus only on request (docker compose --profile monitoring up)
    assert compose["services"]["prometheus"]["profiles"] == ["monitoring"]


def test_compose__serve_on_loopback_with_tokens_from_the_environment(compose):
    serve = compose["services"]["serve"]
    assert serve["command"][:1] == ["serve"] and "--insecure-local" not in serve["command"]
    assert all(p.startswith("127.0.0.1:") for p in serve["ports"]), serve["ports"]
    assert "TOOLLEDGER_API_TOKENS" in serve["environment"]
    assert serve["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_compose__images_pinned_and_health_checked(compose):
    services = compose["services"]
    for name in ("postgres", "redis"):
        image = services[name]["image"]
        assert ":" in image and not image.endswith(":latest"), image
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "--maxmemory-policy noeviction" in redis_cmd


@pytest.mark.parametrize(
    ("answer", "healthy"),
    [
        ("PONG", True),
        ("LOADING Redis is loading the dataset in memory", False),
        ("NOAUTH Authentication required.", False),
    ],
)
def test_compose__redis_healthy_only_when_it_answers_pong(compose, tmp_path, answer, healthy):
    """redis-cli exits 0 on an error reply (seen: NOAUTH, exit 0): a healthcheck on its exit
    status called a Redis loading its append-only file, or wanting a password, healthy."""
    check = compose["services"]["redis"]["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL", check
    fake = tmp_path / "redis-cli"  # what redis-cli prints and exits with, as seen
    fake.write_text(f"#!/bin/sh\necho '{answer}'\nexit 0\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    command = check[1].replace("$$", "$")  # compose's escape, kept by `config`, undone at run
    proc = subprocess.run(["sh", "-c", command], env=env, capture_output=True, timeout=10)
    assert (proc.returncode == 0) is healthy, (answer, proc)


def test_compose__migration_first_workers_scalable_one_beat(compose):
    services = compose["services"]
    assert services["migrate"]["command"] == ["db", "upgrade", "--grant", "toolledger_app"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert (
        services["migrate"]["depends_on"]["db-roles"]["condition"]
        == "service_completed_successfully"
    )
    # a new sandbox volume is marked at this version's format (the sweep removes free lock
    # files), a used one left as it is: `--new` only, never the upgrade under running workers
    assert services["sandbox-init"]["command"] == ["sandbox", "upgrade", "--new"]
    for name in ("worker", "sweeper", "beat", "serve"):
        for first in ("migrate", "sandbox-init"):
            assert (
                services[name]["depends_on"][first]["condition"] == "service_completed_successfully"
            ), (name, first)
    assert "container_name" not in services["worker"]  # --scale worker=N must work
    assert services["beat"]["command"] == ["beat"] and "deploy" not in services["beat"]


def test_compose__configured_only_through_toolledger_variables(compose):
    for name in ("migrate", "sandbox-init", "worker", "sweeper", "beat"):
        env = compose["services"][name]["environment"]
        assert env and all(k.startswith("TOOLLEDGER_") for k in env), env
        assert env["TOOLLEDGER_DB"].startswith("postgresql://")
        assert env["TOOLLEDGER_BROKER"].startswith("redis://")


def test_compose__only_the_migration_connects_as_the_databases_owner(compose):
    """The deployment review: every service connected as the owner (a superuser in the
    image). The migration owns the schema and grants the app role the ledger's rows; every
    other service connects as that role, which db-roles makes."""
    import sqlalchemy as sa

    services = compose["services"]
    owner = services["postgres"]["environment"]["POSTGRES_USER"]
    assert sa.make_url(services["migrate"]["environment"]["TOOLLEDGER_DB"]).username == owner
    for name in ("sandbox-init", "worker", "sweeper", "beat", "serve"):
        url = sa.make_url(services[name]["environment"]["TOOLLEDGER_DB"])
        assert url.username == "toolledger_app" != owner, name
    roles = services["db-roles"]
    assert roles["depends_on"]["postgres"]["condition"] == "service_healthy"
    script = (ROOT / "deploy" / "postgres" / "roles.sql").read_text()
    assert "CREATE ROLE toolledger_app LOGIN" in script and "SUPERUSER" not in script


def _option(command: list[str], *names: str) -> str | None:
    for i, arg in enumerate(command):
        if arg in names and i + 1 < len(command):
            return command[i + 1]
    return None


def test_compose__tools_on_threads_and_the_sweep_on_a_worker_of_its_own(compose):
    """The README's production configuration: the tools' workers on the threads pool,
    consuming the job queue only, and the sweep on a prefork worker of its own, so that
    threads held by hung tools cannot hold up the sweep that revokes them. The queue names
    are written out in the file: they must be the ones the settings use by default."""
    defaults = Settings()
    worker = compose["services"]["worker"]["command"]
    sweeper = compose["services"]["sweeper"]["command"]
    assert worker[0] == sweeper[0] == "worker"
    assert _option(worker, "--pool", "-P") == "threads"
    assert _option(worker, "-Q", "--queues") == defaults.queue
    assert _option(sweeper, "--pool", "-P") in (None, "prefork")
    assert _option(sweeper, "-Q", "--queues") == defaults.sweep_queue
    assert _option(sweeper, "--concurrency", "-c") == "1"
    # workers x threads, each thread one connection: far from Postgres's default 100 at 4
    assert int(_option(worker, "--concurrency", "-c") or 0) * 4 <= 60
