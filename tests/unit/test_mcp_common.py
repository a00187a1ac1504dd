"""``mcp serve``'s read-only runs apart (``serve._read_apart``): bounded, and capped."""

from __future__ import annotations

import threading

import anyio
import pytest

from toolledger.mcp import serve
from toolledger.mcp.common import InFlight
from toolledger.worker.reads import ReadSlots


def test_read_apart__given_up_at_the_timeout_not_at_zero() -> None:
    release = threading.Event()

    async def scenario() -> list[tuple[object, str]]:
        slow = await serve._read_apart(0.2, InFlight(), release.wait, 30)
        fast = await serve._read_apart(0, InFlight(), lambda: "read")  # 0: not bounded
        return [slow, fast]

    try:
        slow, fast = anyio.run(scenario)
    finally:
        release.set()
    assert slow == (None, "did not finish within 0.2 s (--timeout)")
    assert fast == ("read", "")


def test_read_apart__at_most_so_many_runs_at_once_given_up_ones_included(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """helper-94 (suspected): a given-up read keeps its thread and, in its read, a pooled
    connection; asked again and again, every call started another. Capped: past the cap a
    call is told, never queued; a run that ends gives its place back."""
    monkeypatch.setattr(serve, "_reads", ReadSlots(2))
    release = threading.Event()

    async def scenario() -> list[tuple[object, str]]:
        out = [await serve._read_apart(0.1, InFlight(), release.wait, 30) for _ in range(3)]
        release.set()
        await anyio.sleep(0.2)  # the two given-up runs end, and give their places back
        out.append(await serve._read_apart(5, InFlight(), lambda: "read"))
        return out

    try:
        first, second, third, later = anyio.run(scenario)
    finally:
        release.set()
    assert first[0] is None and second[0] is None  # given up, still running
    assert third == (None, "was not started: 2 reads still run on this server")
    assert later == ("read", "")


def test_read_apart__a_read_that_raises_raises_in_the_caller() -> None:
    def refused() -> None:
        raise ValueError("no such file")

    async def scenario() -> None:
        await serve._read_apart(5, InFlight(), refused)

    with pytest.raises(ValueError, match="no such file"):
        anyio.run(scenario)
