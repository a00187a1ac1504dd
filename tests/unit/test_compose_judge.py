"""The compose run's judge fails on facts crafted to break each of its judgements, and passes
the facts of a clean run (tests/acceptance/compose_judge.py)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.acceptance.compose_judge import host_of, judge

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
RESTART = T0 + timedelta(seconds=30)
KILLED = {"deadbeef0001"}


def op(scope: str, key: str, tool: str, status: str, **args: Any) -> dict[str, Any]:
    return {"scope": scope, "idempotency_key": key, "tool": tool, "status": status, "args": args}


def ex(
    scope: str,
    key: str,
    status: str,
    host: str = "live00000001",
    attempt: int = 1,
    started: int = 0,
    result: dict[str, Any] | None = None,
    reconciled: bool = False,
) -> dict[str, Any]:
    return {
        "execution_id": f"e-{key}" + (f"-{attempt}" if attempt > 1 else ""),
        "scope": scope,
        "idempotency_key": key,
        "attempt": attempt,
        "status": status,
        "worker_id": f"celery@{host}:7",
        "started_at": T0 + timedelta(seconds=started),
        "lease_expires_at": T0 + timedelta(seconds=started + 8),
        "reconciled": reconciled,
        "result": result,
    }


def landing(
    scope: str, key: str, path: str, seq: int, execution_id: str = "", n: int = 0
) -> dict[str, Any]:
    return {
        "scope": scope,
        "key": key,
        "path": path,
        "seq": seq,
        "execution_id": execution_id or f"e-{key}",
        "n": n,
        "redo": False,
    }


NOT_APPLIED = {"error": "not_applied"}


@pytest.fixture()
def clean() -> dict[str, Any]:
    """A clean run: a write and two appends succeeded, an append cut off by a kill and proven
    not applied, a write in the inbox after the Postgres restart."""
    return {
        "ops": [
            op("s", "w1", "probe_write", "succeeded", path="w1.txt", content="one\n"),
            op("s", "a1", "probe_append", "succeeded", path="log.txt", content="line 1\n"),
            op("s", "a2", "probe_append", "failed", path="log.txt", content="line 2\n"),
            op("s", "w2", "probe_write", "unknown", path="w2.txt", content="two\n"),
            op("s", "a3", "probe_append", "succeeded", path="log.txt", content="line 3\n"),
        ],
        "execs": [
            ex("s", "w1", "succeeded"),
            ex("s", "a1", "succeeded"),
            ex("s", "a2", "failed", host="deadbeef0001", result=NOT_APPLIED, reconciled=True),
            ex("s", "w2", "unknown", started=25),
            ex("s", "a3", "succeeded"),
        ],
        "landings": [
            landing("s", "w1", "w1.txt", 10),
            landing("s", "a1", "log.txt", 11),
            landing("s", "a3", "log.txt", 14),
        ],
        "files": {("s", "w1.txt"): "one\n", ("s", "log.txt"): "line 1\nline 3\n"},
        "commits": {"e-w1": 10, "e-a1": 11, "e-a3": 14},
    }


def verdict(facts: dict[str, Any]):
    return judge(
        facts["ops"],
        facts["execs"],
        facts["landings"],
        lambda scope, path: facts["files"].get((scope, path)),
        commits=facts["commits"],
        killed_hosts=KILLED,
        restart_at=RESTART,
    )


def test_judge__a_clean_run_passes_and_says_what_cut_calls_off(clean):
    v = verdict(clean)
    assert v.ok, v.summary()
    assert v.cut_off_by == {"failed: worker killed": 1, "unknown: postgres restart": 1}


def broken(clean: dict[str, Any], mutate) -> dict[str, Any]:
    facts = copy.deepcopy(clean)
    mutate(facts)
    return facts


CASES = {
    "ended": [
        lambda f: f["ops"][0].update(status="approved"),  # a call left open
        lambda f: f["ops"][2].update(status="running"),
        lambda f: f["execs"][2].update(result={"error": "boom"}),  # failed, not proven unapplied
        lambda f: f["execs"][3].update(status="failed"),  # no execution ended as the call did
    ],
    "explained": [
        lambda f: f["execs"][2].update(worker_id="celery@live00000001:7"),  # no kill there
        lambda f: f["execs"][3].update(started_at=T0 + timedelta(seconds=40)),  # after restart
    ],
    "one_effect": [
        lambda f: (  # two attempts both ran and committed: each landed
            f["execs"].append(ex("s", "w1", "succeeded", attempt=2)),
            f["commits"].update({"e-w1-2": 12}),
            f["landings"].append(landing("s", "w1", "w1.txt", 12, execution_id="e-w1-2")),
        ),
        lambda f: f["landings"].append(landing("s", "w1", "w1.txt", 10, n=1)),  # one execution
        lambda f: f["files"].update({("s", "log.txt"): "line 1\nline 1\nline 3\n"}),
    ],
    "none_cut_off": [
        lambda f: f["landings"].append(landing("s", "a2", "log.txt", 15)),  # revoked, landed
        lambda f: f["files"].update({("s", "log.txt"): "line 1\nline 3\nline 2\n"}),  # its line
    ],
    "as_requested": [
        lambda f: f["landings"].pop(0),  # succeeded, nothing landed
        lambda f: f["files"].update({("s", "w1.txt"): "other\n"}),  # the wrong bytes
        lambda f: f["files"].update({("s", "log.txt"): "line 3\n"}),  # an append's line lost
    ],
    "in_order": [
        lambda f: f["files"].update({("s", "log.txt"): "line 3\nline 1\n"}),  # lines swapped
        lambda f: f["landings"].reverse(),  # the newer append landed first
        lambda f: (  # content that is not one line: its place in the file cannot be judged
            f["ops"][4]["args"].update(content="line 3"),
            f["files"].update({("s", "log.txt"): "line 1\nline 3"}),
        ),
    ],
    "own_commit": [
        lambda f: (  # a zombie landed after unknown; the reconciler then saw its bytes
            f["ops"][3].update(status="succeeded"),
            f["execs"][3].update(status="succeeded", reconciled=True),
            f["landings"].append(landing("s", "w2", "w2.txt", 20)),
            f["files"].update({("s", "w2.txt"): "two\n"}),
        ),
        lambda f: (  # revoked attempt 1 landed; attempt 2 committed, never landed
            f["execs"][0].update(status="unknown"),
            f["execs"].append(ex("s", "w1", "succeeded", attempt=2)),
            f["commits"].pop("e-w1"),
            f["commits"].update({"e-w1-2": 12}),
        ),
        lambda f: f["commits"].update({"e-w1": 9}),  # landed under another commit's seq
        lambda f: f["landings"][0].update(execution_id="e-a1"),  # another call's execution
    ],
}
#: Facts that break another judgement too, by their nature.
ALSO = {"none_cut_off-0": {"own_commit"}}  # a call cut off has no commit to land by


@pytest.mark.parametrize(
    ("judgement", "mutate", "also"),
    [(j, m, ALSO.get(f"{j}-{i}", set())) for j, ms in CASES.items() for i, m in enumerate(ms)],
    ids=[f"{j}-{i}" for j, ms in CASES.items() for i in range(len(ms))],
)
def test_judge__fails_on_facts_crafted_to_break_exactly_one_judgement(
    clean, judgement, mutate, also
):
    v = verdict(broken(clean, mutate))
    assert set(v.violations) == {judgement} | also, v.summary()


def test_judge__a_redo_after_a_crash_is_one_effect_not_two(clean):
    clean["landings"].append({**landing("s", "a1", "log.txt", 11), "redo": True})  # the same
    clean["landings"].append(landing("s", "w1", "w1.txt", 10))  # (execution_id, n) again
    assert verdict(clean).ok


def test_host_of__reads_the_container_from_celerys_worker_id():
    assert host_of("celery@3f7009a10276:12") == "3f7009a10276"
    assert host_of(None) == ""
