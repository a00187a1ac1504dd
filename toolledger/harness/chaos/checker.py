"""The checker: what the ledger says, against what physically happened (Jepsen-style).

Everything it judges is gathered first into ``Facts`` — the ledger's rows and events, the
files the run left in the sandbox, the landings the sandbox logged (each under its path's
lock, with the ``seq`` of the commit that made it official), the downstream service's log of
charges, the faults injected and the failpoints that fired — and each invariant is a function
of the facts alone, so that a test can hand it facts made to break exactly that invariant.
Effects and revocations are ordered by the ledger's own sequence (the ``seq`` a landing
carries is its commit's), never by comparing two machines' clocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from toolledger import jsonlines
from toolledger.harness.chaos.faults import DATABASE, KINDS
from toolledger.harness.chaos.workload import Job, Workload
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.models import execution_events, executions, operations

INBOX = ("unknown",)
#: Words in an execution's own record that say its database connection failed; they explain
#: its unknown only if a database fault (a crash, terminated backends, a partition of its
#: host) fell while it was held. A lost lease alone explains nothing: a keeper that never
#: renews, or a lease too short for the work, would explain itself (a cold review).
DB_ERRORS = ("OperationalError", "AdminShutdown", "InterfaceError", "database", "LeaseLost")
#: The run's operator's name, as its retries and resolutions record it.
OPERATOR = "chaos-operator"


@dataclass
class Invariant:
    name: str
    ok: bool
    count: int
    detail: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "violations": self.count,
            "examples": self.detail[:10],
        }


def _invariant(name: str, bad: list[str]) -> Invariant:
    return Invariant(name, not bad, len(bad), bad)


@dataclass
class Facts:
    """Everything the checker judges; built from a run (``gather``) or by hand (tests)."""

    jobs: list[Job]
    ops: dict[str, dict[str, Any]]  # key -> operation row
    execs: list[dict[str, Any]]  # execution rows
    events: list[dict[str, Any]]  # the scope's events, in seq order
    files: dict[str, str | None]  # sandbox path (in the scope) -> its final text, None: absent
    landings: list[dict[str, Any]] | None  # the sandbox's log; None: the version has none
    charges: list[dict[str, Any]]  # the downstream service's log
    faults: list[dict[str, Any]] = field(default_factory=list)
    firings: list[dict[str, Any]] = field(default_factory=list)
    #: pool children that died, as their workers logged it: pid -> each (how, Unix time or
    #: None) it died (a pid is reused: only its last death was kept, a cold review)
    deaths: dict[int, list[tuple[str, float | None]]] = field(default_factory=dict)
    #: processes a failpoint stopped: pid -> each time the harness woke it (Unix time)
    wakes: dict[int, list[float]] = field(default_factory=dict)
    stale_running: list[str] = field(default_factory=list)  # expired leases after the sweep
    verify: list[str] = field(default_factory=list)  # verify's differences
    #: files in the scope's folder at a path no job has (a stray write of anyone's)
    stray_files: list[str] = field(default_factory=list)
    #: staged effects left in the sandbox's pending area after the final settle (not set aside)
    unsettled: list[str] = field(default_factory=list)
    #: what the run's operator did (operator.log): its retries are the only manual ones
    operator: list[dict[str, Any]] = field(default_factory=list)
    _by_execution: tuple[int, dict[str | None, list[dict[str, Any]]]] | None = field(
        default=None, repr=False, compare=False
    )

    def events_of(self, execution_id: str) -> list[dict[str, Any]]:
        """The execution's events in seq order, from an index made in one pass (a scan per
        execution made a 10,000-call run's check quadratic); remade if events were added."""
        if self._by_execution is None or self._by_execution[0] != len(self.events):
            index: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
            for e in self.events:
                index[e["execution_id"]].append(e)
            self._by_execution = (len(self.events), index)
        return list(self._by_execution[1].get(execution_id, []))

    def job_of_key(self) -> dict[str, Job]:
        return {j.key: j for j in self.jobs}

    def exec_by_id(self) -> dict[str, dict[str, Any]]:
        return {e["execution_id"]: e for e in self.execs}

    def revoked_at(self, execution_id: str) -> int | None:
        """The seq of the event that revoked the execution (the sweep's ``unknown``): every
        later decision about it (a person's, a reconciler's, a late result's) is reconciled."""
        return next(
            (e["seq"] for e in self.events_of(execution_id) if e["kind"] == "unknown"), None
        )

    def own_commit(self, execution_id: str) -> dict[str, Any] | None:
        """The event of an execution's own succeeded commit (not a reconciler's), made while
        it held its claim: one after its revocation is no commit the fence allows, and makes
        nothing official (``commits_after_revocation`` names it; it was the path's truth and
        its landing legitimate here: helper-96)."""
        revoked = self.revoked_at(execution_id)
        for e in self.events_of(execution_id):
            if e["kind"] == "succeeded" and not e["detail"].get("reconciled"):
                return e if revoked is None or e["seq"] < revoked else None
        return None

    def commits_after_revocation(self) -> list[str]:
        """Executions whose own terminal write (not a reconciliation) came after the ledger
        revoked them: the compare-and-set on the claim's fence forbids it."""
        bad = []
        for ex in self.execs:
            eid = ex["execution_id"]
            revoked = self.revoked_at(eid)
            if revoked is None:
                continue
            bad += [
                f"{eid} committed its own {e['kind']} at seq {e['seq']}, after it was revoked "
                f"at seq {revoked}"
                for e in self.events_of(eid)
                if e["kind"] in ("succeeded", "failed")
                and not e["detail"].get("reconciled")
                and e["seq"] > revoked
            ]
        return bad


# ---------------------------------------------------------------------------- invariants


def one_effect_per_call(f: Facts) -> Invariant:
    """A call's effect happens at most once: each append's line at most once in its file,
    each charge at most once at the service (under any key: the service deduplicates by key,
    so a second charge of one call can only be under another), each execution's append landed
    at most once (finishing a crashed append again, ``redo``, is the same landing). A write
    may be logged twice for one landing: its line goes before the rename, and a rename that
    failed (EIO) or a crash between the two is retried by the next settle — the same bytes on
    the same path, one effect; the file and the commit order judge writes."""
    bad = []
    for job in (j for j in f.jobs if j.kind == "append"):
        n = (f.files.get(job.group) or "").splitlines(keepends=True).count(job.line)
        if n > 1:
            bad.append(f"{job.cid}: its line is in {job.group} {n} times")
    owner = {e["execution_id"]: e["idempotency_key"] for e in f.execs}
    per_call = Counter(
        owner.get(c.get("execution_id") or "", c["key"]) for c in f.charges if c["kind"] == "charge"
    )
    bad += [f"{key}: charged {n} times" for key, n in per_call.items() if n > 1]
    # each execution runs its tool once: a second request of its own, answered by the
    # service's dedupe as a replay, is the tool run twice under one claim (an append landed
    # twice by one execution failed; a charge asked twice by one passed: a cold review)
    asked = Counter(
        c["execution_id"] for c in f.charges if c["kind"] in ("charge", "replay")
        and c.get("execution_id")
    )  # fmt: skip
    bad += [f"{eid} asked the service for its charge {n} times" for eid, n in asked.items()
            if n > 1]  # fmt: skip
    bad += charges_requested_after_failed(f)
    appends = (x for x in f.landings or [] if x.get("kind") == "append" and not x.get("redo"))
    landed = Counter((x["execution_id"], x["path"]) for x in appends)
    bad += [f"{eid} landed on {path} {n} times" for (eid, path), n in landed.items() if n > 1]
    # a call's effect through two of its executions: the same bytes twice leave one file,
    # which cannot tell; the landing log can (helper-96: a revoked attempt landing after its
    # retry's was one write, twice, unseen)
    through: dict[str, set[str]] = defaultdict(set)
    for x in f.landings or []:  # (a landing without its own commit is judged apart)
        if f.own_commit(x["execution_id"]) is not None:
            through[owner.get(x["execution_id"], x["execution_id"])].add(x["execution_id"])
    bad += [
        f"{key}: its effect landed through {len(eids)} executions ({', '.join(sorted(eids))})"
        for key, eids in through.items()
        if len(eids) > 1
    ]
    return _invariant("at most one effect per call (lines, charges, landings)", bad)


