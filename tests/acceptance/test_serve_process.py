"""``toolledger serve`` as its own fresh process: what an in-process test cannot see, because
the test's interpreter has imported everything long before."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from toolledger.harness.processes import toolledger_argv

OPERATOR = "cold-operator-secret-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve__the_first_decisions_sent_at_once_to_a_fresh_server_all_answer(
    tmp_path: Path,
) -> None:
    """The first publish imported Celery and kombu on a request's thread; kombu's SQLAlchemy
    transport imports ``sqlalchemy.orm``, which the other threads' statements reach: they saw
    it half-imported and answered 500 (a cold review: 5 runs of 5). The server imports them
    before its first request now. Every decision answers, and each call is decided once."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLLEDGER_")}
    env.update(
        TOOLLEDGER_HOME=str(tmp_path / "home"),
        TOOLLEDGER_API_TOKENS=f"op:operator:{OPERATOR}",
    )
    server = subprocess.Popen(
        [*toolledger_argv(), "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "serve.log").open("w"),
    )
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {OPERATOR}"}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/api/inbox", headers=auth, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        calls = 40
        for n in range(calls):
            body = {
                "scope": "cold",
                "tool_call_id": f"c{n}",
                "tool": "write_file",
                "args": {"path": "c.txt", "content": "x"},
            }
            assert httpx.post(f"{base}/api/calls", headers=auth, json=body).status_code == 200
        answers: Counter[tuple[str, int]] = Counter()
        start = threading.Barrier(calls * 2)

        def decide(n: int, action: str) -> None:
            start.wait(30)
            r = httpx.post(
                f"{base}/api/calls/cold/c{n}/{action}", headers=auth, json={}, timeout=120
            )
            answers[(action, r.status_code)] += 1

        threads = [
            threading.Thread(target=decide, args=(n, action))
            for n in range(calls)
            for action in ("approve", "reject")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert sum(answers.values()) == calls * 2
        assert all(code in (200, 409) for _action, code in answers), (
            answers,
            (tmp_path / "serve.log").read_text()[-3000:],
        )
        statuses = Counter(
            httpx.get(f"{base}/api/calls/cold/c{n}", headers=auth).json()["status"]
            for n in range(calls)
        )
        assert sum(statuses.values()) == calls and statuses["pending_approval"] == 0
    finally:
        server.terminate()
        server.wait(30)
