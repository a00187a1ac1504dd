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
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import sqlalchemy as sa

from tests.acceptance.conftest import wait_until
from toolledger import jsonlines
from toolledger.harness.processes import process_state, service_env, toolledger_argv
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.recovery.sweep import sweep
from toolledger.registry import load_registry
from toolledger.sandbox import Sandbox

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
        wait_until(
            lambda: process_state(proc.pid) == psutil.STATUS_STOPPED,
            60,
            "the executor to stop itself",
        )

    def wake(self, proc: subprocess.Popen[str]) -> tuple[int, str, str]:
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
        return proc.returncode, out, err

    def run(self, scope: str, cid: str, **settings: str) -> dict[str, Any]:
        proc = self.execute(scope, cid, **settings)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        return json.loads(out)  # type: ignore[no-any-return]

    def revoke(self, scope: str, cid: str = "c1") -> None:
        """The sweep's first step (every expired lease -> unknown, by the DB clock), until
        this call's execution is revoked (the module's database has other tests' calls)."""

        def revoked() -> bool:
            self.ledger.mark_expired(grace_seconds=0)
            return execution_of(self.ledger, scope, cid).status is Status.UNKNOWN

        wait_until(revoked, 30, "lease expiry")

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
        return jsonlines.read(self.effects_log)

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
    world.revoke(scope)
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
    world.revoke(scope)
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
    world.revoke(scope)
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


@pytest.mark.parametrize("tool", ["append_file", "write_file"])
def test_fence__a_lock_file_removed_under_a_frozen_lander_flags_nothing_that_landed(
    world, scope, tool
):
    """Before: the lander woke, found its stage gone (the sweep, under a lock file of its
    own, had landed it) and flagged the call not_landed, exit 1, "kept aside" bytes that
    did not exist: a person told to land them by hand would append the line twice."""
    # Given c1 committed and frozen while landing, holding its path's lock
    world.submit(scope, "c1", tool, write("log.txt", "once\n"))
    slow = world.execute(scope, "c1", failpoints="before_publish=stop")
    world.frozen(slow)
    # When the lock files are removed by hand and the sweep lands c1 under a new one
    shutil.rmtree(world.root / "sandbox" / ".toolledger" / "paths")
    world.sweep()
    assert world.file(scope, "log.txt") == b"once\n"
    # and the frozen lander wakes
    code, out, err = world.wake(slow)
    # Then it moved and judged nothing more: landed once, the call succeeded and unflagged
    assert code == 0, err
    assert json.loads(out)["review"] is None
    assert world.file(scope, "log.txt") == b"once\n"
    view = world.ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.review) == (Status.SUCCEEDED, None)
    world.sweep()
    assert world.pending() == [] and world.ledger.verify().ok


# ---------------------------------------------------------------------------- proof


def test_proof__late_result_of_an_unfenced_tool_withdraws_the_human_retry(world, scope):
    # Given notify (an effect outside the sandbox) frozen after it ran, before its commit
    world.submit(scope, "c1", "notify", {"to": "ops"})
    zombie = world.execute(scope, "c1", failpoints="after_effect=stop")
    world.frozen(zombie)
    world.revoke(scope)
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
    world.revoke(scope)
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
    fired = jsonlines.read(world.root / "failpoints.log")
    assert [(f["point"], f["action"]) for f in fired] == [("after_effect", "exit")]
    assert world.file(scope, "a.txt") is None  # staged, never committed: nothing landed


# ---------------------------------------------------------------------------- partitions


@pytest.fixture
def partition(pg_url: str) -> Iterator[Any]:
    from tests.conftest import missing_service
    from toolledger.harness.chaos.partition import Partition, unavailable

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
    world.revoke(scope)
    out, err = proc.communicate(timeout=120)
    partition.heal()
    # Then the executor gave up on its own (self-fenced, or its commit never got through),
    # kept its outcome on disk (exit 1: its end is not on record), and nothing of it landed
    assert proc.returncode == 1, err
    assert json.loads(out)["outcome"] == "unrecorded"
    assert "next sweep records it" in json.loads(err.strip().splitlines()[-1])["error"]
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


# ---------------------------------------------------------------------------- regressions
# Found by an adversarial review of the fence (its scripts, rewritten as tests).


def _waiting_on_a_lock(pg_url: str, needle: str) -> bool:
    import psycopg

    with psycopg.connect(pg_url.replace("+psycopg", ""), autocommit=True) as mon:
        return bool(
            mon.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database() AND query LIKE %s",
                (f"%{needle}%",),
            ).fetchone()[0]
        )