def no_claim_after_proof(f: Facts) -> Invariant:
    """Proof beats permission (invariant 11): once an attempt of a call is on record as
    succeeded (its own commit, a reconciler's proof, a person's word), a later attempt not
    yet claimed is withdrawn in the same transaction, so no later attempt's claim (its
    ``running``) comes after it in the ledger's order, unless a later decision on the proven
    attempt (a review that found it failed) overturned it first. A later attempt claimed
    before the proof is the race a ``both_ran`` flag is for. Judged by nothing: a retry
    claimed after the proof, its charge a replay of the service's dedupe and its write the
    same bytes, passed every check (a cold review)."""
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ex in f.execs:
        by_key[ex["idempotency_key"]].append(ex)
    bad = []
    for key, runs in by_key.items():
        for ex in runs:
            claim = next(
                (e["seq"] for e in f.events_of(ex["execution_id"]) if e["kind"] == "running"),
                None,
            )
            if claim is None:
                continue
            for earlier in (p for p in runs if p["attempt"] < ex["attempt"]):
                decided = [
                    e
                    for e in f.events_of(earlier["execution_id"])
                    if e["kind"] in ("succeeded", "failed", "unknown") and e["seq"] < claim
                ]
                if decided and decided[-1]["kind"] == "succeeded":
                    bad.append(f"{key} attempt {ex['attempt']}: {ex['execution_id']} claimed at "
                               f"seq {claim}, after attempt {earlier['attempt']} was recorded "
                               f"succeeded at seq {decided[-1]['seq']}")  # fmt: skip
    return _invariant("no attempt is claimed after an earlier one was proven succeeded", bad)


def charges_requested_again(f: Facts) -> int:
    """Charge calls whose charge the service was asked for more than once (its first
    request, and replays it answered with the first receipt, by any execution): the figure
    the baseline counts as its duplicate charges, counted the same way (a service without the
    deduplication by key would have charged each twice)."""
    asked = Counter(c["key"] for c in f.charges if c["kind"] in ("charge", "replay"))
    return sum(1 for j in f.jobs if j.kind == "charge" and asked[j.key] > 1)


def charges_requested_after_failed(f: Facts) -> list[str]:
    """A charge asked for again (a replay) by another execution of its call than the one that
    charged, where the ledger records the charging one failed: it said the effect did not
    happen, authorised another attempt on that word, and the tool ran again, its second
    request hidden by the service's deduplication (never judged: a cold review). The charging
    one proven not applied is judged by "nothing proven not applied took effect"; one that
    went unknown and was retried while its request was on its way is the race the service's
    key is for (counted, ``charges_requested_again``)."""
    status = {e["execution_id"]: e for e in f.execs}
    charged_by = {c["key"]: c.get("execution_id") for c in f.charges if c["kind"] == "charge"}
    bad = []
    for c in (c for c in f.charges if c["kind"] == "replay"):
        first = status.get(charged_by.get(c["key"]) or "")
        if first is None or c.get("execution_id") == first["execution_id"]:
            continue
        result = first.get("result") if isinstance(first.get("result"), dict) else {}
        if first["status"] == "failed" and (result or {}).get("error") != "not_applied":
            bad.append(f"{c['key']}: charged by {first['execution_id']}, which the ledger "
                       f"records failed, and asked again by {c.get('execution_id')}")  # fmt: skip
    return bad


def only_the_calls_effects(f: Facts) -> Invariant:
    """The world holds nothing no call asked for: every line of an append log is one call's
    whole line (no torn, glued or foreign line), every file one of its calls' bytes, every
    charge one call's, with that call's terms, made by one of its executions."""
    bad = []
    lines_of: dict[str, set[str]] = defaultdict(set)
    bytes_of: dict[str, set[str]] = defaultdict(set)
    for job in f.jobs:
        if job.kind == "append":
            lines_of[job.group].add(job.line)
        elif "path" in job.args:
            bytes_of[job.args["path"]].add(job.args["content"])
    for path, lines in lines_of.items():
        for n, line in enumerate((f.files.get(path) or "").splitlines(keepends=True), 1):
            if line not in lines:
                bad.append(f"{path} line {n}: {line[:80]!r} is no call's line")
    for path, contents in bytes_of.items():
        found = f.files.get(path)
        if found is not None and found not in contents:
            bad.append(f"{path}: holds {found[:80]!r}, which no call on it wrote")
    bad += [f"{path}: a file no call writes" for path in f.stray_files]
    jobs, owner = f.job_of_key(), {e["execution_id"]: e["idempotency_key"] for e in f.execs}
    for landing in f.landings or []:  # what the log says landed is what its call does
        writer = jobs.get(owner.get(landing["execution_id"], ""))
        if writer is None or writer.kind == "charge":
            bad.append(f"{landing['execution_id']} landed on {landing['path']}: no call's write")
            continue
        kind = "append" if writer.kind == "append" else "write"
        if (landing["path"], landing.get("kind")) != (writer.args["path"], kind):
            bad.append(f"{writer.cid}: landed as {landing.get('kind')} on {landing['path']}, "
                       f"its call is a {kind} on {writer.args['path']}")  # fmt: skip
        if landing.get("redo") and kind != "append":
            bad.append(f"{writer.cid}: a write landed again as an append finished again (redo)")
        digest = hashlib.sha256(writer.args["content"].encode("utf-8")).hexdigest()
        # every version that logs landings logs their digest: one without it told nothing
        # of the bytes, and passed (a cold review)
        if landing.get("sha256") != digest:
            found = str(landing.get("sha256"))[:12]
            bad.append(f"{writer.cid}: landed bytes ({found}) not its call's")
    made = defaultdict(set)  # each chaos tool makes one effect: its stage's n is 0
    for landing in f.landings or []:
        made[landing["execution_id"]].add(landing.get("n", 0))
    bad += [f"{eid} landed {len(ns)} effects; its call makes one" for eid, ns in made.items()
            if len(ns) > 1]  # fmt: skip
    for c in (c for c in f.charges if c["kind"] == "charge"):
        charged = jobs.get(c["key"])
        terms = c.get("receipt") or {}
        if charged is None or charged.kind != "charge":
            bad.append(f"a charge under {c['key']!r}, which no call has")
        elif owner.get(c.get("execution_id") or "") != charged.key:
            bad.append(f"{charged.cid}: charged by {c.get('execution_id')}, not its execution")
        elif (terms.get("account"), terms.get("cents")) != (
            charged.args["account"],
            charged.args["cents"],
        ):
            bad.append(f"{charged.cid}: charged {terms}, not its terms")
    return _invariant("the world holds only the calls' own effects", bad)


