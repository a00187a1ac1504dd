"""The chaos run's agent and operator, run as processes of the version of toolledger under test.

``python toolledger_chaos_roles.py submit PLAN`` — the agent: submits the plan's jobs at their
times, each shared path's writers one after another (a writer waits for the one before it to
end, or for a while), retrying through database faults; logs each submission.

``python toolledger_chaos_roles.py operate PLAN`` — a careful human at the inbox, every few
seconds until the harness asks it to finish: resolves what the evidence makes clear and retries
what is visibly absent (with ``accept_duplicate`` only where its version asks for it); logs
every action with its reason.

Like the tools module next to it, this file uses only the API every version shares (Settings,
Submitter, Ledger reads, recovery.humans), so the harness can point it at an older checkout.
Settings come from the TOOLLEDGER_* environment; the plan (JSON) names the scope, the jobs and
the files to log to.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import sqlalchemy as sa

#: An older checkout under test (``--code``) names its modules without the namespace.
LEGACY = bool(os.environ.get("TOOLLEDGER_CHAOS_LEGACY"))


if TYPE_CHECKING:
    from toolledger.config import Settings
    from toolledger.ledger.transitions import Status
    from toolledger.recovery import humans
    from toolledger.worker.submit import Submitter
else:

    def _module(name: str) -> Any:
        return importlib.import_module(name.removeprefix("toolledger.") if LEGACY else name)

    Status = _module("toolledger.ledger.transitions").Status
    humans = _module("toolledger.recovery.humans")
    Settings = _module("worker.config" if LEGACY else "toolledger.config").Settings
    Submitter = _module("toolledger.worker.submit").Submitter
#: Since the namespace, a human's retry and resolve take the parts, not a Submitter.
PARTS = not LEGACY
#: Since 2026-12-07 a review of a flag is asked for (``review=True``): a resolution alone is
#: refused on an execution no longer unknown. An older version took it as the review.
ASKS_REVIEW = "review" in inspect.signature(humans.resolve).parameters
#: Later that day a review says what it saw (``seen``: the newest event's seq), and is refused
#: ("look again") if a flag it would settle was raised since.
ASKS_SEEN = "seen" in inspect.signature(humans.resolve).parameters

OPEN = ("approved", "running", "pending_approval")


def log(path: str, entry: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), **entry}) + "\n")


#: What a database fault looks like (older versions let some raw driver errors through).
DB_FAULTS = (sa.exc.SQLAlchemyError, psycopg.Error)


def retrying(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Through database faults (terminated sessions, a crashed server): a patient client."""
    for tries in range(120):
        try:
            return fn(*args, **kwargs)
        except DB_FAULTS as exc:
            if tries % 10 == 9:
                print(f"{what}: still failing: {str(exc).splitlines()[0]}", file=sys.stderr)
            time.sleep(min(2.0, 0.1 * (tries + 1)))
    raise RuntimeError(f"{what}: the database never answered")


# ---------------------------------------------------------------------------- the agent


def submit(plan: dict[str, Any]) -> None:
    sub = Submitter(Settings.from_env())
    scope, jobs = plan["scope"], plan["jobs"]
    began, window = plan["began"], plan["window"]
    max_wait = plan["chain_wait"]
    waiting: list[tuple[dict[str, Any], float]] = []
    sent: set[str] = set()
    open_now: set[str] = set()
    checked = 0.0

    def ended(cid: str) -> bool:
        """Submitted, and no longer approved, running or pending (one query per refresh)."""
        nonlocal open_now, checked
        if time.time() - checked > 0.5:
            open_now = retrying("open calls", lambda: {
                c.tool_call_id
                for s in OPEN
                for c in sub.ledger.list_calls(status=Status(s), scope=scope, limit=0)
            })  # fmt: skip
            checked = time.time()
        return cid in sent and cid not in open_now

    def send(job: dict[str, Any], waited: float) -> None:
        call = sub.prepare(scope, job["cid"], job["tool"], job["args"])
        out = retrying("submit", sub.submit, call, approved_by="chaos-agent")
        sent.add(job["cid"])
        log(plan["submitted_log"], {"cid": job["cid"], "waited_s": round(waited, 2),
                                    "enqueued": out.get("enqueued")})  # fmt: skip

    for i, job in enumerate(jobs):
        time.sleep(max(0.0, began + window * i / len(jobs) - time.time()))
        if job["after"]:
            waiting.append((job, time.time()))
        else:
            send(job, 0.0)
        waiting = _release(waiting, ended, send, max_wait)
    while waiting:
        time.sleep(0.2)
        waiting = _release(waiting, ended, send, max_wait)
    sub.close()


