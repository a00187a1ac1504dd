"""Wrong secrets are throttled by the client's address (``auth.FailureThrottle``): a guesser's
tries stop at a few a minute an address, refused before any comparison, while a person who
mistypes waits seconds and everyone else is untouched."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.integration.test_server import SECRETS, TOKENS
from toolledger.config import ConfigError, Settings
from toolledger.harness.console_load import start_server
from toolledger.server.app import create_app
from toolledger.server.auth import (
    Authenticator,
    FailureThrottle,
    Throttled,
    parse_tokens,
)

WRONG = "not-the-secret-0123456789"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_throttle__a_burst_then_one_try_a_refill() -> None:
    clock = Clock()
    throttle = FailureThrottle(burst=3, refill_seconds=10, clock=clock)
    for _ in range(3):
        throttle.check("10.0.0.1")
        throttle.failed("10.0.0.1")
    with pytest.raises(Throttled) as caught:
        throttle.check("10.0.0.1")
    assert caught.value.retry_after == 10
    throttle.check("10.0.0.2")  # another address is untouched
    clock.now += 4
    assert throttle.wait("10.0.0.1") == pytest.approx(6)
    clock.now += 6
    throttle.check("10.0.0.1")  # one more try...
    throttle.failed("10.0.0.1")
    with pytest.raises(Throttled):  # ...and no second
        throttle.check("10.0.0.1")
    clock.now += 30  # forgiven in full: the whole burst again
    for _ in range(3):
        throttle.check("10.0.0.1")
        throttle.failed("10.0.0.1")


def test_throttle__logged_once_when_an_address_starts_to_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    throttle = FailureThrottle(burst=3, refill_seconds=10, clock=clock)
    with caplog.at_level(logging.WARNING, logger="toolledger.serve"):
        for _ in range(3):
            clock.now += 0.5  # its failures fade as they come: it still has to be said
            throttle.failed("10.0.0.1")
        clock.now += 20
        throttle.failed("10.0.0.1")  # a try after its wait: it does not wait again, nothing said
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "3 wrong tokens from 10.0.0.1: its secrets are refused for 9 s, then one more every 10 s"
    ], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="toolledger.serve"):
        for _ in range(4):  # helper-99: a line each guess after the burst, each saying "3"
            clock.now += 5  # (not forgiven in full since it was said: said once)
            throttle.failed("10.0.0.1")
            assert throttle.wait("10.0.0.1") > 0
        assert not caplog.records
        clock.now += 60  # forgiven in full: its next wait is said again
        for _ in range(3):
            throttle.failed("10.0.0.1")
    assert len(caplog.records) == 1


def test_throttle__ipv6_counts_by_its_64_and_a_mapped_ipv4_as_itself() -> None:
    throttle = FailureThrottle(burst=2, clock=Clock())
    throttle.failed("2001:db8:1:2::1")
    throttle.failed("2001:db8:1:2:ffff::9")  # the same /64: one host may hold all of it
    with pytest.raises(Throttled):
        throttle.check("2001:db8:1:2::abcd")
    throttle.check("2001:db8:1:3::1")
    throttle.failed("fe80::1%eth0")  # scoped: its /64, no error (helper-103: it raised)
    assert "fe80::/64" in throttle._buckets
    throttle.failed("::ffff:192.0.2.7")
    throttle.failed("192.0.2.7")
    with pytest.raises(Throttled):
        throttle.check("192.0.2.7")


def test_throttle__a_full_table_forgets_the_forgiven_never_the_throttled() -> None:
    """helper-99: past the table's size the longest remembered address was forgotten,
    throttled or not, so a pool of addresses reset its own buckets (30 guesses where 10
    were promised), and each insertion scanned the table under the lock."""
    clock = Clock()
    throttle = FailureThrottle(burst=2, refill_seconds=10, max_addresses=3, clock=clock)
    for _ in range(5):
        throttle.failed("10.0.0.2")
    throttle.failed("10.0.0.1")
    clock.now += 15  # 10.0.0.1 is forgiven, nothing worth remembering; 10.0.0.2 is not
    throttle.failed("10.0.0.3")
    throttle.failed("10.0.0.3")
    throttle.failed("10.0.0.4")  # full: the forgiven one goes
    assert set(throttle._buckets) == {"10.0.0.2", "10.0.0.3", "10.0.0.4"}
    for n in range(5, 40):  # none forgiven: new addresses share their /16's, nobody goes
        with contextlib.suppress(Throttled):
            throttle.take(f"10.0.1.{n}")
    neighbours = f"{throttle.OVERFLOW} 10.0.0.0/16"
    assert set(throttle._buckets) == {"10.0.0.2", "10.0.0.3", "10.0.0.4", neighbours}
    with pytest.raises(Throttled):
        throttle.check("10.0.0.2")
    with pytest.raises(Throttled):  # its burst is spent: new neighbours wait...
        throttle.take("10.0.2.1")
    throttle.take("192.0.2.1")  # ...not a client from elsewhere (helper-102: one bucket for all)
    clock.now += 60  # all forgiven: a new address has its own bucket again
    throttle.take("10.0.2.1")
    assert "10.0.2.1" in throttle._buckets


def test_throttle__whatever_is_no_address_counts_as_one() -> None:
    """helper-99: a name that is no IP address (a forged X-Forwarded-For behind a trusting
    proxy) had a bucket of its own each: a guess each, and memory without bound."""
    throttle = FailureThrottle(burst=2, clock=Clock())
    throttle.failed("not-an-ip-1")
    throttle.failed("not-an-ip-2")
    with pytest.raises(Throttled):
        throttle.check("fe80::1%eth0/bad")
    assert set(throttle._buckets) == {throttle.UNNAMED}


def test_authenticator__concurrent_guesses_pass_the_burst_no_more() -> None:
    """helper-99: the check and the count were apart, and 120 concurrent wrong bearers of
    200 KB (their hashing lets other threads run) got 12 and 13 compared, not 10."""
    import threading

    auth = Authenticator(parse_tokens(TOKENS, "t"), throttle=FailureThrottle(burst=10))
    compared = []
    slow = auth.by_secret

    def hashing(secret: str) -> Any:
        compared.append(secret)
        time.sleep(0.02)  # a long secret's hash, the GIL released
        return slow(secret)

    auth.by_secret = hashing  # type: ignore[method-assign]
    start = threading.Barrier(60)

    def guess() -> None:
        start.wait(10)
        with contextlib.suppress(Throttled):
            auth.by_secret_from(WRONG, "10.0.0.9")

    threads = [threading.Thread(target=guess) for _ in range(60)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(compared) == 10


def test_tokens__a_secret_longer_than_any_token_is_refused_unhashed() -> None:
    with pytest.raises(ConfigError, match="longer than 4096"):
        parse_tokens("ops:operator:" + "x" * 4097, "t")
    auth = Authenticator(parse_tokens(TOKENS, "t"))
    assert auth.by_secret("y" * 4_000_000) is None


def test_authenticator__a_throttled_address_is_refused_even_the_right_secret() -> None:
    """Refused before the comparison: otherwise the answer to a throttled guess (refused, or
    let in) would still say whether it was right."""
    auth = Authenticator(
        parse_tokens(TOKENS, "t"), throttle=FailureThrottle(burst=2, clock=Clock())
    )
    assert auth.by_secret_from(SECRETS["otto"], "10.0.0.1") is not None
    for _ in range(5):  # right secrets cost nothing
        auth.by_secret_from(SECRETS["otto"], "10.0.0.1")
    assert auth.by_secret_from(WRONG, "10.0.0.1") is None
    assert auth.by_secret_from(WRONG, "10.0.0.1") is None
    with pytest.raises(Throttled):
        auth.by_secret_from(SECRETS["otto"], "10.0.0.1")


@pytest.fixture
def app(fresh_db_url: str, tmp_path: Path) -> Iterator[tuple[Any, Clock]]:
    settings = Settings.from_env(
        {"TOOLLEDGER_DB": fresh_db_url, "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
         "TOOLLEDGER_HOME": str(tmp_path / "home"), "TOOLLEDGER_TOOLS": "tests.external_tools",
         "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0"}
    )  # fmt: skip
    app = create_app(settings, parse_tokens(TOKENS, "t"), metrics=False)
    clock = Clock()
    app.state.desk.auth.throttle._clock = clock
    yield app, clock


def test_api__wrong_bearers_then_429_with_retry_after_per_address(app: Any) -> None:
    asgi, clock = app
    guesser = TestClient(asgi, client=("203.0.113.9", 5000))
    other = TestClient(asgi, client=("198.51.100.4", 5000))
    with guesser, other:
        for _ in range(10):
            r = guesser.get("/api/inbox", headers={"Authorization": f"Bearer {WRONG}"})
            assert r.status_code == 401
        right = {"Authorization": f"Bearer {SECRETS['otto']}"}
        r = guesser.get("/api/inbox", headers=right)
        assert r.status_code == 429 and r.headers["retry-after"] == "6", r.text
        assert r.json()["kind"] == "throttled" and r.json()["exit_code"] == 2
        assert other.get("/api/inbox", headers=right).status_code == 200
        r = guesser.get("/api/inbox")  # no secret sent: nothing guessed, nothing counted
        assert r.status_code == 401
        clock.now += 6
        assert guesser.get("/api/inbox", headers=right).status_code == 200


def login_form(client: TestClient) -> str:
    page = client.get("/login")
    return re.search(r'name="nonce" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]


def test_console__wrong_logins_then_429_and_no_session(app: Any) -> None:
    asgi, clock = app
    with TestClient(asgi, client=("203.0.113.9", 5000)) as client:
        for _ in range(10):
            nonce = login_form(client)
            r = client.post("/login", data={"nonce": nonce, "token": WRONG, "next": "/"})
            assert r.status_code == 401
        nonce = login_form(client)
        data = {"nonce": nonce, "token": SECRETS["ann"], "next": "/"}
        r = client.post("/login", data=data, follow_redirects=False)
        assert r.status_code == 429 and r.headers["retry-after"] == "6"
        assert "try again in 6 s" in r.text and "toolledger_session" not in r.cookies
        clock.now += 6
        r = client.post("/login", data=data, follow_redirects=False)  # the same form
        assert r.status_code == 303 and "toolledger_session" in r.cookies


OPERATOR = "throttle-operator-secret-0123456789"


@pytest.mark.parametrize("trusted", [False, True])
def test_serve__behind_a_proxy_each_client_is_throttled_by_its_own_address(
    tmp_path: Path, trusted: bool
) -> None:
    """A real ``serve``. Behind a proxy every request comes from the proxy's address: without
    ``--forwarded-allow-ips`` one guesser throttles everyone (X-Forwarded-For ignored, it could
    be forged), with it each client by the address the proxy names."""
    home = tmp_path / "home"
    options = ("--forwarded-allow-ips", "127.0.0.1") if trusted else ()
    server, base = start_server(
        f"sqlite:///{home / 'ledger.db'}", home, OPERATOR, role="operator", options=options
    )
    try:
        for _ in range(10):
            r = httpx.get(
                f"{base}/api/inbox",
                headers={"Authorization": f"Bearer {WRONG}", "X-Forwarded-For": "203.0.113.9"},
            )
            assert r.status_code == 401
        right = {"Authorization": f"Bearer {OPERATOR}", "X-Forwarded-For": "198.51.100.4"}
        assert httpx.get(f"{base}/api/inbox", headers=right).status_code == (
            200 if trusted else 429
        )
        guesser = {"Authorization": f"Bearer {OPERATOR}", "X-Forwarded-For": "203.0.113.9"}
        assert httpx.get(f"{base}/api/inbox", headers=guesser).status_code == 429
        log = (home / "serve.log").read_text()
        assert f"10 wrong tokens from {'203.0.113.9' if trusted else '127.0.0.1'}" in log, log
    finally:
        server.terminate()
        server.wait(30)


def test_console__a_bearer_throttled_on_a_page_is_told_when_to_come_back(app: Any) -> None:
    """helper-99: the login form's 429 said Retry-After, a console page's did not."""
    asgi, _clock = app
    with TestClient(asgi, client=("203.0.113.9", 5000)) as client:
        wrong = {"Authorization": f"Bearer {WRONG}"}
        for _ in range(10):
            client.get("/", headers=wrong, follow_redirects=False)
        r = client.get("/", headers=wrong, follow_redirects=False)
        assert r.status_code == 429 and r.headers["retry-after"] == "6", r.headers


@pytest.mark.parametrize("value", ["*", "10.0.0.1,*", " "])
def test_serve__trusting_every_address_is_refused(tmp_path: Path, value: str) -> None:
    """helper-99: with uvicorn's ``*`` every client named the address it is counted by:
    300 guesses from one client, and any other address made to wait."""
    import subprocess

    from toolledger.harness.processes import toolledger_argv

    env = {
        **os.environ,
        "TOOLLEDGER_HOME": str(tmp_path),
        "TOOLLEDGER_API_TOKENS": f"ops:operator:{OPERATOR}",
    }
    done = subprocess.run(
        [*toolledger_argv(), "serve", "--port", "0", "--forwarded-allow-ips", value],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "name the proxy's own addresses" in done.stderr and "Traceback" not in done.stderr
