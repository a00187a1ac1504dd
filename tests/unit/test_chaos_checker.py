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
#: When the World's executions were claimed and went unknown (where they do).
BEGAN = datetime(2026, 12, 2, 4, 0, 0, tzinfo=UTC)
WENT_UNKNOWN = BEGAN + timedelta(seconds=20)
DURING = (BEGAN + timedelta(seconds=5)).timestamp()


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
        self.operator: list[dict[str, Any]] = []
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
                           "worker_id": "chaos-w1@h:101", "started_at": BEGAN})  # fmt: skip
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
            operator=list(self.operator),
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


def _landing_under_another_commits_seq(w: World) -> None:
    # w1's execution committed, but what landed carries another commit's seq
    (landing,) = [x for x in w.landings if x["execution_id"] == "e-w1-1"]
    landing["seq"] = 1


def _landing_of_a_reconciled_success(w: World) -> None:
    # w1 attempt 2 was revoked; a reconciler (not its own commit) said succeeded; its bytes
    # landed: only an execution's own commit makes its bytes official
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.execs.append({"execution_id": "e-w1-z", "idempotency_key": w1.key, "attempt": 2,
                    "status": "succeeded", "reconciled": True, "worker_id": "chaos-w2@h:7"})  # fmt: skip
    w.event(w1.key, "e-w1-z", "unknown", reason="lease expired")
    done = w.event(w1.key, "e-w1-z", "succeeded", reconciled=True, result={})
    w.landings.append({"execution_id": "e-w1-z", "seq": done["seq"], "path": "own/w1.txt",
                       "kind": "write", "redo": False})  # fmt: skip
    w.firings.append({"ref": "e-w1-z", "point": "after_stage"})  # type: ignore[attr-defined]


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


def _auto_retry_proven_without_the_reconciler(w: World) -> None:
    _auto_retry(w, ["revoked", "proven", "retried"])
    (proof,) = [e for e in w.events if e["kind"] == "failed" and e["execution_id"] == "e-w1-1"]
    proof["detail"]["evidence"] = {"human": "absent"}  # not the reconciler's word


def _auto_retry_after_a_failure_that_may_have_applied(w: World) -> None:
    _auto_retry(w, ["revoked", "proven", "retried"])
    (proof,) = [e for e in w.events if e["kind"] == "failed" and e["execution_id"] == "e-w1-1"]
    proof["detail"]["result"] = {"error": "tool_error"}  # a failure, not "not applied"


def _later_attempt_neither_automatic_nor_asked(w: World) -> None:
    # an approved attempt 2 by the sweep that does not call itself automatic: nothing judged it
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.event(w1.key, None, "approved", attempt=2, after="e-w1-1")["actor"] = "sweep"


def _auto_retry_after_another_attempt(w: World) -> None:
    # attempt 3 authorised after attempt 1's proof, while attempt 2 was never revoked
    _auto_retry(w, ["revoked", "proven", "retried"])
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.operator.append({"action": "retry", "cid": "w1", "attempt": 2})
    for e in w.events:
        if e["kind"] == "approved" and e["detail"].get("automatic"):
            e["detail"]["attempt"] = 3
    w.event(w1.key, None, "approved", attempt=2)  # the operator's retry, asked


def _auto_retry_without_proof(w: World) -> None:
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.event(w1.key, None, "approved", attempt=2, automatic=True, after="e-w1-1")


def _call_never_ended(w: World) -> None:
    w.ops["chaos_charge:c1"]["status"] = "approved"  # lost: approved, never ran
    w.charges.clear()


def _call_waiting_for_approval(w: World) -> None:
    w.ops["chaos_charge:c1"]["status"] = "pending_approval"
    w.charges.clear()


def _staged_effect_never_settled(w: World) -> Facts:
    f = w.facts()
    f.unsettled = ["0190-e.1.ab.write"]
    return f


def _write_landing_missing(w: World) -> None:
    # w1 committed; no landing of it was logged, its file is there (a write, not an append)
    w.landings[:] = [x for x in w.landings if x["execution_id"] != "e-w1-1"]


def _stray_file(w: World) -> Facts:
    f = w.facts()
    f.stray_files = ["own/zz.txt"]  # a file at a path no call has
    return f


def _stray_carriage_return(w: World) -> None:
    w.files["logs/x.log"] = "a1 r1\na2 r1\n\r"  # read byte for byte, a CR is no call's


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
    w.event("chaos_write:w1", "e-w1-1", "unknown", reason="lease expired")["at"] = WENT_UNKNOWN


def _unknown_explained_by_its_own_lease_loss(w: World) -> None:
    # its only "cause" is its own record of losing the lease: a keeper that never renews
    # would explain itself
    _unknown_without_a_fault(w)
    w.event("chaos_write:w1", "e-w1-1", "evidence", worker_id="chaos-w1@h:101",
            not_started=True, reason="LeaseLost: the lease was lost")  # fmt: skip


