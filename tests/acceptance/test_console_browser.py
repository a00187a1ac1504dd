"""The console in a real browser (headless Chromium, Debian's package, driven by Playwright):
a person logs in, approves a pending call and sees a real worker run it, resolves an unknown
with evidence, and reads a call full of script payloads without any of them running.

Set TOOLLEDGER_SCREENSHOTS=docs/console to refresh the README's screenshots."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.acceptance.conftest import Stack, landed, wait_until
from tests.conftest import CI
from toolledger.harness.processes import toolledger_argv

playwright = pytest.importorskip("playwright.sync_api") if not CI else None
from playwright.sync_api import Browser, Page, sync_playwright  # noqa: E402

OPERATOR = "operator-secret-for-the-browser-test"
APPROVER = "approver-secret-for-the-browser-test"

#: Payloads that would run if anything an agent wrote reached the page as HTML.
PAYLOADS = [
    "<script>window.__pwned = 'script'</script>",
    "<img src=x onerror=\"window.__pwned = 'img'\">",
    '"><svg onload="window.__pwned = \'svg\'">',
    "</pre><iframe srcdoc=\"<script>parent.__pwned='frame'</script>\"></iframe>",
    "javascript:window.__pwned='href'",
]


def chromium() -> str | None:
    for candidate in (
        os.environ.get("TOOLLEDGER_CHROMIUM"),
        "/usr/lib/chromium/chromium",  # Debian's binary (/usr/bin/chromium is a wrapper)
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
    ):
        if candidate and Path(candidate).exists():
            return candidate
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    exe = chromium()
    if exe is None:
        message = "no Chromium (apt-get install chromium)"
        if CI:
            pytest.fail(f"{message}; under CI=true the browser test must run", pytrace=False)
        pytest.skip(message)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(world: Stack, env: dict[str, str], *options: str) -> Iterator[str]:
    """``toolledger serve`` for real, in its own process: its base URL once it answers."""
    port = free_port()
    log_path = world.root / f"serve-{port}.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [*toolledger_argv(), "serve", *options, "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(base + "/login", timeout=2).status_code == 200
        except httpx.HTTPError:
            assert proc.poll() is None, log_path.read_text()
            return False

    try:
        wait_until(up, 60, "toolledger serve to answer")
        yield base
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture
def served(world: Stack, scope: str) -> Iterator[tuple[Stack, str, str]]:
    """Its tokens see only this test's scope (the Postgres database is shared by the
    module's tests)."""
    tokens = f"olga:operator:{OPERATOR}:{scope},abe:approver:{APPROVER}:{scope}"
    with serving(world, world.env(api_tokens=tokens)) as base:
        yield world, base, scope


def login(page: Page, base: str, secret: str) -> None:
    page.goto(base + "/")
    assert "/login" in page.url
    page.fill("#token", secret)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/")


def inert(page: Page) -> list[str]:
    """What a payload managed to do, seen through the page: nothing, if it was inert."""
    found = []
    if page.evaluate("() => window.__pwned") is not None:
        found.append(f"a payload ran: {page.evaluate('() => window.__pwned')}")
    for selector in ("script", "iframe", "svg", "img[onerror]", "[onload]", "[onerror]"):
        n = page.locator(selector).count()
        if n:
            found.append(f"{n} <{selector}> element(s) from the payloads")
    return found


