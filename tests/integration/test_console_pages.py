"""The console's expensive pages and look-alike ids (a cold review): a call page's file check
is not redone on every view, big pages are rendered off the event loop and bounded, and ids
differing only by blanks read differently wherever a person decides."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from tests.helpers import run_cli
from tests.integration.test_server import login, serving
from toolledger.ledger.ledger import Ledger
from toolledger.server import console


@pytest.fixture
def server(fresh_db_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, Ledger]]:
    yield from serving(fresh_db_url, tmp_path)


def test_call_page__rendered_off_the_event_loop(
    server: Any, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call with 400 KB of arguments took 0.4 s to render on the event loop: /login and
    every other request waited behind 10 such pages. The page is rendered in a thread."""
    client, ledger = server
    ledger.submit(scope, "c1", "write_file", {"path": "a.txt", "content": "x"})
    on_loop: list[bool] = []
    real = console.env.get_template

    def spy(name: str, *a: Any, **k: Any) -> Any:
        template = real(name, *a, **k)
        render = template.render

        def recorded(*ra: Any, **rk: Any) -> str:
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:
                on_loop.append(False)
            return render(*ra, **rk)

        template.render = recorded  # type: ignore[method-assign]
        return template

    monkeypatch.setattr(console.env, "get_template", spy)
    login(client, "ann")
    on_loop.clear()
    for path in (f"/calls/{scope}/c1", "/", f"/calls?scope={scope}"):
        assert client.get(path).status_code == 200
    assert on_loop == [False, False, False]


def test_call_page__large_arguments_shown_bounded_and_whole_on_request(
    server: Any, scope: str
) -> None:
    """400 KB of arguments made a 3 MB page (shown twice, escaping expanding them). The page
    shows their start, says how much is not shown and links to them whole."""
    client, ledger = server
    content = "<&>\"'" * 80_000  # 400 KB, each character escaped on the page
    args = {"path": "big.txt", "content": content}
    ledger.submit(scope, "big", "write_file", args)
    login(client, "ann")
    page = client.get(f"/calls/{scope}/big")
    assert page.status_code == 200
    # the arguments' 32 K characters and the submitted event's 16 K, each escaped at most
    # six times over (&#34;): bounded, whatever the arguments' size (it was 3.8 MB)
    assert len(page.content) < 400_000, len(page.content)
    assert 'id="args-truncated"' in page.text
    link = f"/calls/{quote(scope, safe='')}/big?whole=args"
    assert f'href="{link}"' in page.text
    assert "not shown" in page.text and "characters" in page.text
    assert "approve-form" in page.text  # still decidable: on what it says it shows
    whole = client.get(link)
    assert whole.status_code == 200 and whole.headers["content-type"].startswith("application/json")
    assert "attachment" in whole.headers.get("content-disposition", "")
    assert json.loads(whole.content) == args
    # a small call's page shows its arguments whole, with no notice
    ledger.submit(scope, "small", "write_file", {"path": "s.txt", "content": "hi"})
    small = client.get(f"/calls/{scope}/small").text
    assert 'id="args-truncated"' not in small and "&#34;hi&#34;" in small
    # another's scope is not reachable through the link either
    client.cookies.clear()
    assert client.get(link, follow_redirects=False).status_code == 303


def _counting_hashes(
    monkeypatch: pytest.MonkeyPatch, gate: threading.Event | None = None
) -> list[int]:
    """Each sha256 taken of more than the requested five bytes (the file's), counted; held
    until ``gate`` is set when one is given."""
    hashed: list[int] = []
    real = hashlib.sha256

    def counting(data: bytes = b"", *a: Any, **k: Any) -> Any:
        if len(data) > 5 or data == b"hello":
            hashed.append(len(data))
            if gate is not None:
                gate.wait(10)
        return real(data, *a, **k)

    monkeypatch.setattr(hashlib, "sha256", counting)
    return hashed