def succeeded_effects_present(f: Facts) -> Invariant:
    """Every call the ledger says succeeded (and no human was asked to review) has its effect
    in the world: a write's file holds its bytes, an append's line is in its log, a charge is
    at the service. Where landings are logged, each write or append whose own execution
    committed has its landing: a log that records none measures nothing. (A shared path is
    judged by its last success: an older write on it may be overwritten or set aside.)"""
    bad = []
    ran_by = defaultdict(list)
    for e in f.execs:
        ran_by[e["idempotency_key"]].append(e["execution_id"])
    landed = {x["execution_id"] for x in f.landings or []}
    for job in f.jobs:
        op = f.ops.get(job.key)
        if op is None or op["status"] != "succeeded" or op.get("review"):
            continue
        if job.kind != "shared" and not _effect_present(f, job):
            bad.append(f"{job.cid} ({job.kind}): the ledger says succeeded, its effect is absent")
        if f.landings is None or job.kind not in ("write", "append"):
            continue
        for eid in ran_by[job.key]:
            if f.own_commit(eid) is not None and eid not in landed:
                bad.append(f"{job.cid}: {eid} committed, no landing of it was logged")
    return _invariant("every succeeded call's effect is in the world", bad)


def no_effect_after_revocation(f: Facts) -> Invariant:
    """Every landing is of an execution whose own commit made it official, with that commit's
    seq; and on each path, effects land in commit order (an older write or append never after
    a newer one; an append finished again after a crash, ``redo``, is the same landing)."""
    if f.landings is None:  # an older version: nothing to judge by (reported as not measured)
        return Invariant("no effect of a revoked execution lands", True, 0, ["not measured"])
    bad = f.commits_after_revocation()
    for landing in f.landings:
        commit = f.own_commit(landing["execution_id"])
        if commit is None or commit["seq"] != landing["seq"]:
            revoked = f.revoked_at(landing["execution_id"])
            bad.append(
                f"{landing['execution_id']} landed on {landing['path']} with seq {landing['seq']}"
                f" but its own commit is {commit and commit['seq']} (revoked at {revoked})"
            )
    bad += out_of_commit_order(f.landings)
    bad += appends_out_of_commit_order_in_files(f)
    bad += effects_without_a_landing(f)
    return _invariant("no effect of a revoked execution lands", bad)


def effects_without_a_landing(f: Facts) -> list[str]:
    """Each call's effect that is in the world (a write's bytes on its path, an append's line
    in its log) with no logged landing of an execution of that call whose own commit made it
    official: only the commit-to-landing direction was judged, and an effect only a revoked
    execution could have made, landed past the log, passed (a cold review). What it cannot
    tell: a revoked attempt's bytes from its retry's, the same bytes, where the retry landed."""
    ran_by: dict[str, set[str]] = defaultdict(set)
    for ex in f.execs:
        ran_by[ex["idempotency_key"]].add(ex["execution_id"])
    landed = {x["execution_id"] for x in f.landings or [] if f.own_commit(x["execution_id"])}
    bad = []
    for job in (j for j in f.jobs if j.kind != "charge"):
        path = job.args["path"]
        if job.kind == "append":
            there = job.line in (f.files.get(path) or "").splitlines(keepends=True)
        else:
            there = f.files.get(path) == job.args["content"]
        if there and not ran_by[job.key] & landed:
            bad.append(f"{job.cid}: its effect is in {path}, and no landing of a committed "
                       "execution of it was logged")  # fmt: skip
    return bad


def inversions(seqs: Sequence[int]) -> list[tuple[int, int]]:
    """Each place in ``seqs`` (commits' seqs, in the order their effects landed or stand in a
    file) where one committed later comes first: (the later, the earlier)."""
    return [(a, b) for a, b in itertools.pairwise(seqs) if b < a]


def out_of_commit_order(landings: Iterable[dict[str, Any]]) -> list[str]:
    """On each path (of its scope), every effect that landed after one committed later; an
    append finished again after a crash (``redo``) is the same landing, not another, but the
    only one logged of it (a crash before its first line) is its landing (it was skipped, and
    a landing out of order with it: helper-96)."""
    per_path: dict[tuple[str, str], list[int]] = defaultdict(list)
    seen: set[tuple[str, str, str | None]] = set()
    for landing in landings:  # in the order they landed (each logged under its path's lock)
        where = (landing.get("scope", ""), landing["path"])
        eid = landing.get("execution_id")
        if landing.get("redo") and (*where, eid) in seen:
            continue
        seen.add((*where, eid))
        per_path[where].append(landing["seq"])
    return [
        f"{path}: seq {b} landed after seq {a}"
        for (_, path), seqs in per_path.items()
        for a, b in inversions(seqs)
    ]


def appends_out_of_commit_order_in_files(f: Facts) -> list[str]:
    """Each append log's lines, as they stand in the file, in the order of their calls'
    commits: the landing log says in what order the lander wrote, the file what the world
    holds (lines of calls without an own commit are judged elsewhere)."""
    ran_by: dict[str, list[str]] = defaultdict(list)
    for ex in f.execs:
        ran_by[ex["idempotency_key"]].append(ex["execution_id"])
    by_line: dict[tuple[str, str], int] = {}
    for job in (j for j in f.jobs if j.kind == "append"):
        for eid in ran_by[job.key]:
            commit = f.own_commit(eid)
            if commit is not None:
                by_line[(job.group, job.line)] = commit["seq"]
    bad = []
    for path in sorted({j.group for j in f.jobs if j.kind == "append"}):
        # each line at its first place (a second copy is a duplicate, judged as one)
        lines = dict.fromkeys((f.files.get(path) or "").splitlines(keepends=True))
        seqs = [by_line[(path, line)] for line in lines if (path, line) in by_line]
        bad += [f"{path}: the line of seq {b} stands after seq {a}" for a, b in inversions(seqs)]
    return bad