def _unknown_after_a_partition_long_before(w: World) -> None:
    # a partition of its host an hour before it was claimed
    _unknown_without_a_fault(w)
    w.faults.append({"kind": "partition", "pids": [7], "target": "chaos-w1",  # type: ignore[attr-defined]
                     "t": DURING - 3600, "cut_s": 14.0})  # fmt: skip


def _unknown_after_a_zombie_on_its_pid_long_before(w: World) -> None:
    _unknown_without_a_fault(w)
    w.faults.append({"kind": "zombie", "pids": [101], "target": "chaos-w1",  # type: ignore[attr-defined]
                     "t": DURING - 3600, "frozen_s": 14.0})  # fmt: skip


def _unknown_with_a_db_error_but_no_database_fault(w: World) -> None:
    _unknown_without_a_fault(w)
    w.event("chaos_write:w1", "e-w1-1", "evidence", worker_id="chaos-w1@h:101",
            error="OperationalError: server closed the connection")  # fmt: skip


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
        _landing_under_another_commits_seq,
        _landing_of_a_reconciled_success,
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
        _auto_retry_proven_without_the_reconciler,
        _auto_retry_after_a_failure_that_may_have_applied,
        _later_attempt_neither_automatic_nor_asked,
        _auto_retry_after_another_attempt,
    ],
    "every succeeded call's effect is in the world": [
        _write_absent,
        _append_line_absent,
        _charge_never_made,
        _no_landing_logged,
        _write_landing_missing,
    ],
    FOREIGN: [
        _torn_line,
        _glued_lines,
        _foreign_bytes,
        _charge_by_another_calls_execution,
        _charge_with_other_terms,
        _stray_file,
        _stray_carriage_return,
    ],
    "every call ends: succeeded, failed, rejected, or unknown for a human": [
        _call_never_ended,
        _call_waiting_for_approval,
        _call_stuck_running,
        _lease_expired_after_the_sweep,
        _staged_effect_never_settled,
        _call_never_recorded,
    ],
    "every unknown lines up with a fault on that execution": [
        _unknown_without_a_fault,
        _unknown_explained_by_its_own_lease_loss,
        _unknown_after_a_partition_long_before,
        _unknown_after_a_zombie_on_its_pid_long_before,
        _unknown_with_a_db_error_but_no_database_fault,
    ],
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
    w.faults = []  # type: ignore[attr-defined]
    made = breaker(w)
    facts = made if isinstance(made, Facts) else w.facts()
    if not isinstance(made, Facts):
        facts.firings = w.firings  # type: ignore[attr-defined]
        facts.faults = w.faults  # type: ignore[attr-defined]
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
    before = DURING - 30  # a 14 s freeze or cut that began before the claim, overlapping it
    for cause in (
        {"firings": [{"ref": "e-w1-1", "point": "after_claim"}]},
        {"faults": [{"kind": "kill_child", "pids": [101], "target": "chaos-w1", "t": DURING}]},
        {"faults": [{"kind": "partition", "pids": [], "target": "chaos-w1", "t": DURING}]},
        {
            "faults": [
                {"kind": "zombie", "pids": [101], "target": "w", "t": before + 20, "frozen_s": 14.0}
            ]
        },
        {
            "faults": [{"kind": "pg_crash", "pids": [], "target": "postgres", "t": DURING}],
            "own": "OperationalError: the server closed the connection",
        },
        {
            "faults": [{"kind": "pg_terminate", "pids": [], "target": "postgres", "t": DURING}],
            "own": "LeaseLost: renewals failed",
        },
    ):
        w = World()
        _unknown_without_a_fault(w)
        if "own" in cause:
            w.event("chaos_write:w1", "e-w1-1", "evidence", error=cause.pop("own"))
        f = copy.copy(w.facts())
        for k, v in cause.items():
            setattr(f, k, v)
        assert "every unknown lines up with a fault on that execution" not in broken(f), cause