@pytest.mark.postgres
@pytest.mark.parametrize("first", ["write_file", "append_file"])
def test_order__a_commit_blocked_inside_its_statement_still_lands_in_commit_order(
    pg_url, tmp_path, scope, first
):
    """Before: c1's finish drew its seq, then waited on its operation row (locked by a human's
    frozen command); c2 committed meanwhile with a newer seq and landed; c1 then committed
    with the older seq and its write was dropped (or its append landed after c2's)."""
    import psycopg

    world = World(pg_url, tmp_path, Ledger(pg_url))
    world.submit(scope, "c1", first, write("notes.txt", "AAAA\n"))
    world.submit(scope, "c2", "append_file", write("notes.txt", "BBBB\n"))
    c1 = world.execute(scope, "c1", failpoints="after_effect=stop", lease_seconds="30")
    world.frozen(c1)
    key = world.ledger.key_for(scope, "c1")
    with psycopg.connect(pg_url.replace("+psycopg", "")) as locker:
        locker.execute(
            "SELECT 1 FROM operations WHERE scope = %s AND idempotency_key = %s FOR UPDATE",
            (scope, key),
        )
        os.kill(c1.pid, signal.SIGCONT)  # its commit now waits inside its statement
        wait_until(lambda: _waiting_on_a_lock(pg_url, "WITH done"), 30, "c1 blocked")
        c2 = world.execute(scope, "c2", lease_seconds="30", db_timeout="5")
        wait_until(lambda: _waiting_on_a_lock(pg_url, "pg_advisory_xact_lock"), 30, "c2 waits")
    for proc in (c1, c2):  # the lock released: c1 commits, then c2
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    world.sweep()
    seqs = [
        next(e.seq for e in world.ledger.events(scope, cid) if e.kind == "succeeded")
        for cid in ("c1", "c2")
    ]
    assert seqs[0] < seqs[1]  # the ledger's order is the order of the commits
    assert world.file(scope, "notes.txt") == b"AAAA\nBBBB\n"
    assert [e["seq"] for e in world.effects()] == seqs
    world.ledger.close()


@pytest.mark.postgres
def test_order__a_lander_that_cannot_ask_the_ledger_lands_nothing(pg_url, tmp_path, scope):
    """Before: a lander whose ledger read failed skipped another execution's half-done append
    and appended at the same offset; the redo later wrote over its bytes."""
    import psycopg

    world = World(pg_url, tmp_path, Ledger(pg_url))
    world.submit(scope, "c1", "append_file", write("log.txt", "AAAA\n"))
    world.submit(scope, "c2", "append_file", write("log.txt", "BBBB\n"))
    c1 = world.execute(scope, "c1", failpoints="before_publish=exit(9)")
    c1.communicate(timeout=60)
    assert c1.returncode == 9 and any("applying-0" in f for f in world.pending())
    c2 = world.execute(scope, "c2", failpoints="after_terminal=stop", db_timeout="1")
    world.frozen(c2)
    with psycopg.connect(pg_url.replace("+psycopg", "")) as locker:
        locker.execute("LOCK TABLE executions IN ACCESS EXCLUSIVE MODE")
        code, out, err = world.wake(c2)
        assert code == 0, err
        assert json.loads(out)["landing"]["busy"] == 1  # nothing landed, nothing guessed
    assert world.file(scope, "log.txt") is None
    world.sweep()
    assert world.file(scope, "log.txt") == b"AAAA\nBBBB\n" and world.pending() == []
    world.ledger.close()


def test_proof__a_late_result_withdraws_the_retry_before_anyone_claims_it(world, scope):
    """Before: the withdrawal waited for the next sweep, and only for unknown executions:
    a worker could claim attempt 2 in between and notify twice."""
    world.submit(scope, "c1", "notify", {"to": "ops"})
    zombie = world.execute(scope, "c1", failpoints="after_effect=stop")
    world.frozen(zombie)
    world.revoke(scope)
    code, _, err = world.cli("retry", "--scope", scope, "--tool-call-id", "c1", "--by", "carol",
                             "--accept-duplicate")  # fmt: skip
    assert code == 0, err
    world.wake(zombie)  # its late result: the notification was sent — and no sweep runs
    view = world.ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.authorized_attempts) == (Status.SUCCEEDED, 1)
    assert [e.kind for e in world.ledger.events(scope, "c1")][-2:] == ["succeeded", "withdrawn"]
    code, _, err = world.cli("execute", "--scope", scope, "--tool-call-id", "c1")
    assert code == 5 and len(world.ledger.get(scope, "c1").executions) == 1


