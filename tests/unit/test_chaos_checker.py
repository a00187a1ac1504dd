"""The chaos checker bites: for each invariant, facts made to break exactly that invariant
fail it — and only it — while the clean facts pass every one."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from toolledger.harness.chaos.checker import Facts, check
from toolledger.harness.chaos.workload import Job

RUN = "r1"


def job(cid: str, kind: str, **extra: Any) -> Job:
    tools = {"write": "chaos_write", "shared": "chaos_write", "append": "chaos_append",
             "charge": "chaos_charge"}  # fmt: skip
    args: dict[str, Any]
    if kind == "charge":
        args = {"account": "a", "cents": 100, "hold_ms": 0}
    else:
        path = extra.pop("path", f"own/{cid}.txt")
        content = f"{cid} {RUN}" + ("\n" if kind == "append" else "")
        args = {"path": path, "content": content, "hold_ms": 0}
    line = args.get("content", "") if kind == "append" else ""
    group = args.get("path", "") if kind in ("shared", "append") else ""
    return Job(cid, kind, tools[kind], args, group=group, line=line, **extra)


class World:
    """A small clean run: each call claimed once, committed, landed."""

    def __init__(self) -> None:
        self.jobs = [
            job("w1", "write"),
            job("s1", "shared", path="shared/a.txt"),
            job("s2", "shared", path="shared/a.txt", after="s1"),
            job("a1", "append", path="logs/x.log"),
            job("a2", "append", path="logs/x.log"),
            job("c1", "charge"),
        ]
        self.seq = 0
        self.ops: dict[str, dict[str, Any]] = {}
        self.execs: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.landings: list[dict[str, Any]] = []
        self.charges: list[dict[str, Any]] = []
        for j in self.jobs:
            self.run(j)
        self.files = {
            "own/w1.txt": "w1 r1",
            "shared/a.txt": "s2 r1",
            "logs/x.log": "a1 r1\na2 r1\n",
        }

    def event(self, key: str, eid: str | None, kind: str, **detail: Any) -> dict[str, Any]:
        self.seq += 1
        ev = {"seq": self.seq, "idempotency_key": key, "execution_id": eid, "kind": kind,
              "actor": "w", "detail": detail}  # fmt: skip
        self.events.append(ev)
        return ev

    def run(self, j: Job, attempt: int = 1) -> str:
        eid = f"e-{j.cid}-{attempt}"
        self.ops[j.key] = {"status": "succeeded", "review": None}
        self.execs.append({"execution_id": eid, "idempotency_key": j.key, "attempt": attempt,
                           "status": "succeeded", "reconciled": False,
                           "worker_id": "chaos-w1@h:101"})  # fmt: skip
        self.event(j.key, eid, "running", attempt=attempt)
        done = self.event(j.key, eid, "succeeded", reconciled=False, result={})
        if j.kind == "charge":
            terms = {"account": j.args["account"], "cents": j.args["cents"]}
            self.charges.append({"kind": "charge", "key": j.key, "execution_id": eid,
                                 "receipt": {"charge_id": "ch_1", "key": j.key, **terms}})  # fmt: skip
        else:
            self.landings.append({"execution_id": eid, "seq": done["seq"], "path": j.group or
                                  j.args["path"], "kind": "append" if j.kind == "append" else
                                  "write", "redo": False})  # fmt: skip
        return eid

    def facts(self) -> Facts:
        return Facts(
            jobs=self.jobs,
            ops=self.ops,
            execs=self.execs,
            events=self.events,
            files=dict(self.files),
            landings=self.landings,
            charges=self.charges,
            faults=[],
            firings=[],
        )


def broken(facts: Facts) -> set[str]:
    return {i["name"] for i in check(facts)["invariants"] if not i["ok"]}


def test_checker__a_clean_run_passes_every_invariant():
    report = check(World().facts())
    assert report["ok"], [i for i in report["invariants"] if not i["ok"]]


def _duplicate_line(w: World) -> None:
    w.files["logs/x.log"] += "a1 r1\n"


def _duplicate_charge(w: World) -> None:
    w.charges.append(dict(w.charges[0]))


def _charged_again_under_another_key(w: World) -> None:
    # the service deduplicates by key: a second charge of c1 can only come under another key
    again = copy.deepcopy(w.charges[0])
    again["key"] = again["receipt"]["key"] = "chaos_charge:c1-again"
    w.charges.append(again)


def _landed_twice(w: World) -> None:
    w.landings.append(dict(next(x for x in w.landings if x["execution_id"] == "e-a2-1")))


def _landing_without_own_commit(w: World) -> None:
    # a zombie of s1's revoked attempt 2 landed: its execution never committed
    s1 = next(j for j in w.jobs if j.cid == "s1")
    w.execs.append({"execution_id": "e-s1-z", "idempotency_key": s1.key, "attempt": 2,
                    "status": "unknown", "reconciled": False, "worker_id": "chaos-w2@h:7"})  # fmt: skip
    w.event(s1.key, "e-s1-z", "unknown", reason="lease expired")
    w.landings.append({"execution_id": "e-s1-z", "seq": 99, "path": "shared/a.txt",
                       "kind": "write", "redo": False})  # fmt: skip
    w.firings.append({"ref": "e-s1-z", "point": "after_stage"})  # type: ignore[attr-defined]


def _stale_write_after_newer(w: World) -> None:
    older = next(x for x in w.landings if x["execution_id"] == "e-s1-1")
    w.landings.remove(older)
    w.landings.append(older)  # s1's bytes (committed before s2's) land after s2's


def _append_before_an_older_one(w: World) -> None:
    # a2 (committed after a1) lands first: the lines are both there, once each, out of order
    i, j = (next(n for n, x in enumerate(w.landings) if x["execution_id"] == f"e-{c}-1")
            for c in ("a1", "a2"))  # fmt: skip
    w.landings[i], w.landings[j] = w.landings[j], w.landings[i]


def _shared_path_wrong(w: World) -> None:
    w.files["shared/a.txt"] = "s1 r1"


def _hidden_effect(w: World) -> None:
    w.ops["chaos_append:a2"]["status"] = "failed"  # its line is in the file


def _hidden_write(w: World) -> None:
    w.ops["chaos_write:w1"]["status"] = "failed"  # its file holds its bytes


def _hidden_charge(w: World) -> None:
    w.ops["chaos_charge:c1"]["status"] = "failed"  # the service charged it


def _hidden_shared_write(w: World) -> None:
    w.ops["chaos_write:s1"]["status"] = "failed"  # its landing is logged (s2 wrote over it)


def _write_absent(w: World) -> None:
    w.files["own/w1.txt"] = None  # committed, logged as landed, not there


def _append_line_absent(w: World) -> None:
    w.files["logs/x.log"] = "a1 r1\n"


def _charge_never_made(w: World) -> None:
    w.charges.clear()


def _no_landing_logged(w: World) -> None:
    w.landings.clear()  # the files are there: the log measured nothing


def _torn_line(w: World) -> None:
    w.files["logs/x.log"] += "a2 r"  # a torn second copy of a2's line


def _glued_lines(w: World) -> None:
    w.files["logs/x.log"] = "a1 r1a2 r1\n"  # both calls' bytes, neither call's line
    w.ops["chaos_append:a1"]["review"] = w.ops["chaos_append:a2"]["review"] = "not_landed"


def _foreign_bytes(w: World) -> None:
    w.ops["chaos_write:w1"]["status"] = "failed"
    w.files["own/w1.txt"] = "no call wrote this"


def _charge_by_another_calls_execution(w: World) -> None:
    w.charges[0]["execution_id"] = "e-w1-1"


def _charge_with_other_terms(w: World) -> None:
    w.charges[0]["receipt"]["cents"] = 10_000


def _auto_retry(w: World, order: list[str]) -> None:
    """w1's attempt 1 revoked, proven absent, retried automatically: in ``order``."""
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.firings.append({"ref": "e-w1-1", "point": "after_claim"})  # type: ignore[attr-defined]
    for step in order:
        if step == "revoked":
            w.event(w1.key, "e-w1-1", "unknown", reason="lease expired")
        elif step == "proven":
            w.event(w1.key, "e-w1-1", "failed", result={"error": "not_applied"},
                    evidence={"reconciler": "absent"})  # fmt: skip
        else:
            w.event(w1.key, None, "approved", attempt=2, automatic=True, after="e-w1-1")


