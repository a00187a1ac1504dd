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