def test_proof__a_contradicted_call_runs_no_new_attempt_until_reviewed(world, scope):
    world.submit(scope, "c1", "notify", {"to": "ops"})
    zombie = world.execute(scope, "c1", failpoints="after_effect=stop")
    world.frozen(zombie)
    world.revoke(scope)
    first = execution_of(world.ledger, scope, "c1")
    world.cli("resolve", "--execution-id", first.execution_id, "--as", "failed", "--by", "dana",
              "--evidence", "nothing in the channel")  # fmt: skip
    world.cli("retry", "--scope", scope, "--tool-call-id", "c1", "--by", "dana",
              "--accept-duplicate")  # fmt: skip
    world.wake(zombie)  # contradicted: the human said failed, the late result says sent
    code, _, err = world.cli("execute", "--scope", scope, "--tool-call-id", "c1")
    assert code == 5 and "review" in err  # attempt 2 is not claimed while the call is flagged
    # a resolution decided on the unknown execution, sent now, is no review of the flag its
    # sender never saw (it was taken as one, and attempt 2 ran: a cold review)
    code, _, err = world.cli(
        "resolve", "--execution-id", first.execution_id, "--as", "failed", "--by", "carol",
        "--evidence", "nothing in the channel when I looked",
    )  # fmt: skip
    assert code == 5 and "flagged contradicted since" in err, err
    code, _, err = world.cli("execute", "--scope", scope, "--tool-call-id", "c1")
    assert code == 5 and "review" in err  # still held
    code, _, err = world.cli(
        "resolve", "--execution-id", first.execution_id, "--as", "succeeded", "--by", "erin",
        "--evidence", "it is in the channel after all", "--review",
    )  # fmt: skip
    assert code == 0, err
    view = world.ledger.get(scope, "c1")  # the review proved attempt 1: attempt 2 withdrawn
    assert (view.operation.status, view.operation.review, len(view.executions)) == (
        Status.SUCCEEDED,
        None,
        1,
    )


def test_order__an_effect_that_cannot_land_after_its_commit_is_flagged(world, scope):
    """Before: c1's committed write of d/f, crashed before landing, was set aside silently
    when c2 had made d a file; the ledger said c1 succeeded and nobody was asked."""
    world.submit(scope, "c1", "write_file", write("d/f", "one"))
    proc = world.execute(scope, "c1", failpoints="after_terminal=exit(9)")
    proc.communicate(timeout=60)
    world.submit(scope, "c2", "write_file", write("d", "two"))
    assert world.run(scope, "c2")["status"] == "succeeded"
    world.sweep()
    assert world.file(scope, "d") == b"two"
    view = world.ledger.get(scope, "c1")
    assert (view.operation.status, view.operation.review) == (Status.SUCCEEDED, "not_landed")
    _code, out, _ = world.cli("list", "--review", "--scope", scope, "--json")
    assert [c["tool_call_id"] for c in json.loads(out)["calls"]] == ["c1"]


def c1_frozen_its_retry_authorised_then_c2(world: Any, scope: str) -> Any:
    """c1 (write p.txt) frozen before its effect and revoked, its attempt 2 authorised on the
    missing target; then c2, a newer write of p.txt, submitted. The frozen process is kept."""
    world.submit(scope, "c1", "write_file", write("p.txt", "OLD (c1)\n"))
    zombie = world.execute(scope, "c1", failpoints="before_effect=stop")
    world.frozen(zombie)
    world.revoke(scope)
    assert world.sweep().auto_retried >= 1  # (the module's ledger holds other tests' calls)
    c1 = world.ledger.get(scope, "c1").operation
    assert (c1.status, c1.authorized_attempts) == (Status.APPROVED, 2)  # target missing: attempt 2
    world.submit(scope, "c2", "write_file", write("p.txt", "NEW (c2)\n"))
    return zombie


def test_order__an_automatic_retry_never_overwrites_a_newer_write(world, scope):
    """Before: the sweep saw p.txt missing and authorised attempt 2 of c1; c2 then wrote
    p.txt; attempt 2 ran later and overwrote c2's bytes with c1's older request."""
    zombie = c1_frozen_its_retry_authorised_then_c2(world, scope)
    assert world.run(scope, "c2")["status"] == "succeeded"
    late = world.run(scope, "c1")  # attempt 2 runs only now
    assert (late["status"], late["executions"][-1]["result"]["error"]) == ("failed", "superseded")
    assert world.file(scope, "p.txt") == b"NEW (c2)\n"
    world.wake(zombie)
    assert world.file(scope, "p.txt") == b"NEW (c2)\n"