def _auto_retry_proof_before_revocation(w: World) -> None:
    _auto_retry(w, ["proven", "revoked", "retried"])


def _auto_retry_proof_after_the_retry(w: World) -> None:
    _auto_retry(w, ["revoked", "retried", "proven"])


def _shared_written_though_none_succeeded(w: World) -> None:
    shared = {j.key for j in w.jobs if j.kind == "shared"}
    for key in shared:
        w.ops[key]["status"] = "failed"
    ids = {e["execution_id"] for e in w.execs if e["idempotency_key"] in shared}
    w.events[:] = [e for e in w.events if not (e["execution_id"] in ids and e["kind"] ==
                                               "succeeded")]  # fmt: skip
    w.landings[:] = [x for x in w.landings if x["execution_id"] not in ids]


def _auto_retry_without_proof(w: World) -> None:
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.event(w1.key, None, "approved", attempt=2, automatic=True, after="e-w1-1")


def _call_never_ended(w: World) -> None:
    w.ops["chaos_charge:c1"]["status"] = "approved"  # lost: approved, never ran
    w.charges.clear()


def _call_stuck_running(w: World) -> None:
    w.ops["chaos_charge:c1"]["status"] = "running"
    w.charges.clear()


def _lease_expired_after_the_sweep(w: World) -> Facts:
    f = w.facts()
    f.stale_running = ["e-c1-1"]
    return f


