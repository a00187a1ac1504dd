"""The fence reaches the effect (DESIGN invariant 10), on both backends, with real processes.

Each executor here is a real ``toolledger execute`` process, frozen by a failpoint
(``stop``: it SIGSTOPs itself) at an exact instruction of the pipeline, revoked meanwhile by
the sweep, a human, a retry or a newer call on the same path, then woken. Afterwards the files
and the effects log (one line per landing, written under the path's lock with the commit's
seq) are checked against the ledger.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from ledger.ledger import Ledger
from ledger.transitions import Status
from recovery.sweep import sweep
from tests.acceptance.conftest import wait_until
from worker.processes import process_state, service_env, toolledger_argv
from worker.sandbox import Sandbox
from worker.tools import load_registry

LEASE = "2"  # seconds: the tests wait this long for a frozen executor's lease to expire


@dataclass
class World:
    db: str
    root: Path
    ledger: Ledger
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def sandbox(self) -> Sandbox:
        return Sandbox(self.root / "sandbox", effects_log=str(self.effects_log)).prepare()

    @property
    def effects_log(self) -> Path:
        return self.root / "effects.log"

    def env(self, **settings: str) -> dict[str, str]:
        base = {
            "db": self.db,
            "broker": "redis://127.0.0.1:1/0",  # nobody listens: nothing here publishes
            "sandbox": str(self.root / "sandbox"),
            "effects_log": str(self.effects_log),
            "failpoint_log": str(self.root / "failpoints.log"),
            "tools": "tests.external_tools",
            "lease_seconds": LEASE,
            "lock_wait": "0.5",
            "home": str(self.root / "home"),
        }
        return service_env(**{**base, **settings})

    def cli(self, *argv: str, **settings: str) -> tuple[int, str, str]:
        proc = subprocess.run(
            [*toolledger_argv(), *argv],
            env=self.env(**settings),
            capture_output=True,
            text=True,
            timeout=120,
        )
        return proc.returncode, proc.stdout, proc.stderr

    def submit(self, scope: str, cid: str, tool: str, args: dict[str, Any]) -> None:
        self.ledger.submit(scope, cid, tool, args, approved_by="alice")

    def execute(self, scope: str, cid: str, **settings: str) -> subprocess.Popen[str]:
        """``toolledger execute`` in the background (a failpoint may stop it)."""
        argv = [*toolledger_argv(), "execute", "--scope", scope, "--tool-call-id", cid, "--json"]
        proc = subprocess.Popen(
            argv,
            env=self.env(**settings),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def frozen(self, proc: subprocess.Popen[str]) -> None:
        wait_until(lambda: process_state(proc.pid) == "T", 60, "the executor to stop itself")

    def wake(self, proc: subprocess.Popen[str]) -> tuple[int, str, str]:
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
        return proc.returncode, out, err

    def run(self, scope: str, cid: str, **settings: str) -> dict[str, Any]:
        proc = self.execute(scope, cid, **settings)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        return json.loads(out)  # type: ignore[no-any-return]

    def revoke(self) -> None:
        """The sweep's first step: every expired lease -> unknown (DB clock)."""
        wait_until(lambda: self.ledger.mark_expired(grace_seconds=0), 30, "lease expiry")

    def sweep(self, **kw: Any) -> Any:
        return sweep(
            self.ledger,
            load_registry("tests.external_tools"),
            self.sandbox,
            grace_seconds=0,
            requeue_after=3600,
            publish=None,
            **kw,
        )

    def effects(self) -> list[dict[str, Any]]:
        if not self.effects_log.exists():
            return []
        return [json.loads(line) for line in self.effects_log.read_text().splitlines()]

    def file(self, scope: str, path: str) -> bytes | None:
        target = self.root / "sandbox" / scope / path
        return target.read_bytes() if target.exists() else None

    def pending(self) -> list[str]:
        pending = self.root / "sandbox" / ".toolledger" / "pending"
        return sorted(p.name for p in pending.iterdir()) if pending.is_dir() else []


@pytest.fixture
def world(db_url: str, tmp_path: Path) -> Iterator[World]:
    ledger = Ledger(db_url)
    w = World(db_url, tmp_path, ledger)
    w.sandbox  # noqa: B018 - prepared, as a worker would find it
    yield w
    for proc in w.procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)
    ledger.close()


def write(path: str, content: str) -> dict[str, str]:
    return {"path": path, "content": content}


