"""``toolledger demo``: an agent session, a crash, and recovery — on the embedded default.

Two real workers and the beat run on SQLite (ledger and broker, under .toolledger/). A scripted
agent submits its tool calls turn by turn and writes their results into an OpenAI-style
transcript; then it crashes before recording its last turn's results, while one of those calls
is executed by a worker whose pool child dies after the tool ran, before the terminal record.
Nothing of it had landed (a tool's writes land only after its commit); the beat's sweep finds
the stale execution, proves it not applied, and — the target file missing — retries it once
by itself. Repair gives the transcript its missing results, without running anything again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolledger.config import Settings, shown_url
from toolledger.harness.processes import (
    ManagedProcess,
    beat_process,
    service_env,
    stop_all,
    worker_process,
)
from toolledger.ledger.errors import LedgerError
from toolledger.ledger.transitions import Status
from toolledger.recovery.transcript import repair_file
from toolledger.worker.submit import Submitter
from toolledger.worker.tasks import publish

#: Short clocks so the crash is found in seconds (soft < hard < lease, as always).
DEMO_ENV = {"lease_seconds": "3", "sweep_interval": "1", "sweep_grace": "0", "requeue_after": "15"}
CRASH_QUEUE = "toolledger.demo-crash"


@dataclass
class Expect:
    """What the script expects of one call, and what happened."""

    tool_call_id: str
    expected: str
    why: str
    got: str = "?"

    @property
    def ok(self) -> bool:
        return self.got == self.expected


@dataclass
class Demo:
    settings: Settings
    out: Callable[[str], None]
    scope: str = field(default_factory=lambda: time.strftime("demo-%Y%m%d-%H%M%S"))
    began: float = field(default_factory=time.monotonic)
    procs: list[ManagedProcess] = field(default_factory=list)
    transcript: list[dict[str, Any]] = field(default_factory=list)
    expects: dict[str, Expect] = field(default_factory=dict)

    def step(self, text: str) -> None:
        self.out(f"[{time.monotonic() - self.began:5.1f}s] {text}")

    # ------------------------------------------------------------------ the world

    def start(self) -> None:
        settings = {
            "home": self.settings.home,
            "db": self.settings.db,
            "broker": self.settings.broker,
            "sandbox": self.settings.sandbox,
            **DEMO_ENV,
        }
        env = service_env(None, **{k: str(v) for k, v in settings.items()})
        logs = self.settings.home / "logs"
        self.procs = [
            worker_process("demo-w1", env, logs),
            worker_process(
                "demo-w2",
                {**env, "TOOLLEDGER_FAILPOINTS": "after_effect=exit(23)"},
                logs,
                concurrency=1,
                extra=("--queues", CRASH_QUEUE),
            ),
            beat_process(
                "demo-beat", {**env, "TOOLLEDGER_HOME": str(self.settings.home / "beat")}, logs
            ),
        ]
        for p in self.procs:
            p.start()
        for p in self.procs:
            p.wait_ready(90)

    def stop(self) -> None:
        stop_all(self.procs)

    # ------------------------------------------------------------------ the agent

    def call(
        self,
        sub: Submitter,
        cid: str,
        tool: str,
        args: dict[str, Any],
        *,
        approve: bool,
        key: str | None = None,
    ) -> str | None:
        """Submit one call as the agent runtime would; None if it was refused."""
        try:
            prepared = sub.prepare(self.scope, cid, tool, args, key)
            sub.submit(prepared, approved_by="policy:auto" if approve else None)
            return prepared.key
        except LedgerError as exc:
            self.tool_message(cid, {"error": "refused", "message": str(exc)})
            self.expects[cid].got = "refused"
            self.step(f"  {cid}: refused at submit — {exc}")
            return None

    def assistant(self, calls: list[tuple[str, str, dict[str, Any]]]) -> None:
        self.transcript.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": cid,
                        "type": "function",
                        "function": {
                            "name": tool,
                            "arguments": json.dumps(args, ensure_ascii=False),
                        },
                    }
                    for cid, tool, args in calls
                ],
            }
        )

    def tool_message(self, cid: str, content: dict[str, Any]) -> None:
        self.transcript.append(
            {
                "role": "tool",
                "tool_call_id": cid,
                "content": json.dumps(content, ensure_ascii=False),
            }
        )

    def wait_done(self, sub: Submitter, cids: list[str], timeout: float = 40) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(
                sub.ledger.get(self.scope, c).operation.status
                not in (Status.APPROVED, Status.RUNNING, Status.UNKNOWN)
                for c in cids
            ):
                return
            time.sleep(0.1)
        raise TimeoutError(f"calls {cids} did not finish within {timeout}s")

    def wait_status(self, sub: Submitter, cid: str, status: Status, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while sub.ledger.get(self.scope, cid).operation.status is not status:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cid} never reached {status}")
            time.sleep(0.05)

    def transcript_path(self) -> Path:
        return self.settings.home / "demo" / self.scope / "transcript.jsonl"

    def answer(self, sub: Submitter, cids: list[str]) -> None:
        """The agent writes each call's result into its transcript."""
        for cid in cids:
            self.tool_message(cid, sub.ledger.receipt(self.scope, cid).content)


