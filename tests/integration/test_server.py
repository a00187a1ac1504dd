"""The HTTP API and the console's forms (toolledger serve), on both backends.

Every endpoint; every role against every action, allowed and refused; the actor is always
the token's name; scopes a token may not see are 404; CSRF and login; bodies go through the
same input layer as the CLI's."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import pytest
from fastapi.testclient import TestClient

from tests import external_tools
from toolledger.config import ConfigError, Settings
from toolledger.ledger.errors import InvalidIdentifier, NotFound
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.server.app import create_app
from toolledger.server.auth import Authenticator, Token, parse_tokens
from toolledger.server.console import DONE

SECRETS = {
    "vera": "viewer-secret-0123456789",
    "agent-7": "agent-secret-0123456789",
    "ann": "approver-secret-0123456789",
    "otto": "operator-secret-0123456789",
    "scoped": "scoped-secret-0123456789",
}
TOKENS = (
    f"vera:viewer:{SECRETS['vera']},agent-7:agent:{SECRETS['agent-7']},"
    f"ann:approver:{SECRETS['ann']},otto:operator:{SECRETS['otto']},"
    f"scoped:operator:{SECRETS['scoped']}:mine|other"
)


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


@pytest.fixture
def server(fresh_db_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, Ledger]]:
    yield from serving(fresh_db_url, tmp_path)


def serving(
    db_url: str, tmp_path: Path, session_key: bytes | None = None
) -> Iterator[tuple[TestClient, Ledger]]:
    settings = Settings.from_env(
        {
            "TOOLLEDGER_DB": db_url,
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",  # no worker here: enqueue fails
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
            "TOOLLEDGER_TOOLS": "tests.external_tools",
            "TOOLLEDGER_HOME": str(tmp_path / "home"),
        }
    )
    app = create_app(settings, parse_tokens(TOKENS, "test"), metrics=False, session_key=session_key)
    ledger = Ledger(db_url)
    with TestClient(app) as client:
        yield client, ledger
    ledger.close()


def pending(ledger: Ledger, scope: str, call: str, path: str = "a.txt") -> None:
    ledger.submit(scope, call, "write_file", {"path": path, "content": "hello"})


def unknown(ledger: Ledger, scope: str, call: str) -> str:
    ledger.submit(
        scope, call, "write_file", {"path": f"{call}.txt", "content": "x"}, approved_by="setup"
    )
    claim = ledger.claim(scope, f"write_file:{call}", 1, worker_id="w")
    assert claim is not None
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    return claim.execution_id


# ----------------------------------------------------------------------------- endpoints


def test_submit_show_events_list__the_cli_shapes(server: Any, scope: str) -> None:
    client, _ = server
    body = {
        "scope": scope,
        "tool_call_id": "c1",
        "tool": "write_file",
        "args": {"path": "a.txt", "content": "hi"},
    }
    r = client.post("/api/calls", json=body, headers=bearer("agent-7"))
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "pending_approval" and r.json()["outcome"] == "created"
    shown = client.get(f"/api/calls/{scope}/c1", headers=bearer("vera")).json()
    assert set(shown) >= {
        "scope",
        "tool_call_id",
        "tool",
        "idempotency_key",
        "args_sha256",
        "status",
        "executions",
        "receipt",
    }
    assert shown["args"] == body["args"]
    events = client.get(f"/api/calls/{scope}/c1/events", headers=bearer("vera")).json()
    assert [e["kind"] for e in events["events"]] == ["submitted", "pending_approval"]
    assert events["events"][0]["actor"] == "agent-7"  # the token's name, not a field
    listed = client.get("/api/calls", params={"scope": scope}, headers=bearer("vera")).json()
    assert listed["count"] == 1 and listed["calls"][0]["tool_call_id"] == "c1"
    inbox = client.get("/api/inbox", headers=bearer("vera")).json()
    assert inbox["pending_approval"] >= 1
    for dots in (".", ".."):  # a URL path drops them: its console page could not be opened
        r = client.post(
            "/api/calls", json={**body, "tool_call_id": dots}, headers=bearer("agent-7")
        )
        assert r.status_code == 422 and "dot segment" in r.json()["error"], r.text
    listed = client.get("/api/calls", params={"scope": scope}, headers=bearer("vera")).json()
    assert listed["count"] == 1  # nothing recorded


def test_submit__a_dot_id_recorded_before_it_was_refused_is_still_replayed(
    server: Any, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asking again for a call the ledger holds is its replay, never a refusal (which would
    tell the model that a call which took effect had failed): the rule against '.' and '..'
    is for new calls only (a cold review: its first version refused the replay, exit 6)."""
    client, ledger = server
    args = {"path": "dot.txt", "content": "x"}
    with monkeypatch.context() as m:  # as an earlier version recorded it
        m.setattr("toolledger.ledger.ledger.check_new_tool_call_id", lambda tcid: tcid)
        ledger.submit(scope, ".", "write_file", args)
    body = {"scope": scope, "tool_call_id": ".", "tool": "write_file", "args": args}
    r = client.post("/api/calls", json=body, headers=bearer("agent-7"))
    assert r.status_code == 200 and r.json()["outcome"] == "existing", r.text
    with pytest.raises(InvalidIdentifier, match="dot segment"):  # a new one still refused
        ledger.submit(scope, "..", "write_file", args)


