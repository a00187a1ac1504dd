"""A call submitted through the HTTP API runs on a real ``celery worker``, on both backends,
and its receipt reads back through the API."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.acceptance.conftest import Stack, landed, wait_until
from toolledger.server.app import create_app
from toolledger.server.auth import parse_tokens

OPERATOR = "api-operator-secret-0123456789"
AGENT = "api-agent-secret-0123456789"


def test_submit_through_the_api__a_real_worker_runs_it(world: Stack, scope: str) -> None:
    tokens = parse_tokens(f"ops:operator:{OPERATOR},bot:agent:{AGENT}", "test")
    app = create_app(world.settings(), tokens, metrics=False)
    with TestClient(app) as client:
        bot = {"Authorization": f"Bearer {AGENT}"}
        ops = {"Authorization": f"Bearer {OPERATOR}"}
        body = {
            "scope": scope,
            "tool_call_id": "call_1",
            "tool": "probe_write",
            "args": {"path": "out/1.txt", "content": "written via the API\n"},
        }
        r = client.post("/api/calls", json={**body, "approve": True}, headers=bot)
        assert r.status_code == 403  # an agent never approves its own call
        r = client.post("/api/calls", json=body, headers=bot)
        assert r.status_code == 200 and r.json()["status"] == "pending_approval"
        r = client.post(f"/api/calls/{scope}/call_1/approve", json={"reason": "ok"}, headers=ops)
        assert r.status_code == 200 and r.json()["enqueued"] is True, r.text

        def done() -> dict | None:
            shown = client.get(f"/api/calls/{scope}/call_1", headers=bot).json()
            return shown if shown["status"] == "succeeded" else None

        shown = wait_until(done, 60, "the worker to run the call")
        assert shown["receipt"]["path"] == "out/1.txt"
        assert landed(world.sandbox / scope / "out" / "1.txt") == "written via the API\n"
        events = client.get(f"/api/calls/{scope}/call_1/events", headers=bot).json()["events"]
        actors = [(e["kind"], e["actor"]) for e in events]
        assert ("submitted", "bot") in actors and ("approved", "ops") in actors