def shot(page: Page, name: str) -> None:
    target = os.environ.get("TOOLLEDGER_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(target) / name), full_page=True)


def status_of(page: Page) -> str:
    return page.inner_text("#status").strip()


def test_approve_in_the_browser__a_real_worker_runs_it(browser: Browser, served: Any) -> None:
    world, base, scope = served
    sub = world.submitter()
    for i, content in enumerate(["the quarterly report\n", "draft 2\n"]):
        call = sub.prepare(
            scope,
            f"call_{i}",
            "probe_write",
            {"path": f"reports/q{i}.txt", "content": content},
        )
        sub.submit(call)
    sub.close()
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    login(page, base, APPROVER)
    assert page.inner_text("#count-pending .n") == "2"
    shot(page, "inbox.png")
    page.click("text=call_0")
    page.fill("#approve-reason", "reviewed the report text with the finance team")
    page.click("button[value=approve]")
    assert "Approved and enqueued" in page.inner_text("main")

    def ran() -> bool:
        page.reload()
        return status_of(page) == "succeeded"

    wait_until(ran, 60, "the worker to run the approved call")

    def shown_landed() -> bool:  # the receipt is given at the commit; the bytes land after it
        page.reload()
        return "the file holds exactly the requested content" in page.inner_text("#file")

    wait_until(shown_landed, 30, "the approved call's bytes to land")
    assert "abe" in page.inner_text("#events")  # the token's name, recorded
    assert landed(world.sandbox / scope / "reports" / "q0.txt") == ("the quarterly report\n")
    shot(page, "call.png")
    page.close()


def test_resolve_an_unknown_with_evidence(browser: Browser, served: Any) -> None:
    world, base, scope = served
    ledger = world.ledger()
    ledger.submit(
        scope,
        "call_u",
        "probe_append",
        {"path": "log/audit.txt", "content": "entry 17\n"},
        approved_by="setup",
    )
    claim = ledger.claim(scope, "probe_append:call_u", 1, worker_id="frozen-worker")
    assert claim is not None
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    login(page, base, OPERATOR)
    assert page.inner_text("#count-unknown .n") == "1"
    page.click("text=call_u")
    assert status_of(page) == "unknown"
    assert "the requested content is not in the file" in page.inner_text("#file")
    shot(page, "unknown.png")
    page.check("#resolve-form-1 input[value=failed]")
    page.fill("#evidence-1", "log/audit.txt has no 'entry 17': the append never landed")
    page.click("#resolve-form-1 button[type=submit]")
    assert "Resolved, with your evidence recorded" in page.inner_text("main")
    assert status_of(page) == "failed"
    assert "the append never landed" in page.inner_text("#events")
    view = ledger.get(scope, "call_u")
    assert view.current is not None and view.current.reconciled
    assert ledger.events(scope, "call_u")[-1].actor == "olga"
    ledger.close()
    page.close()


def test_script_payloads_are_text_not_code(browser: Browser, served: Any) -> None:
    world, base, scope = served
    ledger = world.ledger()
    ledger.submit(
        scope,
        PAYLOADS[0][:200],
        "probe_write",
        {"path": "x.txt", "content": "\n".join(PAYLOADS)},
        approved_by="olga",
        reason=PAYLOADS[1],  # shown in the approval's event
    )
    page = browser.new_page()
    login(page, base, OPERATOR)
    assert inert(page) == []
    page.goto(base + f"/calls?scope={scope}")
    page.click(f"a[href^='/calls/{scope}/']")
    assert page.url.startswith(base + f"/calls/{scope}/")
    page.wait_for_timeout(300)  # time for an onerror/onload to fire, if one could
    assert inert(page) == []
    text = page.inner_text("#args")
    for payload in PAYLOADS:
        assert payload.replace("\n", "") in text.replace("\\n", "").replace('\\"', '"')
    assert PAYLOADS[0][:30] in page.inner_text("h1")  # the tool_call_id, shown as text
    ledger.close()
    page.close()


def test_the_inertness_check_catches_a_payload_that_runs(browser: Browser) -> None:
    """The check above can fail: on a page that renders the payloads as HTML, it does."""
    page = browser.new_page()
    page.set_content("<div>" + "".join(PAYLOADS[:3]) + "</div>")
    time.sleep(0.2)
    found = inert(page)
    assert any("a payload ran" in f for f in found) and any("<script>" in f for f in found)
    page.close()


@pytest.fixture
def served_locally(world: Stack) -> Iterator[tuple[Stack, str]]:
    """``toolledger serve --insecure-local``: no token, every request the operator."""
    env = {k: v for k, v in world.env().items() if not k.startswith("TOOLLEDGER_API_TOKENS")}
    with serving(world, env, "--insecure-local") as base:
        yield world, base


@pytest.mark.parametrize("world", ["embedded"], indirect=True)
def test_insecure_local__the_console_decides_and_another_site_cannot(
    browser: Browser, served_locally: Any
) -> None:
    """The console's own forms work from a real browser (its posts are same-origin; under
    the old no-referrer policy Chromium sent them as Origin: null, refused), and a page of
    another site that posts the same form is refused: the call stays pending."""
    world, base = served_locally
    ledger = world.ledger()
    for call in ("mine", "theirs"):
        ledger.submit("local", call, "probe_write", {"path": f"{call}.txt", "content": "x"})
    page = browser.new_page()
    page.goto(f"{base}/calls/local/mine")
    page.fill("#approve-reason", "looked at it")
    page.click("button[value=approve]")
    assert "Approved and enqueued" in page.inner_text("main")
    assert ledger.get("local", "mine").operation.status.value != "pending_approval"
    page.goto(f"{base}/calls/local/theirs")  # even a page that knew the form's token
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    attacker = browser.new_page()
    attacker.set_content(
        f'<form method="post" action="{base}/calls/local/theirs/approve">'
        f'<input name="csrf" value="{csrf}"><input name="reason" value="pwned">'
        '<button value="approve" name="action">go</button></form>'
    )
    with attacker.expect_navigation():
        attacker.click("button")
    assert "another site" in attacker.content()
    assert ledger.get("local", "theirs").operation.status.value == "pending_approval"
    ledger.close()
    page.close()
    attacker.close()