def execution_of(ledger: Ledger, scope: str, cid: str, attempt: int = 1) -> Any:
    return next(e for e in ledger.get(scope, cid).executions if e.attempt == attempt)


# ---------------------------------------------------------------------------- zombies


@pytest.mark.parametrize("point", ["before_effect", "after_stage", "after_effect"])
def test_fence__zombie_revoked_then_a_newer_writer_wins_and_its_bytes_never_land(
    world, scope, point
):
    # Given c1 write_file(notes.txt, v1) whose executor freezes at <point> (before its commit)
    world.submit(scope, "c1", "write_file", write("notes.txt", "v1"))
    zombie = world.execute(scope, "c1", failpoints=f"{point}=stop")
    world.frozen(zombie)
    # When its lease expires, the sweep marks it unknown, a human resolves it failed,
    world.revoke()
    c1 = execution_of(world.ledger, scope, "c1")
    code, _, err = world.cli(
        "resolve", "--execution-id", c1.execution_id, "--as", "failed", "--by", "dana",
        "--evidence", "no notes.txt: nothing happened",
    )  # fmt: skip
    assert code == 0, err
    # and a newer call c2 writes notes.txt = v2
    world.submit(scope, "c2", "write_file", write("notes.txt", "v2"))
    assert world.run(scope, "c2")["status"] == "succeeded"
    # and then the zombie wakes up
    code, out, err = world.wake(zombie)
    # Then the newer content survives: nothing of the zombie landed, its result is evidence
    assert code == 0, err
    assert json.loads(out)["outcome"] == "stale"
    assert world.file(scope, "notes.txt") == b"v2"
    c2 = execution_of(world.ledger, scope, "c2")
    assert [(e["execution_id"], e["path"]) for e in world.effects()] == [
        (c2.execution_id, "notes.txt")
    ]
    late = world.ledger.evidence_of(c1.execution_id)[-1].detail
    assert (late["landed"], late["proves"]) == (False, None)
    if point == "before_effect":  # it woke past its lease: its own sandbox refused to stage
        assert late["status"] == "unknown" and "LeaseLost" in late["error"]
    else:  # staged before it froze: the commit, not the sandbox, refused it
        assert late["status"] == "succeeded" and late["staged"][0]["path"] == "notes.txt"
    view = world.ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.review) == (Status.FAILED, None)
    assert world.pending() == [] and world.ledger.verify().ok


def test_fence__the_sweep_alone_settles_the_zombie_not_applied(world, scope):
    # The same, with no human: the sweep proves the zombie's effect absent from the fence
    world.submit(scope, "c1", "append_file", write("log.txt", "line 1\n"))
    zombie = world.execute(scope, "c1", failpoints="after_stage=stop")
    world.frozen(zombie)
    world.revoke()
    summary = world.sweep()
    assert summary.not_applied == 1 and summary.auto_retried == 0  # append: no auto retry
    world.wake(zombie)
    world.sweep()
    view = world.ledger.get(scope, "c1")
    assert (view.operation.status, view.current.result["error"]) == (Status.FAILED, "not_applied")
    assert world.file(scope, "log.txt") is None and world.effects() == []
    assert world.pending() == []