def test_checker__a_failpoint_that_ended_the_process_explains_its_other_executions():
    """On a threads pool one process holds several executions: a kill or exit failpoint on
    one of them explains the others of that pid — only those, only if it ended the process,
    and only if it fired while the execution was held (claimed, not yet unknown)."""
    name = "every unknown lines up with a fault on that execution"
    began, went_unknown, t = BEGAN, WENT_UNKNOWN, DURING
    for firing, explained in (
        ({"point": "after_stage", "action": "kill", "pid": 101, "t": t}, True),
        ({"point": "after_claim", "action": "exit", "pid": 101, "t": t}, True),
        ({"point": "after_stage", "action": "stop", "pid": 101, "t": t}, True),
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
        f.faults = [{"kind": kind, "pids": [101], "target": "chaos-w1", "t": DURING}]
        assert "every unknown lines up with a fault on that execution" in broken(f), kind
    w = World()
    _unknown_without_a_fault(w)
    f = copy.copy(w.facts())
    f.faults = [{"kind": "kill_main", "pids": [], "target": "chaos-w1", "t": DURING}]  # host only
    assert "every unknown lines up with a fault on that execution" in broken(f)


def test_fault_kinds__each_entry_has_its_injector():
    from toolledger.harness.chaos.baseline import BaselineRun
    from toolledger.harness.chaos.faults import BASELINE, EXTERNAL
    from toolledger.harness.chaos.harness import ChaosRun

    for kind in EXTERNAL:
        assert callable(getattr(ChaosRun, f"_fault_{kind}", None)), kind
    for kind in BASELINE:
        assert callable(getattr(BaselineRun, f"_fault_{kind}", None)), kind


def test_checker__fenced_counts_what_revoked_executions_put_on_record():
    """A revoked execution that went on and met the fence: its own worker's evidence after
    the revocation. A clean World has none; each kind counts, another's evidence does not."""
    assert check(World().facts())["fenced"] == {
        "not_started": 0, "refused_at_commit": 0, "staged_refused": 0,
    }  # fmt: skip
    w = World()
    _unknown_without_a_fault(w)
    mine = "chaos-w1@h:101"
    w.event("chaos_write:w1", "e-w1-1", "evidence", worker_id=mine, late_result=None,
            staged=[{"path": "own/w1.txt"}])  # fmt: skip
    w.event("chaos_write:w1", "e-w1-1", "evidence", worker_id="someone-else", late_result=None)
    w.event("chaos_append:a1", "e-a1-1", "evidence", worker_id=mine, not_started=True)
    w.event(
        "chaos_append:a2", "e-a2-1", "evidence", worker_id=mine, late_result=None
    )  # never revoked
    assert check(w.facts())["fenced"] == {
        "not_started": 1, "refused_at_commit": 1, "staged_refused": 1,
    }  # fmt: skip


def test_gather__reads_bytes_and_sees_every_file(tmp_path):
    """``gather`` reads each file byte for byte (a CR stays a CR), lists files at paths no
    job has, and staged effects left unsettled (set aside ones are not)."""
    from toolledger.harness.chaos.checker import _read, gather
    from toolledger.harness.chaos.workload import Workload
    from toolledger.ledger.ledger import Ledger

    root = tmp_path / "sandbox" / "s"
    (root / "own").mkdir(parents=True)
    (root / "own" / "w1.txt").write_bytes(b"w1 r1\r")
    (root / "own" / "zz.txt").write_bytes(b"stray")
    pending = tmp_path / "sandbox" / ".toolledger" / "pending"
    pending.mkdir(parents=True)
    (pending / "e.1.ab.write").write_bytes(b"x")
    (pending / "e.1.ab.refused").write_bytes(b"x")
    (pending / "e.spool.tmp7267").write_bytes(b"")  # a spool's write cut by a SIGKILL
    (pending / "e.spool").write_bytes(b"{}")  # a spool never settled: still counted
    assert _read(root / "own" / "w1.txt") == "w1 r1\r"
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    ledger.upgrade()
    try:
        f = gather(ledger, "s", tmp_path, Workload([job("w1", "write")]), [], landings_logged=True)
    finally:
        ledger.close()
    assert f.files == {"own/w1.txt": "w1 r1\r"}
    assert (f.stray_files, f.unsettled) == (["own/zz.txt"], ["e.1.ab.write", "e.spool"])


def test_checker__an_append_finished_again_is_no_landing_out_of_order():
    """A crashed append finished by the next settle (``redo``) is the same landing: logged
    after a newer one, it is no inversion (and counted as no second effect)."""
    w = World()
    again = dict(next(x for x in w.landings if x["execution_id"] == "e-a1-1"), redo=True)
    w.landings.append(again)  # after a2's, which committed later
    assert check(w.facts())["ok"], [i for i in check(w.facts())["invariants"] if not i["ok"]]


def test_out_of_commit_order__each_scope_is_its_own():
    """The same path name in two scopes is two paths: their seqs interleave freely."""
    from toolledger.harness.chaos.checker import out_of_commit_order

    landings = [
        {"scope": "a", "path": "p", "seq": 5},
        {"scope": "b", "path": "p", "seq": 2},
        {"scope": "a", "path": "p", "seq": 7},
    ]
    assert out_of_commit_order(landings) == []
    assert out_of_commit_order([{**x, "scope": "a"} for x in landings]) == [
        "p: seq 2 landed after seq 5"
    ]


def test_checker__the_operators_retry_unlogged_is_its_own():
    """The operator logs a retry once it returned: a retry whose commit's answer a database
    fault lost is not in its log, and is its own all the same (the approval's actor)."""
    w = World()
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.event(w1.key, None, "approved", attempt=2)["actor"] = "chaos-operator"
    assert check(w.facts())["ok"], [i for i in check(w.facts())["invariants"] if not i["ok"]]
