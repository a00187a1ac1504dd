"""A group of persistent processes that each run exactly one share of a measurement.

(A multiprocessing Pool may give two tasks to one process and none to another, which would
measure the wrong concurrency; here process i always runs share i.)
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any


def _serve(conn: Connection) -> None:
    while True:
        message = conn.recv()
        if message is None:
            return
        fn, args = message
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - sent back to the parent, which raises
            conn.send(("error", traceback.format_exc()))


class Group:
    def __init__(self, size: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn: Callable[..., Any], shares: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Share i runs in process i; all of them at once."""
        assert len(shares) <= len(self.conns)
        for conn, args in zip(self.conns, shares, strict=False):
            conn.send((fn, args))
        results = [conn.recv() for conn in self.conns[: len(shares)]]
        errors = [r[1] for r in results if r[0] == "error"]
        if errors:
            raise RuntimeError("a benchmark process failed:\n" + errors[0])
        return [r[1] for r in results]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
