"""Appends on one path land in commit order, under real concurrency, on each backend.

Processes each submit and execute appends to two shared files for a while; afterwards every
file's lines must stand in the order of the ledger's commits (the seq of each execution's
succeeded event), each line once. The code before a3390d2 (a lander listed the pending area,
then asked the ledger, and landed what it listed) put about 1 append in 500 before the one
committed just before it (tests/integration/test_landing_order.py drives that interleaving by
hand; this test finds it unaided). The short run is in every suite; the long one is `large`."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from toolledger.builtin_tools import BUILTINS
from toolledger.harness.chaos.checker import inversions
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.models import execution_events
from toolledger.sandbox import Sandbox
from toolledger.tools import Registry
from toolledger.worker.pipeline import Executor, LeaseKeeper

REGISTRY = Registry([t for t in BUILTINS if t.name == "append_file"])
PROCESSES = 6
FILES = 2


def _append_for(db_url: str, root: str, scope: str, proc: int, seconds: float, done: Any) -> None:
    ledger = Ledger(db_url)
    executor = Executor(
        ledger, REGISTRY, Sandbox(root), worker_id=f"w{proc}", lease_seconds=30,
        leases=LeaseKeeper(ledger, 30),
    )  # fmt: skip
    stop_at, i = time.monotonic() + seconds, 0
    try:
        while time.monotonic() < stop_at:
            cid = f"p{proc}-{i}"
            args = {"path": f"log{i % FILES}.txt", "content": f"{cid}\n"}
            ledger.submit(scope, cid, "append_file", args, approved_by="stress")
            outcome = executor.execute(scope, f"append_file:{cid}", 1)
            if outcome.state != "finished":
                raise AssertionError(f"{cid}: {outcome}")
            i += 1
        with done.get_lock():
            done.value += i
    finally:
        ledger.close()


@pytest.mark.parametrize(
    "seconds", [8.0, pytest.param(90.0, marks=pytest.mark.large)], ids=["short", "long"]
)
def test_order__concurrent_appends_land_in_commit_order(
    db_url: str, scope: str, tmp_path: Path, seconds: float
) -> None:
    root = tmp_path / "sandbox"
    Sandbox(root).prepare()
    fork = multiprocessing.get_context("fork")
    done = fork.Value("i", 0)
    procs = [
        fork.Process(target=_append_for, args=(db_url, str(root), scope, p, seconds, done))
        for p in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=seconds + 120)
        assert p.exitcode == 0, f"an appender failed (exit {p.exitcode})"

    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        committed = conn.execute(
            sa.select(execution_events.c.idempotency_key, execution_events.c.seq).where(
                execution_events.c.scope == scope, execution_events.c.kind == "succeeded"
            )
        ).all()
    engine.dispose()
    seq_of = {f"{key.removeprefix('append_file:')}\n": seq for key, seq in committed}
    assert len(seq_of) == done.value > 100 * PROCESSES * seconds / 60  # the run did work

    bad, lines_seen = [], 0
    for f in range(FILES):
        lines = (root / scope / f"log{f}.txt").read_text().splitlines(keepends=True)
        lines_seen += len(lines)
        assert len(set(lines)) == len(lines), f"log{f}.txt: a line twice"
        seqs = [seq_of[line] for line in lines]
        bad += [f"log{f}.txt: seq {b} after {a}" for a, b in inversions(seqs)]
    assert lines_seen == done.value  # each committed append landed, once
    assert not bad, f"{len(bad)} of {lines_seen} appends landed out of commit order: {bad[:5]}"