def _expectations() -> list[Expect]:
    return [
        Expect(
            "call_plan",
            "succeeded",
            "approved at once; its message was delivered twice, the ledger claim let it run once",
        ),
        Expect("call_log", "succeeded", "approved at once"),
        Expect(
            "call_escape",
            "refused",
            "its path leaves the sandbox: refused at submit, nothing recorded",
        ),
        Expect("call_deploy", "rejected", "a human rejected it: it never ran"),
        Expect("call_notify", "succeeded", "pending until a human approved it, then ran"),
        Expect(
            "call_overwrite",
            "refused",
            "it reused the key 'plan' with other arguments: a conflict, refused at submit",
        ),
        Expect(
            "call_report",
            "succeeded (attempt 2)",
            "its worker died before its commit: nothing landed; the sweep proved it "
            "and retried it by itself, once",
        ),
        Expect("call_summary", "succeeded", "ran normally while the agent was down"),
    ]


def run_demo(settings: Settings, out: Callable[[str], None] = print) -> dict[str, Any]:
    demo = Demo(settings, out)
    demo.expects = {e.tool_call_id: e for e in _expectations()}
    sub = Submitter(settings)
    try:
        # never the password a ledger's URL may hold (it was printed as given)
        ledger = shown_url(settings.db)
        demo.step(f"starting 2 workers and the beat on {ledger} (scope {demo.scope})")
        demo.start()
        _script(demo, sub)
    finally:
        demo.step("stopping the workers and the beat")
        demo.stop()
    return _report(demo, sub)


def _script(demo: Demo, sub: Submitter) -> None:
    s = demo.scope
    demo.transcript += [
        {"role": "system", "content": "You are a build assistant. Write files only when asked."},
        {
            "role": "user",
            "content": "The nightly build failed. Diagnose it, write the report "
            "to diagnosis.txt and tell the team.",
        },
    ]
    # Turn 1: two calls approved at once by policy, one that tries to leave the sandbox.
    turn1 = [
        ("call_plan", "write_file", {"path": "plan.md", "content": "1. read logs\n2. fix"}),
        ("call_log", "append_file", {"path": "activity.log", "content": "diagnosis started\n"}),
        ("call_escape", "write_file", {"path": "../../etc/cron.d/x", "content": "* * * * *"}),
    ]
    demo.assistant(turn1)
    demo.step("turn 1: the agent asks for 3 calls")
    demo.call(sub, "call_plan", *turn1[0][1:], approve=True, key="plan")
    demo.call(sub, "call_log", *turn1[1][1:], approve=True)
    demo.call(sub, "call_escape", *turn1[2][1:], approve=True)
    for _ in range(2):  # a duplicating broker or a retrying producer
        publish(sub.app, sub.settings, s, "plan", 1)
    demo.step("  call_plan's message published twice more (duplicate delivery)")
    demo.wait_done(sub, ["call_plan", "call_log"])
    demo.answer(sub, ["call_plan", "call_log"])

    # Turn 2: two calls need a human; one reuses a key for other content.
    turn2 = [
        ("call_deploy", "append_file", {"path": "deploy.log", "content": "deploy to prod\n"}),
        ("call_notify", "write_file", {"path": "outbox/team.txt", "content": "Build fixed."}),
        ("call_overwrite", "write_file", {"path": "plan.md", "content": "rm -rf /"}),
    ]
    demo.transcript.append({"role": "user", "content": "Go ahead, but ask before deploying."})
    demo.assistant(turn2)
    demo.step("turn 2: 2 calls wait for a human, 1 reuses a key")
    demo.call(sub, "call_deploy", *turn2[0][1:], approve=False)
    demo.call(sub, "call_notify", *turn2[1][1:], approve=False)
    demo.call(sub, "call_overwrite", *turn2[2][1:], approve=True, key="plan")
    sub.decide(s, "call_deploy", "ops:alice", "no deploys on Fridays", approve=False)
    demo.step("  alice rejects call_deploy; bob approves call_notify")
    sub.decide(s, "call_notify", "ops:bob", None, approve=True)
    demo.wait_done(sub, ["call_notify"])
    demo.answer(sub, ["call_deploy", "call_notify"])

    # Turn 3: the report goes to the worker that will crash; the agent crashes too.
    turn3 = [
        ("call_report", "write_file", {"path": "diagnosis.txt", "content": "done"}),
        ("call_summary", "write_file", {"path": "summary.txt", "content": "flaky test"}),
    ]
    demo.assistant(turn3)
    demo.step("turn 3: the report is routed to a worker whose child dies before its commit")
    report = sub.prepare(s, "call_report", *turn3[0][1:])
    sub.ledger.submit(s, "call_report", report.tool, report.args, approved_by="policy:auto")
    publish(sub.app, sub.settings.with_(queue=CRASH_QUEUE), s, report.key, 1)
    sub.ledger.mark_enqueued(s, report.key, 1)
    demo.call(sub, "call_summary", *turn3[1][1:], approve=True)
    path = demo.transcript_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(m, ensure_ascii=False) + "\n" for m in demo.transcript))
    demo.step(f"  the agent crashes before recording turn 3's results ({path})")
    demo.wait_status(sub, "call_report", Status.RUNNING)
    demo.step("  call_report: tool ran, worker child died: running, and nothing has landed")
    demo.wait_done(sub, ["call_report", "call_summary"])
    first, *_ = sub.ledger.get(s, "call_report").executions
    demo.step(
        f"  the beat's sweep: lease expired -> unknown -> not applied ({first.execution_id[:13]}…)"
        " -> retried once, by itself: attempt 2 wrote diagnosis.txt"
    )
    repaired = repair_file(path, sub.ledger, s)
    demo.step(
        f"repair: {len(repaired.inserted)} results replayed into the transcript "
        "(nothing re-executed)"
    )
    again = repair_file(path, sub.ledger, s)
    demo.step(f"repair again: {len(again.inserted)} inserted (idempotent)")