def _release(waiting: list[Any], ended: Any, send: Any, max_wait: float) -> list[Any]:
    """Submit every chained writer whose predecessor has ended (or waited long enough)."""
    still = []
    for job, since in waiting:
        if ended(job["after"]) or time.time() - since > max_wait:
            send(job, time.time() - since)
        else:
            still.append((job, since))
    return still


# ---------------------------------------------------------------------------- the operator


class Operator:
    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan, self.scope = plan, plan["scope"]
        self.sub = Submitter(Settings.from_env())
        self.ledger = self.sub.ledger
        self.jobs = {j["cid"]: j for j in plan["jobs"]}
        self.sandbox = Path(plan["sandbox"]) / self.scope
        self.retried: dict[str, int] = {}
        self.settled: set[str] = set()

    def act(self, action: str, cid: str, why: str, **detail: Any) -> None:
        log(self.plan["operator_log"], {"action": action, "cid": cid, "why": why, **detail})

    def inbox(self) -> list[Any]:
        rows = list(self.ledger.list_calls(status=Status.UNKNOWN, scope=self.scope, limit=0))
        with contextlib.suppress(TypeError):  # versions with the review flag
            rows += self.ledger.list_calls(scope=self.scope, limit=0, review=True)
        rows += [
            r for r in self.ledger.list_calls(status=Status.FAILED, scope=self.scope, limit=0)
            if r.tool_call_id not in self.settled
        ]  # fmt: skip
        return rows

    def open_calls(self) -> int:
        return sum(
            len(self.ledger.list_calls(status=Status(s), scope=self.scope, limit=0)) for s in OPEN
        )

    def pass_once(self) -> int:
        acted = 0
        for row in retrying("inbox", self.inbox):
            job = self.jobs.get(row.tool_call_id or "")
            if job is not None:
                acted += retrying("decide", self.decide, row, job)
        return acted

    def decide(self, row: Any, job: dict[str, Any]) -> int:
        view = self.ledger.get(self.scope, job["cid"])
        current = view.current
        if current is None:
            return 0
        if getattr(view.operation, "review", None):
            # an unknown attempt (the current one, or a later one a withdrawal left behind)
            # is resolved first: every review waits until the attempts after it have ended
            unknown = [e for e in view.executions if e.status is Status.UNKNOWN]
            if current.status is not Status.UNKNOWN and not unknown:
                return self.review(job, view)
            pending = current if current.status is Status.UNKNOWN else unknown[-1]
            # never retried: a flagged call waits for a person
            present = self.looks_present(job)
            if present is None:
                return 0
            status = Status.SUCCEEDED if present else Status.FAILED
            why = f"flagged, and its effect is there: {present}"
            return self.resolve(job, pending, status, why)
        if row.status is Status.FAILED:
            return self.failed(job, current)
        present = self.looks_present(job)
        if present is True:
            return self.resolve(job, current, Status.SUCCEEDED, "the effect is there")
        if job["kind"] == "shared" and present is False and self.superseded(job):
            why = "not on the path; a later writer followed"
            return self.resolve(job, current, Status.FAILED, why)
        if present is False:
            return self.retry(job, "the effect is visibly absent")
        return 0

    def failed(self, job: dict[str, Any], current: Any) -> int:
        """A failed call: retried only if nothing of it is there and it was not superseded."""
        not_applied = (current.result or {}).get("error") == "not_applied"
        if job["kind"] in ("append", "write") and not_applied and self.looks_present(job) is False:
            return self.retry(job, "not applied, and its effect is visibly absent")
        self.settled.add(job["cid"])
        return 0

    def review(self, job: dict[str, Any], view: Any) -> int:
        """A flagged call: the flag names the execution a human or a reconciler decided. The
        first flag still waiting (the view's, in versions that fold them): the last one
        raised may be reviewed already while an earlier one waits, which the ledger refuses
        to settle by a review of another execution, every pass (a call left in the inbox)."""
        history = self.ledger.events(self.scope, job["cid"])
        waiting = [f.execution_id for f in getattr(view, "flags", ()) or ()]
        named = (waiting or [e.execution_id for e in history if e.kind == "flagged"][-1:])[0]
        flagged = next(e for e in view.executions if e.execution_id == named)
        present = self.looks_present(job)
        status = Status.SUCCEEDED if present is not False else Status.FAILED
        why = f"flagged {view.operation.review}: reviewed against the world ({present})"
        return self.resolve(job, flagged, status, why, review=True, seen=history[-1].seq)

    def looks_present(self, job: dict[str, Any]) -> bool | None:
        """What a human sees: the file's bytes, the log's line, the service's receipt."""
        if job["kind"] in ("write", "shared"):
            target = self.sandbox / job["args"]["path"]
            content = target.read_text() if target.exists() else None
            return bool(content == job["args"]["content"])
        if job["kind"] == "append":
            target = self.sandbox / job["args"]["path"]
            return target.exists() and job["line"] in target.read_text().splitlines(keepends=True)
        url = f"{self.plan['downstream']}/receipt?key=chaos_charge:{job['cid']}"
        try:
            with urllib.request.urlopen(url, timeout=2):  # noqa: S310 - the harness's service
                return True
        except urllib.error.HTTPError as exc:
            return False if exc.code == 404 else None
        except OSError:
            return None

    def superseded(self, job: dict[str, Any]) -> bool:
        later = [j for j in self.plan["jobs"] if j["after"] == job["cid"]]
        return any(self.ledger_has(j["cid"]) for j in later)

    def ledger_has(self, cid: str) -> bool:
        try:
            self.ledger.key_for(self.scope, cid)
        except Exception:  # noqa: BLE001 - NotFound in every version
            return False
        return True

    def resolve(
        self,
        job: dict[str, Any],
        current: Any,
        status: Status,
        why: str,
        review: bool = False,
        seen: int | None = None,
    ) -> int:
        """A resolution of an unknown execution; ``review``, of the flag the operator looked
        at, ``seen`` the newest event it read (each passed only to a version that asks)."""
        try:
            who: Any = self.sub.ledger if PARTS else self.sub  # the signature of its version
            asked: dict[str, Any] = {"review": True} if review and ASKS_REVIEW else {}
            if asked and seen is not None and ASKS_SEEN:
                asked["seen"] = seen
            humans.resolve(
                who,
                current.execution_id,
                status,
                by="chaos-operator",
                evidence=why,
                **asked,
            )
        except DB_FAULTS:
            raise
        except Exception as exc:  # noqa: BLE001 - a sweep got there first, or it is refused
            if "how it ends decides" in str(exc):  # a later attempt still runs: look again
                return 0
            if "look again" in str(exc):  # the call moved after the operator read it
                return 0
            self.act("gave_up", job["cid"], f"{why}; refused: {exc}")
            self.settled.add(job["cid"])
            return 0
        self.settled.add(job["cid"])
        self.act("resolve", job["cid"], why, execution_id=current.execution_id, status=status.value)
        return 1

    def retry(self, job: dict[str, Any], why: str) -> int:
        if self.retried.get(job["cid"], 0) >= 2:
            self.settled.add(job["cid"])
            return 0
        sub = self.sub
        who: tuple[Any, ...] = (sub.ledger, sub.registry, sub.enqueue) if PARTS else (sub,)
        retry: Any = humans.retry  # the signature of its version
        try:
            out = retry(*who, self.scope, job["cid"], by="chaos-operator", reason=why)
            accepted = False
        except humans.DuplicateNotAccepted:
            out = retry(*who, self.scope, job["cid"], by="chaos-operator",
                               accept_duplicate=True, reason=why)  # fmt: skip
            accepted = True
        except Exception as exc:
            if isinstance(exc, DB_FAULTS):
                raise
            return 0
        self.retried[job["cid"]] = self.retried.get(job["cid"], 0) + 1
        self.settled.discard(job["cid"])
        self.act("retry", job["cid"], why, attempt=out["attempt"], accept_duplicate=accepted)
        return 1


def operate(plan: dict[str, Any]) -> None:
    op = Operator(plan)
    finish = Path(plan["finish_file"])
    quiet_passes = 0
    while True:
        time.sleep(plan["operator_every"])
        acted = op.pass_once()
        if finish.exists():  # done once nothing is left to do and nothing is in flight
            quiet = not acted and not retrying("open calls", op.open_calls)
            quiet_passes = quiet_passes + 1 if quiet else 0
            if quiet_passes >= 3:
                break
    Path(plan["operator_done"]).write_text("done")
    op.sub.close()


if __name__ == "__main__":
    role, plan_path = sys.argv[1], sys.argv[2]
    plan = json.loads(Path(plan_path).read_text())
    {"submit": submit, "operate": operate}[role](plan)
    os._exit(0)  # no lingering broker threads
