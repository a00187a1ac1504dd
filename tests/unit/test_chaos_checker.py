"""The chaos checker bites: for each invariant, facts made to break exactly that invariant
fail it — and only it — while the clean facts pass every one."""

from __future__ import annotations

import copy
import hashlib
import time
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


def digest(j: Job) -> str:
    """The SHA-256 of the call's bytes, as its landing logs it."""
    return hashlib.sha256(j.args["content"].encode()).hexdigest()


def receipt_of(j: Job) -> dict[str, Any]:
    """What the call's tool returns (the chaos tools' results)."""
    if j.kind == "charge":
        terms = {"account": j.args["account"], "cents": j.args["cents"]}
        return {"charge_id": f"ch_{j.cid}", "key": j.key, **terms}
    data = j.args["content"].encode()
    if j.kind == "append":
        return {"path": j.args["path"], "bytes_appended": len(data)}
    return {"path": j.args["path"], "bytes_written": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip


class World:
    """A small clean run: each call claimed once, committed, landed."""

    def __init__(self) -> None:
        self.jobs = [  # two of the kinds a breaker takes a call of away: the run still did work
            job("w1", "write"),
            job("w2", "write"),
            job("s1", "shared", path="shared/a.txt"),
            job("s2", "shared", path="shared/a.txt", after="s1"),
            job("a1", "append", path="logs/x.log"),
            job("a2", "append", path="logs/x.log"),
            job("c1", "charge"),
            job("c2", "charge"),
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
            "own/w2.txt": "w2 r1",
            "shared/a.txt": "s2 r1",
            "logs/x.log": "a1 r1\na2 r1\n",
        }

    def event(self, key: str, eid: str | None, kind: str, **detail: Any) -> dict[str, Any]:
        self.seq += 1
        ev = {"seq": self.seq, "idempotency_key": key, "execution_id": eid, "kind": kind,
              "actor": "w", "detail": detail}  # fmt: skip
        if kind in ("unknown", "failed"):
            ev["at"] = WENT_UNKNOWN
        self.events.append(ev)
        return ev

    def run(self, j: Job, attempt: int = 1) -> str:
        eid = f"e-{j.cid}-{attempt}"
        self.ops[j.key] = {"status": "succeeded", "review": None}
        result = receipt_of(j)
        self.execs.append({"execution_id": eid, "idempotency_key": j.key, "attempt": attempt,
                           "status": "succeeded", "reconciled": False, "result": result,
                           "worker_id": "chaos-w1@h:101", "started_at": BEGAN})  # fmt: skip
        self.event(j.key, eid, "running", attempt=attempt)
        done = self.event(j.key, eid, "succeeded", reconciled=False, result=result)
        if j.kind == "charge":
            self.charges.append({"kind": "charge", "key": j.key, "execution_id": eid,
                                 "receipt": dict(result)})  # fmt: skip
        else:
            self.landings.append({"execution_id": eid, "seq": done["seq"], "path": j.group or
                                  j.args["path"], "kind": "append" if j.kind == "append" else
                                  "write", "redo": False, "sha256": digest(j)})  # fmt: skip
        return eid

    def attempt(self, j: Job, eid: str, attempt: int, status: str, reconciled: bool,
                worker: str = "chaos-w2@h:7", result: bool = True) -> None:  # fmt: skip
        """Another execution of ``j``'s call, as its row stands at the end (an attempt after
        the first approved by the run's operator, as every later attempt must be)."""
        if attempt >= 2:
            self.event(j.key, None, "approved", attempt=attempt)["actor"] = "chaos-operator"
        row = {"execution_id": eid, "idempotency_key": j.key, "attempt": attempt,
               "status": status, "reconciled": reconciled, "worker_id": worker}  # fmt: skip
        self.execs.append({**row, "result": receipt_of(j)} if result else row)

    def facts(self) -> Facts:
        for e in self.execs:  # every execution of this world was claimed then
            e.setdefault("started_at", BEGAN)
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
    w.attempt(s1, "e-s1-z", 2, "unknown", False, result=False)
    w.event(s1.key, "e-s1-z", "unknown", reason="lease expired")
    w.landings.append({"execution_id": "e-s1-z", "seq": 99, "path": "shared/a.txt",
                       "kind": "write", "redo": False,
                       "sha256": digest(s1)})  # fmt: skip
    w.firings.append({"ref": "e-s1-z", "point": "after_stage", "t": DURING})  # type: ignore[attr-defined]


def _revoked_only(w: World, cid: str) -> None:
    """``cid``'s only execution stopped after staging, revoked, then reconciled succeeded
    (its effect found): no own commit, so nothing of it may land — yet its effect is in the
    world, landed past the log (a cold review: only commit-to-landing was judged)."""
    j = next(j for j in w.jobs if j.cid == cid)
    eid = f"e-{cid}-1"
    w.events[:] = [e for e in w.events if e["execution_id"] != eid]
    w.landings[:] = [x for x in w.landings if x["execution_id"] != eid]
    next(e for e in w.execs if e["execution_id"] == eid)["reconciled"] = True
    w.event(j.key, eid, "running", attempt=1)
    w.firings.append({"ref": eid, "point": "after_stage", "t": DURING, "action": "stop"})  # type: ignore[attr-defined]
    w.event(j.key, eid, "unknown", reason="lease expired")
    w.event(j.key, eid, "succeeded", reconciled=True, result=receipt_of(j),
            evidence={"reconciler": "present"})  # fmt: skip


def _append_of_a_revoked_execution_unlogged(w: World) -> None:
    _revoked_only(w, "a1")


def _write_of_a_revoked_execution_unlogged(w: World) -> None:
    _revoked_only(w, "w1")


def _landing_under_another_commits_seq(w: World) -> None:
    # w1's execution committed, but what landed carries another commit's seq
    (landing,) = [x for x in w.landings if x["execution_id"] == "e-w1-1"]
    landing["seq"] = 1


def _landing_of_a_reconciled_success(w: World) -> None:
    # w1 attempt 2 was revoked; a reconciler (not its own commit) said succeeded; its bytes
    # landed: only an execution's own commit makes its bytes official
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.attempt(w1, "e-w1-z", 2, "succeeded", True)
    w.event(w1.key, "e-w1-z", "unknown", reason="lease expired")
    done = w.event(w1.key, "e-w1-z", "succeeded", reconciled=True, result=receipt_of(w1))
    w.landings.append({"execution_id": "e-w1-z", "seq": done["seq"], "path": "own/w1.txt",
                       "kind": "write", "redo": False,
                       "sha256": digest(w1)})  # fmt: skip
    w.firings.append({"ref": "e-w1-z", "point": "after_stage", "t": DURING})  # type: ignore[attr-defined]


def _stale_write_after_newer(w: World) -> None:
    older = next(x for x in w.landings if x["execution_id"] == "e-s1-1")
    w.landings.remove(older)
    w.landings.append(older)  # s1's bytes (committed before s2's) land after s2's


def _append_before_an_older_one(w: World) -> None:
    # a2 (committed after a1) lands first: the lines are both there, once each, out of order
    i, j = (next(n for n, x in enumerate(w.landings) if x["execution_id"] == f"e-{c}-1")
            for c in ("a1", "a2"))  # fmt: skip
    w.landings[i], w.landings[j] = w.landings[j], w.landings[i]


def _own_commit_after_revocation(w: World) -> None:
    # helper-96: w1's attempt 2 was revoked, then its executor's own commit went through all
    # the same (the fence's compare-and-set failed to hold): nothing landed, nothing said
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.attempt(w1, "e-w1-z", 2, "succeeded", False)
    w.event(w1.key, "e-w1-z", "unknown", reason="lease expired")
    w.event(w1.key, "e-w1-z", "succeeded", reconciled=False, result=receipt_of(w1))
    w.firings.append({"ref": "e-w1-z", "point": "after_stage", "t": DURING})  # type: ignore[attr-defined]


def _one_write_landed_through_two_executions(w: World) -> None:
    # w1's attempt 2 committed and landed the same bytes again: one file, one text, two
    # effects of one call, which only the landing log tells (helper-96)
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.attempt(w1, "e-w1-2", 2, "succeeded", False)
    done = w.event(w1.key, "e-w1-2", "succeeded", reconciled=False, result=receipt_of(w1))
    w.landings.append({"execution_id": "e-w1-2", "seq": done["seq"], "path": "own/w1.txt",
                       "kind": "write", "redo": False,
                       "sha256": digest(w1)})  # fmt: skip


def _appends_out_of_order_in_the_file(w: World) -> None:
    # the log says a1 then a2; the file holds a2's line first (helper-96: only the log was read)
    w.files["logs/x.log"] = "a2 r1\na1 r1\n"


def _an_append_first_logged_as_redo_out_of_order(w: World) -> None:
    # a1's only logged landing is a redo (its first line never written), after a2's: it is
    # a1's landing, out of commit order (redo lines were all skipped: helper-96)
    older = next(x for x in w.landings if x["execution_id"] == "e-a1-1")
    w.landings.remove(older)
    w.landings.append(dict(older, redo=True))


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
    w.firings.append({"ref": "e-w1-1", "point": "after_claim", "t": DURING})  # type: ignore[attr-defined]
    for step in order:
        if step == "revoked":
            w.event(w1.key, "e-w1-1", "unknown", reason="lease expired")
        elif step == "proven":
            w.event(w1.key, "e-w1-1", "failed", result={"error": "not_applied"},
                    evidence={"reconciler": "absent"}, reconciled=True)  # fmt: skip
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


def _attempt_without_any_approval(w: World) -> None:
    # w1's attempt 2 ran and committed with no approval of it on record at all: the judge
    # walked approvals only, and never saw it (a cold review)
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.execs.append({"execution_id": "e-w1-2", "idempotency_key": w1.key, "attempt": 2,
                    "status": "unknown", "reconciled": False, "worker_id": "chaos-w1@h:101"})  # fmt: skip
    w.event(w1.key, "e-w1-2", "running", attempt=2)
    w.firings.append({"ref": "e-w1-2", "point": "after_claim", "t": DURING})  # type: ignore[attr-defined]
    w.event(w1.key, "e-w1-2", "unknown", reason="lease expired")


def _auto_retry_without_proof(w: World) -> None:
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.event(w1.key, None, "approved", attempt=2, automatic=True, after="e-w1-1")


def _call_never_ended(w: World) -> None:
    w.ops["chaos_charge:c1"]["status"] = "approved"  # lost: approved, never ran
    w.charges[:] = [c for c in w.charges if c["key"] != "chaos_charge:c1"]


def _call_waiting_for_approval(w: World) -> None:
    w.ops["chaos_charge:c1"]["status"] = "pending_approval"
    w.charges[:] = [c for c in w.charges if c["key"] != "chaos_charge:c1"]


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
    w.charges[:] = [c for c in w.charges if c["key"] != "chaos_charge:c1"]


def _lease_expired_after_the_sweep(w: World) -> Facts:
    f = w.facts()
    f.stale_running = ["e-c1-1"]
    return f


def _call_never_recorded(w: World) -> None:
    del w.ops["chaos_charge:c1"]
    w.charges[:] = [c for c in w.charges if c["key"] != "chaos_charge:c1"]


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


def _unknown_before_its_lease_expired(w: World) -> None:
    # invariant 6: the sweep marked w1 unknown 15 s before its lease expired (database
    # clock), while a freeze of its process was on (a cause, but a live executor revoked)
    ev = w.event("chaos_write:w1", "e-w1-1", "unknown", reason="lease expired",
                 lease_expired_at=(WENT_UNKNOWN + timedelta(seconds=15)).isoformat())  # fmt: skip
    ev["at"] = WENT_UNKNOWN
    w.faults.append({"kind": "zombie", "pids": [101], "target": "chaos-w1", "t": DURING,  # type: ignore[attr-defined]
                     "frozen_s": 14.0})  # fmt: skip


def _unknown_before_the_lease_its_row_holds(w: World) -> None:
    # the same, where the event records no lease (an older version): the row's is the one
    _unknown_before_its_lease_expired(w)
    w.events[-1]["detail"].pop("lease_expired_at")
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-w1-1"]
    ex["lease_expires_at"] = WENT_UNKNOWN + timedelta(seconds=15)


def _receipt_names_another_file(w: World) -> None:
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-w1-1"]
    ex["result"] = {**ex["result"], "path": "own/OTHER.txt"}


def _receipt_of_other_bytes(w: World) -> None:
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-s2-1"]
    ex["result"] = {**ex["result"], "sha256": "0" * 64}


def _append_receipt_of_another_size(w: World) -> None:
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-a1-1"]
    ex["result"] = {**ex["result"], "bytes_appended": 1}


def _charge_receipt_not_the_services(w: World) -> None:
    # the service charged ch_c1, 100 cents; the ledger's receipt says another charge
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-c1-1"]
    ex["result"] = {**ex["result"], "charge_id": "ch_999", "cents": 1}


def revoked(w: World, key: str, eid: str) -> None:
    """``eid`` killed at its claim, revoked, then proven not applied (as the sweep does)."""
    w.firings.append({"ref": eid, "point": "after_claim", "t": DURING})  # type: ignore[attr-defined]
    w.event(key, eid, "unknown", reason="lease expired")
    w.event(key, eid, "failed", reconciled=True, result={"error": "not_applied"})


def _charge_by_an_execution_proven_not_applied(w: World) -> None:
    # c1's attempt the ledger proved not applied is the one the service says charged
    c1 = next(j for j in w.jobs if j.cid == "c1")
    w.execs.append({"execution_id": "e-c1-0", "idempotency_key": c1.key, "attempt": 0,
                    "status": "failed", "reconciled": True, "worker_id": "chaos-w2@h:7",
                    "result": {"error": "not_applied"}})  # fmt: skip
    w.charges[[c["key"] for c in w.charges].index(c1.key)]["execution_id"] = "e-c1-0"
    revoked(w, c1.key, "e-c1-0")


def _charge_asked_again_after(w: World, error: str) -> None:
    """c1's attempt 1 charged, was stopped, revoked, and recorded failed with ``error``;
    attempt 2 ran and asked for the charge again: the service answered a replay."""
    c1 = next(j for j in w.jobs if j.cid == "c1")
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-c1-1"]
    w.events[:] = [e for e in w.events if e["execution_id"] != "e-c1-1"]
    ex.update(status="failed", result={"error": error}, reconciled=True)
    w.event(c1.key, "e-c1-1", "running", attempt=1)
    w.firings.append({"ref": "e-c1-1", "point": "after_effect", "t": DURING, "action": "stop"})  # type: ignore[attr-defined]
    w.event(c1.key, "e-c1-1", "unknown", reason="lease expired")
    if error == "not_applied":  # the reconciler's word, and the sweep's retry on it
        w.event(c1.key, "e-c1-1", "failed", reconciled=True, result=ex["result"],
                evidence={"reconciler": "absent"})  # fmt: skip
        w.event(c1.key, None, "approved", attempt=2, automatic=True, after="e-c1-1")
    else:  # a person's word, and the operator's retry
        w.event(c1.key, "e-c1-1", "failed", reconciled=True, result=ex["result"],
                evidence={"kind": "human"})["actor"] = "chaos-operator"  # fmt: skip
        w.event(c1.key, None, "approved", attempt=2)["actor"] = "chaos-operator"
    r = receipt_of(c1)
    w.execs.append({"execution_id": "e-c1-2", "idempotency_key": c1.key, "attempt": 2,
                    "status": "succeeded", "reconciled": False, "result": r,
                    "worker_id": "chaos-w1@h:101"})  # fmt: skip
    w.event(c1.key, "e-c1-2", "running", attempt=2)
    w.event(c1.key, "e-c1-2", "succeeded", reconciled=False, result=r)
    w.ops[c1.key]["authorized_attempts"] = 2


def _charge_asked_again_after_a_failed_that_charged(w: World) -> None:
    # a person said attempt 1 failed though it charged; attempt 2 asked again: a replay
    _charge_asked_again_after(w, "resolved failed by a person")
    w.charges.append({"kind": "replay", "key": "chaos_charge:c1", "execution_id": "e-c1-2"})


def _one_execution_asked_for_its_charge_twice(w: World) -> None:
    # c1's one execution sent its request twice (its tool ran twice under one claim): the
    # service's dedupe answered the second a replay, which only another execution's was
    # judged by (an append landed twice by one execution fails; a charge asked twice passed)
    w.charges.append({"kind": "replay", "key": "chaos_charge:c1", "execution_id": "e-c1-1"})


def _claimed_after_an_earlier_attempt_proven_succeeded(w: World) -> None:
    """c1's attempt 1 charged, was stopped and revoked; the operator retried (attempt 2);
    the reconciler then proved attempt 1 succeeded, which withdraws the unclaimed attempt 2
    (invariant 11), but attempt 2 was claimed after the proof and asked the service again."""
    c1 = next(j for j in w.jobs if j.cid == "c1")
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-c1-1"]
    w.events[:] = [e for e in w.events if e["execution_id"] != "e-c1-1"]
    w.event(c1.key, "e-c1-1", "running", attempt=1)
    w.firings.append({"ref": "e-c1-1", "point": "after_effect", "t": DURING, "action": "stop"})  # type: ignore[attr-defined]
    w.event(c1.key, "e-c1-1", "unknown", reason="lease expired")
    w.event(c1.key, None, "approved", attempt=2)["actor"] = "chaos-operator"
    r = receipt_of(c1)
    ex.update(reconciled=True)
    w.event(c1.key, "e-c1-1", "succeeded", reconciled=True, result=r,
            evidence={"reconciler": "downstream receipt under the key"})  # fmt: skip
    w.execs.append({"execution_id": "e-c1-2", "idempotency_key": c1.key, "attempt": 2,
                    "status": "succeeded", "reconciled": False, "result": r,
                    "worker_id": "chaos-w1@h:101"})  # fmt: skip
    w.event(c1.key, "e-c1-2", "running", attempt=2)
    w.event(c1.key, "e-c1-2", "succeeded", reconciled=False, result=r)
    w.charges.append({"kind": "replay", "key": c1.key, "execution_id": "e-c1-2"})
    w.ops[c1.key]["authorized_attempts"] = 2


def _operator_retry_while_the_attempt_before_ran(w: World) -> None:
    """The operator's retry of c1 authorised while attempt 1 still ran (neither unknown nor
    failed: a retry is of those only, and revokes them): both attempts live at once, attempt
    2 asking the service again, a replay its dedupe hid. Only automatic retries were judged
    against the attempt before them."""
    c1 = next(j for j in w.jobs if j.cid == "c1")
    w.events[:] = [e for e in w.events if e["execution_id"] != "e-c1-1"]
    r = receipt_of(c1)
    w.event(c1.key, "e-c1-1", "running", attempt=1)
    w.event(c1.key, None, "approved", attempt=2)["actor"] = "chaos-operator"
    w.execs.append({"execution_id": "e-c1-2", "idempotency_key": c1.key, "attempt": 2,
                    "status": "succeeded", "reconciled": False, "result": r,
                    "worker_id": "chaos-w1@h:101"})  # fmt: skip
    w.event(c1.key, "e-c1-2", "running", attempt=2)
    w.event(c1.key, "e-c1-1", "succeeded", reconciled=False, result=r)
    w.event(c1.key, "e-c1-2", "succeeded", reconciled=False, result=r)
    w.charges.append({"kind": "replay", "key": c1.key, "execution_id": "e-c1-2"})
    w.ops[c1.key]["authorized_attempts"] = 2


def _zombie_charge_request_of_an_execution_proven_not_applied(w: World) -> None:
    # attempt 1 proven not applied, retried; attempt 2 charged; then attempt 1 (a zombie)
    # sent its request: a replay, never judged (only kind "charge" was)
    _charge_asked_again_after(w, "not_applied")
    w.charges[[c["key"] for c in w.charges].index("chaos_charge:c1")]["execution_id"] = "e-c1-2"
    w.charges.append({"kind": "replay", "key": "chaos_charge:c1", "execution_id": "e-c1-1"})


def _landing_of_an_execution_proven_not_applied(w: World) -> None:
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.execs.append({"execution_id": "e-w1-0", "idempotency_key": w1.key, "attempt": 0,
                    "status": "failed", "reconciled": True, "worker_id": "chaos-w2@h:7",
                    "result": {"error": "not_applied"}})  # fmt: skip
    w.landings.insert(0, {"execution_id": "e-w1-0", "seq": 0, "path": "own/w1.txt",
                          "kind": "write", "redo": False,
                          "sha256": digest(w1)})  # fmt: skip
    revoked(w, w1.key, "e-w1-0")


def _nothing_succeeded(w: World) -> None:
    # every call failed (a tool broken): nothing duplicated, nothing hidden, nothing done
    for op in w.ops.values():
        op["status"] = "failed"
    for e in w.execs:
        e["status"], e["result"] = "failed", {"error": "boom"}
    w.events[:] = [e for e in w.events if e["kind"] != "succeeded"]
    w.landings.clear()
    w.charges.clear()
    w.files = dict.fromkeys(w.files)


def _a_charge_failed_without_a_fault(w: World) -> None:
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-c1-1"]
    ex["status"], ex["result"] = "failed", {"error": "tool_error"}
    w.ops["chaos_charge:c1"]["status"] = "failed"
    w.events[:] = [e for e in w.events if not (e["execution_id"] == "e-c1-1" and e["kind"] ==
                                               "succeeded")]  # fmt: skip
    w.event("chaos_charge:c1", "e-c1-1", "failed", result=ex["result"])
    w.charges[:] = [c for c in w.charges if c["key"] != "chaos_charge:c1"]


def _a_charge_failed_for_its_lease_without_a_database_fault(w: World) -> None:
    # the tool's word that its lease was lost explains nothing without a fault that cut it
    _a_charge_failed_without_a_fault(w)
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-c1-1"]
    ex["result"]["lease_lost"] = True


def _a_retry_superseded_that_no_fault_authorised(w: World) -> None:
    # "superseded" explains a failure only for an automatic retry (its predecessor judged)
    _a_charge_failed_without_a_fault(w)
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-c1-1"]
    ex["result"] = {"error": "superseded"}


def _a_call_rejected(w: World) -> None:
    # the run's agent submits every call approved: a rejection is a bug no execution shows
    c1 = next(j for j in w.jobs if j.cid == "c1")
    w.ops[c1.key]["status"] = "rejected"
    w.execs[:] = [e for e in w.execs if e["idempotency_key"] != c1.key]
    w.events[:] = [e for e in w.events if e["idempotency_key"] != c1.key]
    w.charges[:] = [c for c in w.charges if c["key"] != c1.key]


def _a_call_failed_without_an_execution(w: World) -> None:
    _a_call_rejected(w)
    w.ops["chaos_charge:c1"]["status"] = "failed"


def _landing_on_another_path(w: World) -> None:
    (landing,) = [x for x in w.landings if x["execution_id"] == "e-w1-1"]
    landing["path"] = "own/w2.txt"  # w1's bytes on w2's path, which w2 then overwrote


def _append_landed_as_a_write(w: World) -> None:
    (landing,) = [x for x in w.landings if x["execution_id"] == "e-a2-1"]
    landing["kind"] = "write"


def _a_write_landed_again_as_a_redo(w: World) -> None:
    # a stale shared write landed again after a newer one, labelled as an append's redo
    again = dict(next(x for x in w.landings if x["execution_id"] == "e-s1-1"), redo=True)
    w.landings.append(again)


def _unknown_explained_only_by_a_death_an_hour_later(w: World) -> Facts:
    _unknown_without_a_fault(w)
    f = w.facts()
    f.deaths = {101: [("signal 9 (SIGKILL)", DURING + 3600)]}
    return f


def _unknown_explained_only_by_a_firing_an_hour_later(w: World) -> None:
    _unknown_without_a_fault(w)
    w.firings.append({"ref": "e-w1-1", "point": "after_terminal", "t": DURING + 3600})  # type: ignore[attr-defined]


def _unknown_explained_only_by_a_crash(w: World) -> Facts:
    # a pool child that exited with an error (no fault, no time limit) explains nothing
    _unknown_without_a_fault(w)
    f = w.facts()
    f.deaths = {101: [("exitcode 1", DURING)]}
    return f


def _receipt_of_the_authorised_attempt_wrong(w: World) -> None:
    # withdrawn back to attempt 1 while attempt 2 succeeded too: the receipt is attempt 1's
    w1 = next(j for j in w.jobs if j.cid == "w1")
    w.ops[w1.key]["authorized_attempts"] = 1
    (first,) = [e for e in w.execs if e["execution_id"] == "e-w1-1"]
    first["result"] = {**first["result"], "path": "own/OTHER.txt"}
    w.event(w1.key, None, "approved", attempt=2)["actor"] = "chaos-operator"
    w.execs.append({**first, "execution_id": "e-w1-2", "attempt": 2, "result": receipt_of(w1),
                    "reconciled": True})  # fmt: skip
    w.event(w1.key, "e-w1-2", "succeeded", reconciled=True, result=receipt_of(w1))


def _receipt_that_calls_itself_a_persons(w: World) -> None:
    # resolved_by in an executor's own result is not a person's decision
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-w2-1"]
    ex["result"] = {"resolved_by": "x", "path": "own/OTHER.txt"}


def _shared_path_older_while_the_last_is_contradicted(w: World) -> None:
    w.files["shared/a.txt"] = "s1 r1"
    _flagged(w, "s2", "contradicted")  # not "its bytes could not land"


def _landed_bytes_not_the_calls(w: World) -> None:
    (landing,) = [x for x in w.landings if x["execution_id"] == "e-s1-1"]
    landing["sha256"] = "0" * 64  # foreign bytes on a shared path, overwritten since


def _landing_without_a_digest(w: World) -> None:
    (landing,) = [x for x in w.landings if x["execution_id"] == "e-s1-1"]
    del landing["sha256"]  # foreign bytes on a shared path, overwritten since, untold


def _one_write_landed_two_effects(w: World) -> None:
    first = next(x for x in w.landings if x["execution_id"] == "e-w1-1")
    w.landings.append({**first, "n": 1})


def _verify_differs(w: World) -> Facts:
    f = w.facts()
    f.verify = ['{"table": "operations"}']
    return f


def _flagged(w: World, cid: str, reason: str, explained: bool = True) -> Job:
    """``cid``'s execution flagged ``reason``; ``explained``: revoked first, for a fault on it."""
    j = next(j for j in w.jobs if j.cid == cid)
    eid = f"e-{cid}-1"
    if explained:
        w.firings.append({"ref": eid, "point": "after_effect", "t": DURING})  # type: ignore[attr-defined]
        w.event(j.key, eid, "unknown", reason="lease expired")
    w.event(j.key, eid, "flagged", reason=reason)
    w.ops[j.key]["review"] = reason
    return j


def _a_write_flagged_not_landed_lost(w: World) -> None:
    # w1 committed; its bytes "could not land", though nothing in chaos makes a path unsafe:
    # its file is absent, nothing landed (a cold review: it passed every check)
    _flagged(w, "w1", "not_landed", explained=False)
    w.landings[:] = [x for x in w.landings if x["execution_id"] != "e-w1-1"]
    w.files["own/w1.txt"] = None


def _a_charge_flagged_both_ran_never_made(w: World) -> None:
    # the flag says an earlier attempt proved succeeded: no charge at the service at all
    c1 = _flagged(w, "c1", "both_ran")
    w.charges[:] = [c for c in w.charges if c["key"] != c1.key]


def _a_flag_no_fault_explains(w: World) -> None:
    _flagged(w, "c1", "both_ran", explained=False)  # never revoked: nothing contradicted


def _a_flag_not_on_record(w: World) -> None:
    w.ops["chaos_charge:c1"]["review"] = "contradicted"  # no flagged event of it


def _landing_by_a_charges_execution(w: World) -> None:
    # the log says a charge's execution landed a file: no call's write
    done = next(e for e in w.events if e["execution_id"] == "e-c1-1" and e["kind"] == "succeeded")
    w.landings.append({"execution_id": "e-c1-1", "seq": done["seq"], "path": "own/zz.txt",
                       "kind": "write", "redo": False, "sha256": "0" * 64})  # fmt: skip


def _auto_retry_naming_another_calls_attempt(w: World) -> None:
    # w1's automatic attempt 2 "after" w2's attempt 1, revoked and proven absent: not w1's
    w1, w2 = (next(j for j in w.jobs if j.cid == c) for c in ("w1", "w2"))
    w.firings.append({"ref": "e-w2-1", "point": "after_claim", "t": DURING})  # type: ignore[attr-defined]
    w.event(w2.key, "e-w2-1", "unknown", reason="lease expired")
    w.event(w2.key, "e-w2-1", "failed", result={"error": "not_applied"},
            evidence={"reconciler": "absent"}, reconciled=True)  # fmt: skip
    w.event(w1.key, None, "approved", attempt=2, automatic=True, after="e-w2-1")


def _succeeded_with_no_succeeded_execution(w: World) -> None:
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-w1-1"]
    ex["status"] = "unknown"  # the call says succeeded; none of its executions did


def _receipt_not_a_dict(w: World) -> None:
    (ex,) = [e for e in w.execs if e["execution_id"] == "e-w1-1"]
    ex["result"] = "ok"


def _unknown_with_a_db_error_while_another_host_was_cut(w: World) -> None:
    # its own record of a database error; the partition fell on another worker's host
    _unknown_with_a_db_error_but_no_database_fault(w)
    w.faults.append({"kind": "partition", "pids": [7], "target": "chaos-w2", "t": DURING,  # type: ignore[attr-defined]
                     "cut_s": 14.0})  # fmt: skip


ONE_EFFECT = "at most one effect per call (lines, charges, landings)"
REVOKED = "no effect of a revoked execution lands"
REVIEWS = "every flag for review lines up with a fault and holds in the world"
RECEIPTS = "every receipt says what its call did"
FAILURES = "every failure lines up with a fault on that execution"
FOREIGN = "the world holds only the calls' own effects"
PROOF = "no attempt is claimed after an earlier one was proven succeeded"
BREAKS = {
    ONE_EFFECT: [
        _duplicate_line,
        _duplicate_charge,
        _charged_again_under_another_key,
        _one_write_landed_through_two_executions,
        _landed_twice,
        _charge_asked_again_after_a_failed_that_charged,
        _one_execution_asked_for_its_charge_twice,
    ],
    PROOF: [_claimed_after_an_earlier_attempt_proven_succeeded],
    "no effect of a revoked execution lands": [
        _landing_without_own_commit,
        _landing_under_another_commits_seq,
        _landing_of_a_reconciled_success,
        _stale_write_after_newer,
        _append_before_an_older_one,
        _own_commit_after_revocation,
        _appends_out_of_order_in_the_file,
        _an_append_first_logged_as_redo_out_of_order,
        _append_of_a_revoked_execution_unlogged,
        _write_of_a_revoked_execution_unlogged,
    ],
    "every shared path holds its last succeeded write": [
        _shared_path_older_while_the_last_is_contradicted,
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
        _attempt_without_any_approval,
        _auto_retry_naming_another_calls_attempt,
        _operator_retry_while_the_attempt_before_ran,
    ],
    "every succeeded call's effect is in the world": [
        _write_absent,
        _append_line_absent,
        _charge_never_made,
        _no_landing_logged,
        _write_landing_missing,
    ],
    RECEIPTS: [
        _receipt_names_another_file,
        _receipt_of_other_bytes,
        _append_receipt_of_another_size,
        _charge_receipt_not_the_services,
        _receipt_of_the_authorised_attempt_wrong,
        _receipt_that_calls_itself_a_persons,
        _succeeded_with_no_succeeded_execution,
        _receipt_not_a_dict,
    ],
    "nothing proven not applied took effect": [
        _charge_by_an_execution_proven_not_applied,
        _landing_of_an_execution_proven_not_applied,
        _zombie_charge_request_of_an_execution_proven_not_applied,
    ],
    FAILURES: [
        _nothing_succeeded,
        _a_charge_failed_without_a_fault,
        _a_charge_failed_for_its_lease_without_a_database_fault,
        _a_retry_superseded_that_no_fault_authorised,
        _a_call_rejected,
        _a_call_failed_without_an_execution,
    ],
    FOREIGN: [
        _landed_bytes_not_the_calls,
        _landing_without_a_digest,
        _one_write_landed_two_effects,
        _landing_on_another_path,
        _append_landed_as_a_write,
        _a_write_landed_again_as_a_redo,
        _torn_line,
        _glued_lines,
        _foreign_bytes,
        _charge_by_another_calls_execution,
        _charge_with_other_terms,
        _landing_by_a_charges_execution,
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
        _unknown_explained_only_by_a_death_an_hour_later,
        _unknown_explained_only_by_a_firing_an_hour_later,
        _unknown_explained_only_by_a_crash,
        _unknown_before_its_lease_expired,
        _unknown_before_the_lease_its_row_holds,
        _unknown_with_a_db_error_while_another_host_was_cut,
    ],
    REVIEWS: [
        _a_write_flagged_not_landed_lost,
        _a_charge_flagged_both_ran_never_made,
        _a_flag_no_fault_explains,
        _a_flag_not_on_record,
    ],
    "verify: events rebuild state exactly": [_verify_differs],
}
#: Breakers that break another invariant too, by their nature: which.
ALSO = {
    _landing_without_own_commit: set(),  # a zombie's landing also hides nothing: none
    _charged_again_under_another_key: {FOREIGN},  # a key no call has
    _glued_lines: {REVIEWS},  # flagged not_landed so as to be judged only as foreign bytes
    # effects in the world with no landing logged: of a revoked execution, for all it shows
    _no_landing_logged: {REVOKED},
    _write_landing_missing: {REVOKED},
    _shared_written_though_none_succeeded: {REVOKED},
    _charge_with_other_terms: {RECEIPTS},  # the ledger's receipt is not the service's then
    # an attempt 2 claimed after attempt 1 committed its success: a retry after the proof
    _attempt_without_any_approval: {PROOF},
    # a landing without its own commit is one after its revocation, too
    _landing_of_an_execution_proven_not_applied: {"no effect of a revoked execution lands"},
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
        {"firings": [{"ref": "e-w1-1", "point": "after_claim", "t": DURING}]},
        {"deaths": {101: [("signal 9 (SIGKILL)", DURING)]}},
        # a pid reused: the death that fell while it was held is kept beside a later one
        {"deaths": {101: [("signal 9 (SIGKILL)", DURING), ("signal 15 (SIGTERM)", DURING + 60)]}},
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
        f = _unknown_between(began, went_unknown)
        f.firings = [{"ref": "other", **firing}]
        assert (name not in broken(f)) == explained, firing


def _unknown_between(began: Any, went_unknown: Any) -> Facts:
    """Facts of execution e-w1-1 begun at ``began`` and made unknown at ``went_unknown``,
    explained by no fault yet (a copy: the caller adds firings, wakes)."""
    w = World()
    _unknown_without_a_fault(w)
    (held,) = [e for e in w.execs if e["execution_id"] == "e-w1-1"]
    held["started_at"] = began
    w.events[-1]["at"] = went_unknown
    return copy.copy(w.facts())


def test_checker__a_stop_holds_its_process_until_its_wake():
    """A threads thread takes its claim's time, another thread's failpoint stops the process,
    and the claim goes out when the harness wakes it, 15 s on: the execution began after the
    firing, within the stop, and its unknown is the stop's (a threads run at load 12, 12-07:
    explained by nothing). The stop lasts to its wake only: one woken before the execution
    began, or a stop never woken, explains nothing later (the checker stays able to fail)."""
    name = "every unknown lines up with a fault on that execution"
    stop_t = (BEGAN - timedelta(seconds=10)).timestamp()  # the claim went out 10 s after it
    for wakes, explained in (
        ({101: [(BEGAN + timedelta(seconds=1)).timestamp()]}, True),
        ({101: [(BEGAN - timedelta(seconds=5)).timestamp()]}, False),  # woken before the claim
        ({202: [(BEGAN + timedelta(seconds=1)).timestamp()]}, False),  # another process's
        ({}, False),
    ):
        f = _unknown_between(BEGAN, WENT_UNKNOWN)
        f.firings = [{"ref": "other", "point": "after_stage", "action": "stop", "pid": 101,
                      "t": stop_t}]  # fmt: skip
        f.wakes = wakes
        assert (name not in broken(f)) == explained, wakes


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
    w.event("chaos_write:w1", "e-w1-1", "evidence", worker_id=mine, not_started=True,
            lease_lost=True)  # fmt: skip
    # not the fence's (helper-96: they met the figure with no revocation at all): a claim
    # whose commit could not be learned, never revoked; the time limit before the tool
    w.event("chaos_append:a1", "e-a1-1", "evidence", worker_id=mine, not_started=True)
    w.event("chaos_write:w1", "e-w1-1", "evidence", worker_id=mine, not_started=True,
            reason="SoftTimeLimitExceeded")  # fmt: skip
    w.event(
        "chaos_append:a1", "e-a1-1", "evidence", worker_id=mine, not_started=True, lease_lost=True
    )  # fmt: skip  (its lease lost, but the sweep never revoked it)
    w.event(
        "chaos_append:a2", "e-a2-1", "evidence", worker_id=mine, late_result=None
    )  # never revoked
    assert check(w.facts())["fenced"] == {
        "not_started": 1, "refused_at_commit": 1, "staged_refused": 1,
    }  # fmt: skip
    # a refused commit with nothing staged counts as refused, not as staged bytes refused
    w.event("chaos_write:w1", "e-w1-1", "evidence", worker_id=mine, late_result=None)
    w.event("chaos_write:w1", "e-w1-1", "evidence", worker_id=mine, late_result=None, staged=[])
    assert check(w.facts())["fenced"] == {
        "not_started": 1, "refused_at_commit": 3, "staged_refused": 1,
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
    (pending / "e.spool.tmp7267.0a1b2c3d").write_bytes(b"")  # (named so since 12-06)
    (pending / "e.spool").write_bytes(b"{}")  # a spool never settled: still counted
    # a claim whose commit was never learned and that the ledger does not hold: no effect
    unmade = '{"lease_token": "t", "status": "not_started", "reason": "claim commit unknown"}'
    (pending / "u.spool").write_text(unmade)
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


def test_gather__sees_strays_outside_the_scope_folder_and_links(tmp_path):
    """Only the scope's folder was looked at, through links: a file at the sandbox's root or
    in another scope's folder, a link to a directory, and a job's path made a link to a file
    outside the sandbox all passed (a cold review)."""
    from toolledger.harness.chaos.checker import sandbox_strays

    sandbox = tmp_path / "sandbox"
    root = sandbox / "s"
    (root / "own").mkdir(parents=True)
    (root / "own" / "w1.txt").write_bytes(b"w1 r1")
    (sandbox / ".toolledger" / "pending").mkdir(parents=True)
    (sandbox / ".toolledger" / "pending" / "e.1.ab.write").write_bytes(b"x")  # not a stray
    assert sandbox_strays(sandbox, "s", {"own/w1.txt"}) == []
    (sandbox / "root.txt").write_bytes(b"x")
    (sandbox / "other").mkdir()
    (sandbox / "other" / "f.txt").write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"x")
    (root / "linked").symlink_to(outside, target_is_directory=True)
    (root / "own" / "w2.txt").symlink_to(outside / "secret")  # a job's path, a link
    assert sandbox_strays(sandbox, "s", {"own/w1.txt", "own/w2.txt"}) == [
        "other/f.txt (outside the scope's folder)",
        "root.txt (outside the scope's folder)",
        "s/linked (a symbolic link)",
        "s/own/w2.txt (a symbolic link)",
    ]


def test_checker__a_reconciled_success_after_a_newer_commit_is_not_the_paths_truth():
    """s1's attempt 1 went unknown; its retry committed and landed; s2 committed and landed;
    then the sweep reconciled s1's attempt 1 succeeded (its bytes were there then): the path
    rightly holds s2's bytes, and the checker said it should hold s1's (a cold review)."""
    w = World()
    s1 = next(j for j in w.jobs if j.cid == "s1")
    w.attempt(s1, "e-s1-0", 0, "succeeded", True, worker="chaos-w1@h:101")
    w.event(s1.key, "e-s1-0", "unknown", reason="lease expired")
    w.event(s1.key, "e-s1-0", "succeeded", reconciled=True, result=receipt_of(s1))
    f = w.facts()
    f.firings = [{"ref": "e-s1-0", "point": "after_claim", "t": DURING}]
    report = check(f)
    assert report["ok"], [i for i in report["invariants"] if not i["ok"]]


def test_checker__a_shared_path_whose_last_success_waits_for_a_human_is_theirs():
    """s2 committed, its bytes could not land (flagged not_landed): the path holds s1's, and
    the ledger already asked a human; the path's judge failed on it all the same (a cold
    review). The flag is judged apart: nothing in chaos makes a path unsafe, so a not_landed
    flag is a lost effect, unless something stands in the path's way (itself a foreign file)."""
    w = World()
    _flagged(w, "s2", "not_landed", explained=False)
    w.landings[:] = [x for x in w.landings if x["execution_id"] != "e-s2-1"]
    w.files["shared/a.txt"] = "s1 r1"
    assert broken(w.facts()) == {REVIEWS}
    f = w.facts()
    f.stray_files = ["s/shared/a.txt (a symbolic link)"]  # what made it unsafe: a link
    assert broken(f) == {FOREIGN}


def test_checker__a_flag_with_its_cause_holding_in_the_world_passes():
    """both_ran on an execution revoked for a fault on it, its effect there: the human's."""
    for cid, reason in (("c1", "both_ran"), ("w1", "both_ran"), ("a1", "contradicted")):
        w = World()
        w.firings = []  # type: ignore[attr-defined]
        _flagged(w, cid, reason)
        f = w.facts()
        f.firings = w.firings  # type: ignore[attr-defined]
        report = check(f)
        assert report["ok"], (cid, [i for i in report["invariants"] if not i["ok"]])


def test_gather__a_childs_death_is_read_with_its_time(tmp_path):
    from toolledger.harness.chaos.checker import child_deaths

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "w1.log").write_text(
        "2026-12-02 04:00:05,250 ERROR celery.concurrency.asynpool: Process 'ForkPoolWorker-2' "
        "pid:101 exited with 'signal 9 (SIGKILL)'\n"
        "[2026-12-02 04:00:06,000: ERROR/MainProcess] Process 'ForkPoolWorker-3' pid:102 "
        "exited with 'exitcode 1'\n"
        '{"ts": "2026-12-02T04:00:07.000+00:00", "level": "ERROR", "message": "Process '
        "'ForkPoolWorker-4' pid:103 exited with 'signal 9 (SIGKILL)'\"}\n"
        "Process 'ForkPoolWorker-5' pid:104 exited with 'signal 15 (SIGTERM)'\n"
    )
    deaths = child_deaths(logs)
    local = datetime(2026, 12, 2, 4, 0, 5, 250000).timestamp()  # as logging writes asctime
    assert deaths[101] == [("signal 9 (SIGKILL)", local)]
    assert deaths[102][0][1] == datetime(2026, 12, 2, 4, 0, 6).timestamp()
    assert deaths[103] == [("signal 9 (SIGKILL)", (BEGAN + timedelta(seconds=7)).timestamp())]
    assert deaths[104] == [("signal 15 (SIGTERM)", None)]  # no time: it explains nothing
    w = World()
    _unknown_without_a_fault(w)
    f = w.facts()
    f.deaths = {101: deaths[104]}
    assert "every unknown lines up with a fault on that execution" in broken(f)


def test_checker__an_effect_whose_retry_landed_the_same_bytes_is_explained():
    """The known limit of 'every effect in the world has a logged landing': w1's attempt 1
    revoked (its bytes might have landed past the log), its retry committed and landed the
    same bytes: the file cannot tell them apart, and the retry's landing explains it."""
    w = World()
    w.firings = []  # type: ignore[attr-defined]
    w.events[:] = [e for e in w.events if e["execution_id"] != "e-w1-1"]
    w.landings[:] = [x for x in w.landings if x["execution_id"] != "e-w1-1"]
    _auto_retry(w, ["revoked", "proven", "retried"])
    (first,) = [e for e in w.execs if e["execution_id"] == "e-w1-1"]
    first.update(status="failed", result={"error": "not_applied"}, reconciled=True)
    w1 = w.jobs[0]
    w.execs.append({**first, "execution_id": "e-w1-2", "attempt": 2, "status": "succeeded",
                    "reconciled": False, "result": receipt_of(w1)})  # fmt: skip
    w.ops[w1.key]["authorized_attempts"] = 2
    w.event(w1.key, "e-w1-2", "running", attempt=2)
    done = w.event(w1.key, "e-w1-2", "succeeded", reconciled=False, result=receipt_of(w1))
    w.landings.append({"execution_id": "e-w1-2", "seq": done["seq"], "path": "own/w1.txt",
                       "kind": "write", "redo": False,
                       "sha256": digest(w1)})  # fmt: skip
    f = w.facts()
    f.firings = w.firings  # type: ignore[attr-defined]
    report = check(f)
    assert report["ok"], [i for i in report["invariants"] if not i["ok"]]
    f.landings = [x for x in w.landings if x["execution_id"] != "e-w1-2"]
    assert "no effect of a revoked execution lands" in broken(f)


def test_checker__a_charge_asked_again_is_counted_as_the_baseline_counts_it():
    """A second request of a call's charge, answered as a replay by the service's dedupe, is
    counted as the baseline counts its duplicate charges; where the charging execution went
    unknown and its retry asked while its own request was on its way (the race the service's
    key is for), it is no violation — the figure tells it."""
    from toolledger.harness.chaos.report import markdown

    assert check(World().facts())["charges_requested_again"] == 0
    w = World()
    w.firings = []  # type: ignore[attr-defined]
    _charge_asked_again_after(w, "resolved failed by a person")
    (first,) = [e for e in w.execs if e["execution_id"] == "e-c1-1"]
    first.update(status="unknown", result=None)  # still unknown: never said failed
    w.events[:] = [e for e in w.events if not (e["execution_id"] == "e-c1-1" and
                                               e["kind"] == "failed")]  # fmt: skip
    w.charges.append({"kind": "replay", "key": "chaos_charge:c1", "execution_id": "e-c1-2"})
    f = w.facts()
    f.firings = w.firings  # type: ignore[attr-defined]
    report = check(f)
    assert report["ok"], [i for i in report["invariants"] if not i["ok"]]
    assert report["charges_requested_again"] == 1
    full = {**report, "scope": "s", "jobs": 8, "mix": {}, "workers": 1, "concurrency": 1,
            "faults": {}, "fault_window_s": 1, "seed": 1, "lease_s": 1, "code": "x",
            "recovered_s": 1, "duration_s": 1, "operator": {},
            "baseline": {"duplicates": 3, "duplicate_charges": 2, "shared_path_mismatches": 0,
                         "lost": 0}}  # fmt: skip
    assert "| toolledger | 0 | 1 | 0 | 0 |" in markdown(full)
    assert "| plain Celery tasks, acks_late, no ledger | 3 | 2 | 0 | 0 |" in markdown(full)


def test_checker__an_unknown_after_its_lease_expired_or_by_its_own_worker_is_no_early_one():
    """Only the sweep's unknown for an expired lease waits for the lease: one at or after it
    passes, and a worker that marks its own execution unknown (another reason) is legit."""
    for at, reason in ((15, "lease expired"), (16, "lease expired"), (0, "the executor's own")):
        w = World()
        w.faults = []  # type: ignore[attr-defined]
        _unknown_before_its_lease_expired(w)
        w.events[-1]["at"] = WENT_UNKNOWN + timedelta(seconds=at)
        w.events[-1]["detail"]["reason"] = reason
        f = w.facts()
        f.faults = w.faults  # type: ignore[attr-defined]
        assert check(f)["ok"], (at, reason)


def test_child_deaths__every_death_of_a_reused_pid_is_kept(tmp_path):
    """A pid is reused: each of its deaths is kept, in the order logged (only the last was)."""
    from toolledger.harness.chaos.checker import child_deaths

    logs = tmp_path / "logs"
    logs.mkdir()
    line = "2026-12-02 04:00:0{} ERROR Process 'ForkPoolWorker-2' pid:101 exited with '{}'\n"
    (logs / "w1.log").write_text(line.format(5, "signal 9 (SIGKILL)") +
                                 line.format(9, "signal 15 (SIGTERM)"))  # fmt: skip
    assert [how for how, _ in child_deaths(logs)[101]] == ["signal 9 (SIGKILL)",
                                                          "signal 15 (SIGTERM)"]  # fmt: skip


def test_gather__reads_the_runs_scope_and_every_fact_it_is_handed(tmp_path):
    """gather's wiring: the run's scope's rows, events and landings only (another scope's are
    another run's), a lease expired after the sweep, verify's differences, a link at a job's
    path read as absent (never followed), and every log read: each dropped or mis-wired was
    noticed by no test (a cold review's mutations)."""
    import json

    from toolledger.harness.chaos.checker import gather
    from toolledger.harness.chaos.workload import Workload
    from toolledger.ledger.ledger import Ledger
    from toolledger.ledger.models import operations

    w1, w2 = job("w1", "write"), job("w2", "write")
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    ledger.upgrade()
    try:
        claimed = {}
        for scope, lease in (("s", -5.0), ("other", 60.0)):
            for j in (w1, w2):
                ledger.submit(scope, j.cid, j.tool, j.args, approved_by="chaos-agent")
            claim = ledger.claim(scope, w1.key, 1, worker_id="chaos-w1@h:101",
                                 lease_seconds=lease)  # fmt: skip
            assert claim is not None
            claimed[scope] = claim.execution_id
        with ledger.engine.begin() as conn:  # a row that its events no longer rebuild
            conn.execute(operations.update().where(operations.c.scope == "s",
                                                   operations.c.idempotency_key == w2.key)
                         .values(status="rejected"))  # fmt: skip
        root = tmp_path / "sandbox" / "s" / "own"
        root.mkdir(parents=True)
        (tmp_path / "elsewhere").write_text("w1 r1")
        (root / "w1.txt").symlink_to(tmp_path / "elsewhere")
        (root / "w2.txt").write_text("w2 r1")
        landing = {"path": "own/w2.txt", "kind": "write", "seq": 1, "execution_id": "x"}
        (tmp_path / "effects.log").write_text(
            "".join(json.dumps({**landing, "scope": sc}) + "\n" for sc in ("s", "other"))
        )
        for name, entry in (("charges.log", {"kind": "charge", "key": "k"}),
                            ("failpoints.log", {"ref": "e", "point": "after_claim"}),
                            ("operator.log", {"action": "retry", "cid": "w1"})):  # fmt: skip
            (tmp_path / name).write_text(json.dumps(entry) + "\n")
        (tmp_path / "logs").mkdir()
        (tmp_path / "logs" / "w.log").write_text(
            "Process 'ForkPoolWorker-1' pid:101 exited with 'signal 9 (SIGKILL)'\n"
        )
        f = gather(ledger, "s", tmp_path, Workload([w1, w2]), [{"kind": "zombie"}],
                   landings_logged=True)  # fmt: skip
    finally:
        ledger.close()
    assert set(f.ops) == {w1.key, w2.key}
    assert [e["execution_id"] for e in f.execs] == [claimed["s"]]
    assert f.events and {e["scope"] for e in f.events} == {"s"}
    assert f.stale_running == [claimed["s"]]  # its lease expired; other's holds
    assert f.verify  # the row the events do not rebuild
    assert f.files == {"own/w1.txt": None, "own/w2.txt": "w2 r1"}
    assert f.landings == [{**landing, "scope": "s"}]
    assert (len(f.charges), len(f.firings), len(f.operator)) == (1, 1, 1)
    assert f.faults == [{"kind": "zombie"}] and f.deaths == {101: [("signal 9 (SIGKILL)", None)]}


def test_checker__a_claim_before_the_proof_or_after_it_was_overturned_is_no_claim_after_it():
    """The race a ``both_ran`` flag is for (attempt 2 claimed, then attempt 1 proven) and a
    retry after a review found the proven attempt failed are no claim after a proof."""
    w = World()
    w.firings = []  # type: ignore[attr-defined]
    _claimed_after_an_earlier_attempt_proven_succeeded(w)
    running = next(e for e in w.events if e["execution_id"] == "e-c1-2" and e["kind"] == "running")
    proof = next(e for e in w.events if e["execution_id"] == "e-c1-1" and e["kind"] == "succeeded")
    f = w.facts()
    f.firings = w.firings  # type: ignore[attr-defined]
    assert PROOF in broken(f)
    running["seq"], proof["seq"] = proof["seq"], running["seq"]  # claimed first: the race
    f.events.sort(key=lambda e: e["seq"])
    assert PROOF not in broken(f)
    running["seq"], proof["seq"] = proof["seq"], running["seq"]
    f.events.sort(key=lambda e: e["seq"])
    review = {**proof, "seq": proof["seq"] + 0.5, "kind": "failed"}  # a review overturned it
    f.events.append(review)
    f.events.sort(key=lambda e: e["seq"])
    assert PROOF not in broken(f)


def test_checker__each_fault_counts_whether_it_met_an_execution_in_flight():
    """A fault that struck while nothing it could cut off was held tested nothing (a run of
    400 jobs, seed 3: every kill, child kill, zombie, crash and terminate of 40 met idle or
    already-stopped workers, and its report said only "injected"). Each kind that can cut
    an execution off counts the faults that struck one in flight: a process's kinds on its
    pids (a partition, its host too), a database's on any; the broker's are not measured."""
    w = World()
    for e in w.events:  # every execution ended 20 s after its claim
        e["at"] = WENT_UNKNOWN
    hour = DURING + 3600
    faults = [
        {"kind": "zombie", "pids": [101], "target": "chaos-w1", "t": DURING, "frozen_s": 14.0},
        {"kind": "zombie", "pids": [555], "target": "chaos-w2", "t": DURING, "frozen_s": 14.0},
        {"kind": "kill_main", "pids": [101], "target": "chaos-w1", "t": hour},
        {"kind": "kill_child", "pids": [101], "target": "chaos-w1", "t": DURING - 60},
        {"kind": "partition", "pids": [], "target": "chaos-w1", "t": DURING - 30, "cut_s": 40},
        {"kind": "pg_crash", "pids": [9], "target": "postgres", "t": DURING, "down_s": 2.0},
        {"kind": "pg_terminate", "pids": [], "target": "postgres", "t": hour},
        {"kind": "redis_flush", "pids": [], "target": "redis", "t": DURING},
    ]
    f = w.facts()
    f.faults = faults
    report = check(f)
    assert report["faults_met_work"] == {
        "kill_child": 0, "kill_main": 0, "partition": 1, "pg_crash": 1, "pg_terminate": 0,
        "redis_flush": None, "zombie": 1,
    }  # fmt: skip
    assert report["ok"]  # reported, not judged: a run's faults may all meet nothing by chance
    from toolledger.harness.chaos.report import markdown

    full = {**report, "scope": "s", "jobs": 8, "mix": {}, "workers": 1, "concurrency": 1,
            "faults": {"zombie": 2, "kill_main": 1, "redis_flush": 1, "failpoint:after_claim": 1},
            "faults_not_injected": {"kill_main": 2, "partition": 5}, "fault_window_s": 1,
            "seed": 1, "lease_s": 1, "code": "x", "recovered_s": 1, "duration_s": 1,
            "operator": {}}  # fmt: skip
    text = markdown(full)
    assert "| zombie | 2 | 1 |" in text
    assert "| kill_main | 1 | 0 (2 more scheduled, no target) |" in text
    assert "| redis_flush | 1 | not measured |" in text
    assert "| partition | **0 of 5 scheduled: no target** | - |" in text


def test_chaos_run__a_fault_that_found_no_target_is_counted_not_dropped(tmp_path, monkeypatch):
    """A scheduled fault whose kind found no target until its deadline (every worker
    stopped, frozen or restarting) was dropped without a word: the report listed what was
    injected, and a kind scheduled five times and injected never looked like one not asked
    for. It is counted, by kind."""
    from toolledger.harness.chaos import harness

    monkeypatch.setattr(harness, "FREEZE_PAST_LEASE", 0.0)
    monkeypatch.setattr(harness, "PARENT_HOLD", 0.0)
    cfg = harness.ChaosConfig(out=tmp_path, db="postgresql://x", broker="redis://x", jobs=10,
                              duration=0.2, faults=3, lease_seconds=0.05,
                              kinds=("zombie", "kill_main"), progress=lambda _: None)  # fmt: skip
    run = harness.ChaosRun(cfg)
    run.began = time.time()
    run._inject()  # no worker at all: nothing to freeze or kill
    assert run.faults == []
    assert run.missed == {"zombie": 2, "kill_main": 1}  # the schedule takes kinds in turn


def test_operator__reviews_the_flag_still_waiting_not_the_last_one_raised(monkeypatch):
    """A call flagged twice (``both_ran`` on attempt 1, then on attempt 3), the later flag
    reviewed: the operator reviewed the last flag raised, which the ledger refuses ("not the
    one its call is flagged for … review that one"), every pass, and the call stayed in the
    inbox for ever (a run of 400 jobs, seed 3: 7 refusals, 1 call left for humans)."""
    import importlib
    import sys
    from types import SimpleNamespace as NS

    from toolledger.harness.chaos.harness import PLUGIN
    from toolledger.ledger.transitions import Flag

    monkeypatch.syspath_prepend(str(PLUGIN))
    roles = importlib.import_module("toolledger_chaos_roles")
    try:
        history = [NS(kind="flagged", execution_id="e1", seq=10),
                   NS(kind="flagged", execution_id="e3", seq=20),
                   NS(kind="reviewed", execution_id="e3", seq=30)]  # fmt: skip
        view = NS(operation=NS(review="both_ran"),
                  executions=[NS(execution_id=e) for e in ("e1", "e2", "e3")],
                  flags=(Flag("e1", "both_ran"),))  # fmt: skip
        op = roles.Operator.__new__(roles.Operator)
        op.scope, op.ledger = "s", NS(events=lambda scope, cid: history)
        reviewed: list[tuple[str, int | None]] = []
        op.looks_present = lambda job: True  # type: ignore[method-assign]
        op.resolve = lambda job, ex, status, why, review=False, seen=None: (  # type: ignore[method-assign]
            reviewed.append((ex.execution_id, seen)) or 1
        )
        op.review({"cid": "c"}, view)
        assert reviewed == [("e1", 30)]
        # a version whose view has no waiting flags: the last one raised, as before
        op.review({"cid": "c"}, NS(operation=view.operation, executions=view.executions))
        assert reviewed[-1] == ("e3", 30)
    finally:
        sys.modules.pop("toolledger_chaos_roles", None)


def test_report__a_fault_kind_skipped_is_in_the_markdown():
    """A kind the run could not inject at all (no partitions without root and ``ip netns``,
    no Postgres crash without a cluster of its own, no child to kill on threads) is in the
    JSON's ``fault_kinds_skipped``; the Markdown report, what a person reads, named only
    what was injected, and a run with no partition read like one that asked for none."""
    from toolledger.harness.chaos.report import markdown

    report = check(World().facts())
    full = {**report, "scope": "s", "jobs": 8, "mix": {}, "workers": 1, "concurrency": 1,
            "faults": {"zombie": 2}, "fault_kinds_skipped": ["partition", "pg_crash"],
            "fault_window_s": 1, "seed": 1, "lease_s": 1, "code": "x", "recovered_s": 1,
            "duration_s": 1, "operator": {}}  # fmt: skip
    text = markdown(full)
    assert "| partition | **skipped: this run could not inject it** | - |" in text
    assert "| pg_crash | **skipped: this run could not inject it** | - |" in text


def test_chaos_run__only_the_first_worker_stops_at_the_fence_points(tmp_path):
    """The fleet's first hit of each point where a stop meets the fence stops its process
    until the sweep revoked its execution (a prefork child's parent with it): every job hits
    them in the first seconds, so both workers of a run stood stopped for its first ~35 s, no
    call ended, and the external faults, waiting for a target, then struck a fleet that held
    nothing (seed 7, 300 jobs, 60 s: kills, partitions and crashes 0 of 3 each met an
    execution in flight). Only the first worker stops; the others' chain never fires its
    stop and shares the kill's ``first+`` marker, so the fleet still kills at every point."""
    from toolledger import failpoints
    from toolledger.harness.chaos import harness

    cfg = harness.ChaosConfig(out=tmp_path, db="postgresql://x", broker="redis://x", jobs=100,
                              progress=lambda _: None)  # fmt: skip
    run = harness.ChaosRun(cfg)
    first, other = run.worker_failpoints(0), run.worker_failpoints(1)
    for spec, stops in ((first, True), (other, False)):
        actions = failpoints.parse(spec)
        for point in harness.STOPPABLE:
            head = actions[point]
            assert head.kind == "stop"
            assert head.first is stops and (head.probability > 0 or stops) is stops
            assert head.then is not None and head.then.kind == "kill" and head.then.first
            assert head.then.index == 1  # the same marker on every worker
        assert all(actions[p].kind == "kill" and actions[p].first for p in actions
                   if p not in harness.STOPPABLE)  # fmt: skip


def test_chaos_run__a_kill_or_freeze_picks_a_worker_not_cut_off_while_there_is_one(tmp_path):
    """A worker partitioned from Postgres claims nothing (its claims time out), so a kill or
    a freeze of it meets no execution in flight: CI's run (300 jobs, 45 s) met none with its
    kills, three each, struck mostly at workers cut off or just healed. Such a fault picks a
    worker not cut off; when every one is, none (it waits for one, since 12-07: striking a
    cut one anyway met no work)."""
    from types import SimpleNamespace as NS

    from toolledger.harness.chaos import harness

    cfg = harness.ChaosConfig(out=tmp_path, db="postgresql://x", broker="redis://x", jobs=10,
                              progress=lambda _: None)  # fmt: skip
    run = harness.ChaosRun(cfg)
    workers = [NS(name=f"chaos-w{i}", pid=100 + i, alive=lambda: True, children=lambda: [],
                  kind="worker", restarts=0, log_text=lambda: "w@h ready.")
               for i in (1, 2, 3)]  # fmt: skip
    run.workers = workers  # type: ignore[assignment]
    run._busy = {w.pid: w.name for w in workers}  # each holds an execution in flight
    run.partitions = {w.name: NS(is_cut=w.name != "chaos-w2") for w in workers}  # type: ignore[misc]
    assert {run._pick("kill_child").name for _ in range(40)} == {"chaos-w2"}  # type: ignore[union-attr]
    run.partitions["chaos-w2"].is_cut = True  # type: ignore[attr-defined]
    assert run._pick("kill_child") is None


#: Database faults, and whether each explains what went wrong with an execution held then: one
#: while it was held does, one ten minutes later does not, and none does not.
DATABASE_FAULT_WHILE_HELD = (
    ([{"kind": "pg_crash", "pids": [], "target": "postgres", "t": DURING}], True),
    ([{"kind": "pg_terminate", "pids": [], "target": "postgres", "t": DURING}], True),
    ([{"kind": "pg_crash", "pids": [], "target": "postgres", "t": DURING + 600}], False),
    ([], False),
)


def test_checker__a_spooled_outcome_under_a_database_fault_is_explained():
    """An execution whose terminal write a Postgres crash or terminate kept from the ledger
    spools its outcome (the worker's own record that it could not commit), the sweep revokes
    it and settles the spool as evidence: the database fault explains that unknown. The
    spool's record names no error, and the checker failed a clean run of CI's once database
    faults struck work in flight (12-07: a pg_crash at 22.6 s, its commit spooled at 26 s).
    A spool with no database fault while it was held explains nothing."""
    name = "every unknown lines up with a fault on that execution"
    spooled = {"spool": "e-w1-1:1", "worker_id": "chaos-w1@h:101", "late_result": {},
               "status": "succeeded", "error": None}  # fmt: skip
    for faults, explained in DATABASE_FAULT_WHILE_HELD:
        w = World()
        _unknown_without_a_fault(w)
        w.event("chaos_write:w1", "e-w1-1", "evidence", **spooled)
        f = copy.copy(w.facts())
        f.faults = faults
        assert (name not in broken(f)) == explained, faults


def test_checker__a_tool_stopped_by_its_lease_lost_to_a_database_fault_is_explained():
    """A charge whose tool saw its lease lost (renewals cut by a Postgres crash) and stopped
    before sending fails by its own word, ``lease_lost``: the database fault while it was
    held explains that failure (CI, 12-07: the checker failed a clean threads-pool run on
    it). The same word with no database fault, or one long before, explains nothing."""
    for faults, explained in DATABASE_FAULT_WHILE_HELD:
        w = World()
        _a_charge_failed_for_its_lease_without_a_database_fault(w)
        f = copy.copy(w.facts())
        f.faults = faults
        assert (FAILURES not in broken(f)) == explained, faults


def test_checker__a_partition_explains_a_claim_committed_just_after_its_heal_only():
    """A claim sent while its worker was cut off committed after the heal (TCP retransmitted
    it) with the worker gone on: its unknown is the partition's, within PARTITION_TAIL_S of
    the heal; one claimed long after it is not (and never another worker's)."""
    from toolledger.harness.chaos.checker import PARTITION_TAIL_S

    name = "every unknown lines up with a fault on that execution"
    cut = 14.0
    for healed_before_claim, target, explained in (
        (2.0, "chaos-w1", True),  # 2 s after the heal, as seen in CI's runs
        (PARTITION_TAIL_S + 5.0, "chaos-w1", False),
        (2.0, "chaos-w2", False),  # another worker's cut
    ):
        w = World()
        _unknown_without_a_fault(w)
        (held,) = [e for e in w.execs if e["execution_id"] == "e-w1-1"]
        held["started_at"] = BEGAN
        t = BEGAN.timestamp() - healed_before_claim - cut
        f = copy.copy(w.facts())
        f.faults = [{"kind": "partition", "pids": [], "target": target, "t": t, "cut_s": cut}]
        assert (name not in broken(f)) is explained, (healed_before_claim, target)


def test_checker__a_database_fault_explains_a_claim_tried_through_it_only():
    """A claim tried again through a Postgres crash commits after it, its lease counted from
    the first try: no renewal came in time and it went unknown, its ``started_at`` 3 s after
    the crash ended (CI, 12-08: the checker found no fault). One claimed long after the
    crash, or with no database fault, is not explained by it."""
    from toolledger.harness.chaos.checker import CLAIM_RETRY_TAIL_S

    name = "every unknown lines up with a fault on that execution"
    for ended_before_claim, explained in ((3.0, True), (CLAIM_RETRY_TAIL_S + 5.0, False)):
        w = World()
        _unknown_without_a_fault(w)
        w.event("chaos_write:w1", "e-w1-1", "evidence", error="LeaseLost: not renewed in time")
        (held,) = [e for e in w.execs if e["execution_id"] == "e-w1-1"]
        held["started_at"] = BEGAN
        down = 1.8
        t = BEGAN.timestamp() - ended_before_claim - down
        f = copy.copy(w.facts())
        f.faults = [{"kind": "pg_crash", "pids": [], "target": "postgres", "t": t, "down_s": down}]
        assert (name not in broken(f)) is explained, ended_before_claim
