"""``serve --workers N`` with the database URL in a secret file (helper-92).

Each of uvicorn's worker processes builds its app from the environment; ``serve`` wrote the
resolved URL there as TOOLLEDGER_DB beside TOOLLEDGER_DB_FILE, every process refused "both
set", and nothing answered. The file's variable is left to them now, the URL (and its
password) kept out of their environment."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from toolledger.harness.processes import service_env, toolledger_argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve__workers_read_the_database_url_from_its_secret_file(tmp_path: Path) -> None:
    secret = tmp_path / "db-url"
    secret.write_text(f"sqlite:///{tmp_path / 'ledger.db'}\n")
    env = service_env(
        home=str(tmp_path / "home"), sandbox=str(tmp_path / "sandbox"), metrics="off",
        db_file=str(secret),
    )  # fmt: skip
    port = _free_port()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [*toolledger_argv(), "serve", "--insecure-local", "--port", str(port), "--workers", "2"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline, answer = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/api/inbox", timeout=2)
                if answer.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        said = (tmp_path / "serve.log").read_text(errors="replace")
        assert answer is not None and answer.status_code == 200, said[-3000:]
        assert "both set" not in said
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        for child in children:
            environ = child.environ()
            assert "TOOLLEDGER_DB" not in environ and environ["TOOLLEDGER_DB_FILE"] == str(secret)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_serve__the_workers_environment_in_the_cases_a_review_found(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """helper-94: a lower-case ``toolledger_db_file`` (the settings read names in any case)
    had the URL written beside it, and every process refused again; ``--db`` over a file
    holding no good URL refused ``--workers`` where one process served."""
    from toolledger.config import Settings
    from toolledger.server.run import _urls_for_workers

    for name in [k for k in os.environ if k.upper().startswith("TOOLLEDGER_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path / "home"))
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text(f"sqlite:///{tmp_path / 'a.db'}\n")
    bad.write_text("not a url\n")
    monkeypatch.setenv("toolledger_db_file", str(good))
    out = _urls_for_workers(Settings.from_env())
    lower = "toolledger_db_file"  # as a user may spell it
    assert "TOOLLEDGER_DB" not in out and os.environ[lower] == str(good)
    monkeypatch.setenv("toolledger_db_file", str(bad))
    given = f"sqlite:///{tmp_path / 'b.db'}"
    out = _urls_for_workers(Settings.from_env(db=given))
    assert out["TOOLLEDGER_DB"] == given and "toolledger_db_file" not in os.environ
    monkeypatch.setenv("TOOLLEDGER_DB", given)  # what a worker process then reads
    assert Settings.from_env().db == given


def _samples(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    want = set(labels.items())
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and want <= set(s.labels.items())
    )


def test_serve__workers_serve_one_sum_of_their_counters_and_the_gauges_once(
    tmp_path: Path,
) -> None:
    """``serve --workers 2``: two processes behind one socket, one scrape target. Each scrape
    was answered by whichever process accepted it, from its own memory: the counter read
    9 11 9 9 11 … for 20 submissions, and increase() invented traffic (a cold review). Now
    every scrape serves the sum of both processes' files, and the ledger's gauges once (not
    doubled). The group's directory (``serve-HOST-PID`` in PROMETHEUS_MULTIPROC_DIR) replaces
    a dead run's at start and is removed at exit."""
    from toolledger.observability.metrics import CACHE_SECONDS

    shared = tmp_path / "prom"
    host = socket.gethostname()
    gone = subprocess.Popen(["true"])
    gone.wait()
    (shared / f"serve-{host}-{gone.pid}").mkdir(parents=True)  # a killed serve's leftovers
    (shared / f"serve-{host}-{gone.pid}" / "counter_1.db").write_bytes(b"old")
    env = service_env(home=str(tmp_path / "home"), sandbox=str(tmp_path / "sandbox"))
    env["PROMETHEUS_MULTIPROC_DIR"] = str(shared)
    port = _free_port()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [*toolledger_argv(), "serve", "--insecure-local", "--port", str(port), "--workers", "2"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{base}/metrics", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError((tmp_path / "serve.log").read_text(errors="replace")[-3000:])
        calls = 12
        for i in range(calls):
            args = {"path": f"f{i}.txt", "content": "x"}
            body = {"scope": "s", "tool_call_id": f"c{i}", "tool": "write_file", "args": args}
            answer = httpx.post(f"{base}/api/calls", json=body, timeout=10)
            assert answer.status_code < 300, answer.text
        time.sleep(CACHE_SECONDS + 0.5)  # each process's cached gauges read anew
        seen = []
        for _ in range(30):  # a connection each: either process may answer
            text = httpx.get(f"{base}/metrics", timeout=10).text
            seen.append(
                (
                    _samples(text, "toolledger_calls_total", status="pending_approval"),
                    _samples(text, "toolledger_calls", status="pending_approval"),
                )
            )
        assert seen == [(calls, calls)] * 30, seen
        assert sorted(p.name for p in shared.iterdir()) == [f"serve-{host}-{proc.pid}"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert list(shared.iterdir()) == []  # removed at exit


def _serve_until_exit(env: dict[str, str], workers: int, limit: float) -> tuple[int | None, str]:
    """``serve --workers N`` run until it exits or ``limit`` s pass (then stopped: None)."""
    argv = [*toolledger_argv(), "serve", "--port", str(_free_port()), "--workers", str(workers)]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        said, _ = proc.communicate(timeout=limit)
        return proc.returncode, said.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        said, _ = proc.communicate(timeout=20)
        return None, said.decode(errors="replace")


def test_serve__workers_whose_ledger_cannot_be_opened_exit_with_its_one_line(
    tmp_path: Path,
) -> None:
    """A ledger ``serve`` cannot open at start (Postgres not answering; a file that is another
    application's database) is one line and exit 1, with ``--workers 2`` as with one process.
    Until 2026-12-07 each of uvicorn's processes died at its start with the whole traceback,
    uvicorn started it again, and again: 78 tracebacks (10,926 lines) in 40 s, for ever,
    nothing answering and ``serve`` never exiting (a cold review)."""
    import sqlite3

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    tokens = "vera:viewer:viewer-secret-0123456789"
    for db in (
        f"postgresql+psycopg://postgres@127.0.0.1:{_free_port()}/none",
        f"sqlite:///{other}",
    ):
        env = service_env(
            home=str(tmp_path / "home"), sandbox=str(tmp_path / "sandbox"), metrics="off",
            db=db, api_tokens=tokens,
        )  # fmt: skip
        code, said = _serve_until_exit(env, 1, 60)
        assert code == 1, said[-2000:]
        alone = said.strip().splitlines()[-1]
        assert alone.startswith("toolledger: error: "), said[-2000:]
        code, said = _serve_until_exit(env, 2, 60)
        assert "Traceback" not in said, said[-3000:]
        assert code == 1, said[-2000:]
        assert said.strip().splitlines()[-1] == alone, said[-2000:]


def test_serve__a_process_started_again_without_its_ledger_says_one_line(
    tmp_path: Path, monkeypatch: Any, capfd: Any
) -> None:
    """A process uvicorn starts again while Postgres is down (the parent checked it only at
    start) exits 1 with one line logged, not its traceback."""
    from toolledger.server.run import app_from_env

    url = f"postgresql+psycopg://postgres@127.0.0.1:{_free_port()}/none"
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for k in [k for k in os.environ if k.startswith("TOOLLEDGER_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TOOLLEDGER_DB", url)
    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TOOLLEDGER_METRICS", "off")
    monkeypatch.setenv("TOOLLEDGER_API_TOKENS", "vera:viewer:viewer-secret-0123456789")
    monkeypatch.setenv("TOOLLEDGER_API_SESSION_KEY", "k" * 32)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    with pytest.raises(SystemExit) as ended:
        app_from_env()
    assert ended.value.code == 1
    said = capfd.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "cannot start: connection failed" in said[0], said