def test_order__an_automatic_retry_never_overwrites_a_newer_write_not_landed_yet(world, scope):
    """A cold review: as above, but c2's executor died between its commit and its landing.
    The retry's reconciler saw p.txt still missing (c2's bytes committed, waiting to land),
    called the effect absent, wrote c1's older bytes and committed after c2: they landed
    last, over c2's. Bytes waiting on the path now mean "cannot tell": superseded."""
    zombie = c1_frozen_its_retry_authorised_then_c2(world, scope)
    crashed = world.execute(scope, "c2", failpoints="after_terminal=exit(9)")
    crashed.communicate(timeout=60)  # committed, not landed
    assert world.ledger.get(scope, "c2").operation.status is Status.SUCCEEDED
    assert world.file(scope, "p.txt") is None
    late = world.run(scope, "c1")  # attempt 2 runs only now
    assert (late["status"], late["executions"][-1]["result"]["error"]) == ("failed", "superseded")
    world.sweep()
    assert world.file(scope, "p.txt") == b"NEW (c2)\n"
    world.wake(zombie)
    world.sweep()
    assert world.file(scope, "p.txt") == b"NEW (c2)\n"


# ---------------------------------------------------- effects outside the sandbox: no fence

PAYMENTS = "tests.external_tools,tests.payment_tools"


@pytest.mark.parametrize("revoked", [True, False], ids=["revoked", "lease-passed"])
def test_lease__frozen_between_claim_and_tool_the_tool_never_starts(
    world, scope, tmp_path, monkeypatch, revoked
):
    """A worker frozen after its claim, past its lease: woken, it started the tool anyway
    (a tool outside the sandbox has no fence; it was told only through ``ctx.lease_lost``,
    if the keeper's thread had run). Now it never starts it, and says so on record: the
    sweep proves the effect absent (``not_applied``), whether the ledger had revoked the
    execution before it woke or only its own clock said the lease was gone."""
    charges = tmp_path / "charges.log"
    monkeypatch.setenv("TEST_CHARGES_LOG", str(charges))
    world.submit(scope, "c1", "careful_charge", {"amount": 10})
    proc = world.execute(scope, "c1", failpoints="after_claim=stop", tools=PAYMENTS)
    world.frozen(proc)
    if revoked:
        world.revoke(scope)
    else:
        time.sleep(float(LEASE) + 0.5)  # its own clock's deadline passed; nobody swept
    code, out, err = world.wake(proc)
    assert code == 0, err
    assert json.loads(out)["outcome"] == "stale" and not charges.exists()
    ex = execution_of(world.ledger, scope, "c1")
    (late,) = world.ledger.evidence_of(ex.execution_id)
    assert late.detail["not_started"] and late.detail["absent"]
    world.revoke(scope)  # (at once if it was; else once the database's lease expires)
    world.sweep()
    ex = execution_of(world.ledger, scope, "c1")
    assert (ex.status, ex.result["error"]) == (Status.FAILED, "not_applied")
    assert not charges.exists() and world.ledger.verify().ok


def test_lease__a_tool_that_checks_lease_lost_sees_it_after_a_freeze(
    world, scope, tmp_path, monkeypatch
):
    """The README asks a tool that cannot undo its effect to check ``ctx.lease_lost``
    first. Frozen just before the tool and revoked meanwhile, the tool read the flag clear
    in 2 of 5 runs of a cold review (12-05): the keeper's thread had not run since the
    freeze, and only it set the flag. The flag now reads the lease's deadline itself."""
    charges = tmp_path / "charges.log"
    monkeypatch.setenv("TEST_CHARGES_LOG", str(charges))
    for i in range(3):
        cid = f"c{i}"
        world.submit(scope, cid, "careful_charge", {"amount": i})
        proc = world.execute(scope, cid, failpoints="before_effect=stop", tools=PAYMENTS)
        world.frozen(proc)
        world.revoke(scope, cid)
        code, out, err = world.wake(proc)
        assert code == 0, err
        assert json.loads(out)["outcome"] == "stale"
        assert not charges.exists(), charges.read_text()
