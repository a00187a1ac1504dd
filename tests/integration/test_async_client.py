"""``AsyncClient`` has every method ``Client`` has (README: "the same methods, as
coroutines"): ``status`` and ``check`` were missing, and the ``ledger`` property."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest

from toolledger import AsyncClient, Client
from toolledger.config import Settings
from toolledger.ledger.errors import ConflictError


def test_async_client__every_public_method_of_client_as_a_coroutine() -> None:
    for name, member in inspect.getmembers(Client):
        if name.startswith("_"):  # the context manager is ``async with`` there
            continue
        assert hasattr(AsyncClient, name), name
        if inspect.isfunction(member):
            assert inspect.iscoroutinefunction(getattr(AsyncClient, name)), name
            assert list(inspect.signature(member).parameters) == list(
                inspect.signature(getattr(AsyncClient, name)).parameters
            ), name


def test_async_client__status_check_and_the_ledger(sqlite_url: str, tmp_path: Path) -> None:
    settings = Settings.from_env(
        {"TOOLLEDGER_DB": sqlite_url, "TOOLLEDGER_HOME": str(tmp_path / "home"),
         "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox")}
    )  # fmt: skip

    async def go() -> None:
        async with AsyncClient(settings) as client:
            args = {"path": "p.txt", "content": "x"}
            await client.submit("a", "c1", "write_file", args)
            assert await client.status("a", "c1") == "pending_approval"
            checked = await client.check("a", "c2", "write_file", args)
            assert checked.key == "write_file:c2"
            with pytest.raises(ConflictError):
                await client.check("a", "c1", "write_file", {**args, "content": "y"})
            assert client.ledger is client.sync.ledger
            assert [c.tool_call_id for c in client.ledger.list_calls(scope="a")] == ["c1"]

    asyncio.run(go())