def shared_paths_match_the_ledger(f: Facts) -> Invariant:
    """Each shared path holds what the last call the ledger says succeeded on it wrote: last
    by its own commit where landings are logged (effects land in that order; a reconciler's
    success writes nothing, and one recorded after a newer write's commit named that older
    call the path's truth: a cold review), by any success where they are not (an older
    version). A path whose last success waits for a human's review (its bytes could not
    land: ``not_landed``) is the human's to judge."""
    by_key = f.job_of_key()
    succeeded_at: dict[str, tuple[int, str, str]] = {}  # path -> (seq, content, key)
    for e in f.events:
        job = by_key.get(e["idempotency_key"])
        if job is None or job.kind != "shared" or e["kind"] != "succeeded":
            continue
        if f.landings is not None and e["detail"].get("reconciled"):
            continue
        if f.landings is not None and f.own_commit(e["execution_id"]) is not e:
            continue  # a commit after its revocation makes nothing official (judged apart)
        if e["seq"] > succeeded_at.get(job.group, (0, "", ""))[0]:
            succeeded_at[job.group] = (e["seq"], job.args["content"], job.key)
    bad = []
    for path in {j.group for j in f.jobs if j.kind == "shared"}:
        _, expected, key = succeeded_at.get(path, (0, None, ""))
        if key and (f.ops.get(key) or {}).get("review") == "not_landed":
            continue
        found = f.files.get(path)
        if expected is not None and found != expected:
            bad.append(f"{path}: holds {found!r}, the ledger's last success wrote {expected!r}")
        if expected is None and found is not None:
            bad.append(f"{path}: holds {found!r} though no call on it succeeded")
    return _invariant("every shared path holds its last succeeded write", bad)


def effects_never_hidden(f: Facts) -> Invariant:
    """A call whose effect is in the world ends succeeded, or waits in the humans' inbox;
    never failed, rejected or anything else that tells the model it did not happen."""
    bad = []
    for job in f.jobs:
        op = f.ops.get(job.key)
        if op is None or not _effect_present(f, job):
            continue
        if op["status"] != "succeeded" and op["status"] not in INBOX and not op.get("review"):
            bad.append(
                f"{job.cid} ({job.kind}): its effect is there, the ledger says {op['status']}"
            )
    return _invariant("no effect hides behind failed, rejected or a pending retry", bad)


def reviews_explained(f: Facts) -> Invariant:
    """Every call waiting for a human's review lines up with a cause, and what its flag says
    holds in the world: its flag is on record; a ``both_ran`` or ``contradicted`` flag is on an
    execution that went unknown for a fault on it (the decisions they contradict are made on
    revoked executions only), and a ``both_ran`` call's effect is there (the proof found it);
    a ``not_landed`` one's path was made unsafe (a link or a file in its way, which no chaos
    fault makes, itself judged a foreign file): else its effect is simply lost. A flag exempted
    its call from every world check, and needed no cause (a cold review: a ``not_landed`` write
    whose file was absent and a ``both_ran`` charge never made both passed)."""
    jobs, execs = f.job_of_key(), f.exec_by_id()
    bad = []
    for key, op in f.ops.items():
        reason = op.get("review")
        if not reason:
            continue
        job = jobs.get(key)
        cid = job.cid if job is not None else key
        flags = [
            e
            for e in f.events
            if e["idempotency_key"] == key
            and e["kind"] == "flagged"
            and e["detail"].get("reason") == reason
        ]
        if not flags:
            bad.append(f"{cid}: flagged {reason}, with no flag of it on record")
        for flag in flags:
            ex = execs.get(flag["execution_id"] or "")
            if ex is None:
                bad.append(f"{cid}: flagged {reason} on {flag['execution_id']}, no execution")
            elif reason == "not_landed":
                path = (job.args.get("path") if job is not None else None) or ""
                if not _made_unsafe(f, path):
                    bad.append(f"{cid}: flagged not_landed, but nothing made {path} unsafe: "
                               "its effect is lost")  # fmt: skip
            else:
                went = next((e for e in f.events_of(ex["execution_id"]) if e["kind"] == "unknown"),
                            None)  # fmt: skip
                if went is None or _cause(f, ex, went) is None:
                    bad.append(f"{cid}: flagged {reason} on {ex['execution_id']}, which no "
                               "fault on it explains")  # fmt: skip
        if reason == "both_ran" and job is not None and not _effect_present(f, job):
            bad.append(f"{cid}: flagged both_ran, its effect is absent")
    return _invariant("every flag for review lines up with a fault and holds in the world", bad)


def _made_unsafe(f: Facts, path: str) -> bool:
    """Whether something no call wrote stands at ``path`` or under it (a link, a folder)."""
    for stray in f.stray_files:
        name = stray.split(" (", 1)[0]
        if path and (name == path or name.endswith("/" + path) or name.startswith(path + "/")):
            return True
    return False


def _effect_present(f: Facts, job: Job) -> bool:
    if job.kind == "append":
        return job.line in (f.files.get(job.group) or "").splitlines(keepends=True)
    if job.kind == "charge":
        return any(c["kind"] == "charge" and c["key"] == job.key for c in f.charges)
    if job.kind == "write":
        return bool(f.files.get(job.args["path"]) == job.args["content"])
    if f.landings is not None:  # shared: its landing, if the version logs them
        ids = {e["execution_id"] for e in f.execs if e["idempotency_key"] == job.key}
        return any(x["execution_id"] in ids for x in f.landings)
    return False


#: Failpoint actions that hold up the whole process, not only the execution that hit them
#: (a threads pool's process holds several): it ends, or it stops until woken.
PROCESS_ENDING = ("kill", "exit", "stop")


def _while_held(t: float | None, began: Any, went_unknown: Any, lasted: float = 0.0) -> bool:
    """Whether something at Unix time ``t`` lasting ``lasted`` seconds overlapped the time
    the execution was held: after its claim, before it was declared unknown (one second of
    slack each side for the clocks' rounding). Without the times it explains nothing."""
    if t is None or began is None or went_unknown is None:
        return False
    return bool(began.timestamp() - 1.0 <= t + lasted and t <= went_unknown.timestamp() + 1.0)


#: How long after a partition heals its worker's statements may still commit: one sent while
#: cut off reaches Postgres after the heal (TCP retransmits it) and commits there, a claim its
#: worker had given up on (its connection timed out), the execution then held by no executor
#: until its lease expired. Its ``started_at`` fell 0.3-2 s after the heal (3 runs of 23 on a
#: loaded machine, 12-07), outside the cut, and its unknown was explained by nothing.
PARTITION_TAIL_S = 5.0
#: How long after a database fault ends an execution's claim may still commit: the claim is
#: tried again through the fault, and its lease is counted from the first try, so a claim
#: committed 3 s after a Postgres crash, its lease spent on the tries, went unknown with no
#: renewal in time, outside the crash by its ``started_at`` (CI, 12-08).
CLAIM_RETRY_TAIL_S = 5.0


def _fault_held(fault: dict[str, Any], ex: dict[str, Any], unknown: dict[str, Any]) -> bool:
    kind = KINDS.get(fault["kind"])
    lasted = float(fault.get(kind.lasts, 0.0) or 0.0) if kind and kind.lasts else 0.0
    if fault["kind"] == "partition":
        lasted += PARTITION_TAIL_S
    elif fault["kind"] in DATABASE:
        lasted += CLAIM_RETRY_TAIL_S
    return _while_held(fault.get("t"), ex.get("started_at"), unknown.get("at"), lasted)


def _stop_lasted(f: Facts, firing: dict[str, Any]) -> float:
    """How long a ``stop`` firing held its process: to the harness's next wake of it (0: an
    instant, for any other action or a stop never woken). A threads worker's thread that took
    its claim's time, then was stopped with the process by another thread's failpoint, sends
    the claim when woken, 15 s after the firing: its claim lost at once to its own lease's
    clock, its unknown was explained by nothing (a threads run at load 12, 12-07)."""
    t = firing.get("t")
    if firing.get("action") != "stop" or t is None:
        return 0.0
    woke = [w for w in f.wakes.get(firing.get("pid") or 0, []) if w >= t]
    return min(woke) - t if woke else 0.0