def _report(demo: Demo, sub: Submitter) -> dict[str, Any]:
    ledger = sub.ledger
    for cid, exp in demo.expects.items():
        if exp.got == "refused":
            continue
        view = ledger.get(demo.scope, cid)
        current = view.current
        exp.got = view.operation.status.value
        if current is not None and current.reconciled:
            exp.got += " (reconciled)"
        elif current is not None and current.attempt > 1:
            exp.got += f" (attempt {current.attempt})"
    called = [c.tool_call_id for c in ledger.list_calls(scope=demo.scope) if c.tool_call_id]
    executions = {cid: len(ledger.get(demo.scope, cid).executions) for cid in called}
    plan_ran_once = executions.get("call_plan") == 1
    summary = {
        "scope": demo.scope,
        "ok": all(e.ok for e in demo.expects.values()) and plan_ran_once and ledger.verify().ok,
        "duration_s": round(time.monotonic() - demo.began, 1),
        "calls": {
            cid: {"expected": e.expected, "got": e.got, "ok": e.ok, "why": e.why}
            for cid, e in demo.expects.items()
        },
        "executions_per_call": executions,
        "transcript": str(demo.transcript_path()),
        "verify_ok": ledger.verify().ok,
    }
    sub.close()
    return summary


def render(summary: dict[str, Any], settings: Settings, ledger_table: str) -> str:
    lines = ["", "The ledger (toolledger list --scope " + summary["scope"] + "):", ledger_table, ""]
    transcript = Path(summary["transcript"]).read_text().splitlines()
    lines.append(f"The repaired transcript's tail ({summary['transcript']}):")
    for line in transcript[-3:]:
        lines.append("  " + (line if len(line) < 160 else line[:157] + "..."))
    lines += ["", "What happened, and why:"]
    for cid, c in summary["calls"].items():
        mark = "ok " if c["ok"] else "BAD"
        lines.append(f"  {mark} {cid:<15} {c['got']:<24} {c['why']}")
    lines += [
        "",
        f"verify: {'ok' if summary['verify_ok'] else 'DIFFERENCES'}; "
        f"{'all as expected' if summary['ok'] else 'NOT as expected'} in "
        f"{summary['duration_s']}s.",
        f"Explore: toolledger list --scope {summary['scope']}  |  toolledger events "
        f"--scope {summary['scope']} --tool-call-id call_report",
    ]
    return "\n".join(lines)
