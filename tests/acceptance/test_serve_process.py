"""``toolledger serve`` as its own fresh process: what an in-process test cannot see, because
the test's interpreter has imported everything long before."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import httpx

from toolledger.harness.console_load import start_server

OPERATOR = "cold-operator-secret-0123456789"


def test_serve__the_first_decisions_sent_at_once_to_a_fresh_server_all_answer(
    tmp_path: Path,
) -> None:
    """The first publish imported Celery and kombu on a request's thread; kombu's SQLAlchemy
    transport imports ``sqlalchemy.orm``, which the other threads' statements reach: they saw
    it half-imported and answered 500 (a cold review: 5 runs of 5). The server imports them
    before its first request now. Every decision answers, and each call is decided once."""
    home = tmp_path / "home"
    server, base = start_server(f"sqlite:///{home / 'ledger.db'}", home, OPERATOR, role="operator")
    auth = {"Authorization": f"Bearer {OPERATOR}"}
    try:
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
            (home / "serve.log").read_text()[-3000:],
        )
        statuses = Counter(
            httpx.get(f"{base}/api/calls/cold/c{n}", headers=auth).json()["status"]
            for n in range(calls)
        )
        assert sum(statuses.values()) == calls and statuses["pending_approval"] == 0
    finally:
        server.terminate()
        server.wait(30)