def _call_never_recorded(w: World) -> None:
    del w.ops["chaos_charge:c1"]
    w.charges.clear()


def _unknown_without_a_fault(w: World) -> None:
    w.event("chaos_write:w1", "e-w1-1", "unknown", reason="lease expired")


def _verify_differs(w: World) -> Facts:
    f = w.facts()
    f.verify = ['{"table": "operations"}']
    return f


ONE_EFFECT = "at most one effect per call (lines, charges, landings)"
FOREIGN = "the world holds only the calls' own effects"
BREAKS = {
    ONE_EFFECT: [
        _duplicate_line,
        _duplicate_charge,
        _charged_again_under_another_key,
        _landed_twice,
    ],
    "no effect of a revoked execution lands": [
        _landing_without_own_commit,
        _stale_write_after_newer,
        _append_before_an_older_one,
    ],
    "every shared path holds its last succeeded write": [
        _shared_path_wrong,
        _shared_written_though_none_succeeded,
    ],
    "no effect hides behind failed, rejected or a pending retry": [
        _hidden_effect,
        _hidden_write,
        _hidden_charge,
        _hidden_shared_write,
    ],
    "automatic retries only after revocation and proof of absence": [
        _auto_retry_without_proof,
        _auto_retry_proof_before_revocation,
        _auto_retry_proof_after_the_retry,
    ],
    "every succeeded call's effect is in the world": [
        _write_absent,
        _append_line_absent,
        _charge_never_made,
        _no_landing_logged,
    ],
    FOREIGN: [
        _torn_line,
        _glued_lines,
        _foreign_bytes,
        _charge_by_another_calls_execution,
        _charge_with_other_terms,
    ],
    "every call ends: succeeded, failed, rejected, or unknown for a human": [
        _call_never_ended,
        _call_stuck_running,
        _lease_expired_after_the_sweep,
        _call_never_recorded,
    ],
    "every unknown lines up with a fault on that execution": [_unknown_without_a_fault],
    "verify: events rebuild state exactly": [_verify_differs],
}
#: Breakers that break another invariant too, by their nature: which.
ALSO = {
    _landing_without_own_commit: set(),  # a zombie's landing also hides nothing: none
    _charged_again_under_another_key: {FOREIGN},  # a key no call has
}


@pytest.mark.parametrize(
    ("name", "breaker"),
    [(name, b) for name, breakers in BREAKS.items() for b in breakers],
    ids=[b.__name__.strip("_") for breakers in BREAKS.values() for b in breakers],
)
def test_checker__each_invariant_fails_on_facts_made_to_break_it(name, breaker):
    w = World()
    w.firings = []  # type: ignore[attr-defined]
    made = breaker(w)
    facts = made if isinstance(made, Facts) else w.facts()
    if not isinstance(made, Facts):
        facts.firings = w.firings  # type: ignore[attr-defined]
    assert name in broken(facts), name
    assert broken(facts) == {name} | ALSO.get(breaker, set())