def _wakes(woken: list[dict[str, Any]]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = defaultdict(list)
    for w in woken:
        if isinstance(w.get("pid"), int) and isinstance(w.get("woke"), int | float):
            out[w["pid"]].append(float(w["woke"]))
    return dict(out)


def unknowns_explained(f: Facts) -> tuple[Invariant, Counter[str]]:
    """Every execution that went unknown lines up with a fault on that very execution: a
    failpoint that fired on it or ended its process (a threads pool's process holds several),
    a kill or freeze of its worker process, a partition of its worker, or its own record of
    losing the database."""
    reasons: Counter[str] = Counter()
    bad = []
    for ex in f.execs:
        went = [e for e in f.events_of(ex["execution_id"]) if e["kind"] == "unknown"]
        if not went:
            continue
        early = _before_its_lease_expired(ex, went[0])
        if early:
            bad.append(f"{ex['execution_id']} ({ex['idempotency_key']}) {early}")
        cause = _cause(f, ex, went[0])
        if cause is None:
            bad.append(f"{ex['execution_id']} ({ex['idempotency_key']}) by {ex['worker_id']}")
        else:
            reasons[cause] += 1
    return _invariant("every unknown lines up with a fault on that execution", bad), reasons


def _before_its_lease_expired(ex: dict[str, Any], unknown: dict[str, Any]) -> str | None:
    """Invariant 6: the sweep marks a ``running`` unknown for an expired lease only once the
    lease expired by the database clock (its event's ``at`` and the lease it records are both
    the database's): one earlier revoked a live executor (judged by nothing: a cold review).
    A worker that marks its own execution unknown says so by another reason."""
    if unknown["detail"].get("reason") != "lease expired":
        return None
    expired = _utc(unknown["detail"].get("lease_expired_at") or ex.get("lease_expires_at"))
    at = _utc(unknown.get("at"))
    if expired is None or at is None or at >= expired:
        return None
    return f"marked unknown for an expired lease at {at.isoformat()}, its lease expired at " \
        f"{expired.isoformat()}"  # fmt: skip


def _utc(when: Any) -> datetime | None:
    if isinstance(when, str):
        try:
            when = datetime.fromisoformat(when)
        except ValueError:
            return None
    if not isinstance(when, datetime):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _cause(f: Facts, ex: dict[str, Any], unknown: dict[str, Any]) -> str | None:
    eid = ex["execution_id"]
    for fp in f.firings:  # while it was held: one an hour later explained it (a cold review)
        if fp.get("ref") == eid and _while_held(
            fp.get("t"), ex.get("started_at"), unknown.get("at")
        ):
            return f"failpoint {fp['point']}"
    pid, host = _pid(ex["worker_id"]), _host(ex["worker_id"])
    for fp in f.firings:  # one that ended the process ended every execution it held (threads)
        if (
            pid is not None
            and fp.get("pid") == pid
            and fp.get("action") in PROCESS_ENDING
            and _while_held(
                fp.get("t"), ex.get("started_at"), unknown.get("at"), _stop_lasted(f, fp)
            )
        ):
            return f"failpoint {fp['point']} ended its process"
    held = [fault for fault in f.faults if _fault_held(fault, ex, unknown)]
    for fault in held:
        kind = KINDS.get(fault["kind"])
        blames = kind.blames if kind else None
        if blames and (
            pid in fault["pids"] or (blames == "pid_or_host" and host == fault["target"])
        ):
            return str(fault["kind"])
    own = " ".join(
        json.dumps(e["detail"]) for e in f.events_of(eid) if e["kind"] in ("unknown", "evidence")
    )
    db_fault = any(  # every execution's, or (a partition) its host's
        x["kind"] in DATABASE and (KINDS[x["kind"]].blames is None or host == x["target"])
        for x in held
    )
    if db_fault and any(word in own for word in DB_ERRORS):
        return "its own database connection failed"
    # a tool that saw its lease lost and stopped before its effect (failed, by its own word):
    # the renewals a database fault cut (CI, 12-07: a charge failed under a Postgres crash)
    result = ex.get("result")
    if db_fault and isinstance(result, dict) and result.get("lease_lost") is True:
        return "its lease was lost to a database fault"
    # its outcome spooled: the worker's own record that its terminal write could not reach
    # the ledger (the spool names no error; a database fault met its commit in CI, 12-07)
    spooled = any(
        e["kind"] == "evidence"
        and e["detail"].get("spool")
        and e["detail"].get("worker_id") == ex["worker_id"]
        for e in f.events_of(eid)
    )
    if db_fault and spooled:
        return "its own database connection failed"
    for how, died in f.deaths.get(pid, []) if pid is not None else []:
        # e.g. killed by Celery's hard time limit after a stalled fsync; at any time, every
        # kill_child's logged death explained any unknown of that pid, and a crash (exitcode
        # 1: no fault, no time limit) explained itself (a cold review)
        if how.startswith("signal") and _while_held(died, ex.get("started_at"), unknown.get("at")):
            return f"worker process died ({how})"
    return None


def automatic_retries_proven(f: Facts) -> Invariant:
    """Every automatic retry followed its earlier attempt's revocation and the proof that its
    effect was absent (the reconciler's word), in that order; and every later attempt is one
    of these or a retry the run's operator asked for (one that calls itself neither, or names
    an attempt other than the one before it, was judged by nothing: a cold review)."""
    execs = f.exec_by_id()
    asked = Counter((a["cid"], a.get("attempt")) for a in f.operator if a.get("action") == "retry")
    cid_of = {j.key: j.cid for j in f.jobs}
    bad = []
    for e in f.events:
        attempt = e["detail"].get("attempt")
        if e["kind"] != "approved" or not isinstance(attempt, int) or attempt < 2:
            continue
        if not e["detail"].get("automatic"):
            # the operator logs a retry once it returned: one whose commit's answer a database
            # fault lost is its own all the same (its name is the approval's actor)
            mine = e.get("actor") == OPERATOR
            if not mine and not asked[(cid_of.get(e["idempotency_key"]), attempt)]:
                who = e.get("actor")
                bad.append(f"{e['idempotency_key']} attempt {attempt}: approved by {who}, "
                           "neither automatic nor the operator's retry")  # fmt: skip
            # a person retries a call unknown or failed only: the attempt before it ended or
            # was revoked first. A retry while it still ran let two attempts live at once, a
            # charge's second request hidden by the service's dedupe; only automatic retries
            # were judged against it (a cold review). (One after a success, claimed, is
            # judged by "no attempt is claimed after an earlier one was proven succeeded".)
            if _last_decision(f, e["idempotency_key"], attempt - 1, e["seq"]) == "running":
                bad.append(f"{e['idempotency_key']} attempt {attempt}: retried while attempt "
                           f"{attempt - 1} still ran (neither unknown nor failed)")  # fmt: skip
            continue
        before = e["detail"].get("after")
        ex = execs.get(before or "")
        if (
            ex is None
            or ex["idempotency_key"] != e["idempotency_key"]
            or (ex["attempt"] != attempt - 1)
        ):
            bad.append(f"{e['idempotency_key']} attempt {attempt}: after {before}, "
                       "not the attempt before it")  # fmt: skip
            continue
        history = f.events_of(before)
        revoked = [h["seq"] for h in history if h["kind"] == "unknown" and h["seq"] < e["seq"]]
        proven = [
            h["seq"]
            for h in history
            if h["kind"] == "failed"
            and h["detail"].get("result", {}).get("error") == "not_applied"
            and "reconciler" in h["detail"].get("evidence", {})
            and h["seq"] < e["seq"]
        ]
        if not (revoked and proven and revoked[0] < proven[0]):
            bad.append(f"{e['idempotency_key']} attempt {attempt}: "
                       f"revoked {revoked}, proven absent {proven}")  # fmt: skip
    # an attempt no approval authorised at all: only approvals were walked (a cold review)
    approved = {
        (e["idempotency_key"], e["detail"].get("attempt"))
        for e in f.events
        if e["kind"] == "approved"
    }
    bad += [
        f"{ex['idempotency_key']} attempt {ex['attempt']}: {ex['execution_id']} ran, no "
        "approval of that attempt is on record"
        for ex in f.execs
        if ex["attempt"] >= 2 and (ex["idempotency_key"], ex["attempt"]) not in approved
    ]
    return _invariant("automatic retries only after revocation and proof of absence", bad)


def _last_decision(f: Facts, key: str, attempt: int, seq: int) -> str:
    """What the ledger had last recorded of ``key``'s ``attempt`` before ``seq``: its last
    ``succeeded``, ``failed`` or ``unknown``, ``running`` if none yet, ``unclaimed`` if it
    has no execution."""
    ex = next((x for x in f.execs if x["idempotency_key"] == key and x["attempt"] == attempt), None)
    if ex is None:
        return "unclaimed"
    decided = [
        e["kind"]
        for e in f.events_of(ex["execution_id"])
        if e["kind"] in ("succeeded", "failed", "unknown") and e["seq"] < seq
    ]
    return decided[-1] if decided else "running"


def receipts_match_the_world(f: Facts) -> Invariant:
    """The receipt of every call the ledger says succeeded (no human asked to review it) says
    what its call did: a write's path, size and SHA-256 are its content's, an append's path
    and size its line's, a charge's receipt the one the service gave under the call's key.
    A receipt naming another file, other bytes or another charge passed every other check (a
    cold review). A person's resolution records their words, not a tool's result: not
    judged here."""
    bad = []
    for job in f.jobs:
        op = f.ops.get(job.key)
        if op is None or op["status"] != "succeeded" or op.get("review"):
            continue
        ran = [e for e in f.execs if e["idempotency_key"] == job.key]
        done = [e for e in ran if e["status"] == "succeeded"]
        # the receipt is the authorised attempt's (a withdrawal may leave a later attempt
        # succeeded too: judging the highest let a wrong receipt pass, a cold review)
        current = [e for e in done if e["attempt"] == op.get("authorized_attempts")]
        if not done:
            bad.append(f"{job.cid}: succeeded, with no succeeded execution")
            continue
        receipt = (current or [max(done, key=lambda e: e["attempt"])])[0]
        decided = [e for e in f.events_of(receipt["execution_id"]) if e["kind"] == "succeeded"]
        if decided and (decided[-1]["detail"].get("evidence") or {}).get("kind") == "human":
            continue  # a person's words, not a tool's result (as the ledger tells it)
        wrong = _receipt_wrong(f, job, receipt.get("result"))
        if wrong:
            bad.append(f"{job.cid}: its receipt {wrong}")
    return _invariant("every receipt says what its call did", bad)


def _receipt_wrong(f: Facts, job: Job, result: Any) -> str | None:
    if not isinstance(result, dict):
        return f"is {result!r}, no result"
    if job.kind == "charge":
        given = [c["receipt"] for c in f.charges if c["kind"] == "charge" and c["key"] == job.key]
        if given and result != given[0]:
            return f"is {result}, the service charged {given[0]}"
        return None
    data = job.args["content"].encode("utf-8")
    if job.kind == "append":
        expected: dict[str, Any] = {"path": job.args["path"], "bytes_appended": len(data)}
    else:
        digest = hashlib.sha256(data).hexdigest()
        expected = {"path": job.args["path"], "bytes_written": len(data), "sha256": digest}
    if {k: result.get(k) for k in expected} != expected:
        return f"is {result}, its call's effect is {expected}"
    return None


def nothing_proven_absent_took_effect(f: Facts) -> Invariant:
    """An execution the ledger records as not applied (its effect proven absent: the fence,
    the reconciler's word, its executor's record that it never started) has no effect in the
    world: no charge made by it, no landing of it. Such a proof allows a retry without a
    duplicate accepted, and a charge by that very execution was judged by nothing (a cold
    review)."""
    absent = {
        e["execution_id"]
        for e in f.execs
        if e["status"] == "failed"
        and isinstance(e.get("result"), dict)
        and e["result"].get("error") == "not_applied"
    }
    bad = [
        f"{c['key']}: charged by {c['execution_id']}, which the ledger proved not applied"
        for c in f.charges  # a request answered as a replay is one all the same
        if c["kind"] in ("charge", "replay") and c.get("execution_id") in absent
    ]
    bad += [
        f"{x['execution_id']} landed on {x['path']}, which the ledger proved not applied"
        for x in f.landings or []
        if x["execution_id"] in absent
    ]
    return _invariant("nothing proven not applied took effect", bad)


def failures_explained(f: Facts) -> Invariant:
    """Every execution that failed by its own record lines up with a fault on it, as every
    unknown must: a run in which every call failed (a tool broken) passed every other
    invariant, nothing duplicated, nothing hidden, and the chaos run exited 0 (a cold review).
    Judged elsewhere or explained by what came before: one revoked first (its unknown is
    judged), and an automatic retry that found the world moved on (``superseded``: its
    predecessor's unknown is judged). A call rejected, or failed with no execution, is a
    failure no execution explains: the run's agent submits every call approved, so nothing in
    it rejects, and a call fails by running (both were judged by nothing: a cold review)."""
    ran = {e["idempotency_key"] for e in f.execs}
    bad = [
        f"{key}: {op['status']}, with no execution" if op["status"] == "failed" else
        f"{key}: rejected, though every call of the run is submitted approved"
        for key, op in f.ops.items()
        if op["status"] == "rejected" or (op["status"] == "failed" and key not in ran)
    ]  # fmt: skip
    automatic = {
        (e["idempotency_key"], e["detail"].get("attempt"))
        for e in f.events
        if e["kind"] == "approved" and e["detail"].get("automatic")
    }
    for ex in f.execs:
        history = f.events_of(ex["execution_id"])
        if ex["status"] != "failed" or any(e["kind"] == "unknown" for e in history):
            continue
        result: dict[str, Any] = ex["result"] if isinstance(ex.get("result"), dict) else {}
        if (
            result.get("error") == "superseded"
            and (ex["idempotency_key"], ex["attempt"]) in automatic
        ):
            continue
        failed = next((e for e in history if e["kind"] == "failed"), {})
        if _cause(f, ex, failed) is None:
            bad.append(f"{ex['execution_id']} ({ex['idempotency_key']}) failed: "
                       f"{str(result.get('error'))[:60]}")  # fmt: skip
    return _invariant("every failure lines up with a fault on that execution", bad)


def every_call_ended(f: Facts) -> tuple[Invariant, int, int]:
    missing = [j.key for j in f.jobs if j.key not in f.ops]
    lost = [k for k, op in f.ops.items() if op["status"] in ("approved", "pending_approval")]
    stuck = [k for k, op in f.ops.items() if op["status"] == "running"] + f.stale_running
    bad = [f"{k}: not recorded" for k in missing] + [f"{k}: {f.ops[k]['status']}" for k in lost]
    bad += [f"{k}: running" for k in stuck]
    bad += [f"{name}: staged, never settled" for name in f.unsettled]
    inv = _invariant("every call ends: succeeded, failed, rejected, or unknown for a human", bad)
    return inv, len(missing) + len(lost), len(stuck) + len(f.unsettled)


INVARIANTS: list[Callable[[Facts], Invariant]] = [
    one_effect_per_call,
    no_effect_after_revocation,
    shared_paths_match_the_ledger,
    effects_never_hidden,
    automatic_retries_proven,
    succeeded_effects_present,
    only_the_calls_effects,
    receipts_match_the_world,
    nothing_proven_absent_took_effect,
    failures_explained,
    reviews_explained,
    no_claim_after_proof,
]


def check(f: Facts) -> dict[str, Any]:
    dup, after, shared, hidden, auto, absent, foreign, receipts, proven, work, flags, proof = (
        fn(f) for fn in INVARIANTS
    )
    ended, lost, stuck = every_call_ended(f)
    explained, reasons = unknowns_explained(f)
    verified = _invariant("verify: events rebuild state exactly", f.verify)
    invariants = [dup, after, shared, hidden, auto, absent, foreign, receipts, proven, work,
                  flags, proof, ended, explained, verified]  # fmt: skip
    statuses = Counter(op["status"] for op in f.ops.values())
    inbox = [k for k, op in f.ops.items() if op["status"] in INBOX or op.get("review")]
    return {
        "duplicates": dup.count,
        # None: this version logs no landings, so the check could not be made
        "effects_after_revocation": after.count if f.landings is not None else None,
        "shared_path_mismatches": shared.count,
        "hidden_effects": hidden.count,
        "absent_effects": absent.count,
        "foreign_effects": foreign.count,
        "wrong_receipts": receipts.count,
        "proven_absent_effects": proven.count,
        "unexplained_flags": flags.count,
        # a second request of a charged call, answered by the service's own deduplication
        "charge_replays": sum(1 for c in f.charges if c["kind"] == "replay"),
        # counted as the baseline counts its duplicate charges: asked for more than once
        "charges_requested_again": charges_requested_again(f),
        "lost": lost,
        "stuck": stuck,
        "verify_ok": verified.ok,
        "unknown": {"count": statuses.get("unknown", 0), "reasons": dict(reasons)},
        "inbox": {
            "count": len(inbox),
            "share": round(len(inbox) / max(1, len(f.jobs)), 4),
            "calls": [_inbox_reason(f, k) for k in inbox][:50],
        },
        "statuses": dict(statuses),
        "reconciled": sum(1 for e in f.execs if e["reconciled"]),
        "auto_retries": sum(
            1 for e in f.events if e["kind"] == "approved" and e["detail"].get("automatic")
        ),
        "executions": len(f.execs),
        "fenced": fenced(f),
        # per fault kind: its faults that struck an execution in flight they could cut off
        "faults_met_work": faults_met_work(f),
        "landings": None if f.landings is None else len(f.landings),
        "invariants": [i.to_json() for i in invariants],
        "ok": all(i.ok for i in invariants),
    }


def faults_met_work(f: Facts) -> dict[str, int | None]:
    """Per fault kind, how many of its faults struck while an execution they could cut off
    was held (claimed, not yet ended, by the ledger's record of both): a kind of a process's
    (a kill, a freeze, a cut) on one its pids held, a partition on one its host held, a
    database's on any; the broker's kinds (a flush, a duplicate publication) are not
    measured (None). A fault that met nothing in flight tested nothing: a run's report said
    only how many were injected, and in one of 400 jobs every kill, freeze, crash and
    terminate struck workers that held nothing (a cold review)."""
    ends: dict[str, datetime | None] = {}
    for ex in f.execs:
        last = next(
            (e for e in f.events_of(ex["execution_id"])
             if e["kind"] in ("succeeded", "failed", "unknown")),
            None,
        )  # fmt: skip
        ends[ex["execution_id"]] = _utc(last.get("at")) if last is not None else None
    met: dict[str, int | None] = {}
    for fault in f.faults:
        kind = KINDS.get(fault["kind"])
        if kind is None or not (kind.blames or kind.database):
            met[fault["kind"]] = None
            continue
        t = fault.get("t")
        lasted = float(fault.get(kind.lasts, 0.0) or 0.0) if kind.lasts else 0.0
        hit = False
        for ex in f.execs:
            began, until = _utc(ex.get("started_at")), ends.get(ex["execution_id"])
            if t is None or began is None or began.timestamp() > t + lasted:
                continue
            if until is not None and until.timestamp() < t:
                continue
            pid, host = _pid(ex.get("worker_id")), _host(ex.get("worker_id"))
            if (
                kind.blames is None
                or pid in fault.get("pids", [])
                or (kind.blames == "pid_or_host" and host == fault.get("target"))
            ):
                hit = True
                break
        met[fault["kind"]] = (met.get(fault["kind"]) or 0) + hit
    return dict(sorted(met.items()))


def fenced(f: Facts) -> dict[str, int]:
    """Executions that lost their claim and met the fence, by what their own worker put on
    record: ``not_started`` (the lease was gone before the tool; it may say so before the
    sweep revokes it), ``refused_at_commit`` (after the revocation, a late result: the tool
    ran, its terminal write was refused), of which ``staged_refused`` had staged bytes that
    never landed. "No effect of a revoked execution lands" measures nothing where these are
    all 0."""
    out = {"not_started": 0, "refused_at_commit": 0, "staged_refused": 0}
    for ex in f.execs:
        history = f.events_of(ex["execution_id"])
        revoked = next((e["seq"] for e in history if e["kind"] == "unknown"), None)
        for e in history:
            own = e["kind"] == "evidence" and e["detail"].get("worker_id") == ex["worker_id"]
            if not own:
                continue
            if e["detail"].get("not_started"):
                # the fence's: its lease lost, the execution revoked; not a claim cut by the
                # time limit, nor one whose commit it could not learn (both counted before,
                # and a run could meet its "fence met" figure with no revocation: helper-96)
                out["not_started"] += bool(revoked is not None and e["detail"].get("lease_lost"))
            elif revoked is not None and e["seq"] > revoked and "late_result" in e["detail"]:
                out["refused_at_commit"] += 1
                out["staged_refused"] += bool(e["detail"].get("staged"))
    return out


def _inbox_reason(f: Facts, key: str) -> dict[str, Any]:
    op = f.ops[key]
    last = [e for e in f.events if e["idempotency_key"] == key][-1:]
    return {"key": key, "status": op["status"], "review": op.get("review"),
            "last_event": last[0]["kind"] if last else None}  # fmt: skip


# ---------------------------------------------------------------------------- gathering


read_lines = jsonlines.read


_DEATH = re.compile(r"Process '[^']+' pid:(\d+) exited with '([^']+)'")
#: A log line's time: toolledger's text format and Celery's own (``2026-12-06 13:36:46,123``,
#: local), or the JSON format's ``ts`` (ISO, with its offset).
_WHEN = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[,.]\d+)?(?:[+-]\d\d:\d\d|Z)?)")


