"""``Finished`` builds its record when first read, and otherwise behaves as the frozen
dataclass it replaced: immutable, equal by value, picklable, matched by position."""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
from datetime import UTC, datetime

import pytest

from toolledger.ledger.records import ExecutionRecord, Finished
from toolledger.ledger.transitions import Status


def _record(result: dict[str, int]) -> ExecutionRecord:
    now = datetime(2026, 12, 2, tzinfo=UTC)
    return ExecutionRecord(
        "e1", "s", "k", 1, Status.SUCCEEDED, "w", "t", now, now, now, now, result, False, None
    )


def test_finished__builds_its_record_once_when_read_then_lets_the_builder_go():
    calls: list[int] = []

    def build() -> ExecutionRecord:
        calls.append(1)
        return _record({"n": 1})

    done = Finished(build, 7)
    assert calls == [] and done.seq == 7  # the executor reads seq only: nothing built
    assert done.execution == _record({"n": 1}) and done.execution is done.execution
    assert calls == [1] and done._load is None


def test_finished__threads_reading_at_once_all_get_the_record():
    def slow() -> ExecutionRecord:  # wide enough for every thread to find it unbuilt
        time.sleep(0.05)
        return _record({"n": 2})

    done, start = Finished(slow, 1), threading.Barrier(8)
    seen: list[ExecutionRecord] = []

    def read() -> None:
        start.wait(5)
        seen.append(done.execution)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [_record({"n": 2})] * 8


def test_finished__behaves_as_the_frozen_dataclass():
    lazy, built = Finished(lambda: _record({"n": 3}), 4), Finished(_record({"n": 3}), 4)
    assert lazy == built and lazy != Finished(_record({"n": 3}), 5)
    assert repr(lazy) == repr(built) and repr(lazy).startswith("Finished(execution=")
    with pytest.raises(dataclasses.FrozenInstanceError):
        lazy.seq = 9  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del lazy.seq
    with pytest.raises(TypeError):
        hash(lazy)
    # a lambda inside, pickled as built (our own bytes, read back at once)
    assert pickle.loads(pickle.dumps(lazy)) == built  # noqa: S301
    match lazy:
        case Finished(record, seq):
            assert (record.result, seq) == ({"n": 3}, 4)
        case _:
            pytest.fail("not matched by position")