def test_checker__a_write_logged_twice_for_one_landing_is_one_effect():
    """A write's line is logged before its rename: a rename that failed (EIO) or a crash
    between the two is retried by the next settle, logged again — one effect, not two."""
    w = World()
    w.landings.append(dict(next(x for x in w.landings if x["execution_id"] == "e-w1-1")))
    assert check(w.facts())["ok"]


def test_checker__every_invariant_has_a_breaker():
    assert set(BREAKS) == {i["name"] for i in check(World().facts())["invariants"]}


def test_checker__an_unknown_with_its_own_cause_is_explained():
    for cause in (
        {"firings": [{"ref": "e-w1-1", "point": "after_claim"}]},
        {"faults": [{"kind": "kill_child", "pids": [101], "target": "chaos-w1"}]},
        {"faults": [{"kind": "partition", "pids": [], "target": "chaos-w1"}]},
    ):
        w = World()
        _unknown_without_a_fault(w)
        f = copy.copy(w.facts())
        for k, v in cause.items():
            setattr(f, k, v)
        assert "every unknown lines up with a fault on that execution" not in broken(f), cause


def test_checker__a_failpoint_that_ended_the_process_explains_its_other_executions():
    """On a threads pool one process holds several executions: a kill or exit failpoint on
    one of them explains the others of that pid — only those, only if it ended the process,
    and only if it fired while the execution was held (claimed, not yet unknown)."""
    name = "every unknown lines up with a fault on that execution"
    began = datetime(2026, 12, 2, 4, 0, 0, tzinfo=UTC)
    went_unknown = began + timedelta(seconds=20)
    t = (began + timedelta(seconds=5)).timestamp()
    for firing, explained in (
        ({"point": "after_stage", "action": "kill", "pid": 101, "t": t}, True),
        ({"point": "after_claim", "action": "exit", "pid": 101, "t": t}, True),
        ({"point": "after_stage", "action": "raise", "pid": 101, "t": t}, False),
        ({"point": "after_stage", "action": "kill", "pid": 202, "t": t}, False),
        ({"point": "after_stage", "action": "kill", "pid": 101, "t": t + 60}, False),  # after
        ({"point": "after_stage", "action": "kill", "pid": 101, "t": t - 60}, False),  # before
        ({"point": "after_stage", "action": "kill", "pid": 101}, False),  # no time
    ):
        w = World()
        _unknown_without_a_fault(w)
        (held,) = [e for e in w.execs if e["execution_id"] == "e-w1-1"]
        held["started_at"] = began
        w.events[-1]["at"] = went_unknown
        f = copy.copy(w.facts())
        f.firings = [{"ref": "other", **firing}]
        assert (name not in broken(f)) == explained, firing


def test_checker__a_fault_that_cannot_stop_a_worker_explains_no_unknown():
    """Only kinds whose entry says they blame a process explain an unknown on it: a Redis
    flush or a duplicate publication at the same pid or host does not."""
    for kind in ("redis_flush", "duplicate", "pg_terminate"):
        w = World()
        _unknown_without_a_fault(w)
        f = copy.copy(w.facts())
        f.faults = [{"kind": kind, "pids": [101], "target": "chaos-w1"}]
        assert "every unknown lines up with a fault on that execution" in broken(f), kind
    w = World()
    _unknown_without_a_fault(w)
    f = copy.copy(w.facts())
    f.faults = [{"kind": "kill_main", "pids": [], "target": "chaos-w1"}]  # host only: not enough
    assert "every unknown lines up with a fault on that execution" in broken(f)


def test_fault_kinds__each_entry_has_its_injector():
    from toolledger.harness.chaos.baseline import BaselineRun
    from toolledger.harness.chaos.faults import BASELINE, EXTERNAL
    from toolledger.harness.chaos.harness import ChaosRun

    for kind in EXTERNAL:
        assert callable(getattr(ChaosRun, f"_fault_{kind}", None)), kind
    for kind in BASELINE:
        assert callable(getattr(BaselineRun, f"_fault_{kind}", None)), kind