def test_call_page__the_file_is_hashed_once_while_it_is_unchanged(
    server: Any, scope: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each view of a sandbox call's page read and hashed its file (a 60 MB file: 250 ms a
    view, 40 views at once 6.6 s). The check is kept by the file's identity, size and times,
    and redone when the file changes."""
    client, ledger = server
    ledger.submit(scope, "f1", "write_file", {"path": "f.txt", "content": "hello"})
    root = tmp_path / "sandbox" / scope
    root.mkdir(parents=True, exist_ok=True)
    (root / "f.txt").write_bytes(b"say hello world")
    login(client, "ann")
    hashed = _counting_hashes(monkeypatch)
    for _ in range(6):
        page = client.get(f"/calls/{scope}/f1").text
        assert "the file contains the requested content" in page
    assert hashed.count(15) == 1, hashed
    (root / "f.txt").write_bytes(b"goodbye all, you")  # changed: checked again
    again = client.get(f"/calls/{scope}/f1").text
    assert "the requested content is not in the file" in again
    assert hashed.count(16) == 1, hashed


def test_call_page__many_views_at_once_check_the_file_once(
    server: Any, scope: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concurrent first views wait for the one check under way instead of each reading and
    hashing the file (40 views at once of a 60 MB file took 6.6 s)."""
    client, ledger = server
    ledger.submit(scope, "f2", "write_file", {"path": "g.txt", "content": "hello"})
    root = tmp_path / "sandbox" / scope
    root.mkdir(parents=True, exist_ok=True)
    (root / "g.txt").write_bytes(b"hello there")
    desk = client.app.state.desk  # type: ignore[attr-defined]
    view = desk.ledger.get(scope, "f2")
    gate = threading.Event()
    hashed = _counting_hashes(monkeypatch, gate)
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda: results.append(desk._file_check(view))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    gate.wait(0.5)  # the four start their checks meanwhile
    gate.set()
    for t in threads:
        t.join(30)
    assert hashed.count(11) == 1, hashed
    assert len(results) == 4 and all(r["contains"] for r in results)


LOOK_ALIKE = ["n16", "n16 ", " n16", "n\xa016", "n 16", "n  16"]


def test_console__ids_differing_by_blanks_read_differently(server: Any, scope: str) -> None:
    """``"n16 "`` and ``"n16"`` were both accepted and looked the same on the page and in the
    lists: a person approving could not tell which call. Blanks an id's reader cannot see
    (leading, trailing, doubled, or other than a space) are written as escapes."""
    client, ledger = server
    for i, call in enumerate(LOOK_ALIKE):
        ledger.submit(scope, call, "write_file", {"path": f"l{i}.txt", "content": "x"})
    login(client, "ann")
    listed = client.get("/calls", params={"scope": scope}).text
    for shown in ("n16<", "n16\\u0020<", "\\u0020n16<", "n\\u00a016<", "n 16<"):
        assert f">{shown}/a>" in listed, (shown, listed)
    assert "n\\u0020\\u002016<" in listed or "n\\u0020\\u0020" + "16<" in listed
    page = client.get(f"/calls/{scope}/" + quote("n16 ", safe="")).text
    assert f"{scope} / n16\\u0020</span>" in page
    assert "<title>n16\\u0020" in page or "n16\\u0020 " in page.split("</title>")[0]


def test_cli__ids_differing_by_blanks_read_differently(
    fresh_db_url: str, scope: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI's human output (list, show, approve, events) wrote ``n16 `` as ``n16``: an
    operator approving from a terminal could not tell which call. ``--json`` is unchanged."""
    ledger = Ledger(fresh_db_url)
    try:
        for i, call in enumerate(LOOK_ALIKE):
            ledger.submit(scope, call, "write_file", {"path": f"l{i}.txt", "content": "x"})
    finally:
        ledger.close()
    db = ("--db", fresh_db_url)
    code, out, _ = run_cli(capsys, *db, "list", "--scope", scope)
    assert code == 0
    ids = [line.split()[1] for line in out.splitlines()[1:]]
    assert "n16\\u0020" in ids and "\\u0020n16" in ids and "n16" in ids
    assert "n\\u00a016" in ids and "n\\u0020\\u002016" in ids
    assert len(set(out.splitlines()[1:])) == len(LOOK_ALIKE)
    where = ("--scope", scope, "--tool-call-id", "n16 ")
    code, out, _ = run_cli(capsys, *db, "show", *where)
    assert code == 0 and out.startswith(f"{scope}/n16\\u0020 "), out
    code, out, _ = run_cli(capsys, *db, "approve", *where, "--by", "ann", "--reason", "ok")
    assert f"{scope}/n16\\u0020 ->" in out, out
    code, out, _ = run_cli(capsys, *db, "show", *where, "--json")
    assert json.loads(out)["tool_call_id"] == "n16 "  # the contract's JSON: the id as it is
