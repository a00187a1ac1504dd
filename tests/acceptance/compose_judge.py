"""The compose run's verdict, from facts read after the fact: the ledger's rows, the sandbox's
log of landings and the files themselves. Pure, so that tests/unit/test_compose_judge.py can
show each judgement failing on facts crafted to break exactly it."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from toolledger.harness.chaos.checker import inversions, out_of_commit_order

Key = tuple[str, str]  # (scope, idempotency_key)


@dataclass
class Verdict:
    violations: dict[str, list[str]] = field(default_factory=dict)
    cut_off_by: Counter[str] = field(default_factory=Counter)

    def add(self, judgement: str, what: str) -> None:
        self.violations.setdefault(judgement, []).append(what)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        return "; ".join(f"{k}: {len(v)} ({', '.join(v[:3])})" for k, v in self.violations.items())


def host_of(worker_id: str | None) -> str:
    """``celery@<hostname>:<pid>`` → hostname (a container's id under compose)."""
    return (worker_id or "").split("@")[-1].rsplit(":", 1)[0]


def judge(
    ops: Iterable[dict[str, Any]],
    execs: Iterable[dict[str, Any]],
    landings: list[dict[str, Any]],
    read: Callable[[str, str], str | None],
    *,
    commits: dict[str, int],
    killed_hosts: set[str],
    restart_at: datetime,
) -> Verdict:
    """Seven judgements (``commits``: each execution's own succeeded commit, execution_id ->
    its event's seq; a reconciler's or a human's decision is not one).

    ended          every call succeeded, or failed proven not applied (reconciled), or waits
                   in the inbox (unknown) — nothing approved or running is left;
    explained      every call that did not succeed was cut off by a fault of the run: its last
                   execution ran on a killed container, or held its lease across the restart;
    one_effect     no call landed more than once (distinct executions or appends per call);
    none_cut_off   no call that did not succeed landed anything;
    as_requested   every succeeded call landed, and its file holds what was asked (a write's
                   bytes; an append's line exactly once in its file);
    in_order       on each path, effects landed in the order of their commits (the ledger's seq
                   each landing recorded), and an append file's lines stand in that order;
    own_commit     every landing is of an execution of its call whose own commit made it
                   official, with that commit's seq: a revoked execution's bytes never land,
                   even when its call succeeds later (by a reconciler, or another attempt).
    """
    v = Verdict()
    by_key = {(o["scope"], o["idempotency_key"]): o for o in ops}
    execs_of: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for e in sorted(execs, key=lambda e: e["attempt"]):
        execs_of[(e["scope"], e["idempotency_key"])].append(e)
    landed: dict[Key, set[tuple[str, int]]] = defaultdict(set)
    for ln in landings:  # a redo after a crash repeats (execution_id, n): one effect, not two
        landed[(ln["scope"], ln["key"])].add((ln["execution_id"], ln["n"]))

    for key, op in by_key.items():
        name = "/".join(key)
        status = op["status"]
        if status not in ("succeeded", "failed", "unknown"):
            v.add("ended", f"{name} {status}")
            continue
        if len(landed.get(key, ())) > 1:
            v.add("one_effect", f"{name} x{len(landed[key])}")
        if status == "succeeded":
            _as_requested(v, name, op, key in landed, read)
            continue
        if key in landed:
            v.add("none_cut_off", f"{name} {status}")
        last = (execs_of.get(key) or [None])[-1]
        if last is None or last["status"] != status:
            v.add("ended", f"{name} {status} without an execution that ended so")
            continue
        if status == "failed" and not (
            last["reconciled"] and (last["result"] or {}).get("error") == "not_applied"
        ):
            v.add("ended", f"{name} failed, not proven unapplied")
            continue
        if host_of(last["worker_id"]) in killed_hosts:
            v.cut_off_by[f"{status}: worker killed"] += 1
        elif last["started_at"] <= restart_at <= (last["lease_expires_at"] or restart_at):
            v.cut_off_by[f"{status}: postgres restart"] += 1
        else:
            v.add("explained", f"{name} {status} on {last['worker_id']}")

    _appends_once(v, by_key, read)
    _in_order(v, by_key, landings, read)
    _own_commits(v, execs_of, landings, commits)
    return v


def _own_commits(
    v: Verdict,
    execs_of: dict[Key, list[dict[str, Any]]],
    landings: list[dict[str, Any]],
    commits: dict[str, int],
) -> None:
    for ln in landings:
        key, eid = (ln["scope"], ln["key"]), ln["execution_id"]
        name = "/".join(key)
        if eid not in {e["execution_id"] for e in execs_of.get(key, [])}:
            v.add("own_commit", f"{name}: landed by {eid}, no execution of this call")
        elif commits.get(eid) != ln["seq"]:
            own = commits.get(eid)
            v.add("own_commit", f"{name}: {eid} landed at seq {ln['seq']}, its own commit is {own}")


def _in_order(
    v: Verdict,
    by_key: dict[Key, dict[str, Any]],
    landings: list[dict[str, Any]],
    read: Callable[[str, str], str | None],
) -> None:
    for what in out_of_commit_order(landings):
        v.add("in_order", what)
    seq_of = {(ln["scope"], ln["key"]): ln["seq"] for ln in landings}
    lines: dict[tuple[str, str], dict[str, Key]] = defaultdict(dict)
    for key, op in by_key.items():
        if op["tool"].endswith("append") and key in seq_of:
            content = op["args"]["content"]
            if not content.endswith("\n") or content.count("\n") != 1:  # lines are how we see
                v.add("in_order", f"{'/'.join(key)}: not one line, its order cannot be judged")
            lines[(op["scope"], op["args"]["path"])][content] = key
    for where, key_of_line in lines.items():
        text = (read(*where) or "").splitlines(keepends=True)
        seqs = [seq_of[key_of_line[line]] for line in text if line in key_of_line]
        for later, earlier in inversions(seqs):
            v.add("in_order", f"{'/'.join(where)}: the line of seq {earlier} after {later}'s")


def _as_requested(
    v: Verdict, name: str, op: dict[str, Any], landed: bool, read: Callable[[str, str], str | None]
) -> None:
    if not landed:
        v.add("as_requested", f"{name} succeeded, nothing landed")
    elif (
        op["tool"].endswith("write")
        and read(op["scope"], op["args"]["path"]) != op["args"]["content"]
    ):
        v.add("as_requested", f"{name} file differs")


def _appends_once(
    v: Verdict, by_key: dict[Key, dict[str, Any]], read: Callable[[str, str], str | None]
) -> None:
    files: dict[tuple[str, str], Counter[str]] = {}
    for key, op in by_key.items():
        if not op["tool"].endswith("append"):
            continue
        where = (op["scope"], op["args"]["path"])
        if where not in files:
            files[where] = Counter((read(*where) or "").splitlines(keepends=True))
        n = files[where][op["args"]["content"]]
        want = 1 if op["status"] == "succeeded" else 0
        if n != want:
            judgement = "one_effect" if n > 1 else "as_requested" if want else "none_cut_off"
            v.add(judgement, f"{'/'.join(key)} {op['status']}: its line {n} times")