def test_fence__zombie_append_and_a_human_retry_exactly_one_line(world, scope):
    # Given an append frozen before its effect, revoked, and a human retry that runs at once
    world.submit(scope, "c1", "append_file", write("ledger.txt", "charge $10\n"))
    zombie = world.execute(scope, "c1", failpoints="before_effect=stop")
    world.frozen(zombie)
    world.revoke()
    code, out, err = world.cli(
        "retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol",
        "--accept-duplicate", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert world.run(scope, "c1")["status"] == "succeeded"  # attempt 2
    # When the zombie resumes and appends (its late result will prove nothing), and the sweep
    code, out, _ = world.wake(zombie)
    assert json.loads(out)["outcome"] == "stale"
    world.sweep()
    # Then exactly one line, from attempt 2; attempt 2 is not withdrawn nor flagged
    assert world.file(scope, "ledger.txt") == b"charge $10\n"
    first, second = world.ledger.get(scope, "c1").executions
    assert (first.status, first.result["error"]) == (Status.FAILED, "not_applied")
    assert second.status is Status.SUCCEEDED
    assert [e["execution_id"] for e in world.effects()] == [second.execution_id]
    assert world.ledger.get(scope, "c1").operation.review is None


# ---------------------------------------------------------------------------- after the commit


def test_fence__frozen_after_commit_a_newer_writer_drops_its_stale_bytes(world, scope):
    # Given c1 committed (succeeded) and frozen before it took the path's lock
    world.submit(scope, "c1", "write_file", write("notes.txt", "v1"))
    slow = world.execute(scope, "c1", failpoints="after_terminal=stop")
    world.frozen(slow)
    assert world.ledger.get(scope, "c1").operation.status is Status.SUCCEEDED
    # When c2 commits later on the same path and lands first
    world.submit(scope, "c2", "write_file", write("notes.txt", "v2"))
    landed = world.run(scope, "c2")["landing"]
    # Then c2 found c1's older committed bytes and dropped them: they can never land after v2
    assert (landed["landed"], landed["discarded"]) == (1, 1)
    world.wake(slow)
    assert world.file(scope, "notes.txt") == b"v2"
    c2 = execution_of(world.ledger, scope, "c2")
    assert [e["execution_id"] for e in world.effects()] == [c2.execution_id]
    assert world.pending() == []


def test_fence__frozen_while_landing_holds_one_path_others_land_in_commit_order(world, scope):
    # Given c1 committed and frozen while landing (it holds notes.txt's lock)
    world.submit(scope, "c1", "write_file", write("notes.txt", "v1"))
    slow = world.execute(scope, "c1", failpoints="before_publish=stop")
    world.frozen(slow)
    # When c2 commits on the same path and another call writes elsewhere in the scope
    world.submit(scope, "c2", "write_file", write("notes.txt", "v2"))
    busy = world.run(scope, "c2")
    world.submit(scope, "c3", "write_file", write("other.txt", "free"))
    free = world.run(scope, "c3")
    # Then only that path waits (c2 is recorded, its bytes wait); the rest of the scope does not
    assert busy["status"] == "succeeded" and busy["landing"]["busy"] == 1
    assert free["landing"]["landed"] == 1 and world.file(scope, "other.txt") == b"free"
    # and once c1 wakes and the next settle runs, the bytes land in commit order: v2 last
    world.wake(slow)
    world.sweep()
    assert world.file(scope, "notes.txt") == b"v2"
    on_notes = [e for e in world.effects() if e["path"] == "notes.txt"]
    assert [e["execution_id"] for e in on_notes] == [
        execution_of(world.ledger, scope, c).execution_id for c in ("c1", "c2")
    ]
    assert on_notes[0]["seq"] < on_notes[1]["seq"]
    assert world.pending() == []


def test_fence__killed_after_commit_settle_lands_the_effect_once(world, scope):
    world.submit(scope, "c1", "append_file", write("log.txt", "once\n"))
    proc = world.execute(scope, "c1", failpoints="after_publish=exit(9)")
    proc.communicate(timeout=60)
    assert proc.returncode == 9  # its bytes landed, the cleanup did not happen
    world.sweep()
    world.sweep()
    assert world.file(scope, "log.txt") == b"once\n" and world.pending() == []
    world.submit(scope, "c2", "append_file", write("log.txt", "twice\n"))
    proc = world.execute(scope, "c2", failpoints="before_publish=exit(9)")
    proc.communicate(timeout=60)
    assert proc.returncode == 9  # committed, its append intent recorded, no byte written
    world.sweep()
    assert world.file(scope, "log.txt") == b"once\ntwice\n" and world.pending() == []


# ---------------------------------------------------------------------------- proof


def test_proof__late_result_of_an_unfenced_tool_withdraws_the_human_retry(world, scope):
    # Given notify (an effect outside the sandbox) frozen after it ran, before its commit
    world.submit(scope, "c1", "notify", {"to": "ops"})
    zombie = world.execute(scope, "c1", failpoints="after_effect=stop")
    world.frozen(zombie)
    world.revoke()
    code, _, err = world.cli(
        "retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol", "--accept-duplicate"
    )
    assert code == 0, err
    # When the zombie wakes (its late result: the notification was sent) and the sweep runs
    world.wake(zombie)
    world.sweep()
    # Then attempt 1 is proven succeeded and the authorised attempt 2 is withdrawn
    view = world.ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.authorized_attempts) == (Status.SUCCEEDED, 1)
    assert view.current.result["notified"] == "ops" and view.current.reconciled
    assert [e.kind for e in world.ledger.events(scope, "c1")][-1] == "withdrawn"
    code, _, err = world.cli("execute", "--scope", scope, "--tool-call-id", "c1")
    assert code == 5 and "succeeded" in err  # nothing left to run