def child_deaths(logs: Path) -> dict[int, list[tuple[str, float | None]]]:
    """Pool children that died, as the workers themselves logged it: pid -> each (how, when:
    the Unix time of its log line, None if the line has none)."""
    deaths: dict[int, list[tuple[str, float | None]]] = defaultdict(list)
    for log in logs.glob("*.log") if logs.exists() else []:
        for line in log.read_text(errors="replace").splitlines():
            match = _DEATH.search(line)
            if match:
                deaths[int(match[1])].append((match[2], _when(line[: match.start()])))
    return dict(deaths)


def _when(text: str) -> float | None:
    found = _WHEN.search(text)
    if found is None:
        return None
    try:  # naive: the machine's local time, as logging writes asctime
        return datetime.fromisoformat(found[1].replace(",", ".").replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _pid(worker_id: str | None) -> int | None:
    try:
        return int((worker_id or "").rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def _host(worker_id: str | None) -> str:
    return (worker_id or "").split("@", 1)[0]


def _row(r: Any) -> dict[str, Any]:
    return dict(r._mapping)


def gather(
    ledger: Ledger,
    scope: str,
    out: Path,
    workload: Workload,
    faults: list[dict[str, Any]],
    *,
    landings_logged: bool,
) -> Facts:
    """The facts of a finished run: the ledger (at the schema of this version), the run's
    sandbox and logs."""
    with ledger.engine.connect() as conn:
        ops = {
            r.idempotency_key: _row(r)
            for r in conn.execute(sa.select(operations).where(operations.c.scope == scope))
        }
        execs = [
            _row(r) for r in conn.execute(sa.select(executions).where(executions.c.scope == scope))
        ]
        events = [
            _row(r)
            for r in conn.execute(
                sa.select(execution_events)
                .where(execution_events.c.scope == scope)
                .order_by(execution_events.c.seq)
            )
        ]
        # (SQLite's is naive, UTC: a test's ledger; Postgres's carries its zone)
        now = _utc(conn.execute(sa.select(sa.func.now())).scalar_one())
    stale = [
        e["execution_id"]
        for e in execs
        if e["status"] == "running"
        and now
        and e["lease_expires_at"]
        and e["lease_expires_at"] < now
    ]
    root = out / "sandbox" / scope
    paths = {j.args["path"] for j in workload.jobs if "path" in j.args}
    files = {p: None if (root / p).is_symlink() else _read(root / p) for p in paths}
    stray = sandbox_strays(out / "sandbox", scope, paths)
    pending = out / "sandbox" / ".toolledger" / "pending"
    unsettled = sorted(
        p.name for p in (pending.iterdir() if pending.is_dir() else []) if not _aside(p.name)
    )
    unsettled = _without_unmade_claims(ledger, pending, unsettled)
    report = ledger.verify()
    return Facts(
        jobs=workload.jobs,
        ops=ops,
        execs=execs,
        events=events,
        files=files,
        landings=[x for x in read_lines(out / "effects.log") if x["scope"] == scope]
        if landings_logged
        else None,
        charges=read_lines(out / "charges.log"),
        faults=faults,
        firings=read_lines(out / "failpoints.log"),
        deaths=child_deaths(out / "logs"),
        wakes=_wakes(read_lines(out / "woken.log")),
        stale_running=stale,
        verify=[json.dumps(d.to_json()) for d in report.differences],
        stray_files=stray,
        unsettled=unsettled,
        operator=read_lines(out / "operator.log"),
    )


def _without_unmade_claims(ledger: Ledger, pending: Path, names: list[str]) -> list[str]:
    """``names`` but the spools of claims whose commit their executor could not learn and that
    the ledger has no execution of: no effect (the claim never committed, nothing ran), kept
    an hour by the settle in case the claim was still on its way (CI's run of 12-06 counted
    six as effects never settled)."""
    from toolledger.effects import CLAIM_UNKNOWN

    unmade = set()
    for name in (n for n in names if n.endswith(".spool")):
        with contextlib.suppress(OSError, ValueError):
            if json.loads((pending / name).read_text()).get("reason") == CLAIM_UNKNOWN:
                unmade.add(name.removesuffix(".spool"))
    if unmade:
        with ledger.engine.connect() as conn:
            unmade -= set(
                conn.execute(
                    sa.select(executions.c.execution_id).where(
                        executions.c.execution_id.in_(sorted(unmade))
                    )
                ).scalars()
            )
    return [n for n in names if n.removesuffix(".spool") not in unmade]


def sandbox_strays(sandbox: Path, scope: str, paths: set[str]) -> list[str]:
    """What the sandbox holds that no job writes: a file in the scope's folder at a path no
    job has (named inside the folder), any file or link outside it (the pending area
    aside), and any symbolic link, wherever it is, never followed. Only the scope's folder
    was looked at, through links: a file at the sandbox's root or in another scope's folder,
    a link to a directory, or a job's path made a link to a file outside, all passed (a cold
    review)."""
    found: list[str] = []
    for at, dirs, names in os.walk(sandbox):  # never into a link
        here = Path(at).relative_to(sandbox)
        if here.parts[:1] == (".toolledger",):
            dirs[:] = []
            continue
        for name in [*names, *(d for d in dirs if (Path(at) / d).is_symlink())]:
            rel = here / name
            if (sandbox / rel).is_symlink():
                found.append(f"{rel} (a symbolic link)")
            elif len(rel.parts) < 2 or rel.parts[0] != scope:
                found.append(f"{rel} (outside the scope's folder)")
            elif str(Path(*rel.parts[1:])) not in paths:
                found.append(str(Path(*rel.parts[1:])))
    return sorted(found)


def _read(path: Path) -> str | None:
    """A file's bytes as text, byte for byte (``read_text`` turns a CR into a newline: a
    stray CR was invisible), undecodable bytes kept as escapes, never dropped."""
    return path.read_bytes().decode("utf-8", "surrogateescape") if path.is_file() else None


def _aside(name: str) -> bool:
    """A staged effect set aside with its intent (never landed, for a human to look at), or a
    spool's temporary file left by a process killed while writing it (``<eid>.spool.tmpPID``:
    no effect, the result it was to keep is lost and its execution ends unknown; CI's threads
    run of 12-06 counted one as an effect never settled)."""
    return (
        name.endswith(".refused")
        or re.fullmatch(r".+\.spool\.tmp\d+(\.[0-9a-f]{8})?", name) is not None
    )