def test_list__pages_with_a_cursor(server: Any, scope: str) -> None:
    client, ledger = server
    for i in range(7):
        pending(ledger, scope, f"c{i}", f"f{i}.txt")
    seen, cursor = [], None
    while True:
        params = {"scope": scope, "limit": 3, **({"cursor": cursor} if cursor else {})}
        page = client.get("/api/calls", params=params, headers=bearer("vera")).json()
        seen += [c["tool_call_id"] for c in page["calls"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == [f"c{i}" for i in range(7)] and len(seen) == 7
    bad = client.get("/api/calls", params={"cursor": "garbage"}, headers=bearer("vera"))
    assert bad.status_code == 422 and bad.json()["kind"] == "input"

    def crafted(*position: str) -> str:
        return base64.urlsafe_b64encode(json.dumps(list(position)).encode()).decode()

    login(client, "vera")
    for params in (
        {"cursor": crafted("2020-01-01T00:00:00", "a", "b")},  # a naive time
        {"cursor": crafted("0001-01-01T00:00:00+01:00", "a", "b")},  # before year 1 in UTC
        {"cursor": crafted("9999-12-31T23:59:59-01:00", "a", "b")},  # after 9999 in UTC
        {"cursor": crafted("2020-01-01T00:00:00+00:00", "a\x00", "b")},
        {"cursor": crafted("2020-01-01T00:00:00+00:00", "a", "b\x00")},
        {"scope": "a\x00"},
        {"scope": "../a"},
    ):
        r = client.get("/api/calls", params=params, headers=bearer("vera"))
        assert r.status_code == 422 and r.json()["kind"] == "input", (params, r.text)
        assert "\n" not in r.json()["error"]
        page = client.get("/calls", params=params)  # the console: its error page, no 500
        assert page.status_code == 422, (params, page.text)
        assert page.headers["content-type"].startswith("text/html")
    page = client.get("/calls", params={"review": "abc"})  # a person reads a page, not JSON
    assert page.status_code == 422 and page.headers["content-type"].startswith("text/html")


def test_approve_reject__recorded_in_the_tokens_name(server: Any, scope: str) -> None:
    client, ledger = server
    pending(ledger, scope, "a")
    pending(ledger, scope, "b", "b.txt")
    r = client.post(
        f"/api/calls/{scope}/a/approve",
        json={"reason": "looks right", "by": "someone-else"},
        headers=bearer("ann"),
    )
    assert r.status_code == 422 and "by" in r.json()["error"]  # no actor from the request
    r = client.post(
        f"/api/calls/{scope}/a/approve", json={"reason": "looks right"}, headers=bearer("ann")
    )
    assert r.status_code == 200 and r.json()["status"] == "approved"
    assert r.json()["enqueued"] is False  # no broker here: reported, the sweep re-publishes
    r = client.post(f"/api/calls/{scope}/b/reject", json={}, headers=bearer("ann"))
    assert r.status_code == 200 and r.json()["status"] == "rejected"
    assert ledger.get(scope, "a").operation.decided_by == "ann"
    assert ledger.get(scope, "b").operation.decided_by == "ann"
    again = client.post(f"/api/calls/{scope}/a/approve", json={}, headers=bearer("ann"))
    assert again.status_code == 409 and again.json()["kind"] == "state"


def test_resolve_and_retry(server: Any, scope: str) -> None:
    client, ledger = server
    eid = unknown(ledger, scope, "u1")
    r = client.post(
        f"/api/executions/{eid}/resolve",
        json={"as": "failed", "evidence": " "},
        headers=bearer("otto"),
    )
    assert r.status_code == 422 and "evidence" in r.json()["error"]
    r = client.post(
        f"/api/executions/{eid}/resolve",
        json={"as": "failed", "evidence": "u1.txt does not exist"},
        headers=bearer("otto"),
    )
    assert r.status_code == 200 and r.json()["status"] == "failed"
    last = ledger.events(scope, "u1")[-1]
    assert last.actor == "otto" and "u1.txt" in json.dumps(last.detail)
    r = client.post(
        f"/api/calls/{scope}/u1/retry", json={"reason": "try again"}, headers=bearer("otto")
    )
    assert r.status_code == 200, r.text
    assert r.json()["attempt"] == 2 and r.json()["authorized_by"] == "otto"
    eid2 = unknown(ledger, scope, "u2")
    r = client.post(f"/api/calls/{scope}/u2/retry", json={}, headers=bearer("otto"))
    # write_file is idempotent: no duplicate to accept; the unknown attempt must be settled
    assert r.status_code in (200, 409), r.text
    assert eid2


def test_errors__json_with_the_clis_kinds(server: Any, scope: str) -> None:
    client, ledger = server
    h = bearer("otto")
    assert client.get(f"/api/calls/{scope}/nope", headers=h).status_code == 404
    r = client.post("/api/calls", content=b'{"scope": "s", "scope": "t"}', headers=h)
    assert r.status_code == 422 and "duplicate" in r.json()["error"]
    r = client.post("/api/calls", content=b"\xff\xfe", headers=h)
    assert r.status_code == 422 and r.json()["exit_code"] == 6
    r = client.post("/api/calls", content=b"[1]", headers=h)
    assert r.status_code == 422
    body = {"scope": scope, "tool_call_id": "x", "tool": "no_such_tool", "args": {}}
    assert client.post("/api/calls", json=body, headers=h).status_code == 404
    body = {
        "scope": scope,
        "tool_call_id": "x",
        "tool": "write_file",
        "args": {"path": "../escape", "content": "x"},
    }
    r = client.post("/api/calls", json=body, headers=h)
    assert r.status_code == 422 and r.json()["kind"] == "input"
    body = {
        "scope": scope,
        "tool_call_id": "k",
        "tool": "write_file",
        "args": {"path": "k.txt", "content": "one"},
    }
    assert client.post("/api/calls", json=body, headers=h).status_code == 200
    body["args"] = {"path": "k.txt", "content": "two"}
    r = client.post("/api/calls", json=body, headers=h)
    assert r.status_code == 409 and r.json()["kind"] == "conflict"
    huge = b'{"x": "' + b"a" * (8 << 20) + b'"}'
    r = client.post("/api/calls", content=huge, headers=h)
    assert r.status_code == 413
    chunks = iter([b'{"x": "', *([b"a" * (1 << 20)] * 8), b'"}'])  # no length declared
    r = client.post("/api/calls", content=chunks, headers=h)
    assert r.status_code == 413
    assert ledger.list_calls(scope=scope)[0].tool_call_id == "k"
    assert len(ledger.list_calls(scope=scope)) == 1  # nothing else was recorded


# ----------------------------------------------------------------------------- auth

#: action -> (method, path template, body); {s} scope, {e} execution id.
ACTIONS: dict[str, tuple[str, str, dict[str, Any] | None]] = {
    "list": ("GET", "/api/calls?scope={s}", None),
    "inbox": ("GET", "/api/inbox", None),
    "show": ("GET", "/api/calls/{s}/p", None),
    "events": ("GET", "/api/calls/{s}/p/events", None),
    "submit": (
        "POST",
        "/api/calls",
        {"tool_call_id": "new", "tool": "write_file", "args": {"path": "new.txt", "content": "n"}},
    ),
    "submit_approved": (
        "POST",
        "/api/calls",
        {
            "tool_call_id": "new2",
            "tool": "write_file",
            "args": {"path": "n2.txt", "content": "n"},
            "approve": True,
        },
    ),
    "approve": ("POST", "/api/calls/{s}/p/approve", {"reason": "ok"}),
    "reject": ("POST", "/api/calls/{s}/p/reject", {"reason": "no"}),
    "retry": ("POST", "/api/calls/{s}/u/retry", {"reason": "again"}),
    "resolve": ("POST", "/api/executions/{e}/resolve", {"as": "failed", "evidence": "absent"}),
}
ALLOWED = {
    "vera": {"list", "inbox", "show", "events"},
    "agent-7": {"list", "inbox", "show", "events", "submit"},
    "ann": {"list", "inbox", "show", "events", "approve", "reject"},
    "otto": set(ACTIONS),
}


def test_errors__the_routers_own_carry_the_clis_kinds(server: Any) -> None:
    """No such route answered {"kind": "http", "exit_code": 1}: the API's errors carry the
    CLI's exit code, and a script reading it took a mistyped path for a failure of the
    server (a cold review)."""
    client, _ledger = server
    h = bearer("otto")
    r = client.get("/api/no-such-route", headers=h)
    assert r.status_code == 404 and r.json()["kind"] == "not_found" and r.json()["exit_code"] == 4
    r = client.delete("/api/calls", headers=h)
    assert r.status_code == 405 and (r.json()["kind"], r.json()["exit_code"]) == ("usage", 2)
    # A scope with no call id was redirected (a bare 307 to ".../s1/", whose empty call id
    # then answered as a call): no route is "not found" in the API's shape, never a redirect
    for path in ("/api/calls/s1", "/api/inbox/", "/api/calls/"):
        r = client.get(path, headers=h, follow_redirects=False)
        assert (r.status_code, r.json()["kind"], r.json()["exit_code"]) == (404, "not_found", 4)
    for path in ("/api/calls/s1/", "/api/calls/s1//events"):  # an empty call id: refused
        r = client.get(path, headers=h, follow_redirects=False)
        assert (r.status_code, r.json()["kind"], r.json()["exit_code"]) == (422, "input", 6)


@pytest.mark.parametrize("action", sorted(ACTIONS))
@pytest.mark.parametrize("who", sorted(ALLOWED))
def test_every_role_against_every_action(server: Any, scope: str, who: str, action: str) -> None:
    client, ledger = server
    pending(ledger, scope, "p")
    eid = unknown(ledger, scope, "u")
    method, path, body = ACTIONS[action]
    if body is not None and method == "POST" and path == "/api/calls":
        body = {**body, "scope": scope}
    url = path.format(s=scope, e=eid)
    r = client.request(method, url, json=body, headers=bearer(who))
    before = ledger.events(scope, "p") + ledger.events(scope, "u")
    if action in ALLOWED[who]:
        assert r.status_code == 200, (who, action, r.text)
        if method == "POST":
            actors = {e.actor for e in ledger.events(scope, "p") + ledger.events(scope, "u")}
            new_calls = [
                c
                for c in ledger.list_calls(scope=scope)
                if c.tool_call_id and c.tool_call_id.startswith("new")
            ]
            for c in new_calls:
                actors |= {e.actor for e in ledger.events(scope, c.tool_call_id)}
            assert who in actors  # recorded in the token's name
    else:
        assert r.status_code == 403, (who, action, r.text)
        assert r.json()["kind"] == "forbidden"
        after = ledger.events(scope, "p") + ledger.events(scope, "u")
        assert after == before and not [
            c for c in ledger.list_calls(scope=scope) if c.tool_call_id.startswith("new")
        ]


def test_no_token__401_and_wrong_token__401(server: Any, scope: str) -> None:
    client, ledger = server
    pending(ledger, scope, "p")
    for headers in (
        {},
        {"Authorization": "Bearer not-a-token-at-all-000"},
        {"Authorization": f"Basic {SECRETS['otto']}"},
    ):
        r = client.get(f"/api/calls/{scope}/p", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = client.post(f"/api/calls/{scope}/p/approve", json={}, headers=headers)
        assert r.status_code == 401
    assert ledger.get(scope, "p").operation.status is Status.PENDING_APPROVAL


def test_scoped_token__other_scopes_do_not_exist(server: Any) -> None:
    client, ledger = server
    pending(ledger, "mine", "p")
    pending(ledger, "theirs", "p")
    eid = unknown(ledger, "theirs", "u")
    h = bearer("scoped")
    assert client.get("/api/calls/mine/p", headers=h).status_code == 200
    missing = client.get("/api/calls/theirs/nope", headers=h)
    hidden = client.get("/api/calls/theirs/p", headers=h)
    assert hidden.status_code == 404 and hidden.json()["kind"] == "not_found"
    assert hidden.json()["error"].replace("'p'", "'nope'") == missing.json()["error"]
    assert client.get("/api/calls/theirs/p/events", headers=h).status_code == 404
    assert client.post("/api/calls/theirs/p/approve", json={}, headers=h).status_code == 404
    assert (
        client.post(
            f"/api/executions/{eid}/resolve", json={"as": "failed", "evidence": "x"}, headers=h
        ).status_code
        == 404
    )
    listed = client.get("/api/calls", headers=h).json()
    assert {c["scope"] for c in listed["calls"]} == {"mine"}
    assert client.get("/api/calls?scope=theirs", headers=h).json()["count"] == 0
    assert client.get("/api/inbox", headers=h).json()["pending_approval"] == 1
    body = {
        "scope": "theirs",
        "tool_call_id": "z",
        "tool": "write_file",
        "args": {"path": "z.txt", "content": "z"},
    }
    assert client.post("/api/calls", json=body, headers=h).status_code == 404
    assert ledger.get("theirs", "p").operation.status is Status.PENDING_APPROVAL


def test_tokens__parsing_refuses_what_is_unsafe() -> None:
    ok = parse_tokens("a:viewer:0123456789abcdef # comment\nb:agent:fedcba9876543210:s1|s2", "t")
    assert [(t.name, t.role.value, t.scopes) for t in ok] == [
        ("a", "viewer", None),
        ("b", "agent", frozenset({"s1", "s2"})),
    ]
    for bad in (
        "a:viewer",
        "a:root:0123456789abcdef",
        "a:viewer:short",
        "a:viewer:0123456789abcdef,a:agent:fedcba9876543210",
        "a:viewer:0123456789abcdef,b:agent:0123456789abcdef",
        "a:viewer:0123456789abcdef:bad/scope",
        "a\x00:viewer:0123456789abcdef",
    ):
        with pytest.raises(ConfigError):
            parse_tokens(bad, "t")


def test_tokens__a_hash_inside_a_secret_is_the_secrets_and_no_error_quotes_a_field() -> None:
    """A cold review: ``0123456789abcdef#Xq9!mZ2@pL7`` was cut at the "#" (the full secret
    refused, its first 16 characters taken); an entry written out of order printed the
    secret in the error that stopped the server."""
    (t,) = parse_tokens("ana:operator:0123456789abcdef#Xq9!mZ2@pL7", "TOOLLEDGER_API_TOKENS")
    assert t.secret == "0123456789abcdef#Xq9!mZ2@pL7"
    (t,) = parse_tokens("# the operators\nana:operator:0123456789abcdef # Ana's", "file")
    assert t.secret == "0123456789abcdef"
    secret = "Zk3v9QpL7mW2xR8tY4nB"
    for out_of_order in (f"{secret}:operator:ana", f"ana:{secret}:operator"):
        with pytest.raises(ConfigError) as refused:
            parse_tokens(out_of_order, "t")
        assert secret not in str(refused.value)


def test_no_tokens__refuses_to_build_unless_insecure_local(tmp_path: Path) -> None:
    settings = Settings.from_env(
        {"TOOLLEDGER_DB": f"sqlite:///{tmp_path}/l.db", "TOOLLEDGER_HOME": str(tmp_path)}
    )
    with pytest.raises(ConfigError, match="no API tokens"):
        create_app(settings, [], metrics=False)


def test_sessions__signed_expiring_and_ended_by_rotation() -> None:
    t = Token("ann", parse_tokens("ann:approver:0123456789abcdef", "t")[0].role, "0123456789abcdef")
    auth = Authenticator([t], b"k" * 32)
    cookie = auth.session_for(t, now=1000.0)
    assert auth.by_session(cookie, now=1001.0) == t
    assert auth.by_session(cookie, now=1000.0 + 9 * 3600) is None  # expired
    assert auth.by_session(cookie[:-2] + "AA", now=1001.0) is None  # forged signature
    rotated = Authenticator([Token("ann", t.role, "another-secret-0123")], b"k" * 32)
    assert rotated.by_session(cookie, now=1001.0) is None
    assert Authenticator([t], b"j" * 32).by_session(cookie, now=1001.0) is None
    assert auth.check_csrf(cookie, auth.csrf_for(cookie))
    assert not auth.check_csrf(cookie, auth.csrf_for(cookie + "x"))
    assert not auth.check_csrf(cookie, None)
    assert not auth.check_csrf(cookie, "é\udcff")  # any text: refused, never an error
    assert auth.by_session("abc.\xe9", now=1001.0) is None
    assert auth.by_session(cookie.split(".")[0] + ".é", now=1001.0) is None


def test_sessions__a_cookie_without_a_well_formed_session_id_is_refused() -> None:
    """A cookie signed before session ids (migration 0005) names no session a logout could
    end: it is refused, and its holder logs in again."""
    t = parse_tokens("ann:approver:0123456789abcdef", "t")[0]
    auth = Authenticator([t], b"k" * 32)
    good = auth.session_of(auth.session_for(t, now=1000.0), now=1001.0)
    assert good is not None and len(good.id) == 22 and good.expires == 1000 + 8 * 3600
    fingerprint = auth._fingerprint(t)
    for body in (
        {"n": "ann", "f": fingerprint, "e": 9999999999},
        {"n": "ann", "f": fingerprint, "s": "short", "e": 9999999999},
        {"n": "ann", "f": fingerprint, "s": 12345, "e": 9999999999},
        {"n": "ann", "f": fingerprint, "s": "a" * 21 + "/", "e": 9999999999},
    ):
        payload = base64.urlsafe_b64encode(json.dumps(body).encode()).rstrip(b"=").decode()
        cookie = f"{payload}.{auth._sign(payload)}"  # signed with the key: only the id is wrong
        assert auth.by_session(cookie, now=1001.0) is None, body


def test_sessions__the_cookie_is_no_oracle_for_the_secret() -> None:
    """The cookie is readable by whoever holds it: its fingerprint of the token is keyed
    with the session key, so a weak secret cannot be found from it offline."""
    t = parse_tokens("ann:approver:0123456789abcdef", "t")[0]
    cookie = Authenticator([t], b"k" * 32).session_for(t, now=1000.0)
    body = json.loads(base64.urlsafe_b64decode(cookie.split(".")[0] + "=="))
    unkeyed = hashlib.sha256(f"{t.name}\0{t.secret}".encode()).hexdigest()[:32]
    assert body["f"] != unkeyed
    other = Authenticator([t], b"j" * 32).session_for(t, now=1000.0)
    assert json.loads(base64.urlsafe_b64decode(other.split(".")[0] + "=="))["f"] != body["f"]


# ----------------------------------------------------------------------------- console


def login(client: TestClient, who: str) -> None:
    page = client.get("/login")
    nonce = re.search(r'name="nonce" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    r = client.post(
        "/login", data={"nonce": nonce, "token": SECRETS[who], "next": "/"}, follow_redirects=False
    )
    assert r.status_code == 303 and "toolledger_session" in r.cookies


def post_login_form(client: TestClient, html: str) -> tuple[str, Any]:
    """Ann logs in through the form ``html`` shows, its ``next`` as the page wrote it: that
    ``next``, and the answer (not followed)."""
    nonce = re.search(r'name="nonce" value="([^"]+)"', html).group(1)  # type: ignore[union-attr]
    target = re.search(r'name="next" value="([^"]+)"', html).group(1)  # type: ignore[union-attr]
    data = {"nonce": nonce, "token": SECRETS["ann"], "next": target}
    return target, client.post("/login", data=data, follow_redirects=False)


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)  # type: ignore[union-attr]


def test_console__login_leads_back_to_a_call_whose_id_is_escaped(server: Any, scope: str) -> None:
    """Logging in led to "/" instead of back to a call whose id holds a zero-width space (the
    page wrote its path escaped, ``\\u200b``, which is no path), and to another call for an id
    holding an escaped "/" (the path was decoded). Both come back to their call."""
    client, ledger = server
    for call in ("zw\u200bid", "a/b"):
        pending(ledger, scope, call)
        path = f"/calls/{scope}/" + quote(call, safe="")
        client.cookies.clear()
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 303
        target, r = post_login_form(client, client.get(r.headers["location"]).text)
        assert r.status_code == 303 and r.headers["location"] == path, (call, target)
        assert client.get(path).status_code == 200


def test_console__a_login_link_made_by_hand_leads_to_its_call(server: Any, scope: str) -> None:
    """A login link whose ``next`` is escaped once (a bookmark, a link in a mail) reaches the
    form decoded: its zero-width space was written ``\\u200b`` on the page, which is no path,
    and the login led to "/". The form's ``next`` is escaped again where it is not ASCII."""
    client, ledger = server
    pending(ledger, scope, "zw\u200bhand")
    path = f"/calls/{scope}/" + quote("zw\u200bhand", safe="")
    client.cookies.clear()
    page = client.get(f"/login?next={path}")  # escaped once: the form gets it decoded
    target, r = post_login_form(client, page.text)
    assert r.status_code == 303 and r.headers["location"] == path, target


def test_console__login_then_approve_with_csrf(server: Any, scope: str) -> None:
    client, ledger = server
    pending(ledger, scope, "p")
    assert client.get("/", follow_redirects=False).status_code == 303  # to /login
    r = client.post("/login", data={"nonce": "x", "token": SECRETS["ann"]}, follow_redirects=False)
    assert r.status_code == 403  # no login nonce cookie: a forged login form
    client.get("/login")  # the nonce cookie set; a nonce that is not ASCII is no 500
    r = client.post("/login", data={"nonce": "é", "token": SECRETS["ann"]}, follow_redirects=False)
    assert r.status_code == 403
    login(client, "ann")
    page = client.get(f"/calls/{scope}/p")
    assert page.status_code == 200 and "Approve" in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    url = f"/calls/{scope}/p/approve"
    r = client.post(url, data={"reason": "fine"}, follow_redirects=False)
    assert r.status_code == 403  # no CSRF token: refused, nothing done
    r = client.post(url, data={"reason": "fine", "csrf": "forged"}, follow_redirects=False)
    assert r.status_code == 403
    r = client.post(url, data={"reason": "fine", "csrf": "é"}, follow_redirects=False)
    assert r.status_code == 403  # not ASCII: refused like any forgery, not a 500
    assert ledger.get(scope, "p").operation.status is Status.PENDING_APPROVAL
    token = csrf_of(page.text)
    r = client.post(url, data={"reason": "", "csrf": token}, follow_redirects=False)
    assert r.status_code == 422  # a reason is required
    r = client.post(url, data={"reason": "fine", "csrf": token}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].endswith("?done=approved")
    op = ledger.get(scope, "p").operation
    assert (op.status, op.decided_by, op.reason) == (Status.APPROVED, "ann", "fine")


def test_console__a_retry_from_a_page_that_showed_an_earlier_attempt_is_refused(
    server: Any, scope: str
) -> None:
    """helper-91: Alice's page showed attempt 1; Bob retried and attempt 2 ended unknown;
    Alice's form (a duplicate accepted) authorised attempt 3, a duplicate of an attempt she
    never saw. The form carries the attempt its page showed; the API may (``attempt``)."""
    client, ledger = server
    unknown(ledger, scope, "r1")
    login(client, "otto")
    page = client.get(f"/calls/{scope}/r1").text
    assert 'name="attempt" value="1"' in page
    token = csrf_of(page)
    r = client.post(
        f"/api/calls/{scope}/r1/retry",
        json={"reason": "again", "attempt": 1},
        headers=bearer("otto"),
    )
    assert r.status_code == 200 and r.json()["attempt"] == 2, r.text
    claim = ledger.claim(scope, "write_file:r1", 2, worker_id="w")
    assert claim is not None
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    url = f"/calls/{scope}/r1/retry"
    stale = {"reason": "resend once", "csrf": token, "attempt": "1", "accept_duplicate": "yes"}
    r = client.post(url, data=stale, follow_redirects=False)
    assert r.status_code == 409 and "decided on attempt 1" in r.text, r.text
    assert ledger.get(scope, "r1").operation.authorized_attempts == 2
    r = client.post(url, data={"reason": "resend", "csrf": token}, follow_redirects=False)
    assert r.status_code == 422  # a page from before the field: reload
    page = client.get(f"/calls/{scope}/r1").text
    assert 'name="attempt" value="2"' in page
    r = client.post(url, data={**stale, "attempt": "2"}, follow_redirects=False)
    assert r.status_code == 303, r.text
    assert ledger.get(scope, "r1").operation.authorized_attempts == 3
    unknown(ledger, scope, "r2")
    api = f"/api/calls/{scope}/r2/retry"
    for bad in ("1", True, 0, 1.0):
        r = client.post(api, json={"attempt": bad}, headers=bearer("otto"))
        assert r.status_code == 422, (bad, r.text)
    r = client.post(api, json={"attempt": 2}, headers=bearer("otto"))
    assert r.status_code == 409 and "decided on attempt 2" in r.json()["error"]
    assert ledger.get(scope, "r2").operation.authorized_attempts == 1


def test_api__a_role_that_may_not_is_403_whatever_the_body(server: Any, scope: str) -> None:
    """helper-91: the body was read before the role: a viewer's approval with an unknown field
    was 422, a large one 413, where the README promises 403."""
    client, _ = server
    h = bearer("vera")
    for path, body in (
        (f"/api/calls/{scope}/c/approve", b'{"foo": 1}'),
        (f"/api/calls/{scope}/c/retry", b"not json"),
        ("/api/executions/e/resolve", b'{"as": 5}'),
        ("/api/calls", b"[]"),
    ):
        r = client.post(path, content=body, headers={**h, "Content-Type": "application/json"})
        assert r.status_code == 403, (path, r.text)


def test_console__cookies_marked_secure_behind_a_tls_proxy(
    fresh_db_url: str, tmp_path: Path
) -> None:
    """helper-91: uvicorn runs without proxy headers, so behind a TLS-terminating proxy the
    scheme is always http and the session cookie was never Secure: ``--secure-cookies``."""
    settings = Settings.from_env(
        {"TOOLLEDGER_DB": fresh_db_url, "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
         "TOOLLEDGER_HOME": str(tmp_path / "home"), "TOOLLEDGER_TOOLS": "tests.external_tools"}
    )  # fmt: skip
    for secure in (False, True):
        app = create_app(settings, parse_tokens(TOKENS, "t"), metrics=False, secure_cookies=secure)
        with TestClient(app) as client:
            page = client.get("/login")
            assert ("secure" in page.headers["set-cookie"].lower()) is secure
            nonce = re.search(r'name="nonce" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
            # (the client keeps no Secure cookie over http: given back by hand, as a browser
            # behind the proxy would)
            client.cookies.set("toolledger_login", page.cookies.get("toolledger_login") or "")
            r = client.post(
                "/login",
                data={"nonce": nonce, "token": SECRETS["ann"], "next": "/"},
                follow_redirects=False,
            )
            session = [c for c in r.headers.get_list("set-cookie") if "toolledger_session" in c]
            assert session and ("secure" in session[0].lower()) is secure, r.headers


def test_console__a_notice_in_a_link_is_shown_only_after_the_persons_own_act(
    server: Any, scope: str
) -> None:
    """helper-91: ``?done=approved`` showed "Approved and enqueued." beside a call still
    pending, to anyone sent the link. Shown only when this person's act is on record."""
    client, ledger = server
    pending(ledger, scope, "n1")
    login(client, "ann")
    page = client.get(f"/calls/{scope}/n1?done=approved").text
    assert "Approved and enqueued." not in page
    token = csrf_of(page)
    r = client.post(f"/calls/{scope}/n1/approve", data={"reason": "ok", "csrf": token})
    assert r.status_code == 200 and "Approved and enqueued." in r.text
    assert "Rejected." not in client.get(f"/calls/{scope}/n1?done=rejected").text
    for other in ("retried", "resolved"):  # ann's approval is not a retry nor a resolution
        assert DONE[other] not in client.get(f"/calls/{scope}/n1?done={other}").text


def test_console__a_form_posted_after_the_session_ended_leads_back_to_its_call(
    server: Any, scope: str
) -> None:
    """helper-91: a decision posted with an ended session went to the login, then to the
    action's path, a GET of which is the call "n2/approve": 404. Back to the call now."""
    client, ledger = server
    pending(ledger, scope, "n2")
    client.cookies.clear()
    r = client.post(f"/calls/{scope}/n2/approve", data={"reason": "ok"}, follow_redirects=False)
    assert r.status_code == 303
    target, r = post_login_form(client, client.get(r.headers["location"]).text)
    assert r.status_code == 303 and r.headers["location"] == f"/calls/{scope}/n2", target
    assert client.get(r.headers["location"]).status_code == 200
    assert ledger.get(scope, "n2").operation.status is Status.PENDING_APPROVAL  # not done


def test_console__a_reason_of_several_lines_as_a_browser_sends_it(server: Any, scope: str) -> None:
    """A textarea's line breaks arrive as CRLF: every two-line reason or evidence was refused
    for its U+000D (a cold review, with Chromium). They are lines; a lone CR is refused."""
    client, ledger = server
    pending(ledger, scope, "p2")
    login(client, "ann")
    token = csrf_of(client.get(f"/calls/{scope}/p2").text)
    url = f"/calls/{scope}/p2/approve"
    r = client.post(url, data={"reason": "a\rb", "csrf": token}, follow_redirects=False)
    assert r.status_code == 422
    reason = "Checked with the customer.\r\nTicket 4411."
    r = client.post(url, data={"reason": reason, "csrf": token}, follow_redirects=False)
    assert r.status_code == 303, r.text
    assert ledger.get(scope, "p2").operation.reason == "Checked with the customer.\nTicket 4411."


def test_console__a_chunked_form_over_the_bound_is_413_as_a_declared_one(
    server: Any, scope: str
) -> None:
    """A body sent without a length is refused as soon as it passes the bound: it answered
    422 in the console (the login and every form), 413 only when declared (a cold review)."""
    client, ledger = server
    pending(ledger, scope, "big")
    login(client, "ann")
    token = csrf_of(client.get(f"/calls/{scope}/big").text)

    def chunks() -> Any:
        yield f"csrf={token}&reason=".encode()
        for _ in range(40):
            yield b"x" * 10_000

    form = {"content-type": "application/x-www-form-urlencoded"}
    for url in (f"/calls/{scope}/big/approve", "/login"):
        r = client.post(url, content=chunks(), headers=form, follow_redirects=False)
        assert r.status_code == 413, (url, r.status_code)
    assert ledger.get(scope, "big").operation.status is Status.PENDING_APPROVAL


def test_console__a_form_that_is_not_utf8_is_refused_not_replaced(server: Any, scope: str) -> None:
    """Starlette's parser read bytes that are not UTF-8 as U+FFFD: a rejection was recorded
    with the reason "a\ufffd\ufffd\ufffdb" where the API refuses such text (a cold review)."""
    client, ledger = server
    pending(ledger, scope, "u8")
    login(client, "ann")
    token = csrf_of(client.get(f"/calls/{scope}/u8").text)
    form = {"content-type": "application/x-www-form-urlencoded"}
    body = f"csrf={token}&reason=a%ED%A0%80b"
    r = client.post(f"/calls/{scope}/u8/reject", content=body, headers=form, follow_redirects=False)
    assert r.status_code == 422 and "not UTF-8" in r.text
    assert ledger.get(scope, "u8").operation.status is Status.PENDING_APPROVAL
    body = f"csrf={token}&reason=caf%C3%A9+ok"
    r = client.post(f"/calls/{scope}/u8/reject", content=body, headers=form, follow_redirects=False)
    assert r.status_code == 303
    assert ledger.get(scope, "u8").operation.reason == "café ok"


def test_console__a_multipart_form_is_refused(server: Any, scope: str) -> None:
    """A multipart body's fields went through Starlette's parser, which read bytes that are not
    UTF-8 as Latin-1: a rejection was recorded with "bad \xff\xfe bytes" as "bad ÿþ bytes"
    (a cold review). The console's forms post nothing but urlencoded bodies."""
    client, ledger = server
    pending(ledger, scope, "mp")
    login(client, "ann")
    token = csrf_of(client.get(f"/calls/{scope}/mp").text)
    for reason in (b"bad \xff\xfe bytes", b"fine"):
        r = client.post(
            f"/calls/{scope}/mp/reject",
            files={"csrf": (None, token.encode()), "reason": (None, reason)},
            follow_redirects=False,
        )
        assert r.status_code == 422 and "urlencoded" in r.text, r.text
    assert ledger.get(scope, "mp").operation.status is Status.PENDING_APPROVAL


def test_console__what_nobody_sees_is_shown_escaped(server: Any, scope: str) -> None:
    """A bidirectional override in an agent's path showed ``invoice\u202efdp.sh`` as
    ``invoicehs.pdf`` on the page where a person approves it; ids differing by a zero-width
    character showed as one (a cold review). Every value a page shows writes them escaped;
    a new call's path holding one is refused (bytes committed before land as ever)."""
    client, ledger = server
    ledger.submit(scope, "bidi", "write_file", {"path": "a.txt", "content": "x\u202ey\n"})
    ledger.submit(scope, "zw\u200b1", "write_file", {"path": "b.txt", "content": "x"})
    login(client, "ann")
    page = client.get(f"/calls/{scope}/bidi").text
    assert "\u202e" not in page and "x\\u202ey" in page
    listed = client.get("/calls", params={"status": "pending_approval", "scope": scope}).text
    assert "\u200b" not in listed and "zw\\u200b1" in listed
    # an id typed with a backslash, "zw\u200b1" in seven characters, is another id: shown so
    ledger.submit(scope, r"zw\u200b1", "write_file", {"path": "c.txt", "content": "x"})
    listed = client.get("/calls", params={"status": "pending_approval", "scope": scope}).text
    assert "zw\\u200b1" in listed and r"zw\\u200b1" in listed
    # an error quotes the id with repr: shown once, not as the typed id's notation
    missing = client.get(f"/calls/{scope}/" + quote("zw\u200b9", safe="")).text
    assert "zw\\u200b9" in missing and r"zw\\u200b9" not in missing, missing
    for path in ("invoice\u202efdp.sh", "n\u2066otes.txt", "zw\u200b.txt", "s\xadoft.txt"):
        body = {
            "scope": scope,
            "tool_call_id": f"p{len(path)}",
            "tool": "write_file",
            "args": {"path": path, "content": "x"},
        }
        r = client.post("/api/calls", json=body, headers=bearer("agent-7"))
        assert r.status_code == 422 and "does not show as itself" in r.text, (path, r.text)
    assert [c.tool_call_id for c in ledger.list_calls(scope=scope)] == [
        "bidi",
        "zw\u200b1",
        r"zw\u200b1",
    ]


def test_api__a_path_whose_escapes_are_not_utf8_is_refused(server: Any, scope: str) -> None:
    """Escapes that are not UTF-8 were read as U+FFFD: ``bad%FE`` and ``bad%FF`` both named
    the call ``bad\ufffd`` and approved it (a cold review)."""
    client, ledger = server
    pending(ledger, scope, "bad\ufffd")
    for path in (f"/api/calls/{scope}/bad%FF", f"/calls/{scope}/bad%FF"):
        r = client.get(path, headers=bearer("ann"))
        assert r.status_code == 422 and "not UTF-8" in r.text, r.text  # the console's: a page
    r = client.post(f"/api/calls/{scope}/bad%FE/approve", json={}, headers=bearer("ann"))
    assert r.status_code == 422
    assert ledger.get(scope, "bad\ufffd").operation.status is Status.PENDING_APPROVAL
    r = client.get(f"/api/calls/{scope}/bad%EF%BF%BD", headers=bearer("ann"))  # U+FFFD itself
    assert r.status_code == 200 and r.json()["tool_call_id"] == "bad\ufffd"


def test_api__a_decision_behind_a_lock_is_503_after_the_timeout_not_a_thread_held_for_ever(
    fresh_db_url: str, backend: str, scope: str, tmp_path: Path
) -> None:
    """helper-91: the server's writes went through a ledger without a timeout: on Postgres an
    approval behind a row lock waited as long as the lock, holding one of the 40 threads that
    reads answer on too (45 of them: no answer to anything). Bounded now by
    TOOLLEDGER_DB_TIMEOUT: 503, nothing changed; the same approval goes through after."""
    import threading

    import sqlalchemy as sa

    settings = Settings.from_env(
        {
            "TOOLLEDGER_DB": fresh_db_url,
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
            "TOOLLEDGER_TOOLS": "tests.external_tools",
            "TOOLLEDGER_HOME": str(tmp_path / "home"),
            "TOOLLEDGER_DB_TIMEOUT": "1",
        }
    )
    app = create_app(settings, parse_tokens(TOKENS, "test"), metrics=False)
    ledger = Ledger(fresh_db_url)
    pending(ledger, scope, "c1")
    holder = sa.create_engine(fresh_db_url.replace("postgresql://", "postgresql+psycopg://"))
    answers: list[int] = []
    try:
        with TestClient(app) as client, holder.connect() as conn:
            if backend == "postgres":  # another transaction holds the call's row
                conn.execute(sa.text("SELECT 1 FROM operations FOR UPDATE"))
            else:  # another process writes
                conn.exec_driver_sql("BEGIN IMMEDIATE")

            def approve() -> None:
                r = client.post(f"/api/calls/{scope}/c1/approve", json={}, headers=bearer("ann"))
                answers.append(r.status_code)

            asking = threading.Thread(target=approve, daemon=True)
            asking.start()
            asking.join(timeout=20)  # far past the 1 s timeout: not a speed limit
            conn.rollback()
            assert answers == [503]
            assert ledger.get(scope, "c1").operation.status is Status.PENDING_APPROVAL
            r = client.post(f"/api/calls/{scope}/c1/approve", json={}, headers=bearer("ann"))
            assert r.status_code == 200, r.text
    finally:
        holder.dispose()
        ledger.close()


def test_api__an_unavailable_database_is_said_in_the_apis_shape(
    server: Any, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A locked or unreachable database answered a bare text/plain 500 after the busy timeout
    (a cold review): 503 in the API's shape, the CLI's exit code 1, no SQL; the console says
    it on its error page; any other bug is a JSON 500 too."""
    import sqlite3

    import psycopg
    import sqlalchemy as sa

    from toolledger.server import state

    client, _ledger = server
    secret = "SELECT secret_column"

    def raising(orig: BaseException) -> Any:
        def down(*_args: Any, **_kwargs: Any) -> Any:
            raise sa.exc.OperationalError(secret, {}, orig)

        return down

    bad = TestClient(client.app, raise_server_exceptions=False)
    for orig in (
        sqlite3.OperationalError("database is locked"),  # past the busy timeout
        psycopg.OperationalError("connection refused"),  # no server (no SQLSTATE)
    ):
        monkeypatch.setattr(state.Desk, "show", raising(orig))
        monkeypatch.setattr(state.Desk, "page", raising(orig))  # the console's call page
        r = client.get(f"/api/calls/{scope}/c", headers=bearer("vera"))
        assert r.status_code == 503 and secret not in r.text, orig
        assert r.json() == {
            "error": "database unavailable: try again (what was recorded stands; show tells)",
            "kind": "unavailable",
            "exit_code": 1,
        }
        page = bad.get(f"/calls/{scope}/c", headers=bearer("vera"))
        assert page.status_code == 503 and "database unavailable" in page.text
    # an OperationalError that trying again will not mend (a table gone): a bug's 500
    monkeypatch.setattr(state.Desk, "show", raising(sqlite3.OperationalError("no such table: x")))
    r = bad.get(f"/api/calls/{scope}/c", headers=bearer("vera"))
    assert r.status_code == 500 and r.json()["kind"] == "internal" and secret not in r.text

    def bug(*_args: Any, **_kwargs: Any) -> Any:
        raise KeyError("internal detail")

    monkeypatch.setattr(state.Desk, "show", bug)
    r = bad.get(f"/api/calls/{scope}/c", headers=bearer("vera"))
    assert r.status_code == 500 and r.json()["kind"] == "internal" and "detail" not in r.text


def test_api_and_console__no_free_connection_in_time_is_503_not_a_bugs_500(
    fresh_db_url: str, scope: str, tmp_path: Path
) -> None:
    """A cold review: with Postgres slow (a lock held on ``operations``), 40 inboxes asked at
    once were answered 25 times 503 and 15 times 500 ``internal error: TimeoutError``, each
    with a traceback logged: the pages' pool (8 + 16 connections) ran out before the 40
    threads did, and SQLAlchemy's "no connection free within the pool timeout" is no
    ``OperationalError``. It is the database's slowness as much as a lock timeout is: 503."""
    import sqlalchemy as sa

    from toolledger.ledger.db import create_engine

    settings = Settings.from_env(
        {
            "TOOLLEDGER_DB": fresh_db_url,
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
            "TOOLLEDGER_HOME": str(tmp_path / "home"),
        }
    )
    app = create_app(settings, parse_tokens(TOKENS, "test"), metrics=False)
    # Given a pages' pool whose one connection a slow read holds
    tiny = Ledger(create_engine(fresh_db_url, pool_size=1, max_overflow=0, pool_timeout=0.1))
    with TestClient(app, raise_server_exceptions=False) as client:
        app.state.desk._reader = tiny  # closed with the desk
        with tiny.engine.connect() as held:
            held.execute(sa.text("SELECT 1"))
            # When the API and the console ask for a page
            r = client.get("/api/inbox", headers=bearer("vera"))
            page = client.get("/", headers=bearer("vera"))
        # Then both say the database did not answer in time, as its own timeouts do
        assert r.status_code == 503, r.text
        assert r.json()["kind"] == "unavailable" and r.json()["exit_code"] == 1
        assert page.status_code == 503 and "database unavailable" in page.text
        # and once the connection is free again, the same read is answered
        assert client.get("/api/inbox", headers=bearer("vera")).status_code == 200


def test_api__an_empty_scope_filter_is_no_filter(server: Any, scope: str) -> None:
    """``?scope=`` was 422 where ``?status=`` is no filter, and the console took both as none."""
    client, ledger = server
    pending(ledger, scope, "e1")
    r = client.get("/api/calls", params={"scope": "", "status": ""}, headers=bearer("vera"))
    assert r.status_code == 200 and "e1" in [c["tool_call_id"] for c in r.json()["calls"]]


def test_api__an_empty_query_value_is_its_default(server: Any, scope: str) -> None:
    """``?review=`` and ``?limit=`` were 422 where an empty ``?status=`` or ``?scope=`` is no
    filter (a review): every empty query value is now the parameter's default, and a bad
    one is still refused."""
    client, ledger = server
    pending(ledger, scope, "e1")
    empty = {"scope": scope, "status": "", "review": "", "limit": "", "cursor": ""}
    r = client.get("/api/calls", params=empty, headers=bearer("vera"))
    assert r.status_code == 200, r.text
    assert [c["tool_call_id"] for c in r.json()["calls"]] == ["e1"]
    r = client.get(f"/api/calls/{scope}/e1/events", params={"after": "", "limit": ""},
                   headers=bearer("vera"))  # fmt: skip
    assert r.status_code == 200, r.text
    assert [e["kind"] for e in r.json()["events"]][:1] == ["submitted"], r.json()
    for params in ({"review": "maybe"}, {"limit": "x"}, {"limit": "0"}):
        bad = client.get("/api/calls", params=params, headers=bearer("vera"))
        assert bad.status_code == 422, (params, bad.text)
    bad = client.get(f"/api/calls/{scope}/e1/events", params={"after": "-1"},
                     headers=bearer("vera"))  # fmt: skip
    assert bad.status_code == 422, bad.text


def test_api__a_client_gone_mid_body_is_no_server_error(server: Any) -> None:
    """A client that disconnects before its body is read left an unhandled ClientDisconnect
    and a traceback in the log (a cold review): it is an ordinary end now."""
    client, _ledger = server
    sent: list[dict[str, Any]] = []
    messages = iter(
        [
            {"type": "http.request", "body": b'{"scope": "s", ', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/calls",
        "raw_path": b"/api/calls",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {SECRETS['otto']}".encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
        "state": {},
    }
    anyio.run(client.app, scope, receive, send)  # raised ClientDisconnect before
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400


def test_console__viewer_sees_no_forms_and_cannot_post(server: Any, scope: str) -> None:
    client, ledger = server
    pending(ledger, scope, "p")
    login(client, "vera")
    page = client.get(f"/calls/{scope}/p")
    assert page.status_code == 200 and "approve-form" not in page.text
    inbox = client.get("/")
    r = client.post(
        f"/calls/{scope}/p/approve",
        data={"reason": "x", "csrf": csrf_of(inbox.text)},
        follow_redirects=False,
    )
    assert r.status_code == 403
    assert ledger.get(scope, "p").operation.status is Status.PENDING_APPROVAL


def test_console__resolve_requires_evidence(server: Any, scope: str) -> None:
    client, ledger = server
    eid = unknown(ledger, scope, "u")
    login(client, "otto")
    page = client.get(f"/calls/{scope}/u")
    token = csrf_of(page.text)
    url = f"/calls/{scope}/u/resolve"
    r = client.post(
        url,
        data={"csrf": token, "execution_id": eid, "as": "failed", "evidence": ""},
        follow_redirects=False,
    )
    assert r.status_code == 422
    r = client.post(
        url,
        data={"csrf": token, "execution_id": "e-not-this-calls", "as": "failed", "evidence": "x"},
        follow_redirects=False,
    )
    assert r.status_code == 422
    r = client.post(
        url,
        data={"csrf": token, "execution_id": eid, "as": "failed", "evidence": "u.txt is absent"},
        follow_redirects=False,
    )
    assert r.status_code == 303
    assert ledger.get(scope, "u").current.status is Status.FAILED


def test_console__a_not_landed_call_is_confirmed_not_decided(server: Any, scope: str) -> None:
    client, ledger = server
    ledger.submit(scope, "n", "append_file", {"path": "a.txt", "content": "x"}, approved_by="al")
    claim = ledger.claim(scope, "append_file:n", 1, worker_id="w")
    ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"appended": 1})
    kept = ".toolledger/pending/k.refused"
    ledger.record_not_landed(claim.execution_id, {"path": "a.txt", "n": 0, "kept": kept})
    login(client, "otto")
    page = client.get(f"/calls/{scope}/n")
    assert "its effect could not land" in page.text and kept in page.text
    assert 'name="as" value="succeeded"' in page.text and 'value="failed"' not in page.text
    hidden = _hidden_fields(page.text, claim.execution_id)
    assert hidden["review"] == "yes"  # the page showed the flag: its form reviews it
    r = client.post(
        f"/calls/{scope}/n/resolve",
        data={**hidden, "evidence": "appended the kept line by hand"},
        follow_redirects=False,
    )
    assert r.status_code == 303
    view = ledger.get(scope, "n")
    assert (view.operation.review, view.current.status) == (None, Status.SUCCEEDED)


def test_console__logout_ends_the_session_in_every_server_process(
    fresh_db_url: str, tmp_path: Path, scope: str
) -> None:
    """A copy of a logged-out cookie (a proxy's log, a shared profile) is refused, by this
    server process and by another on the same ledger; the same token's other sessions stay."""
    key = b"s" * 32
    one, two = serving(fresh_db_url, tmp_path, key), serving(fresh_db_url, tmp_path / "b", key)
    (client, ledger), (other, _) = next(one), next(two)
    try:
        pending(ledger, scope, "p")
        login(client, "ann")
        copied = client.cookies["toolledger_session"]
        login(other, "ann")  # the same token's second session, in the other process
        page = client.get(f"/calls/{scope}/p")
        assert page.status_code == 200
        r = client.post("/logout", data={"csrf": csrf_of(page.text)}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/login"
        for c in (client, other):
            c.cookies.clear()  # the other's own session goes: only the copy is sent
            c.cookies.set("toolledger_session", copied)
            assert c.get(f"/calls/{scope}/p", follow_redirects=False).status_code == 303
            r = c.post(
                f"/calls/{scope}/p/approve",
                data={"reason": "replayed", "csrf": csrf_of(page.text)},
                follow_redirects=False,
            )
            assert r.status_code == 303 and r.headers["location"].startswith("/login")
        assert ledger.get(scope, "p").operation.status is Status.PENDING_APPROVAL
        other.cookies.clear()
        login(other, "ann")  # a fresh session after the logout is good
        assert other.get(f"/calls/{scope}/p").status_code == 200
    finally:
        one.close()
        two.close()


def test_console__a_logout_forgets_the_ended_sessions_whose_cookies_expired(
    server: Any, scope: str
) -> None:
    from datetime import UTC, datetime, timedelta

    import sqlalchemy as sa

    from toolledger.ledger.models import ended_sessions

    client, ledger = server
    past = datetime.now(UTC) - timedelta(seconds=1)
    ledger.end_session("x" * 22, "ann", past)  # its cookie expired: nothing left to refuse
    assert ledger.session_ended("x" * 22)
    ledger.end_session("y" * 22, "ann", past + timedelta(hours=1))  # prunes x
    assert not ledger.session_ended("x" * 22) and ledger.session_ended("y" * 22)
    ledger.end_session("x" * 22, "ann", past)
    login(client, "ann")
    page = client.get("/")
    client.post("/logout", data={"csrf": csrf_of(page.text)}, follow_redirects=False)
    with ledger.engine.connect() as conn:
        left = {r.session_id for r in conn.execute(sa.select(ended_sessions.c.session_id))}
    assert "x" * 22 not in left and "y" * 22 in left and len(left) == 2


def test_console__open_redirect_refused(server: Any) -> None:
    client, _ = server
    for target in ("//evil.example/x", "/\\evil.example", "https://evil.example", "/a\r\nb"):
        page = client.get("/login", params={"next": target})
        assert 'name="next" value="/"' in page.text, target
    page = client.get("/login", params={"next": "/calls?status=unknown"})
    assert 'name="next" value="/calls?status=unknown"' in page.text


def test_console__forms_are_bounded(server: Any) -> None:
    client, _ = server
    r = client.post("/login", data={"token": "x" * (300 * 1024)})
    assert r.status_code == 413


def test_serve__refuses_to_start_exposed_without_tokens(
    capsys: Any, monkeypatch: Any, tmp_path: Path
) -> None:
    from tests.helpers import run_cli

    monkeypatch.delenv("TOOLLEDGER_API_TOKENS", raising=False)
    monkeypatch.delenv("TOOLLEDGER_API_TOKENS_FILE", raising=False)
    db = f"sqlite:///{tmp_path}/l.db"
    code, _, err = run_cli(capsys, "--db", db, "serve", "--port", "0")
    assert code == 2 and "no API tokens" in err
    code, _, err = run_cli(capsys, "--db", db, "serve", "--insecure-local", "--host", "0.0.0.0")  # noqa: S104 - refused, never bound
    assert code == 2 and "loopback" in err
    monkeypatch.setenv("TOOLLEDGER_API_TOKENS", "a:admin:0123456789abcdef")
    code, _, err = run_cli(capsys, "--db", db, "serve")
    assert code == 2 and "the second field is not a role" in err
    monkeypatch.setenv("TOOLLEDGER_API_TOKENS_FILE", str(tmp_path / "missing"))
    code, _, err = run_cli(capsys, "--db", db, "serve")
    assert code == 2 and "cannot read" in err


def test_metrics__served_without_a_token_counts_only(fresh_db_url: str, tmp_path: Path) -> None:
    settings = Settings.from_env(
        {"TOOLLEDGER_DB": fresh_db_url, "TOOLLEDGER_HOME": str(tmp_path / "home")}
    )
    ledger = Ledger(fresh_db_url)
    pending(ledger, "s1", "secret-call-id")
    app = create_app(settings, parse_tokens(TOKENS, "test"))
    with TestClient(app) as client:
        r = client.get("/metrics", follow_redirects=False)
    assert r.status_code == 200
    assert 'toolledger_inbox{kind="pending_approval"} 1.0' in r.text
    assert "secret-call-id" not in r.text and "s1" not in r.text  # counts, never ids
    ledger.close()


def test_metrics__a_scrape_does_not_wait_for_the_threads_slow_requests_hold(
    fresh_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold review: with Postgres frozen, 45 inboxes asked at once held the 40 threads every
    request shares, and /metrics, whose read of the ledger's state took one of them, was
    answered after 15.6 s: past Prometheus' 10 s scrape timeout, so the scrape failed when
    the ledger's gauges were wanted most. Its read has threads of its own now."""
    app = create_app(_settings_for(fresh_db_url, tmp_path), parse_tokens(TOKENS, "test"))
    with TestClient(app) as client, _every_thread_held(client, monkeypatch):
        # When Prometheus scrapes, Then it is answered while they still wait
        scraped = _asked(lambda: client.get("/metrics"))
        assert scraped is not None and scraped.status_code == 200, "it waited for a thread"
        assert "toolledger_ledger_state_up" in scraped.text


def test_api__who_is_asking_is_judged_without_a_thread_slow_requests_hold(
    fresh_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold review: with Postgres frozen and the 40 threads every request shares held, a
    wrong token's 401 waited 7.7 s for one, only to compare a secret (and every API request
    waited twice in the threads' queue: once for its token, once for its work). Judged on
    the event loop now, as the console judges a bearer: 401, 403 and 429 are answered."""
    app = create_app(_settings_for(fresh_db_url, tmp_path), parse_tokens(TOKENS, "test"))
    wrong = {"Authorization": "Bearer not-a-token-of-ours-0123"}
    with TestClient(app) as client, _every_thread_held(client, monkeypatch):
        refused = _asked(lambda: client.post("/api/calls/s/c/approve", json={}, headers=wrong))
        assert refused is not None and refused.status_code == 401, "it waited for a thread"
        viewer = _asked(lambda: client.post("/api/calls/s/c/approve", headers=bearer("vera")))
        assert viewer is not None and viewer.status_code == 403, "it waited for a thread"


def _settings_for(db_url: str, tmp_path: Path) -> Settings:
    return Settings.from_env(
        {
            "TOOLLEDGER_DB": db_url,
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
            "TOOLLEDGER_HOME": str(tmp_path / "home"),
        }
    )


@contextlib.contextmanager
def _every_thread_held(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """45 inboxes asked at once, each held as a frozen database would hold it: every thread
    of the pool the requests share (40) is taken until the block ends."""
    from toolledger.server import state

    slow, held = threading.Event(), threading.Semaphore(0)

    def frozen_inbox(*_args: Any, **_kwargs: Any) -> dict[str, int]:
        held.release()
        slow.wait(timeout=60)  # a database that does not answer (until the block ends)
        return {"pending_approval": 0, "unknown": 0, "review": 0}

    monkeypatch.setattr(state.Desk, "inbox", frozen_inbox)
    asking = [
        threading.Thread(target=lambda: client.get("/api/inbox", headers=bearer("vera")))
        for _ in range(45)
    ]
    try:
        for t in asking:
            t.start()
        for _ in range(40):
            assert held.acquire(timeout=30)
        yield
    finally:
        slow.set()
        for t in asking:
            t.join(timeout=60)


def _asked(ask: Any) -> Any:
    """What ``ask`` was answered, or None if it was not within 20 s (answered in milliseconds:
    the bound pins that it was not waiting for the held threads, not a speed)."""
    answers: list[Any] = []
    asking = threading.Thread(target=lambda: answers.append(ask()), daemon=True)
    asking.start()
    asking.join(timeout=20)
    return answers[0] if answers else None


def test_metrics__a_scrape_does_not_wait_for_a_read_the_database_holds(
    fresh_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold review: the scrape that started a read of the ledger's state waited for it to
    end (25 s with Postgres frozen for 25 s; for ever if it stays so), where a read that
    hangs is the case ``toolledger_ledger_state_timestamp_seconds`` and its alert are for.
    It is served the values last read after ``SCRAPE_WAIT_SECONDS``; the read goes on."""
    from toolledger.observability import metrics

    settings = Settings.from_env(
        {
            "TOOLLEDGER_DB": fresh_db_url,
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
            "TOOLLEDGER_HOME": str(tmp_path / "home"),
        }
    )
    app = create_app(settings, parse_tokens(TOKENS, "test"))
    frozen, reading = threading.Event(), threading.Event()

    def hanging_read(*_args: Any, **_kwargs: Any) -> Any:
        reading.set()
        frozen.wait(timeout=60)  # a database that does not answer (until the test lets it)
        raise RuntimeError("the test let it go")

    monkeypatch.setattr(metrics, "SCRAPE_WAIT_SECONDS", 0.5)
    monkeypatch.setattr(metrics, "state_counts", hanging_read)
    with TestClient(app) as client:
        try:
            # Given a read of the ledger's state that does not end
            scraped: list[Any] = []
            scrape = threading.Thread(
                target=lambda: scraped.append(client.get("/metrics")), daemon=True
            )
            scrape.start()
            # When Prometheus scrapes, Then it is answered while the read still hangs
            scrape.join(timeout=20)  # answered after SCRAPE_WAIT_SECONDS: pinned, not before
            assert reading.is_set() and not frozen.is_set()
            assert scraped and scraped[0].status_code == 200, "the scrape waited for the read"
            assert "toolledger_ledger_state_up 0.0" in scraped[0].text  # none has ended yet
        finally:
            frozen.set()


def test_reads__the_pages_pool_is_made_once_however_many_first_requests_come_at_once(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold review: the pages' pool (Postgres) was made at its first use without a lock,
    and 40 first requests at once made 39 of them, each opening its own connections (46 to
    the database where the pool holds at most 24) until the collector found them."""
    from toolledger.ledger import db

    made: list[Any] = []
    second = threading.Event()

    def slow_to_make(*args: Any, **kwargs: Any) -> Any:
        made.append(args)
        if len(made) > 1:
            second.set()
        second.wait(timeout=2)  # the first one made waits for another to start (or 2 s)
        return real(*args, **kwargs)

    real = db.create_engine
    served = serving(pg_url, tmp_path)
    client, _ledger = next(served)
    try:
        desk = client.app.state.desk  # type: ignore[attr-defined]
        monkeypatch.setattr(db, "create_engine", slow_to_make)
        start = threading.Barrier(8)
        got: list[Ledger] = []

        def first_read() -> None:
            start.wait(timeout=30)
            got.append(desk.reader)

        threads = [threading.Thread(target=first_read) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(got) == 8 and len({id(r) for r in got}) == 1
        assert len(made) == 1
    finally:
        served.close()


def test_reads__survive_postgres_dropping_every_connection(
    pg_url: str, tmp_path: Path, scope: str
) -> None:
    """The reader pool pings nothing at checkout: a dropped connection fails its statement,
    and the read is tried once more on a fresh one."""
    served = serving(pg_url, tmp_path)
    client, ledger = next(served)
    try:
        _reads_after_a_drop(client, ledger, scope)
    finally:
        served.close()


def _reads_after_a_drop(client: TestClient, ledger: Ledger, scope: str) -> None:
    pending(ledger, scope, "p")
    h = bearer("vera")
    assert client.get(f"/api/calls/{scope}/p", headers=h).status_code == 200
    with ledger.engine.connect() as conn:
        conn.exec_driver_sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    for _ in range(3):
        r = client.get(f"/api/calls/{scope}/p", headers=h)
        assert r.status_code == 200, r.text


def test_insecure_local__a_judged_header_sent_twice_is_refused() -> None:
    """The last of two ``Origin`` (or ``Sec-Fetch-Site``, or ``Host``) headers was judged,
    whatever the first said (a cold review; no browser sends two, a forger may)."""
    from toolledger.server.deps import LoopbackOnly

    def request(*headers: tuple[str, str]) -> dict[str, Any]:
        return {"method": "POST", "headers": [(k.encode(), v.encode()) for k, v in headers]}

    ours = ("host", "127.0.0.1:8420")
    assert LoopbackOnly.refusal(request(ours, ("origin", "http://127.0.0.1:8420"))) is None
    for twice in (
        [("Origin", "https://evil.example"), ("origin", "http://127.0.0.1:8420")],
        [("sec-fetch-site", "cross-site"), ("sec-fetch-site", "same-origin")],
        [("host", "evil.example")],
    ):
        assert "more than one" in (LoopbackOnly.refusal(request(ours, *twice)) or ""), twice


def test_serve__a_short_session_key_is_refused(tmp_path: Path, monkeypatch: Any) -> None:
    """Any key was taken ("x"): it keys the token fingerprint a cookie carries, and a guessable
    one made a copied cookie an offline oracle for a weak secret again (a cold review)."""
    from toolledger.server import run

    monkeypatch.setenv("TOOLLEDGER_API_TOKENS", TOKENS)
    monkeypatch.setenv("TOOLLEDGER_API_SESSION_KEY", "x" * (run.MIN_SESSION_KEY - 1))
    monkeypatch.setattr("uvicorn.run", lambda *_a, **_k: pytest.fail("served with that key"))
    settings = Settings.from_env({"TOOLLEDGER_HOME": str(tmp_path / "home")})
    with pytest.raises(ConfigError, match=f"SESSION_KEY is {run.MIN_SESSION_KEY - 1} characters"):
        run.run(settings, host="127.0.0.1", port=0, insecure_local=False)
    assert run.MIN_SESSION_KEY <= 24  # 128 bits in base64 (openssl rand -base64 16) will do
    served: list[Any] = []
    monkeypatch.setattr("uvicorn.run", lambda *a, **_k: served.append(a))
    monkeypatch.setenv("TOOLLEDGER_API_SESSION_KEY", "k" * 24)
    run.run(settings, host="127.0.0.1", port=0, insecure_local=False)
    assert len(served) == 1


def test_insecure_local__refuses_other_sites_and_other_host_names(
    fresh_db_url: str, tmp_path: Path, scope: str
) -> None:
    """No token: every request is the operator. A page on another site (a no-cors POST needs
    no preflight) must not approve or submit, and a rebound DNS name must not read."""
    settings = Settings.from_env(
        {
            "TOOLLEDGER_DB": fresh_db_url,
            "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
            "TOOLLEDGER_HOME": str(tmp_path / "home"),
        }
    )
    ledger = Ledger(fresh_db_url)
    pending(ledger, scope, "p")
    app = create_app(settings, [], insecure_local=True, metrics=False)
    approve = f"/api/calls/{scope}/p/approve"
    body = '{"reason": "x"}'
    plain = {"Content-Type": "text/plain"}
    with TestClient(app, base_url="http://127.0.0.1:8420") as client:
        for headers in (
            {**plain, "Origin": "https://evil.example"},
            {**plain, "Origin": "null"},
            {**plain, "Origin": "http://127.0.0.1:9999"},  # another local server's page
            {**plain, "Sec-Fetch-Site": "cross-site"},
            {**plain, "Sec-Fetch-Site": "same-site"},
            {**plain, "Origin": "null", "Sec-Fetch-Site": "cross-site"},
        ):
            r = client.post(approve, content=body, headers=headers)
            assert r.status_code == 403 and r.json()["kind"] == "forbidden", (headers, r.text)
        submit = {"scope": scope, "tool_call_id": "q", "tool": "write_file",
                  "args": {"path": "q.txt", "content": "q"}, "approve": True}  # fmt: skip
        r = client.post(
            "/api/calls", content=json.dumps(submit),
            headers={**plain, "Origin": "https://evil.example"},
        )  # fmt: skip
        assert r.status_code == 403
        # (a port that is no port was read as one: 127.0.0.1:8420.evil named 127.0.0.1)
        for host in ("evil.example", "evil.example:8420", "127.0.0.1.nip.io",
                     "127.0.0.1:8420.evil", "[::1].evil", "localhost:80x"):  # fmt: skip
            r = client.get(f"/api/calls/{scope}/p", headers={"Host": host})
            assert r.status_code == 403 and "loopback" in r.json()["error"], host
        assert ledger.get(scope, "p").operation.status is Status.PENDING_APPROVAL
        with pytest.raises(NotFound):  # nothing of q was recorded
            ledger.get(scope, "q")
        # the operator's own: its console (same origin), curl and the client (no Origin)
        assert client.get(f"/api/calls/{scope}/p", headers={"Host": "localhost:8420"}).is_success
        # served on another loopback address (--host 127.0.0.2): every request was refused
        for host in ("127.0.0.2:8420", "127.255.0.9", "[::1]:8420"):
            assert client.get(f"/api/calls/{scope}/p", headers={"Host": host}).is_success, host
        r = client.post(approve, content=body, headers={"Origin": "http://127.0.0.1:8420"})
        assert r.status_code == 200, r.text
        assert ledger.get(scope, "p").operation.status is Status.APPROVED
        pending(ledger, scope, "p2")
        r = client.post(f"/api/calls/{scope}/p2/reject", json={"reason": "no"})
        assert r.status_code == 200, r.text
        pending(ledger, scope, "p3")  # a page that hides its origin, the browser vouching
        same = {"Origin": "null", "Sec-Fetch-Site": "same-origin"}
        r = client.post(f"/api/calls/{scope}/p3/approve", json={"reason": "y"}, headers=same)
        assert r.status_code == 200, r.text
    ledger.close()


def test_ids_with_a_slash__an_escaped_suffix_is_part_of_the_id(server: Any, scope: str) -> None:
    """A tool_call_id may end in "/events" or "/approve": sent escaped, it is that call's,
    never the shorter call's events or its approval."""
    client, ledger = server
    pending(ledger, scope, "x")
    pending(ledger, scope, "x/events", "b.txt")
    h = bearer("otto")
    shown = client.get(f"/api/calls/{scope}/x%2Fevents", headers=h)
    assert shown.status_code == 200 and shown.json()["tool_call_id"] == "x/events"
    events = client.get(f"/api/calls/{scope}/x/events", headers=h)
    assert events.status_code == 200 and "events" in events.json()
    for action in ("approve", "reject", "retry"):
        r = client.post(f"/api/calls/{scope}/x%2F{action}", json={"reason": "r"}, headers=h)
        assert r.status_code == 404, (action, r.text)
    assert ledger.get(scope, "x").operation.status is Status.PENDING_APPROVAL
    login(client, "otto")  # the console's forms too
    csrf = csrf_of(client.get(f"/calls/{scope}/x").text)
    for action in ("approve", "reject", "retry", "resolve"):
        r = client.post(
            f"/calls/{scope}/x%2F{action}", data={"reason": "r", "csrf": csrf},
            follow_redirects=False,
        )  # fmt: skip
        assert r.status_code == 404, (action, r.text)
    assert ledger.get(scope, "x").operation.status is Status.PENDING_APPROVAL
    r = client.post(f"/api/calls/{scope}/x%2Fevents/approve", json={"reason": "r"}, headers=h)
    assert r.status_code == 200 and r.json()["tool_call_id"] == "x/events", r.text


def test_console__a_file_whose_bytes_wait_to_land_says_so(
    server: Any, scope: str, tmp_path: Path
) -> None:
    """A call seen succeeded a moment before its bytes land (the receipt is given at the
    commit) read "the requested content is not in the file" (CI, under load): the page says
    bytes for the path wait to land, and the verdict says "not yet"."""
    from toolledger.effects import effects_of
    from toolledger.sandbox import Sandbox

    client, ledger = server
    ledger.submit(scope, "w", "write_file", {"path": "a.txt", "content": "hello"},
                  approved_by="setup")  # fmt: skip
    login(client, "ann")
    before = client.get(f"/calls/{scope}/w").text
    assert 'id="file-pending"' not in before and "not in the file (yet" not in before
    claim = ledger.claim(scope, "write_file:w", 1, worker_id="w", lease_seconds=30)
    assert claim is not None
    sandbox = Sandbox(tmp_path / "sandbox").prepare()
    staging = effects_of(sandbox).staging(scope, claim.execution_id, None)
    staging.write_atomic(scope, "a.txt", b"hello")
    staging.seal()
    page = client.get(f"/calls/{scope}/w").text
    assert 'id="file-pending"' in page
    assert "the requested content is not in the file (yet: bytes for this path wait" in page


# ----------------------------------------------------------------------------- read-only runs


def _held_read(client: TestClient, scope: str, call: str) -> Any:
    body = {"scope": scope, "tool_call_id": call, "tool": "held_read", "args": {"seconds": 60}}
    return client.post("/api/calls", json=body, headers=bearer("agent-7"))


def test_api__read_only_calls_cannot_take_every_thread_from_the_others(
    server: Any, scope: str
) -> None:
    """A cold review: an agent token posted 45 read-only calls of 20 s at once; each ran on
    the thread pool every sync endpoint shares, unbounded, and a viewer's inbox waited 17.7 s
    for a thread. At most READS_AT_ONCE run now, apart from the pool; the others are told at
    once that the server is busy (503, ``busy``, Retry-After), and never run."""
    from toolledger.server.state import READS_AT_ONCE

    client, _ = server
    external_tools.HELD.clear()
    external_tools.HELD_RUNS.clear()
    answers: list[Any] = []
    posts = [
        threading.Thread(target=lambda i=i: answers.append(_held_read(client, scope, f"r{i}")))
        for i in range(45)
    ]
    try:
        # Given 45 reads posted at once, held until the test lets them go
        for t in posts:
            t.start()
        until = time.monotonic() + 30
        while len(external_tools.HELD_RUNS) + len(answers) < 45 and time.monotonic() < until:
            time.sleep(0.05)
        # When a viewer asks for the inbox while they are held
        inbox: list[Any] = []
        asking = threading.Thread(
            target=lambda: inbox.append(client.get("/api/inbox", headers=bearer("vera"))),
            daemon=True,
        )
        asking.start()
        asking.join(timeout=20)  # answered in milliseconds; pinned, not before a read ends
        # Then it is answered, and the reads past the bound were refused, not run
        assert inbox and inbox[0].status_code == 200, "the inbox waited for a read's thread"
        refused = [r for r in answers if r.status_code != 200]
        assert len(refused) == 45 - READS_AT_ONCE, [r.text for r in refused[:3]]
        assert len(external_tools.HELD_RUNS) == READS_AT_ONCE
        for r in refused:
            assert r.status_code == 503 and r.json()["kind"] == "busy", r.text
            assert r.headers["retry-after"] == "1" and "ask again" in r.json()["error"]
    finally:
        external_tools.HELD.set()
        for t in posts:
            t.join(timeout=30)
    ran = [r.json() for r in answers if r.status_code == 200]
    assert len(ran) == READS_AT_ONCE and all(r["result"] == {"held": False} for r in ran)
    assert _held_read(client, scope, "after").status_code == 200  # the places are given back


def test_api__a_read_only_call_past_its_time_limit_is_answered_with_an_error(
    server: Any, scope: str
) -> None:
    """The same review: a read-only run had no time limit in ``serve`` (``mcp serve`` gives
    up at ``--timeout``). Past the tool's time limit the caller gets 504, ``timeout``; the
    run goes on in its thread, holding its place, until it ends."""
    client, _ = server
    desk = client.app.state.desk  # type: ignore[attr-defined]
    desk.read_timeout = 0.5
    external_tools.HELD.clear()
    try:
        r = _held_read(client, scope, "slow")
        assert r.status_code == 504, r.text
        assert r.json()["kind"] == "timeout" and "0.5 s" in r.json()["error"], r.text
    finally:
        external_tools.HELD.set()


# ----------------------------------------------------------------------------- flags


def _flagged_on_attempt_1(
    client: TestClient, ledger: Ledger, scope: str, call: str, *, second: Status
) -> tuple[str, str]:
    """Attempt 1 went unknown, a retry (a duplicate accepted) ran attempt 2 to ``second``
    (succeeded, or unknown too), then attempt 1 was resolved succeeded: the call is flagged
    ``both_ran`` on attempt 1. The two execution ids."""
    ledger.submit(scope, call, "notify", {"to": "x"}, approved_by="setup")
    first = ledger.claim(scope, f"notify:{call}", 1, worker_id="w1")
    assert first is not None
    ledger.mark_unknown(first.execution_id, reason="lease expired", actor="sweep")
    r = client.post(
        f"/api/calls/{scope}/{call}/retry",
        json={"attempt": 1, "accept_duplicate": True, "reason": "run it again"},
        headers=bearer("otto"),
    )
    assert r.status_code == 200, r.text
    later = ledger.claim(scope, f"notify:{call}", 2, worker_id="w2")
    assert later is not None
    if second is Status.SUCCEEDED:
        ledger.finish(later.execution_id, later.lease_token, second, {"notified": "x"})
    else:
        ledger.mark_unknown(later.execution_id, reason="lease expired", actor="sweep")
    ledger.resolve(first.execution_id, Status.SUCCEEDED, by="ann", evidence="delivered too")
    assert ledger.get(scope, call).operation.review == "both_ran"
    return first.execution_id, later.execution_id


def _resolve_forms(html: str) -> list[str]:
    """The execution each of the page's resolve forms names, in order."""
    return re.findall(r'name="execution_id" value="([^"]+)"', html)


def _hidden_fields(html: str, execution_id: str) -> dict[str, str]:
    """The hidden fields of the page's resolve form naming ``execution_id``, as a browser
    posts them (the csrf, the execution, and ``review`` where the form settles a flag)."""
    forms = re.findall(r'<form[^>]*id="resolve-form-\d+">(.*?)</form>', html, re.S)
    form = next(f for f in forms if f'name="execution_id" value="{execution_id}"' in f)
    return dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form))


@pytest.mark.parametrize("second", [Status.SUCCEEDED, Status.UNKNOWN])
def test_console__a_flag_raised_on_an_earlier_attempt_is_settled_from_its_page(
    server: Any, scope: str, second: Status
) -> None:
    """A cold review: a call flagged ``both_ran`` on attempt 1 had one resolve form, naming
    attempt 2 (the last attempt, or the unknown one), which the ledger refuses (an executor's
    own succeeded stands; not the execution flagged): nothing on the page could settle the
    flag, only ``POST /api/executions/<attempt 1>/resolve``. The forms name the executions a
    flag waits on, and the unknown ones; an unknown attempt 2 is resolved before attempt 1's
    success is confirmed."""
    client, ledger = server
    # Given a call flagged on attempt 1, attempt 2 succeeded or unknown
    first, later = _flagged_on_attempt_1(client, ledger, scope, "f", second=second)
    login(client, "otto")
    page = client.get(f"/calls/{scope}/f").text
    forms = _resolve_forms(page)
    assert first in forms, forms
    assert (later in forms) is (second is Status.UNKNOWN), forms  # an unknown is still asked
    assert _hidden_fields(page, first)["review"] == "yes"  # the page showed the flag
    if second is Status.UNKNOWN:  # a form for an unknown execution resolves, never reviews
        assert "review" not in _hidden_fields(page, later)
    review = {**_hidden_fields(page, first), "as": "succeeded",
              "evidence": "both ran: two notifications, accepted"}  # fmt: skip
    if second is Status.UNKNOWN:
        # a review confirming attempt 1 waits for attempt 2's end (since 2026-12-07: how it
        # ends decides which receipt is the call's): refused, saying so; its form resolves it
        r = client.post(f"/calls/{scope}/f/resolve", data=review, follow_redirects=False)
        assert r.status_code == 409 and "is unknown: resolve it, then review this one" in r.text
        assert ledger.get(scope, "f").operation.review is not None
        r = client.post(
            f"/calls/{scope}/f/resolve",
            data={**_hidden_fields(page, later), "as": "succeeded",
                  "evidence": "the second notification was sent too"},
            follow_redirects=False,
        )  # fmt: skip
        assert r.status_code == 303, r.text
        page = client.get(f"/calls/{scope}/f").text
        review = {**review, **_hidden_fields(page, first)}  # the page reloaded
    # When the person reviews attempt 1 through its form, as a browser posts it
    r = client.post(f"/calls/{scope}/f/resolve", data=review, follow_redirects=False)
    # Then the flag is settled, and nothing is left to resolve
    assert r.status_code == 303, r.text
    view = ledger.get(scope, "f")
    assert view.operation.review is None
    page = client.get(f"/calls/{scope}/f").text
    assert _resolve_forms(page) == []


def test_events_and_console__a_long_history_is_paged_and_the_page_shows_the_latest(
    server: Any, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent that links thousands of ids to one key (each a ``linked`` event) made the
    call's events answer, and its console page, megabytes (a cold review: 23,000 links, a
    5.8 MB page). The API pages with ``after`` and ``limit`` as the CLI does; the page shows
    the latest events and says how many it leaves out; a person's act far back in the
    history still shows its notice."""
    from toolledger.server import state

    client, ledger = server
    args = {"path": "l.txt", "content": "x"}
    ledger.submit(scope, "l0", "write_file", args, key="k")
    ledger.approve(scope, "l0", by="ann")  # ann's act, then the links after it
    for i in range(1, 8):
        ledger.submit(scope, f"l{i}", "write_file", args, key="k")
    url = f"/api/calls/{scope}/l3/events"
    whole = client.get(url, headers=bearer("vera")).json()
    assert len(whole["events"]) == 10 and whole["more"] is False
    first = client.get(url, params={"limit": 4}, headers=bearer("vera")).json()
    assert first["more"] is True and first["events"] == whole["events"][:4]
    rest = client.get(
        url, params={"after": first["events"][-1]["seq"]}, headers=bearer("vera")
    ).json()
    assert rest["more"] is False and first["events"] + rest["events"] == whole["events"]
    assert client.get(url, params={"limit": -1}, headers=bearer("vera")).status_code == 422
    monkeypatch.setattr(state, "PAGE_EVENTS", 3)
    login(client, "ann")
    page = client.get(f"/calls/{scope}/l3?done=approved").text
    assert "The 7 earlier events are not shown, only the\nlatest 3" in page, page
    assert page.count('<tr class="ev-') == 3 and "Approved and enqueued." in page


def _contradicted_with_attempt_2_held(ledger: Ledger, scope: str, call: str) -> str:
    """The cold review's scene: bob resolved attempt 1 failed and authorised attempt 2; the
    late result proves attempt 1 succeeded: flagged contradicted, attempt 2 held."""
    ledger.submit(scope, call, "notify", {"to": "x"}, approved_by="setup")
    first = ledger.claim(scope, f"notify:{call}", 1, worker_id="zombie")
    assert first is not None
    ledger.mark_unknown(first.execution_id, reason="lease expired", actor="sweep")
    ledger.resolve(first.execution_id, Status.FAILED, by="bob", evidence="no charge")
    ledger.authorize_retry(scope, call, by="bob", accept_duplicate=True)
    late = {"late_result": {"charged": "x"}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(first.execution_id, late, actor="zombie", outcome=Status.SUCCEEDED)
    assert ledger.get(scope, call).operation.review == "contradicted"
    return first.execution_id


def test_api__a_stale_resolution_is_409_and_review_true_settles_the_flag(
    server: Any, scope: str
) -> None:
    """A resolution sent after the flag was raised was taken as its review (a cold review:
    attempt 2 then ran, a second charge). 409 ``state``, the flag waits; ``"review": true``
    is the review; ``review`` must be a bool (422, as the API refuses a bad field)."""
    client, ledger = server
    eid = _contradicted_with_attempt_2_held(ledger, scope, "s")
    url, otto = f"/api/executions/{eid}/resolve", bearer("otto")
    stale = {"as": "failed", "evidence": "payments console: nothing"}
    r = client.post(url, json=stale, headers=otto)
    assert r.status_code == 409 and r.json()["kind"] == "state", r.text
    assert "flagged contradicted since" in r.json()["error"] and "--review" in r.json()["error"]
    assert ledger.get(scope, "s").operation.review == "contradicted"
    assert ledger.claim(scope, "notify:s", 2, worker_id="w2") is None
    for bad in ("yes", 1, None):
        r = client.post(url, json={**stale, "review": bad}, headers=otto)
        assert r.status_code == 422 and "review" in r.json()["error"], (bad, r.text)
    r = client.post(url, json={**stale, "review": True}, headers=otto)
    assert r.status_code == 200 and r.json()["status"] == "failed", r.text
    assert ledger.get(scope, "s").operation.review is None
    assert ledger.events(scope, "s")[-1].kind == "reviewed"


def test_console__a_flag_is_settled_only_by_a_form_of_the_page_that_showed_it(
    server: Any, scope: str
) -> None:
    """The flagged execution's form carries ``review`` (the page showed the flag) and
    settles it; a post without it (a form for the unknown execution, loaded before the flag
    was raised, or one made by hand) is refused, and the flag waits."""
    client, ledger = server
    eid = _contradicted_with_attempt_2_held(ledger, scope, "s")
    login(client, "otto")
    page = client.get(f"/calls/{scope}/s").text
    hidden = _hidden_fields(page, eid)
    assert hidden["review"] == "yes"
    stale = {k: v for k, v in hidden.items() if k != "review"}
    r = client.post(
        f"/calls/{scope}/s/resolve",
        data={**stale, "as": "failed", "evidence": "payments console: nothing"},
        follow_redirects=False,
    )
    assert r.status_code == 409 and "flagged contradicted since" in r.text
    # said for a person at the console too, not only the command line's --review
    assert "the flagged execution&#39;s form on the page reloaded" in r.text
    assert ledger.get(scope, "s").operation.review == "contradicted"
    assert ledger.claim(scope, "notify:s", 2, worker_id="w2") is None
    r = client.post(
        f"/calls/{scope}/s/resolve",
        data={**hidden, "as": "succeeded", "evidence": "the late result: charged"},
        follow_redirects=False,
    )
    assert r.status_code == 303, r.text
    view = ledger.get(scope, "s")
    assert (view.operation.status, view.operation.review) == (Status.SUCCEEDED, None)


def test_console__a_review_form_says_what_its_page_showed(server: Any, scope: str) -> None:
    """The flagged execution's form carries the page's newest event (``seen``): a flag
    raised after the page was loaded is not settled by it (409, the flag waits); the page
    reloaded settles it."""
    client, ledger = server
    eid = _contradicted_with_attempt_2_held(ledger, scope, "s")
    login(client, "otto")
    hidden = _hidden_fields(client.get(f"/calls/{scope}/s").text, eid)
    assert int(hidden["seen"]) == ledger.events(scope, "s")[-1].seq
    late = {"late_result": {"charged": 2}, "status": "succeeded", "proves": "succeeded"}
    other = ledger.record_late_result(eid, late, actor="zombie2", outcome=Status.SUCCEEDED)
    assert other > int(hidden["seen"])
    assert ledger.events(scope, "s")[-1].kind == "flagged"  # contradicted, once more
    r = client.post(
        f"/calls/{scope}/s/resolve",
        data={**hidden, "as": "succeeded", "evidence": "the late result: charged"},
        follow_redirects=False,
    )
    assert r.status_code == 409 and "look again" in r.text, r.text
    assert ledger.get(scope, "s").operation.review == "contradicted"
    hidden = _hidden_fields(client.get(f"/calls/{scope}/s").text, eid)
    r = client.post(
        f"/calls/{scope}/s/resolve",
        data={**hidden, "as": "succeeded", "evidence": "the late result: charged"},
        follow_redirects=False,
    )
    assert r.status_code == 303, r.text


def test_console__a_flagged_call_is_not_retried_until_reviewed(server: Any, scope: str) -> None:
    """A call flagged contradicted (bob said failed; its executor says it charged) read
    "failed", and a retry was authorised on it (a cold review: once reviewed, it ran, a
    second charge). The API and the console's form are refused, 409, one line naming the
    flag, nothing changed."""
    client, ledger = server
    ledger.submit(scope, "f", "notify", {"to": "x"}, approved_by="setup")
    first = ledger.claim(scope, "notify:f", 1, worker_id="zombie")
    assert first is not None
    ledger.mark_unknown(first.execution_id, reason="lease expired", actor="sweep")
    ledger.resolve(first.execution_id, Status.FAILED, by="bob", evidence="no charge")
    late = {"late_result": {"charged": "x"}, "status": "succeeded", "proves": "succeeded"}
    ledger.record_late_result(first.execution_id, late, actor="zombie", outcome=Status.SUCCEEDED)
    before = [e.kind for e in ledger.events(scope, "f")]
    r = client.post(
        f"/api/calls/{scope}/f/retry",
        json={"reason": "again", "accept_duplicate": True, "attempt": 1},
        headers=bearer("otto"),
    )
    assert r.status_code == 409 and "flagged contradicted" in r.json()["error"], r.text
    assert "review it first" in r.json()["error"]
    login(client, "otto")
    page = client.get(f"/calls/{scope}/f").text
    form = {"reason": "again", "csrf": csrf_of(page), "attempt": "1", "accept_duplicate": "yes"}
    r = client.post(f"/calls/{scope}/f/retry", data=form, follow_redirects=False)
    assert r.status_code == 409 and "flagged contradicted" in r.text, r.text
    assert [e.kind for e in ledger.events(scope, "f")] == before


def test_console__a_hidden_number_out_of_any_range_is_refused_not_a_500(
    server: Any, scope: str
) -> None:
    """The retry form's ``attempt`` and the review form's ``seen`` were read with
    ``str.isdecimal`` then ``int``: 5,000 digits passed the first and raised in the second
    (Python's 4,300-digit limit), a 500; another script's digits (``\\u0661``) were taken as
    a number. Each is refused, 422, nothing changed."""
    client, ledger = server
    client._transport.raise_server_exceptions = False  # a 500 is the finding, not a raise
    eid = unknown(ledger, scope, "h")
    flagged = _contradicted_with_attempt_2_held(ledger, scope, "f")
    login(client, "otto")
    token = csrf_of(client.get(f"/calls/{scope}/h").text)
    hidden = _hidden_fields(client.get(f"/calls/{scope}/f").text, flagged)
    before = {c: [e.seq for e in ledger.events(scope, c)] for c in ("h", "f")}
    for bad in ("9" * 5000, "\u0661", "1 ", "+1", "-1", "0x1", "1.0", "9" * 21):
        retry = {"reason": "again", "csrf": token, "attempt": bad}
        r = client.post(f"/calls/{scope}/h/retry", data=retry, follow_redirects=False)
        assert r.status_code == 422 and "reload" in r.text, (bad, r.status_code)
        review = {**hidden, "seen": bad, "as": "succeeded", "evidence": "charged"}
        r = client.post(f"/calls/{scope}/f/resolve", data=review, follow_redirects=False)
        assert r.status_code == 422 and "reload" in r.text, (bad, r.status_code)
    assert {c: [e.seq for e in ledger.events(scope, c)] for c in ("h", "f")} == before
    assert eid and ledger.get(scope, "f").operation.review == "contradicted"


def test_api__seen_without_review_is_refused(server: Any, scope: str) -> None:
    """``seen`` says what a review looked at; sent without ``review`` it was dropped without a
    word and the post taken as a plain resolution (the CLI refuses ``--seen`` without
    ``--review``): a client that meant its resolution guarded got one that was not. 422,
    nothing changed. (The console's form without ``review`` is a resolution, whatever else it
    carries: one for an execution no longer unknown is 409, the flag's form reloaded.)"""
    client, ledger = server
    eid = unknown(ledger, scope, "u")
    before = [e.seq for e in ledger.events(scope, "u")]
    url, otto = f"/api/executions/{eid}/resolve", bearer("otto")
    for body in ({"seen": before[-1]}, {"seen": before[-1], "review": False}):
        r = client.post(url, json={"as": "failed", "evidence": "none", **body}, headers=otto)
        assert r.status_code == 422 and "seen goes with review" in r.json()["error"], r.text
    assert [e.seq for e in ledger.events(scope, "u")] == before
    assert ledger.get(scope, "u").operation.status is Status.UNKNOWN
    r = client.post(url, json={"as": "failed", "evidence": "none"}, headers=otto)
    assert r.status_code == 200, r.text


def test_head__answered_as_get_without_a_body(server: Any, scope: str) -> None:
    """A HEAD of a call, the list or a console page was 405 (FastAPI's routes name GET
    only; RFC 9110 asks a server taking GET to take HEAD): now the GET's status and headers,
    no body, nothing changed; a route that takes no GET is 405 still, and the token's role
    and scope hold as for GET."""
    client, ledger = server
    pending(ledger, scope, "h")
    for path, headers in (
        (f"/api/calls/{scope}/h", bearer("vera")),
        ("/api/calls", bearer("vera")),
        (f"/api/calls/{scope}/h/events", bearer("vera")),
        ("/login", {}),
    ):
        got, head = client.get(path, headers=headers), client.head(path, headers=headers)
        assert head.status_code == got.status_code == 200, (path, head.status_code)
        assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]
        assert head.headers["content-length"] == got.headers["content-length"]
    assert client.head(f"/api/calls/{scope}/h").status_code == 401
    assert client.head(f"/api/calls/{scope}/h", headers=bearer("scoped")).status_code == 404
    # a HEAD is a GET: of the call "h/approve", which does not exist; nothing is approved
    r = client.head(f"/api/calls/{scope}/h/approve", headers=bearer("ann"))
    assert r.status_code == 404
    assert client.head("/api/executions/x/resolve", headers=bearer("otto")).status_code == 405
    assert ledger.get(scope, "h").operation.status is Status.PENDING_APPROVAL


@pytest.mark.parametrize("who", ["vera", "agent-7", "ann"])
def test_console__a_role_that_may_not_is_403_whatever_the_form(
    server: Any, scope: str, who: str
) -> None:
    """The API answers a role that may not with 403 whatever its body (helper-91); the
    console's forms checked their fields first: a viewer's approval without a reason, or a
    retry or resolution from an approver with a field missing, was 422 saying what to fix,
    as if fixing it would do. Each is 403, nothing changed; the CSRF check still comes first."""
    client, ledger = server
    pending(ledger, scope, "p")
    unknown(ledger, scope, "u")
    login(client, who)
    token = csrf_of(client.get("/").text)
    posts = [(f"/calls/{scope}/u/retry", {}), (f"/calls/{scope}/u/resolve", {"as": "x"})]
    if who != "ann":  # an approver may decide: its empty reason is its own 422
        posts += [(f"/calls/{scope}/p/approve", {}), (f"/calls/{scope}/p/reject", {})]
    before = {c: [e.seq for e in ledger.events(scope, c)] for c in ("p", "u")}
    for path, form in posts:
        r = client.post(path, data={**form, "csrf": token}, follow_redirects=False)
        assert r.status_code == 403 and "may not" in r.text, (path, r.status_code)
        r = client.post(path, data={**form, "csrf": "forged"}, follow_redirects=False)
        assert r.status_code == 403 and "may not" not in r.text, path  # the CSRF's refusal
    assert {c: [e.seq for e in ledger.events(scope, c)] for c in ("p", "u")} == before


def test_api_and_console__a_seen_past_the_calls_newest_event_is_refused(
    server: Any, scope: str
) -> None:
    """A review's ``seen`` past the call's newest event (2**62, a count, a typo) is no seq a
    page showed, and guarded nothing: every flag raised later was below it, and the review
    settled them unseen (200). 422, nothing changed; the page's own ``last_seq`` settles it."""
    client, ledger = server
    eid = _contradicted_with_attempt_2_held(ledger, scope, "s")
    before = [e.seq for e in ledger.events(scope, "s")]
    url, otto = f"/api/executions/{eid}/resolve", bearer("otto")
    review = {"as": "succeeded", "evidence": "the late result: charged", "review": True}
    for past in (before[-1] + 1, before[-1] + 10_000, 2**62):
        r = client.post(url, json={**review, "seen": past}, headers=otto)
        assert r.status_code == 422 and "past the call's newest event" in r.json()["error"], r.text
    login(client, "otto")
    hidden = _hidden_fields(client.get(f"/calls/{scope}/s").text, eid)
    form = {**hidden, "as": "succeeded", "evidence": "the late result: charged"}
    r = client.post(
        f"/calls/{scope}/s/resolve", data={**form, "seen": str(2**62)}, follow_redirects=False
    )
    assert r.status_code == 422 and "past the call&#39;s newest event" in r.text, r.status_code
    assert [e.seq for e in ledger.events(scope, "s")] == before
    assert ledger.get(scope, "s").operation.review == "contradicted"
    r = client.post(url, json={**review, "seen": before[-1]}, headers=otto)
    assert r.status_code == 200, r.text
    assert ledger.get(scope, "s").operation.review is None


def test_console__a_review_without_seen_or_a_retry_without_attempt_is_refused(
    server: Any, scope: str
) -> None:
    """A hand-made post of the review form (``review=yes``) without the page's ``seen``, or
    with an empty one, and a retry form without ``attempt``: 422 "reload", nothing changed
    (the page always writes both; without them the guard they carry would be skipped)."""
    client, ledger = server
    eid = _contradicted_with_attempt_2_held(ledger, scope, "f")
    unknown(ledger, scope, "u")
    login(client, "otto")
    hidden = _hidden_fields(client.get(f"/calls/{scope}/f").text, eid)
    token = hidden["csrf"]
    before = {c: [e.seq for e in ledger.events(scope, c)] for c in ("f", "u")}
    review = {k: v for k, v in hidden.items() if k != "seen"}
    review.update({"as": "succeeded", "evidence": "charged"})
    for seen in (None, ""):
        form = review if seen is None else {**review, "seen": seen}
        r = client.post(f"/calls/{scope}/f/resolve", data=form, follow_redirects=False)
        assert r.status_code == 422 and "newest event is missing" in r.text, r.status_code
    for attempt in (None, ""):
        form = {"csrf": token, "reason": "again"}
        if attempt is not None:
            form["attempt"] = attempt
        r = client.post(f"/calls/{scope}/u/retry", data=form, follow_redirects=False)
        assert r.status_code == 422 and "attempt is missing" in r.text, r.status_code
    assert {c: [e.seq for e in ledger.events(scope, c)] for c in ("f", "u")} == before


def test_api_and_console__a_scope_segment_with_an_escaped_slash_is_refused(
    server: Any, scope: str
) -> None:
    """A scope holds no "/"; the router splits the unescaped path, so ``{scope}%2Fp`` (the
    scope "S/p", no call) was answered with the call p of scope S, and ``…%2Fp/approve``
    approved it. 422 for the API and the console alike, nothing changed; an id's escaped "/"
    is still the id's (``a%2Fb``)."""
    client, ledger = server
    pending(ledger, scope, "p")
    pending(ledger, scope, "a/b", path="ab.txt")
    ann = bearer("ann")
    for bad in ("%2F", "%2f"):
        r = client.get(f"/api/calls/{scope}{bad}p", headers=ann)
        assert r.status_code == 422 and "a scope holds no '/'" in r.json()["error"], r.text
        r = client.post(f"/api/calls/{scope}{bad}p/approve", json={"reason": "x"}, headers=ann)
        assert r.status_code == 422, r.text
        r = client.get(f"/api/calls/{scope}{bad}p/events", headers=ann)
        assert r.status_code == 422, r.text
    login(client, "ann")
    token = csrf_of(client.get(f"/calls/{scope}/p").text)
    assert client.get(f"/calls/{scope}%2Fp").status_code == 422
    r = client.post(
        f"/calls/{scope}%2Fp/approve", data={"csrf": token, "reason": "x"}, follow_redirects=False
    )
    assert r.status_code == 422
    assert ledger.get(scope, "p").operation.status is Status.PENDING_APPROVAL
    r = client.get(f"/api/calls/{scope}/a%2Fb", headers=ann)
    assert r.status_code == 200 and r.json()["tool_call_id"] == "a/b"


def test_docs__swagger_ui_is_one_release_checked_by_the_browser(server: Any) -> None:
    """FastAPI's /docs loaded ``swagger-ui-dist@5`` from a CDN, any 5.x release, unchecked:
    a bad release or a CDN serving other bytes ran as the console's origin, with the person's
    session cookie (a cold review of the HTTP surface). Every file it loads now names one
    release and carries its digest (Subresource Integrity); nothing comes from elsewhere."""
    import re

    from toolledger.server.docs import SCRIPT, STYLE, SWAGGER_UI_VERSION

    client, _ = server
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    loaded = re.findall(r"<(?:script|link)\b[^>]*?(?:src|href)=\"(https?://[^\"]+)\"[^>]*>", page)
    assert sorted(loaded) == sorted([SCRIPT[0], STYLE[0]]), loaded  # no icon, nothing else
    for url, digest in (SCRIPT, STYLE):
        tag = next(t for t in re.findall(r"<(?:script|link)\b[^>]*>", page) if url in t)
        assert f'integrity="{digest}"' in tag and 'crossorigin="anonymous"' in tag, tag
        assert f"swagger-ui-dist@{SWAGGER_UI_VERSION}/" in url and digest.startswith("sha384-")
    assert re.fullmatch(r"\d+\.\d+\.\d+", SWAGGER_UI_VERSION)  # one release, not a range
    assert "/openapi.json" in page and client.get("/openapi.json").status_code == 200


def test_api__no_answer_is_kept_by_a_cache(server: Any, scope: str) -> None:
    """Every answer under /api/ says ``Cache-Control: no-store``, as the console's pages do:
    a call's arguments and results were sent without it, for a browser or a caching proxy in
    front to keep on disk (a cold review)."""
    client, ledger = server
    pending(ledger, scope, "c1")
    h = bearer("otto")
    body = {"scope": scope, "tool_call_id": "c2", "tool": "write_file", "args": {"path": "b"}}
    answers = {
        "show": client.get(f"/api/calls/{scope}/c1", headers=h),
        "events": client.get(f"/api/calls/{scope}/c1/events", headers=h),
        "list": client.get("/api/calls", params={"scope": scope}, headers=h),
        "inbox": client.get("/api/inbox", headers=h),
        "submit": client.post("/api/calls", json=body, headers=h),
        "not found": client.get(f"/api/calls/{scope}/nope", headers=h),
        "no token": client.get(f"/api/calls/{scope}/c1"),
        "bad path": client.get(f"/api/calls/{scope}/bad%FE", headers=h),
        "HEAD": client.head(f"/api/calls/{scope}/c1", headers=h),
    }
    said = {what: r.headers.get("cache-control") for what, r in answers.items()}
    assert said == dict.fromkeys(answers, "no-store"), said
    page = client.get("/login")  # the console's own, unchanged
    assert page.headers["cache-control"] == "no-store"


def test_console__a_refusal_before_any_route_is_its_error_page(server: Any, scope: str) -> None:
    """A path not UTF-8 and a form over the bound are refused before any route: the console's
    error page for a person, as every other console error (they were raw JSON in the browser;
    a cold review), the API's JSON under /api/ as before."""
    client, _ = server
    answers = {
        "path": client.get(f"/calls/{scope}/bad%FE"),
        "form": client.post("/login", data={"token": "x" * (300 * 1024)}),
    }
    said = {k: (r.status_code, r.headers["content-type"].split(";")[0]) for k, r in answers.items()}
    assert said == {"path": (422, "text/html"), "form": (413, "text/html")}, said
    assert "not UTF-8" in answers["path"].text and "limit" in answers["form"].text
    assert answers["path"].headers["content-security-policy"]  # the console's headers
    api = client.get(f"/api/calls/{scope}/bad%FE", headers=bearer("vera"))
    assert api.status_code == 422 and api.json()["kind"] == "input"