def test_proof__late_result_contradicting_a_human_goes_back_to_the_inbox(world, scope):
    world.submit(scope, "c1", "notify", {"to": "ops"})
    zombie = world.execute(scope, "c1", failpoints="after_effect=stop")
    world.frozen(zombie)
    world.revoke()
    c1 = execution_of(world.ledger, scope, "c1")
    code, _, err = world.cli(
        "resolve", "--execution-id", c1.execution_id, "--as", "failed", "--by", "dana",
        "--evidence", "no message in the channel",
    )  # fmt: skip
    assert code == 0, err
    world.wake(zombie)
    code, out, _ = world.cli("list", "--review", "--scope", scope, "--json")
    (row,) = json.loads(out)["calls"]
    assert row["review"] == "contradicted"
    code, out, _ = world.cli("show", "--scope", scope, "--tool-call-id", "c1", "--json")
    detail = json.loads(out)["review_detail"]
    assert (detail["human"]["status"], detail["late"]["status"]) == ("failed", "succeeded")
    code, out, _ = world.cli("verify", "--json")
    assert code == 0 and json.loads(out)["flagged"] == 1


# ---------------------------------------------------------------------------- execute


def test_execute__honours_failpoints_and_logs_them(world, scope):
    world.submit(scope, "c1", "write_file", write("a.txt", "x"))
    code, _, err = world.cli(
        "execute", "--scope", scope, "--tool-call-id", "c1", failpoints="after_effect=exit(23)"
    )
    assert code == 23, err
    fired = [json.loads(line) for line in (world.root / "failpoints.log").read_text().splitlines()]
    assert [(f["point"], f["action"]) for f in fired] == [("after_effect", "exit")]
    assert world.file(scope, "a.txt") is None  # staged, never committed: nothing landed


# ---------------------------------------------------------------------------- partitions


@pytest.fixture
def partition(pg_url: str) -> Iterator[Any]:
    from recovery.chaos.partition import Partition, unavailable
    from tests.conftest import missing_service

    reason = unavailable()
    if reason:
        missing_service("a network namespace for the partition", reason)
    with Ledger(pg_url).engine.connect() as conn:
        socket_dir = conn.exec_driver_sql("SHOW unix_socket_directories").scalar_one()
        port = conn.exec_driver_sql("SHOW port").scalar_one()
    part = Partition(f"{socket_dir.split(',')[0].strip()}/.s.PGSQL.{port}")
    address = part.start()
    part.url = str(
        sa.make_url(pg_url)
        .set(host=address.split(":")[0], port=int(address.split(":")[1]))
        .render_as_string(False)
    )
    yield part
    part.close()


@pytest.mark.postgres
@pytest.mark.parametrize("point", ["before_effect", "after_stage"])
def test_fence__partitioned_worker_lands_nothing_after_the_database_revoked_it(
    pg_url, tmp_path, partition, scope, point
):
    # Given an executor that reaches Postgres only through a path the test can cut, paused
    # (failpoint sleep) before its tool writes, or after it staged its bytes
    world = World(pg_url, tmp_path, Ledger(pg_url))
    world.submit(scope, "c1", "write_file", write("notes.txt", "v1"))
    proc = world.execute(
        scope, "c1", db=partition.url, failpoints=f"{point}=sleep(4)", lease_seconds="2"
    )
    fired = world.root / "failpoints.log"
    wait_until(lambda: fired.exists() and point in fired.read_text(), 60, "the failpoint")
    # When its network path to the database is cut (no RST: packets vanish) while the sweep
    # still reaches the database and revokes it once its lease expired
    partition.cut()
    world.revoke()
    out, err = proc.communicate(timeout=120)
    partition.heal()
    # Then the executor gave up on its own (self-fenced, or its commit never got through),
    # kept its outcome on disk, and nothing of it landed
    assert proc.returncode == 0, err
    assert json.loads(out)["outcome"] == "unrecorded"
    assert world.file(scope, "notes.txt") is None and world.effects() == []
    # and once the path is back, the next sweep records its result as evidence, drops its
    # staged bytes, and proves the effect absent
    summary = world.sweep()  # (the module's database: other tests' calls are in it too)
    assert summary.spooled_results >= 1
    c1 = execution_of(world.ledger, scope, "c1")
    assert (c1.status, c1.result["error"]) == (Status.FAILED, "not_applied")
    late = world.ledger.evidence_of(c1.execution_id)
    assert late and late[-1].detail["landed"] is False
    assert world.file(scope, "notes.txt") is None and world.pending() == []
    world.ledger.close()
