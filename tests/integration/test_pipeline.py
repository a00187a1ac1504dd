"""The execute pipeline in-process, on both backends, with tools written for each case."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from billiard.exceptions import SoftTimeLimitExceeded
from pydantic import BaseModel

from tests.helpers import pending_files
from toolledger import failpoints
from toolledger.builtin_tools import BUILTINS
from toolledger.effects import LeaseLost, effects_of, path_hash
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.models import executions
from toolledger.ledger.transitions import Review, Status
from toolledger.ledger.types import db_now_plus
from toolledger.recovery.sweep import sweep
from toolledger.sandbox import Sandbox
from toolledger.tools import OutcomeUnknown, Registry, ToolContext, ToolError, make_tool
from toolledger.worker.pipeline import Executor, LeaseKeeper


def expire_lease(ledger: Ledger, execution_id: str) -> None:
    """End a running execution's lease now, as its running out would. These tests ran with a
    0.3 s lease and slept past it: on a loaded machine (CI) the lease keeper missed a renewal
    before the tool started, the tool was never run, and the spool the test reads was never
    written (CI's one failure of this file)."""
    with ledger.engine.begin() as conn:
        conn.execute(
            executions.update()
            .where(executions.c.execution_id == execution_id, executions.c.status == "running")
            .values(lease_expires_at=db_now_plus(-1))
        )


class NoArgs(BaseModel):
    pass


class Sleep(BaseModel):
    seconds: float


def ok(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    return {"ok": True, "execution_id": ctx.execution_id}


def reports_failure(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise ToolError("the printer is on fire", code=451)


def crashes(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise ZeroDivisionError("boom")


def cannot_tell(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise OutcomeUnknown("the payment API timed out")


#: A file name with a byte that is not UTF-8, as ``os.listdir`` gives it (surrogateescape).
UNDECODABLE = b"r\xe9sum\xe9.txt".decode("utf-8", "surrogateescape")


def lists_an_undecodable_name(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    return {"files": [UNDECODABLE], UNDECODABLE: 1}


def fails_on_an_undecodable_name(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise FileNotFoundError(2, "No such file", UNDECODABLE)


def reports_an_undecodable_name(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise ToolError(f"cannot read {UNDECODABLE}", path=UNDECODABLE)


def fails_with_a_nul(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise ValueError("bad\x00byte")


def returns_a_nul(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    return {"x": "a\x00b"}


class Unshowable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class UnshowableUnknown(OutcomeUnknown, Unshowable):
    pass


def fails_unshowably(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise Unshowable()


def cannot_tell_unshowably(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise UnshowableUnknown()


def reports_what_is_not_json(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise ToolError("quota", until=datetime(2027, 1, 1, tzinfo=UTC), raw=b"\x00")


def reports_a_number(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    raise ToolError(451)  # type: ignore[arg-type]


def sleeps(args: Sleep, ctx: ToolContext) -> dict[str, Any]:
    time.sleep(args.seconds)
    return {"slept": args.seconds}


def waits_for_lease_loss(args: Sleep, ctx: ToolContext) -> dict[str, Any]:
    lost = ctx.lease_lost.wait(args.seconds)
    return {"noticed_lease_loss": lost}


def writes_after_lease_loss(args: Sleep, ctx: ToolContext) -> dict[str, Any]:
    """Waits (at most ``seconds``) for this process to lose its lease, then tries to write."""
    noticed = ctx.lease_lost.wait(args.seconds)
    ctx.sandbox.write_atomic(ctx.scope, "late.txt", b"late")
    return {"noticed_lease_loss": noticed}


class Threads(BaseModel):
    threads: int


def writes_from_threads(args: Threads, ctx: ToolContext) -> dict[str, Any]:
    """Stages from ``threads`` threads at once: a file each, and a line each on one file."""
    start = threading.Barrier(args.threads)

    def write(i: int) -> None:
        start.wait()
        ctx.sandbox.write_atomic(ctx.scope, f"t{i}.txt", f"{i}".encode())
        ctx.sandbox.append(ctx.scope, "all.txt", f"{i}\n".encode())

    workers = [threading.Thread(target=write, args=(i,)) for i in range(args.threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return {"threads": args.threads}


def writes_again_after_a_full_disk(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    """Its first write fails (the disk is full); it tries once more, then writes another."""
    try:
        ctx.sandbox.write_atomic(ctx.scope, "first.txt", b"1")
    except OSError as exc:
        ctx.sandbox.write_atomic(ctx.scope, "first.txt", b"1 again")
        ctx.sandbox.write_atomic(ctx.scope, "second.txt", b"2")
        return {"first": exc.strerror}
    return {"first": "written"}


class FailingDisk:
    """``toolledger.effects``' view of ``os`` on a failing disk: once armed, a write stops
    after 8 bytes (ENOSPC), and the clean-up's unlink fails too (EIO), and so does its
    setting aside unless ``renames``."""

    armed = False

    def __init__(self, *, renames: bool) -> None:
        self.renames = renames

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: Any) -> int:
        if FailingDisk.armed:
            os.write(fd, bytes(data[:8]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(fd, data)

    def unlink(self, *args: Any, **kwargs: Any) -> None:
        if FailingDisk.armed:
            FailingDisk.armed = not self.renames
            raise OSError(errno.EIO, "Input/output error")
        os.unlink(*args, **kwargs)

    def rename(self, *args: Any, **kwargs: Any) -> None:
        if FailingDisk.armed:
            FailingDisk.armed = False
            raise OSError(errno.EIO, "Input/output error")
        os.rename(*args, **kwargs)


def appends_after_a_failed_write(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    """Its write fails half-way on a failing disk; it appends to the same file instead."""
    FailingDisk.armed = True
    with contextlib.suppress(OSError):
        ctx.sandbox.write_atomic(ctx.scope, "r.txt", b"PARTIAL-WRITE-NEVER-COMMITTED")
    ctx.sandbox.append(ctx.scope, "r.txt", b"appended\n")
    return {"ok": True}


def appends_to_what_becomes_a_folder(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    """As ``appends_after_a_failed_write``; then r.txt becomes a folder: the append is
    committed but can never land."""
    appends_after_a_failed_write(args, ctx)
    (ctx.sandbox.root / ctx.scope / "r.txt").mkdir(parents=True)
    return {"ok": True}


def writes_an_undecodable_name(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    ctx.sandbox.write_atomic(ctx.scope, UNDECODABLE, b"v")
    return {"ok": True}


#: What the thread ``leaves_a_writer_behind`` left was told when it wrote after the call.
LEFT_BEHIND: dict[str, Any] = {}


def leaves_a_writer_behind(args: Sleep, ctx: ToolContext) -> dict[str, Any]:
    """Returns at once; a thread it started writes ``seconds`` later, after the call."""

    def write_late() -> None:
        time.sleep(args.seconds)
        try:
            ctx.sandbox.write_atomic(ctx.scope, "behind.txt", b"after the call")
            LEFT_BEHIND[ctx.execution_id] = "written"
        except LeaseLost as exc:
            LEFT_BEHIND[ctx.execution_id] = exc

    LEFT_BEHIND["thread"] = threading.Thread(target=write_late)
    LEFT_BEHIND["thread"].start()
    return {"left": "a writer"}


REGISTRY = Registry(
    [
        *(
            make_tool(f)
            for f in (
                ok,
                reports_failure,
                crashes,
                cannot_tell,
                sleeps,
                waits_for_lease_loss,
                lists_an_undecodable_name,
                fails_on_an_undecodable_name,
                reports_an_undecodable_name,
                fails_with_a_nul,
                returns_a_nul,
                fails_unshowably,
                cannot_tell_unshowably,
                reports_what_is_not_json,
                reports_a_number,
            )
        ),
        make_tool(writes_after_lease_loss, sandboxed=True),
        make_tool(writes_from_threads, sandboxed=True),
        make_tool(leaves_a_writer_behind, sandboxed=True),
        make_tool(writes_again_after_a_full_disk, sandboxed=True),
        make_tool(appends_after_a_failed_write, sandboxed=True),
        make_tool(writes_an_undecodable_name, sandboxed=True),
        make_tool(appends_to_what_becomes_a_folder, sandboxed=True),
        *(t for t in BUILTINS if t.name in ("write_file", "append_file")),
    ]
)


@pytest.fixture
def run(ledger, scope, tmp_path):
    def _run(
        tool: str,
        args: dict[str, Any] | None = None,
        lease: float = 30.0,
        executor_ledger: Ledger | None = None,
        time_limit: float = 0.0,
    ) -> tuple[Any, Any]:
        cid = f"c{time.monotonic_ns()}"
        ledger.submit(scope, cid, tool, args or {}, approved_by="al")
        executor = Executor(
            executor_ledger or ledger,
            REGISTRY,
            Sandbox(tmp_path),
            worker_id="w",
            lease_seconds=lease,
            leases=LeaseKeeper(executor_ledger or ledger, lease, time_limit),
        )
        outcome = executor.execute(scope, f"{tool}:{cid}", 1)
        return outcome, ledger.get(scope, cid)

    return _run


def test_pipeline__success_records_result_and_receipt(run, ledger):
    outcome, view = run("ok")
    assert outcome.state == "finished" and view.operation.status is Status.SUCCEEDED
    assert view.current.result == {"ok": True, "execution_id": view.current.execution_id}
    assert ledger.receipt(view.scope, view.tool_call_id).content == view.current.result


def test_pipeline__tool_error_is_failed_with_its_detail(run):
    _, view = run("reports_failure")
    assert view.operation.status is Status.FAILED
    assert view.current.result == {
        "error": "tool_error",
        "message": "the printer is on fire",
        "code": 451,
    }
    assert view.current.error == "the printer is on fire"


def test_pipeline__unexpected_exception_is_failed(run):
    _, view = run("crashes")
    assert view.current.status is Status.FAILED
    assert view.current.result == {"error": "ZeroDivisionError", "message": "boom"}


def test_pipeline__a_lone_surrogate_in_a_result_or_an_error_is_recorded_escaped(run):
    """Before: a file name with an undecodable byte in a tool's result or error made the
    terminal write fail on every try (no database stores a lone surrogate): the call stayed
    running and the sweep declared it unknown, its effect done."""
    escaped = "r\\udce9sum\\udce9.txt"  # the escapes, as text
    outcome, view = run("lists_an_undecodable_name")
    assert outcome.state == "finished" and view.current.status is Status.SUCCEEDED
    assert view.current.result == {"files": [escaped], escaped: 1}
    _, view = run("fails_on_an_undecodable_name")
    assert view.current.status is Status.FAILED
    assert view.current.error == f"FileNotFoundError: [Errno 2] No such file: '{escaped}'"
    assert view.current.result["message"] == f"[Errno 2] No such file: '{escaped}'"
    _, view = run("reports_an_undecodable_name")
    assert view.current.status is Status.FAILED and view.current.error == f"cannot read {escaped}"
    assert view.current.result["path"] == escaped


def test_pipeline__a_nul_in_an_error_is_recorded_escaped_in_a_result_as_it_is(run):
    """Before: on Postgres (its text refuses NUL) a tool error holding a NUL could not be
    recorded: the result was spooled and every later try failed too. JSON keeps it."""
    outcome, view = run("fails_with_a_nul")
    assert outcome.state == "finished" and view.current.status is Status.FAILED
    assert view.current.error == "ValueError: bad\\x00byte"
    assert view.current.result == {"error": "ValueError", "message": "bad\x00byte"}
    outcome, view = run("returns_a_nul")
    assert outcome.state == "finished" and view.current.result == {"x": "a\x00b"}


def test_pipeline__whatever_a_tool_raises_ends_in_something_the_ledger_stores(run, ledger):
    """Before: a ToolError whose detail was not JSON, or an exception whose str() raised,
    made the terminal write (or run_tool itself) fail: the call stayed running."""
    outcome, view = run("reports_what_is_not_json")
    assert outcome.state == "finished" and view.current.status is Status.FAILED
    assert view.current.error == "quota"
    assert view.current.result["warning"] == "tool result was not JSON"
    assert "tool_error" in view.current.result["result_repr"]
    outcome, view = run("reports_a_number")
    assert (outcome.state, view.current.error) == ("finished", "451")
    outcome, view = run("fails_unshowably")
    assert outcome.state == "finished" and view.current.status is Status.FAILED
    assert view.current.error == "Unshowable: (Unshowable could not be shown)"
    outcome, view = run("cannot_tell_unshowably")  # still the tool's word: it cannot tell
    assert outcome.state == "unknown" and view.current.status is Status.UNKNOWN
    last = ledger.events(view.scope, view.tool_call_id)[-1]
    assert last.detail["reason"] == "UnshowableUnknown: (UnshowableUnknown could not be shown)"


def test_pipeline__a_tool_staging_from_many_threads_lands_every_effect(run, ledger, tmp_path):
    # Before: each effect took its number from len(staged) without a lock, so two threads
    # staging at once drew the same one; the landing kept one effect a number and dropped
    # the other's bytes (a spooled result with them was refused as damaged).
    outcome, view = run("writes_from_threads", {"threads": 8})
    assert outcome.state == "finished" and view.current.status is Status.SUCCEEDED
    effects = view.current.effects
    assert sorted(e["n"] for e in effects) == list(range(16))
    root = tmp_path / view.scope
    assert {p.name: p.read_text() for p in root.glob("t*.txt")} == {
        f"t{i}.txt": str(i) for i in range(8)
    }
    assert sorted((root / "all.txt").read_text().split()) == [str(i) for i in range(8)]
    assert not pending_files(Sandbox(tmp_path)) and ledger.verify().ok


def test_pipeline__a_thread_left_behind_cannot_write_after_the_call(run, ledger, tmp_path):
    # Before: a thread the tool started could stage after the seal; its bytes sat in the
    # pending area under a committed execution that never named them.
    outcome, view = run("leaves_a_writer_behind", {"seconds": 0.3})
    LEFT_BEHIND.pop("thread").join()
    told = LEFT_BEHIND.pop(outcome.execution_id)
    assert isinstance(told, LeaseLost) and "has returned" in str(told)
    assert view.current.status is Status.SUCCEEDED and not view.current.effects
    assert not (tmp_path / view.scope / "behind.txt").exists()
    assert not pending_files(Sandbox(tmp_path)) and ledger.verify().ok


def test_pipeline__a_stage_that_fails_leaves_nothing_and_frees_its_number(
    run, ledger, tmp_path, monkeypatch
):
    # Before: a stage file whose write failed stayed in the pending area under its number,
    # which the tool's next stage drew again: retrying the same path failed (FileExistsError),
    # and on another path the leftover sat there, named by no commit, until set aside.
    real_fsync, failed = os.fsync, []

    def full_disk_once(fd: int) -> None:
        if not failed and os.readlink(f"/proc/self/fd/{fd}").endswith(".write"):
            failed.append(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr("toolledger.effects.os.fsync", full_disk_once)
    outcome, view = run("writes_again_after_a_full_disk")
    assert failed and outcome.state == "finished" and view.current.status is Status.SUCCEEDED
    assert view.current.result == {"first": "No space left on device"}
    assert [(e["n"], e["path"]) for e in view.current.effects] == [
        (0, "first.txt"),
        (1, "second.txt"),
    ]
    root = tmp_path / view.scope
    assert (root / "first.txt").read_text() == "1 again" and (
        root / "second.txt"
    ).read_text() == "2"
    assert not pending_files(Sandbox(tmp_path)) and ledger.verify().ok


def test_pipeline__a_stage_file_left_by_a_failed_stage_is_never_taken_for_an_effect(
    run, ledger, tmp_path, monkeypatch
):
    # Before: landing matched a stage file to its commit's effect by number alone (and by
    # path hash in settle): a failed write's leftover (one that could be neither removed nor
    # set aside), numbered 0 like the append the commit named, landed its partial bytes in
    # place of the append.
    monkeypatch.setattr("toolledger.effects.os", FailingDisk(renames=False))
    outcome, view = run("appends_after_a_failed_write")
    assert outcome.state == "finished" and view.current.status is Status.SUCCEEDED
    assert [(e["n"], e["kind"]) for e in view.current.effects] == [(0, "append")]
    target = tmp_path / view.scope / "r.txt"
    assert target.read_bytes() == b"appended\n"
    sandbox = Sandbox(tmp_path)
    assert [n.rsplit(".", 1)[1] for n in pending_files(sandbox)] == ["write"]
    landing = effects_of(sandbox).settle(ledger)  # the leftover is set aside, never landed
    assert (landing.landed, landing.refused) == (0, 1)
    assert target.read_bytes() == b"appended\n"
    assert [n.rsplit(".", 1)[1] for n in pending_files(sandbox)] == ["refused"]


def test_pipeline__bytes_set_aside_are_never_replaced_by_others_set_aside_later(
    run, ledger, tmp_path, monkeypatch
):
    # Before: the committed append that could not land (its target a folder now) was kept
    # aside as <eid>.0.<path>.refused for a human, told so; setting aside the failed write's
    # leftover (same number, same path) later renamed it onto that name, replacing the bytes.
    monkeypatch.setattr("toolledger.effects.os", FailingDisk(renames=False))
    _, view = run("appends_to_what_becomes_a_folder")
    assert view.current.status is Status.SUCCEEDED
    sandbox = Sandbox(tmp_path)
    landing = effects_of(sandbox).settle(ledger)
    assert landing.refused == 1 and landing.landed == 0
    kept = effects_of(sandbox).pending_dir.iterdir()
    assert sorted(p.read_bytes() for p in kept) == [b"PARTIAL-", b"appended\n"]
    assert all(n.endswith(".refused") for n in pending_files(sandbox))
    assert effects_of(sandbox).has_pending() is False


def test_pipeline__a_failed_stage_that_cannot_be_removed_is_set_aside_and_its_call_recorded(
    spooled, run, ledger, db_url, tmp_path, monkeypatch
):
    # Before: a failed write's leftover that could not be removed stayed among the call's
    # stages; a spool of the call (the ledger unreachable) named the stages it made, not the
    # leftover, and settle refused it: the call went unknown, then failed, its bytes dropped.
    monkeypatch.setattr("toolledger.effects.os", FailingDisk(renames=True))
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.001)
    broken = FinishUnreachable(db_url)
    try:
        outcome, view = run("appends_after_a_failed_write", executor_ledger=broken)
    finally:
        broken.close()
    assert outcome.state == "unrecorded"
    sandbox = Sandbox(tmp_path)
    kinds = sorted(n.rsplit(".", 1)[1] for n in pending_files(sandbox))
    assert kinds == ["append", "refused", "spool"]  # the leftover set aside at once
    landing = effects_of(sandbox).settle(ledger)
    assert (landing.recorded, landing.landed, landing.failed) == (1, 1, 0), landing.problems
    assert ledger.execution(outcome.execution_id).status is Status.SUCCEEDED
    assert (tmp_path / view.scope / "r.txt").read_bytes() == b"appended\n"
    assert [n.rsplit(".", 1)[1] for n in pending_files(sandbox)] == ["refused"]


def test_pipeline__an_outcome_neither_the_ledger_nor_the_disk_took_is_not_said_spooled(
    run, db_url, monkeypatch, caplog
):
    """helper-90: on a full disk the terminal write failed, the spool failed, and the worker
    logged "spooled; the next sweep records it" (``execute`` said "kept on disk"). The
    outcome says it was not kept, and the log that it is lost."""
    import errno

    from toolledger.effects import Effects

    def full(*_: Any, **__: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Effects, "spool", full)
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.001)
    caplog.set_level("ERROR", logger="toolledger")
    broken = FinishUnreachable(db_url)
    try:
        outcome, _ = run("ok", executor_ledger=broken)
    finally:
        broken.close()
    assert (outcome.state, outcome.kept) == ("unrecorded", False)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "nor keep it on disk: lost" in said and "spooled;" not in said


def test_pipeline__a_path_no_ledger_can_record_is_refused_before_it_is_staged(run, tmp_path):
    # Before: a tool writing a name with an undecodable byte (as os.listdir gives it) staged
    # it, and the terminal write raised UnicodeEncodeError out of execute: the call stayed
    # running until the sweep declared it unknown.
    outcome, view = run("writes_an_undecodable_name")
    assert outcome.state == "finished" and view.current.status is Status.FAILED
    assert "is not valid Unicode" in view.current.error
    assert not pending_files(Sandbox(tmp_path)) and not (tmp_path / view.scope).exists()


def test_pipeline__outcome_unknown_is_declared_unknown_by_the_executor(run, ledger):
    outcome, view = run("cannot_tell")
    assert outcome.state == "unknown" and view.operation.status is Status.UNKNOWN
    assert view.current.result is None
    last = ledger.events(view.scope, view.tool_call_id)[-1]
    assert last.kind == "unknown" and "timed out" in last.detail["reason"]


def test_pipeline__arguments_invalid_at_execution_fail_refused(run):
    _, view = run("sleeps", {"seconds": "not a number"})
    assert view.current.status is Status.FAILED
    assert view.current.result["error"] == "refused"


def test_pipeline__unknown_tool_at_execution_fails_refused(ledger, scope, tmp_path):
    ledger.submit(scope, "c1", "vanished_tool", {}, approved_by="al")
    outcome = Executor(
        ledger, REGISTRY, Sandbox(tmp_path), worker_id="w", lease_seconds=30
    ).execute(scope, "vanished_tool:c1", 1)
    assert outcome.status is Status.FAILED and "unknown tool" in outcome.result["message"]


def test_pipeline__heartbeat_keeps_a_long_tool_alive(run, ledger):
    # lease 2 s, tool 3.5 s: without renewals the lease would expire mid-run. A renewal is
    # due every 0.67 s and the claim self-fences 1.6 s after the last one was sent: 0.9 s of
    # slack for a renewal on a loaded machine (1.2 s / 2.5 s left 0.56 s, and a CI run on two
    # busy cores once took longer: the claim was treated as lost, correctly, and the test failed).
    marked: list[Any] = []
    stop = threading.Event()

    def sweeper() -> None:
        while not stop.wait(0.2):
            marked.extend(ledger.mark_expired(grace_seconds=0))

    t = threading.Thread(target=sweeper)
    t.start()
    try:
        outcome, view = run("sleeps", {"seconds": 3.5}, lease=2.0)
    finally:
        stop.set()
        t.join()
    assert outcome.state == "finished" and view.operation.status is Status.SUCCEEDED
    assert view.current.execution_id not in {m.execution_id for m in marked}
    assert view.current.heartbeat_at > view.current.started_at


def test_pipeline__lease_lost_is_noticed_and_late_result_becomes_evidence(run, ledger, scope):
    def mark_when_running() -> None:
        for _ in range(100):
            rows = [c for c in ledger.list_calls(scope=scope, status=Status.RUNNING)]
            if rows:
                ledger.mark_unknown(rows[0].execution_id, reason="test", actor="t")
                return
            time.sleep(0.05)

    t = threading.Thread(target=mark_when_running)
    t.start()
    outcome, view = run("waits_for_lease_loss", {"seconds": 10}, lease=0.6)
    t.join()
    assert outcome.state == "stale"
    assert outcome.result == {"noticed_lease_loss": True}
    # its late result (no sandbox effect was refused: the report stands) is evidence, and
    # proof at once: the unknown execution is reconciled from it in the same transaction
    assert (view.current.status, view.current.reconciled) == (Status.SUCCEEDED, True)
    assert view.current.result == {"noticed_lease_loss": True}
    evidence, proven = ledger.events(scope, view.tool_call_id)[-2:]
    assert evidence.kind == "evidence"
    assert evidence.detail["late_result"] == {"noticed_lease_loss": True}
    assert (proven.kind, proven.detail["evidence"]["kind"]) == ("succeeded", "late_result")


class CommitThenFail(Ledger):
    """The COMMIT succeeds on the server, the client sees an error (celery#10271)."""

    def finish(self, *args: Any, **kwargs: Any) -> Any:
        super().finish(*args, **kwargs)
        raise sa.exc.OperationalError("COMMIT", {}, Exception("connection reset after commit"))


def test_pipeline__ambiguous_commit_is_resolved_by_rereading(run, ledger, db_url):
    flaky = CommitThenFail(db_url)
    outcome, view = run("ok", executor_ledger=flaky)
    assert outcome.state == "finished"
    assert view.current.status is Status.SUCCEEDED
    kinds = [e.kind for e in ledger.events(view.scope, view.tool_call_id)]
    assert kinds.count("succeeded") == 1 and "evidence" not in kinds
    flaky.close()


class CommitThenFailThenBlind(Ledger):
    """The terminal COMMIT succeeds and its answer is lost, and the re-read after it fails
    ``blind`` times too (the server closed every connection a moment)."""

    def __init__(self, url: str, blind: int) -> None:
        super().__init__(url)
        self.blind, self.finishes = blind, 0

    def finish(self, *args: Any, **kwargs: Any) -> Any:
        self.finishes += 1
        done = super().finish(*args, **kwargs)
        if self.finishes == 1:
            raise sa.exc.OperationalError("COMMIT", {}, Exception("connection reset after commit"))
        return done

    def effect_states(self, ids: Any) -> Any:
        if self.blind:
            self.blind -= 1
            raise sa.exc.OperationalError("SELECT", {}, Exception("server closed the connection"))
        return super().effect_states(ids)


@pytest.mark.parametrize("blind", [1, 100])
def test_pipeline__an_own_commit_unanswered_and_unreadable_lands_its_bytes(
    run, ledger, db_url, tmp_path, monkeypatch, blind
):
    """A cold review: the retry after the lost answer found the row no longer running (its
    own commit had moved it), took that for a revocation and dropped the staged bytes of a
    committed success; verify said ok and the file never came. Now the row is read again
    (once it answers: ``blind=1``), or the result is spooled and the next settle lands the
    bytes (``blind=100``): either way the bytes land once, and no late result is recorded."""
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.01)
    flaky = CommitThenFailThenBlind(db_url, blind)
    outcome, view = run(
        "append_file", {"path": "a.txt", "content": "hello\n"}, executor_ledger=flaky
    )
    assert outcome.state == ("finished" if blind == 1 else "unrecorded")
    assert view.current.status is Status.SUCCEEDED and not view.current.reconciled
    if blind > 1:
        effects_of(Sandbox(tmp_path)).settle(ledger)  # the next sweep, or the worker's start
    assert (tmp_path / view.scope / "a.txt").read_text() == "hello\n"
    kinds = [e.kind for e in ledger.events(view.scope, view.tool_call_id)]
    assert kinds.count("succeeded") == 1 and "evidence" not in kinds
    assert ledger.verify().ok
    assert pending_files(Sandbox(tmp_path)) == []
    flaky.close()


def test_pipeline__an_own_failure_unanswered_and_unreadable_is_not_evidence(
    run, ledger, db_url, tmp_path, monkeypatch
):
    """As above for a tool that failed: its spool is its own commit, not a late result (a
    cold review of the mend: a spooled failure still became an evidence event)."""
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.01)
    flaky = CommitThenFailThenBlind(db_url, 100)
    outcome, view = run("reports_failure", executor_ledger=flaky)
    assert outcome.state == "unrecorded"
    assert view.current.status is Status.FAILED and not view.current.reconciled
    effects_of(Sandbox(tmp_path)).settle(ledger)
    kinds = [e.kind for e in ledger.events(view.scope, view.tool_call_id)]
    assert kinds.count("failed") == 1 and "evidence" not in kinds
    assert pending_files(Sandbox(tmp_path)) == []
    flaky.close()


class FailsWhileAHumanDecides(Ledger):
    """The terminal write fails (nothing committed); meanwhile the sweep marks the execution
    unknown and a human resolves it ``failed``: the executor's next try meets a terminal row
    that is not its own write."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.decided = False

    def finish(self, execution_id: str, *args: Any, **kwargs: Any) -> Any:
        if not self.decided:
            self.decided = True
            self.mark_unknown(execution_id, reason="lease expired", actor="sweep")
            self.resolve(execution_id, Status.FAILED, by="alice", evidence="saw it fail")
            raise sa.exc.OperationalError("UPDATE", {}, Exception("connection reset"))
        return super().finish(execution_id, *args, **kwargs)


def test_pipeline__a_human_resolution_met_after_a_lost_write_is_not_taken_for_its_own(
    run, ledger, db_url, monkeypatch
):
    """Same status, but a human's word (``reconciled``): the executor's result is a late
    result, kept as evidence, not an own commit that needs no record."""
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.01)
    deciding = FailsWhileAHumanDecides(db_url)
    outcome, view = run("reports_failure", executor_ledger=deciding)
    assert outcome.state == "stale"
    assert view.current.status is Status.FAILED and view.current.reconciled
    kinds = [e.kind for e in ledger.events(view.scope, view.tool_call_id)]
    assert kinds[-1] == "evidence", kinds
    assert ledger.verify().ok
    deciding.close()


class FailsWhileTheSweepRevokes(Ledger):
    """The terminal write fails (a Postgres crash: nothing committed) while the sweep marks
    the execution unknown for its lease, which the crash kept the keeper from renewing."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.revoked = False

    def finish(self, execution_id: str, *args: Any, **kwargs: Any) -> Any:
        if not self.revoked:
            self.revoked = True
            self.mark_unknown(execution_id, reason="lease expired", actor="sweep")
            crash = psycopg.OperationalError("server closed the connection unexpectedly")
            raise sa.exc.OperationalError("UPDATE", {}, crash)  # as psycopg's, through SQLAlchemy
        return super().finish(execution_id, *args, **kwargs)


def test_pipeline__a_late_result_says_the_database_error_that_made_it_late(
    run, ledger, db_url, monkeypatch
):
    """The late result of an execution revoked while a database fault held its terminal
    write names that fault's error: it said nothing of it, and the chaos checker found such
    an unknown explained by nothing (CI's threads run, 12-07: a Postgres crash, 2 unknowns)."""
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.01)
    revoking = FailsWhileTheSweepRevokes(db_url)
    outcome, view = run("ok", executor_ledger=revoking)
    assert outcome.state == "stale"
    late = [e for e in ledger.events(view.scope, view.tool_call_id) if e.kind == "evidence"]
    assert len(late) == 1, late
    assert late[0].detail["write_error"].startswith("OperationalError"), late[0].detail
    revoking.close()


def test_pipeline__a_late_result_without_a_database_error_names_none(run, ledger, db_url):
    """Revoked with no write failing (the fence alone): no ``write_error``."""

    class RevokedFirst(Ledger):
        def finish(self, execution_id: str, *args: Any, **kwargs: Any) -> Any:
            self.mark_unknown(execution_id, reason="lease expired", actor="sweep")
            return super().finish(execution_id, *args, **kwargs)

    revoked = RevokedFirst(db_url)
    outcome, view = run("ok", executor_ledger=revoked)
    assert outcome.state == "stale"
    late = [e for e in ledger.events(view.scope, view.tool_call_id) if e.kind == "evidence"]
    assert len(late) == 1 and "write_error" not in late[0].detail, late
    revoked.close()


class AlwaysFails(Ledger):
    def finish(self, *args: Any, **kwargs: Any) -> Any:
        raise sa.exc.OperationalError("UPDATE", {}, Exception("database is gone"))


def test_pipeline__terminal_write_impossible_leaves_running(run, db_url, monkeypatch):
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.01)
    broken = AlwaysFails(db_url)
    outcome, view = run("ok", executor_ledger=broken)
    assert outcome.state == "unrecorded"
    assert view.current.status is Status.RUNNING  # for the sweep: unknown, then reconcile
    broken.close()


def test_pipeline__failpoint_after_claim_raise_leaves_running(run, monkeypatch):
    failpoints.configure("after_claim=1*raise")
    try:
        with pytest.raises(failpoints.FailpointError):
            run("ok")
    finally:
        failpoints.configure(None)


def test_pipeline__lost_claim_runs_nothing(ledger, scope, tmp_path):
    ledger.submit(scope, "c1", "ok", {}, approved_by="al")
    ex = Executor(ledger, REGISTRY, Sandbox(tmp_path), worker_id="w", lease_seconds=30)
    assert ex.execute(scope, "ok:c1", 1).state == "finished"
    assert ex.execute(scope, "ok:c1", 1).state == "lost"
    assert ex.execute(scope, "ok:c1", 2).state == "lost"  # not authorised
    assert len(ledger.get(scope, "c1").executions) == 1


class ClaimThenFail(Ledger):
    """The claim's COMMIT succeeds, the client sees the connection die."""

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        super().claim(*args, **kwargs)
        raise sa.exc.OperationalError("COMMIT", {}, Exception("terminating connection"))


def test_pipeline__ambiguous_claim_commit_is_recognised_as_ours(run, ledger, db_url, monkeypatch):
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.01)
    flaky = ClaimThenFail(db_url)
    outcome, view = run("ok", executor_ledger=flaky)
    assert outcome.state == "finished"
    (ex,) = view.executions  # one claim, ours, carried through to the end
    assert ex.status is Status.SUCCEEDED
    flaky.close()


class ClaimCommitsThenRereadFails(Ledger):
    """The claim's COMMIT succeeds but the client sees an error, and so does the first
    re-read; the next claim finds the call no longer approved (it is running: ours)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.claims = self.rereads = 0

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        self.claims += 1
        found = super().claim(*args, **kwargs)
        if self.claims == 1:
            raise sa.exc.OperationalError("COMMIT", {}, Exception("terminating connection"))
        return found

    def claimed(self, *args: Any, **kwargs: Any) -> Any:
        self.rereads += 1
        if self.rereads == 1:
            raise sa.exc.OperationalError("SELECT", {}, Exception("server closed"))
        return super().claimed(*args, **kwargs)


def test_pipeline__claim_is_never_abandoned_by_its_own_executor(run, db_url, monkeypatch):
    # Before: the re-read failed, the loop claimed again, found the call running (its own
    # claim) and reported "lost": nothing ran and the call ended unknown for a human.
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.01)
    flaky = ClaimCommitsThenRereadFails(db_url)
    outcome, view = run("ok", executor_ledger=flaky)
    assert (outcome.state, flaky.claims) == ("finished", 2)
    (ex,) = view.executions
    assert (ex.status, ex.execution_id) == (Status.SUCCEEDED, outcome.execution_id)
    flaky.close()


class ClaimCommitUnknowable(Ledger):
    def claim(self, *args: Any, **kwargs: Any) -> Any:
        super().claim(*args, **kwargs)
        raise sa.exc.OperationalError("COMMIT", {}, Exception("terminating connection"))

    def claimed(self, *args: Any, **kwargs: Any) -> Any:
        raise sa.exc.OperationalError("SELECT", {}, Exception("server closed"))


class ClaimNeverCommitted(Ledger):
    """A claim whose statement the client saw fail while it was still at the server: kept in
    ``lost``, for the test to commit later, as the server would."""

    lost: dict[str, Any] | None = None

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        self.lost = {"args": args, "kwargs": kwargs}
        raise sa.exc.OperationalError("COMMIT", {}, Exception("terminating connection"))

    def claimed(self, *args: Any, **kwargs: Any) -> Any:
        return None  # not (yet) there


def test_pipeline__claim_commit_that_cannot_be_learned_is_spooled_not_lost(
    run, ledger, db_url, tmp_path, monkeypatch
):
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.001)
    flaky = ClaimCommitUnknowable(db_url)
    outcome, view = run("ok", executor_ledger=flaky)
    flaky.close()
    # The executor says it does not know, never "lost"; the row is running under its token
    assert outcome.state == "unsure"
    (ex,) = view.executions
    assert (ex.status, ex.execution_id) == (Status.RUNNING, outcome.execution_id)
    assert pending_files(Sandbox(tmp_path)) == [f"{ex.execution_id}.spool"]
    # When the database answers again, its word "I never started the tool" is recorded and
    # the sweep proves the effect absent: not applied (a human need not guess)
    expire_lease(ledger, outcome.execution_id)
    summary = sweep(
        ledger, REGISTRY, Sandbox(tmp_path), grace_seconds=0, requeue_after=60, publish=None
    )
    assert summary.spooled_results == 1 and summary.not_applied == 1
    done = ledger.get(view.scope, view.tool_call_id).current
    assert (done.status, done.result["error"]) == (Status.FAILED, "not_applied")
    absent = [e for e in ledger.events(view.scope, view.tool_call_id) if e.kind == "evidence"]
    assert absent[-1].detail["not_started"] is True
    assert pending_files(Sandbox(tmp_path)) == []


class ClaimCutBySoftLimit(Ledger):
    """Celery's soft time limit raised while the claim's statement was at the server, which
    committed it."""

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        super().claim(*args, **kwargs)
        raise SoftTimeLimitExceeded()


class TrackCutBySoftLimit(LeaseKeeper):
    """The soft time limit raised after the claim, before the tool started."""

    def track(self, *args: Any, **kwargs: Any) -> Any:
        raise SoftTimeLimitExceeded()


@pytest.mark.parametrize("where", ["in the claim", "before the tool"])
def test_pipeline__the_soft_time_limit_before_the_tool_started_is_proved_not_applied(
    ledger, db_url, scope, tmp_path, where
):
    """helper-89: a claim waiting out a partition met the soft time limit (20 s against a
    retry budget of about 50 s): the exception left the task, and the call, whose tool never
    ran, read "possibly applied, ask a human". Now spooled as never started, as a claim whose
    commit could not be learned is: the sweep proves it not applied."""
    executor_ledger = ClaimCutBySoftLimit(db_url) if where == "in the claim" else ledger
    keeper = (TrackCutBySoftLimit if where == "before the tool" else LeaseKeeper)(
        executor_ledger, 0.3
    )
    executor = Executor(executor_ledger, REGISTRY, Sandbox(tmp_path), worker_id="w",
                        lease_seconds=0.3, leases=keeper)  # fmt: skip
    ledger.submit(scope, "c1", "ok", {}, approved_by="al")
    try:
        outcome = executor.execute(scope, "ok:c1", 1)
    finally:
        if executor_ledger is not ledger:
            executor_ledger.close()
    assert outcome.state == ("unsure" if where == "in the claim" else "stale")
    (ex,) = ledger.get(scope, "c1").executions
    assert (ex.status, ex.execution_id) == (Status.RUNNING, outcome.execution_id)
    assert pending_files(Sandbox(tmp_path)) == [f"{ex.execution_id}.spool"]
    time.sleep(0.35)
    summary = sweep(
        ledger, REGISTRY, Sandbox(tmp_path), grace_seconds=0, requeue_after=60, publish=None
    )
    assert summary.not_applied == 1, summary
    done = ledger.get(scope, "c1").current
    assert (done.status, done.result["error"]) == (Status.FAILED, "not_applied")


@pytest.mark.postgres
def test_pipeline__a_claim_cut_at_the_server_never_leaves_its_connection_mid_command(
    pg_url, scope, tmp_path
):
    """helper-89: the soft time limit (a signal's exception) raised while the claim waited
    on a row lock left the fast path's connection mid-command: the next claim on it failed
    "another command is already in progress". The connection is dropped now."""
    import signal

    led = Ledger(pg_url)  # the fast path's own connection is Postgres's
    holder = sa.create_engine(pg_url)
    try:
        led.submit(scope, "c1", "ok", {}, approved_by="al")
        led.submit(scope, "c2", "ok", {}, approved_by="al")
        previous = signal.getsignal(signal.SIGALRM)

        def cut(*_: Any) -> None:
            raise SoftTimeLimitExceeded()

        signal.signal(signal.SIGALRM, cut)
        try:
            with holder.connect() as conn:  # another transaction holds c1's row
                conn.execute(
                    sa.text("SELECT 1 FROM operations WHERE scope = :s AND idempotency_key = :k"
                            " FOR UPDATE"), {"s": scope, "k": "ok:c1"},
                )  # fmt: skip
                signal.setitimer(signal.ITIMER_REAL, 0.5)
                with pytest.raises(SoftTimeLimitExceeded):
                    led.claim(scope, "ok:c1", 1, worker_id="w")
                conn.rollback()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert led.claim(scope, "ok:c2", 1, worker_id="w") is not None  # same thread
    finally:
        holder.dispose()
        led.close()


class FinishUnreachable(Ledger):
    """The database is unreachable for terminal writes (and their re-reads)."""

    def finish(self, *args: Any, **kwargs: Any) -> Any:
        raise sa.exc.OperationalError("UPDATE", {}, Exception("database is gone"))

    def effect_states(self, *args: Any, **kwargs: Any) -> Any:
        raise sa.exc.OperationalError("SELECT", {}, Exception("database is gone"))


@pytest.fixture
def spooled(run, db_url, tmp_path, monkeypatch):
    """A write of r.txt whose result the ledger could not take, spooled: its outcome, its
    view, and its spool file, edited by ``edit`` (a function of the spool's JSON) if given."""

    def _spooled(
        edit: Callable[[dict[str, Any]], None] | None = None, lease: float = 30.0
    ) -> tuple[Any, Any, Path]:
        monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.001)
        broken = FinishUnreachable(db_url)
        try:
            outcome, view = run(
                "write_file", {"path": "r.txt", "content": "v"}, executor_ledger=broken, lease=lease
            )
        finally:
            broken.close()
        spool_file = effects_of(Sandbox(tmp_path)).pending_dir / f"{outcome.execution_id}.spool"
        if edit is not None:
            spool = json.loads(spool_file.read_text())
            edit(spool)
            spool_file.write_text(json.dumps(spool))
        return outcome, view, spool_file

    return _spooled


class SoftLimitDuringFinish(Ledger):
    def finish(self, *args: Any, **kwargs: Any) -> Any:
        raise SoftTimeLimitExceeded()


@pytest.mark.parametrize("cause", [FinishUnreachable, SoftLimitDuringFinish])
def test_pipeline__a_result_the_ledger_cannot_take_is_spooled_then_recorded(
    run, ledger, db_url, tmp_path, monkeypatch, caplog, cause
):
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.001)
    broken = cause(db_url)
    content = "secret report 4711"
    with caplog.at_level(logging.WARNING):
        outcome, view = run(
            "write_file", {"path": "r.txt", "content": content}, executor_ledger=broken
        )
    broken.close()
    assert outcome.state == "unrecorded"
    assert view.current.status is Status.RUNNING and not (tmp_path / view.scope / "r.txt").exists()
    # the log says what happened, never the result's contents or the lease token
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "spooled" in logged and content not in logged and "4711" not in logged
    assert view.current.lease_token not in logged
    # When the database answers (the worker's next start, or the next sweep)
    sandbox = Sandbox(tmp_path)
    landing = effects_of(sandbox).settle(ledger)
    # Then the result is recorded under the executor's own lease, and its bytes land
    assert landing.recorded == 1 and landing.landed == 1
    done = ledger.get(view.scope, view.tool_call_id).current
    assert (done.status, done.reconciled, done.result["path"]) == (Status.SUCCEEDED, False, "r.txt")
    assert (tmp_path / view.scope / "r.txt").read_text() == content
    assert pending_files(sandbox) == [] and ledger.verify().ok


def test_pipeline__a_spooled_result_after_revocation_becomes_evidence_lands_nothing(
    run, ledger, db_url, tmp_path, monkeypatch
):
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.001)
    broken = FinishUnreachable(db_url)
    outcome, view = run("write_file", {"path": "r.txt", "content": "v1"}, executor_ledger=broken)
    broken.close()
    expire_lease(ledger, outcome.execution_id)
    ledger.mark_expired(grace_seconds=0)  # the sweep revoked it while the database was away
    landing = effects_of(Sandbox(tmp_path)).settle(ledger)
    assert (landing.recorded, landing.evidence, landing.landed, landing.discarded) == (0, 1, 0, 1)
    late = ledger.evidence_of(outcome.execution_id)[-1].detail
    assert late["late_result"]["path"] == "r.txt" and late["landed"] is False
    assert not (tmp_path / view.scope / "r.txt").exists()
    effects_of(Sandbox(tmp_path)).settle(ledger)  # again: nothing recorded twice
    assert len(ledger.evidence_of(outcome.execution_id)) == 1


def test_pipeline__a_spools_temporary_file_a_killed_writer_left_is_removed_once_stale(
    spooled, ledger, tmp_path
):
    # Given the temporary file of a spool whose writer was killed before its rename (it held
    # the result; no effect), and one of an execution this ledger does not know
    outcome, _, spool_file = spooled()
    eid = outcome.execution_id
    left = spool_file.with_name(f"{spool_file.name}.tmp4242.0a1b2c3d")  # as named since 12-06
    spool_file.rename(left)
    stranger = spool_file.with_name("00000000-0000-4000-8000-000000000000.spool.tmp7")
    stranger.write_bytes(b"{")
    hours_ago = time.time() - 2 * 3600

    def settle_at(mtime: float) -> int:
        for f in (left, stranger):
            os.utime(f, (mtime, mtime))
        return effects_of(Sandbox(tmp_path)).settle(ledger).leftovers

    # When settles run: its execution still running, even an old file stays (its writer may
    # be at work); once revoked, a fresh one stays (a writer woken from a freeze renames it)
    assert settle_at(hours_ago) == 0 and left.exists()
    expire_lease(ledger, eid)
    assert ledger.mark_expired(grace_seconds=0)
    assert settle_at(time.time()) == 0 and left.exists()
    # Then once revoked and an hour old it is removed; the stranger is nobody's to judge
    assert settle_at(hours_ago) == 1
    assert not left.exists() and stranger.exists()
    assert ledger.execution(eid).status is Status.UNKNOWN and ledger.verify().ok


class StatesFailFor(Ledger):
    """The database fails the one question about one execution (a lock timeout, say)."""

    def __init__(self, url: str, execution_id: str) -> None:
        super().__init__(url)
        self.failing = execution_id

    def effect_states(self, execution_ids: list[str]) -> Any:
        if execution_ids == [self.failing]:
            raise sa.exc.OperationalError("SELECT", {}, Exception("lock timeout"))
        return super().effect_states(execution_ids)


def test_pipeline__one_spool_that_cannot_be_settled_stops_no_other(
    run, ledger, db_url, tmp_path, monkeypatch
):
    # Before: settle read the spools one after the other with no guard. A spool cut short
    # (or one whose ledger question failed) raised out of settle: no later spool was recorded,
    # no committed effect landed, and in the sweep the ValueError ended the whole pass.
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.001)
    broken = FinishUnreachable(db_url)
    (_, view1), (second, view2) = (
        run("write_file", {"path": f"{name}.txt", "content": name}, executor_ledger=broken)
        for name in ("one", "two")
    )
    broken.close()
    sandbox = Sandbox(tmp_path)
    cut = "00000000-0000-4000-8000-000000000000"  # sorts first: settled before the others
    (effects_of(sandbox).pending_dir / f"{cut}.spool").write_bytes(b'{"execution_id": "000')
    flaky = StatesFailFor(db_url, second.execution_id)
    try:
        landing = effects_of(sandbox).settle(flaky)
    finally:
        flaky.close()
    # The readable spool is recorded and its bytes land; the one the database failed waits
    assert (landing.recorded, landing.landed, landing.failed) == (1, 1, 2)
    assert (tmp_path / view1.scope / "one.txt").read_text() == "one"
    assert ledger.execution(second.execution_id).status is Status.RUNNING
    problems = " ".join(landing.problems)
    assert cut in problems and "not JSON" in problems
    assert second.execution_id in problems and "OperationalError" in problems
    # the unreadable spool is kept for a human, out of every later pass; the other is retried
    left = pending_files(sandbox)
    staged = [n for n in left if n.startswith(f"{second.execution_id}.0.") and n.endswith("write")]
    assert sorted([f"{cut}.spool.refused", f"{second.execution_id}.spool", *staged]) == left
    assert len(staged) == 1
    summary = sweep(ledger, REGISTRY, sandbox, grace_seconds=60, requeue_after=60, publish=None)
    assert summary.spooled_results == 1 and summary.landed == 1 and not summary.errors
    assert (tmp_path / view2.scope / "two.txt").read_text() == "two"
    assert pending_files(sandbox) == [f"{cut}.spool.refused"]
    assert effects_of(sandbox).has_pending() is False


def test_pipeline__a_sweep_pass_goes_on_past_a_spool_it_cannot_read(
    run, ledger, db_url, tmp_path, monkeypatch
):
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.001)
    broken = FinishUnreachable(db_url)
    outcome, view = run("write_file", {"path": "r.txt", "content": "v"}, executor_ledger=broken)
    broken.close()
    sandbox = Sandbox(tmp_path)
    bad = [f"00000000-0000-4000-8000-00000000000{i}" for i in (1, 2)]
    for eid, text in zip(bad, ('{"status": "succeeded"}', '{"lease_token": "t"}'), strict=True):
        (effects_of(sandbox).pending_dir / f"{eid}.spool").write_text(text)
    summary = sweep(ledger, REGISTRY, sandbox, grace_seconds=60, requeue_after=60, publish=None)
    assert summary.spooled_results == 1 and summary.landed == 1
    assert len(summary.errors) == 2
    for eid, error in zip(bad, summary.errors, strict=True):
        assert eid in error and "no lease token or status" in error
    assert pending_files(sandbox) == [f"{eid}.spool.refused" for eid in bad]
    assert ledger.execution(outcome.execution_id).status is Status.SUCCEEDED
    assert (tmp_path / view.scope / "r.txt").read_text() == "v"


def _no_sha(spool: dict[str, Any]) -> None:
    del spool["effects"][0]["sha256"]


def _no_result(spool: dict[str, Any]) -> None:
    del spool["result"]


def _error_number(spool: dict[str, Any]) -> None:
    spool["error"] = 42


def _late_text(spool: dict[str, Any]) -> None:
    spool["late"] = "edited"


def _proves_nothing_known(spool: dict[str, Any]) -> None:
    spool["proves"] = "landed"


def _kind_unknown(spool: dict[str, Any]) -> None:
    spool["effects"][0]["kind"] = "truncate"


def _proves_a_list(spool: dict[str, Any]) -> None:
    spool["proves"] = []


def _result_not_a_number(spool: dict[str, Any]) -> None:
    spool["result"] = {"x": float("nan")}  # json.dumps writes NaN, json.loads reads it


def _result_lone_surrogate(spool: dict[str, Any]) -> None:
    spool["result"] = {"x": "r\udce9sum\udce9"}  # written as its \u escape, read back lone


def _error_nul(spool: dict[str, Any]) -> None:
    spool["error"] = "a\x00b"  # Postgres text refuses NUL; the executor writes \\x00


@pytest.mark.parametrize(
    "damage",
    [
        _no_sha,
        _no_result,
        _error_number,
        _late_text,
        _proves_nothing_known,
        _kind_unknown,
        _proves_a_list,
        _result_not_a_number,
        _result_lone_surrogate,
        _error_nul,
    ],
)
@pytest.mark.parametrize("revoked", [False, True], ids=["running", "revoked"])
def test_pipeline__a_spool_damaged_into_other_json_is_set_aside_not_retried_or_recorded(
    spooled, ledger, tmp_path, damage, revoked
):
    # Before: a spool holding a lease token and a status was taken as it was. One whose
    # effects lacked a field was recorded under its lease, and the landing of its path then
    # failed on it (a KeyError out of settle: no later path landed, the sweep pass ended);
    # one whose result, error or late result had another shape failed again every pass.
    outcome, view, _ = spooled(damage)
    eid = outcome.execution_id
    sandbox = Sandbox(tmp_path)
    if revoked:
        expire_lease(ledger, eid)
        ledger.mark_expired(grace_seconds=0)
    status = ledger.execution(eid).status
    landing = effects_of(sandbox).settle(ledger)
    assert (landing.recorded, landing.evidence, landing.landed, landing.failed) == (0, 0, 0, 1)
    assert eid in landing.problems[0] and "set aside" in landing.problems[0]
    # nothing of it was recorded, nothing landed, and it is kept for a human, out of every pass
    assert ledger.execution(eid).status is status and not ledger.evidence_of(eid)
    assert not (tmp_path / view.scope / "r.txt").exists()
    assert f"{eid}.spool.refused" in pending_files(sandbox)
    again = effects_of(sandbox).settle(ledger)
    assert again.failed == 0 and again.problems == []
    # what is left is an execution whose result was lost: the sweep's (unknown, fenced)
    expire_lease(ledger, eid)
    summary = sweep(ledger, REGISTRY, sandbox, grace_seconds=0, requeue_after=60, publish=None)
    assert not summary.errors
    assert ledger.execution(eid).status is not Status.RUNNING
    assert not (tmp_path / view.scope / "r.txt").exists() and ledger.verify().ok


def _path_edited(spool: dict[str, Any]) -> None:
    spool["effects"][0]["path"] = "elsewhere.txt"


def _write_made_append(spool: dict[str, Any]) -> None:
    spool["effects"][0]["kind"] = "append"


def _one_more_effect(spool: dict[str, Any]) -> None:
    spool["effects"].append({**spool["effects"][0], "n": 1})


def _effects_dropped(spool: dict[str, Any]) -> None:
    spool["effects"] = None


def _size_edited(spool: dict[str, Any]) -> None:
    spool["effects"][0]["size"] = 999


def _digest_edited(spool: dict[str, Any]) -> None:
    spool["effects"][0]["sha256"] = "0" * 64


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (_path_edited, "was not staged"),
        (_write_made_append, "was not staged"),
        (_one_more_effect, "was not staged"),
        (_effects_dropped, "does not name 1 effect"),
        (_size_edited, "names other bytes"),
        (_digest_edited, "names other bytes"),
    ],
)
def test_pipeline__a_spool_naming_other_effects_than_were_staged_is_not_committed(
    spooled, ledger, tmp_path, edit, said
):
    # Before: a spool whose effects were edited into other well-formed ones was recorded as
    # it was, under its lease: a commit naming a path nothing was staged for (or the staged
    # bytes under another kind), its real stage then kept aside as not matching its commit;
    # one naming none of its effects was recorded as a success whose file never appears.
    outcome, view, _ = spooled(edit)
    eid = outcome.execution_id
    sandbox = Sandbox(tmp_path)
    landing = effects_of(sandbox).settle(ledger)
    assert (landing.recorded, landing.landed, landing.failed) == (0, 0, 1)
    assert said in landing.problems[0] and "set aside" in landing.problems[0]
    assert ledger.execution(eid).status is Status.RUNNING and not ledger.execution(eid).effects
    root = tmp_path / view.scope
    assert not (root / "r.txt").exists() and not (root / "elsewhere.txt").exists()
    assert f"{eid}.spool.refused" in pending_files(sandbox)


@pytest.mark.parametrize("effects", ["x", [{"n": 0}], {"n": 0}, [0]])
def test_pipeline__a_spooled_unknown_commits_no_effects_whatever_they_look_like(
    spooled, ledger, tmp_path, effects
):
    # Before: the staged effects of every spool were checked, an unknown's too (which commits
    # none): one damaged there raised TypeError or KeyError on every pass, never set aside.
    def unknown(spool: dict[str, Any]) -> None:
        spool.update(status="unknown", result=None, reason="the tool cannot tell", effects=effects)

    outcome, view, _ = spooled(unknown)
    eid = outcome.execution_id
    sandbox = Sandbox(tmp_path)
    landing = effects_of(sandbox).settle(ledger)
    assert (landing.recorded, landing.failed, landing.landed) == (1, 0, 0), landing.problems
    assert ledger.execution(eid).status is Status.UNKNOWN
    assert not (tmp_path / view.scope / "r.txt").exists()
    assert not pending_files(sandbox)  # its stage discarded: an unknown commits no effect


def test_pipeline__a_spool_another_settle_recorded_meanwhile_is_not_called_unreadable(
    spooled, ledger, tmp_path, monkeypatch
):
    # Before: settle B read the execution running; settle A then recorded the spool and landed
    # its bytes; B found the stage files gone and reported a good spool as unreadable.
    from toolledger.effects import Effects

    outcome, view, _ = spooled()
    real, first = Effects._check_staged, []

    def a_settles_first(self: Effects, eid: str, scope: str, effects: Any) -> None:
        if not first:  # B has read it running; A (a worker's start, say) settles now
            first.append(None)
            first[0] = effects_of(Sandbox(tmp_path)).settle(ledger)
        real(self, eid, scope, effects)

    monkeypatch.setattr(Effects, "_check_staged", a_settles_first)
    b = effects_of(Sandbox(tmp_path)).settle(ledger)
    assert (first[0].recorded, first[0].landed) == (1, 1)
    assert b.failed == 0 and b.problems == [] and b.evidence == 0
    assert ledger.evidence_of(outcome.execution_id) == []  # nothing of it was late
    assert ledger.execution(outcome.execution_id).status is Status.SUCCEEDED
    assert (tmp_path / view.scope / "r.txt").read_text() == "v"
    assert not pending_files(Sandbox(tmp_path))


def test_pipeline__a_spool_nested_too_deep_for_json_stops_no_other(spooled, ledger, tmp_path):
    # Before: json.loads raised RecursionError, which neither settle nor the sweep caught:
    # every sweep pass ended there, and another call's spooled result never landed.
    outcome, view, _ = spooled()
    sandbox = Sandbox(tmp_path)
    bad = "00000000-0000-4000-8000-000000000000"  # sorts first
    (effects_of(sandbox).pending_dir / f"{bad}.spool").write_bytes(b"[" * 100_000)
    summary = sweep(ledger, REGISTRY, sandbox, grace_seconds=60, requeue_after=60, publish=None)
    assert summary.spooled_results == 1 and summary.landed == 1
    assert len(summary.errors) == 1 and bad in summary.errors[0]
    assert "RecursionError" in summary.errors[0]
    assert ledger.execution(outcome.execution_id).status is Status.SUCCEEDED
    assert (tmp_path / view.scope / "r.txt").read_text() == "v"
    assert pending_files(sandbox) == [f"{bad}.spool.refused"]


def test_pipeline__the_time_limit_ends_a_settle_pass_not_one_spool(
    spooled, ledger, tmp_path, monkeypatch
):
    # One spool's surprise is that spool's problem; the sweep task's soft time limit (an
    # Exception too) is not: it must end the pass, as it ends the task.
    from toolledger.effects import Effects

    spooled()

    def out_of_time(*args: Any, **kwargs: Any) -> None:
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(Effects, "_settle_spool", out_of_time)
    with pytest.raises(SoftTimeLimitExceeded):
        effects_of(Sandbox(tmp_path)).settle(ledger)


@pytest.mark.parametrize("what", ["fifo", "folder", "link"])
def test_pipeline__something_else_in_a_stage_files_place_is_refused_never_waited_on(
    spooled, ledger, tmp_path, what
):
    # Before: a FIFO named like a stage file blocked settle for good in open().
    outcome, view, spool_file = spooled()
    stage = next(p for p in spool_file.parent.iterdir() if p.name.endswith(".write"))
    stage.rename(spool_file.parent / "kept")
    {"fifo": os.mkfifo, "folder": os.mkdir, "link": lambda p: p.symlink_to("kept")}[what](stage)
    done: list[Any] = []
    settling = threading.Thread(
        target=lambda: done.append(effects_of(Sandbox(tmp_path)).settle(ledger)), daemon=True
    )
    settling.start()
    settling.join(10)
    if settling.is_alive():
        os.close(os.open(stage, os.O_WRONLY | os.O_NONBLOCK))  # let it go
        pytest.fail("settle waits on a FIFO in a stage file's place")
    (landing,) = done
    assert landing.recorded == 0 and landing.failed == 1 and "set aside" in landing.problems[0]
    assert ledger.execution(outcome.execution_id).status is Status.RUNNING
    assert not (tmp_path / view.scope / "r.txt").exists()


def _out_of_descriptors_once(monkeypatch: pytest.MonkeyPatch, name_has: str) -> list[str]:
    """``toolledger.effects``' next open of a file whose name holds ``name_has`` fails with
    EMFILE, as a process out of descriptors for a moment; the names it failed, returned."""
    real_open, hit = os.open, []

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if not hit and isinstance(path, str) and name_has in path and not flags & os.O_CREAT:
            hit.append(path)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr("toolledger.effects.os.open", open_)
    return hit


def _landing_renames_fail(
    monkeypatch: pytest.MonkeyPatch, error: OSError, *, once: bool = False
) -> list[str]:
    """``toolledger.effects``' renames of a write's stage into place fail with ``error`` (the
    first only if ``once``; setting one aside still works); the names they failed, returned."""
    real_rename, hit = os.rename, []

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        into_place = str(src).endswith(".write") and not str(dst).endswith(".refused")
        if into_place and not (once and hit):
            hit.append(str(src))
            raise error
        real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr("toolledger.effects.os.rename", rename)
    return hit


def test_pipeline__a_stage_that_cannot_be_read_for_a_moment_keeps_its_spool(
    spooled, ledger, tmp_path, monkeypatch
):
    # Before: any error reading a stage while checking a spool set the spool aside for good:
    # out of descriptors for a moment, a good result was lost and its call went unknown.
    outcome, view, spool_file = spooled()
    hit = _out_of_descriptors_once(monkeypatch, ".write")
    sandbox = Sandbox(tmp_path)
    first = effects_of(sandbox).settle(ledger)
    assert hit and first.recorded == 0 and spool_file.exists()
    assert "Too many open files" in first.problems[0]
    second = effects_of(sandbox).settle(ledger)
    assert (second.recorded, second.landed, second.failed) == (1, 1, 0)
    assert ledger.execution(outcome.execution_id).status is Status.SUCCEEDED
    assert (tmp_path / view.scope / "r.txt").read_text() == "v"


def test_pipeline__an_append_that_cannot_land_for_a_moment_is_not_called_not_landed(
    run, ledger, tmp_path, monkeypatch
):
    # Before: an error of a moment reading the append's intent (applying-<offset>) recorded it
    # not landed and kept aside, but set aside the gone .append name: the intent stayed, and
    # the next settle landed what the ledger said would not land.
    hit = _out_of_descriptors_once(monkeypatch, ".applying-")
    outcome, view = run("append_file", {"path": "a.txt", "content": "once\n"})
    assert hit and view.current.status is Status.SUCCEEDED
    monkeypatch.undo()
    assert not [e for e in ledger.evidence_of(outcome.execution_id) if "not_landed" in e.detail]
    sandbox = Sandbox(tmp_path)
    target = tmp_path / view.scope / "a.txt"
    assert not target.exists()
    assert effects_of(sandbox).settle(ledger).landed == 1
    assert effects_of(sandbox).settle(ledger).landed == 0
    assert target.read_text() == "once\n" and not pending_files(sandbox)


def _committed_then_crashed(
    run: Any, monkeypatch: pytest.MonkeyPatch, tool: str, path: str, content: str
) -> tuple[Any, Any]:
    """A call whose executor committed and then crashed before landing a byte."""
    from toolledger.effects import Effects, Landing

    with monkeypatch.context() as patch:
        patch.setattr(Effects, "publish", lambda *args, **kwargs: Landing())
        outcome, view = run(tool, {"path": path, "content": content})
    assert view.current.status is Status.SUCCEEDED
    return outcome, view


def test_pipeline__a_folder_in_an_append_stages_place_is_set_aside_and_told_once(
    run, ledger, tmp_path, monkeypatch
):
    # Before: after the rename to applying-<offset>, the refusal set aside the gone .append
    # name, so the intent stayed, was refused again on every pass and told again each time.
    outcome, _ = _committed_then_crashed(run, monkeypatch, "append_file", "a.txt", "once\n")
    sandbox = Sandbox(tmp_path)
    pending = effects_of(sandbox).pending_dir
    (stage,) = [p for p in pending.iterdir() if p.name.endswith(".append")]
    stage.unlink()
    stage.mkdir()
    first = effects_of(sandbox).settle(ledger)
    assert (first.refused, first.landed) == (1, 0)
    assert all(n.endswith(".refused") for n in pending_files(sandbox))
    second = effects_of(sandbox).settle(ledger)
    assert (second.refused, second.failed) == (0, 0)
    told = [e for e in ledger.evidence_of(outcome.execution_id) if "not_landed" in e.detail]
    assert len(told) == 1


def test_pipeline__an_effect_left_for_a_moment_holds_back_every_newer_one_on_its_path(
    run, ledger, tmp_path, monkeypatch
):
    # An effect left for the next settle (an error of a moment) must land before anything
    # committed after it on its path: had the newer append landed first, the older write
    # would have replaced it when it landed, and the append would be lost.
    _, view = _committed_then_crashed(run, monkeypatch, "write_file", "r.txt", "v")
    _committed_then_crashed(run, monkeypatch, "append_file", "r.txt", "+a")
    hit = _landing_renames_fail(monkeypatch, OSError(errno.EIO, "Input/output error"), once=True)
    sandbox = Sandbox(tmp_path)
    first = effects_of(sandbox).settle(ledger)
    assert hit and (first.landed, first.left, first.refused) == (0, 1, 0)
    assert "not finished" in first.problems[0]
    target = tmp_path / view.scope / "r.txt"
    assert not target.exists()
    second = effects_of(sandbox).settle(ledger)
    assert (second.landed, second.failed) == (2, 0)
    assert target.read_text() == "v+a" and not pending_files(sandbox)


def test_pipeline__an_append_refused_after_its_intent_is_told_once_and_never_lands(
    run, ledger, tmp_path, monkeypatch
):
    # Before: an error after the rename to applying-<offset> but before the bytes (here the
    # effects log, a folder; likewise the pending folder's fsync) set aside the gone .append
    # name and told "not landed": the intent stayed, and the next settle landed it.
    outcome, view = _committed_then_crashed(run, monkeypatch, "append_file", "a.txt", "x")
    bad_log = tmp_path / "effects-log-is-a-folder"
    bad_log.mkdir()
    first = effects_of(Sandbox(tmp_path, effects_log=str(bad_log))).settle(ledger)
    assert (first.refused, first.landed) == (1, 0)
    second = effects_of(Sandbox(tmp_path)).settle(ledger)
    assert (second.refused, second.landed) == (0, 0)
    told = [e for e in ledger.evidence_of(outcome.execution_id) if "not_landed" in e.detail]
    assert len(told) == 1 and not (tmp_path / view.scope / "a.txt").exists()


@pytest.mark.parametrize("step", ["folder fsync", "intent removal"])
def test_pipeline__an_effect_landed_but_not_yet_durable_is_never_told_not_landed(
    run, ledger, tmp_path, monkeypatch, step
):
    # Before: a write whose rename succeeded and whose folder's fsync failed, or an append
    # whose bytes were written and whose intent could not be removed, was told "not landed"
    # (or reported not landed yet) while its bytes were in place.
    tool, suffix = ("write_file", ".write") if step == "folder fsync" else ("append_file", "")
    outcome, view = _committed_then_crashed(run, monkeypatch, tool, "r.txt", "v")
    real_fsync, real_unlink, moved = os.fsync, os.unlink, []
    real_rename = os.rename

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        real_rename(src, dst, *args, **kwargs)
        moved.append(src)

    def fsync(fd: int) -> None:
        if step == "folder fsync" and moved and str(moved[-1]).endswith(suffix):
            moved.clear()
            raise OSError(errno.EROFS, "Read-only file system")
        real_fsync(fd)

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if step == "intent removal" and ".applying-" in str(path):
            raise OSError(errno.EROFS, "Read-only file system")
        real_unlink(path, *args, **kwargs)

    for name, fn in (("rename", rename), ("fsync", fsync), ("unlink", unlink)):
        monkeypatch.setattr(f"toolledger.effects.os.{name}", fn)
    sandbox = Sandbox(tmp_path)
    first = effects_of(sandbox).settle(ledger)
    assert (first.refused, first.landed) == (0, 0) and "landed" in first.problems[0]
    assert (tmp_path / view.scope / "r.txt").read_text() == "v"
    monkeypatch.undo()
    again = effects_of(sandbox).settle(ledger)
    assert again.failed == 0 and not pending_files(sandbox)
    assert (tmp_path / view.scope / "r.txt").read_text() == "v"  # once, not twice
    assert not [e for e in ledger.evidence_of(outcome.execution_id) if "not_landed" in e.detail]


def test_pipeline__a_target_that_is_a_mount_point_is_refused_not_retried_forever(
    run, ledger, tmp_path, monkeypatch
):
    # rename(2) answers EBUSY for a mount point, for good: it is no error of a moment, and
    # left for the next settle it would hold back its path on every pass, told to no one.
    outcome, _ = _committed_then_crashed(run, monkeypatch, "write_file", "r.txt", "v")
    _landing_renames_fail(monkeypatch, OSError(errno.EBUSY, "Device or resource busy"))
    landing = effects_of(Sandbox(tmp_path)).settle(ledger)
    assert (landing.refused, landing.left, landing.failed) == (1, 0, 0)
    told = [e for e in ledger.evidence_of(outcome.execution_id) if "not_landed" in e.detail]
    assert len(told) == 1


def test_pipeline__a_folder_named_like_a_stage_blocks_no_other_path(
    run, ledger, tmp_path, monkeypatch
):
    # Before: settle unlinked it as a failed execution's stage: IsADirectoryError ended the
    # pass, and every path after it kept its committed bytes unlanded, pass after pass.
    failed, _ = run("reports_failure")
    _, view = _committed_then_crashed(run, monkeypatch, "write_file", "r.txt", "v")
    sandbox = Sandbox(tmp_path)
    folder = f"{failed.execution_id}.0.{'0' * 32}.write"
    (effects_of(sandbox).pending_dir / folder).mkdir()
    summary = sweep(ledger, REGISTRY, sandbox, grace_seconds=60, requeue_after=60, publish=None)
    assert summary.landed == 1 and len(summary.errors) == 1
    assert "IsADirectoryError" in summary.errors[0]
    assert (tmp_path / view.scope / "r.txt").read_text() == "v"


class RenewalsFail(Ledger):
    """A worker cut off from the database: every renewal fails (the sweep still works)."""

    def renew_lease(self, *args: Any, **kwargs: Any) -> bool:
        raise sa.exc.OperationalError("UPDATE", {}, Exception("no route to host"))

    def renew_leases(self, *args: Any, **kwargs: Any) -> set[str]:
        raise sa.exc.OperationalError("UPDATE", {}, Exception("no route to host"))


def test_pipeline__a_worker_that_cannot_renew_stops_itself_before_its_lease_expires(
    run, ledger, db_url, tmp_path
):
    # Before: renewal errors counted as "still ours"; the sweep revoked the call at +0.8 s and
    # the effect landed at +1.8 s, even for a tool that honoured ctx.lease_lost.
    partitioned = RenewalsFail(db_url)
    outcome, view = run(
        "writes_after_lease_loss", {"seconds": 10}, lease=1.0, executor_ledger=partitioned
    )
    partitioned.close()
    # The tool was told, its write refused, and the executor itself declared the call unknown
    # while its lease was still valid by the database clock: before any sweep could revoke it
    assert (outcome.state, outcome.status) == ("unknown", Status.UNKNOWN)
    ex = ledger.execution(outcome.execution_id)
    unknown = [e for e in ledger.events(view.scope, view.tool_call_id) if e.kind == "unknown"]
    assert unknown[-1].actor == "w" and "LeaseLost" in unknown[-1].detail["reason"]
    assert unknown[-1].at < ex.lease_expires_at
    assert not (tmp_path / view.scope / "late.txt").exists()
    assert pending_files(Sandbox(tmp_path)) == []


@pytest.mark.parametrize("time_limit", [0.0, 0.8])
def test_pipeline__a_tool_past_the_time_limit_keeps_its_thread_never_its_claim(
    run, ledger, tmp_path, time_limit
):
    """On a pool that cannot kill a tool (threads), the lease keeper stops renewing a claim
    held past the time limit and treats it as lost, as Celery's hard limit would kill a
    prefork child: the tool is told, its write refused, the call unknown. Without the limit
    (the control) the same tool renews its lease, writes and succeeds."""
    began = time.monotonic()
    wait = 10 if time_limit else 1  # how long the tool waits to be told before it writes
    outcome, view = run(
        "writes_after_lease_loss", {"seconds": wait}, lease=3.0, time_limit=time_limit
    )
    took = time.monotonic() - began
    if not time_limit:
        assert view.operation.status is Status.SUCCEEDED
        assert (tmp_path / view.scope / "late.txt").read_bytes() == b"late"
        return
    assert (outcome.state, outcome.status) == ("unknown", Status.UNKNOWN)
    unknown = [e for e in ledger.events(view.scope, view.tool_call_id) if e.kind == "unknown"]
    assert unknown[-1].detail["reason"].startswith("TimeLimitPassed")  # not the database
    assert took < 8  # told at the limit (0.8 s), not when it gave up waiting (10 s)
    assert not (tmp_path / view.scope / "late.txt").exists()
    assert pending_files(Sandbox(tmp_path)) == []


@pytest.mark.parametrize("time_limit", [0.0, 0.5])
def test_pipeline__a_result_returned_past_the_time_limit_is_not_recorded_as_the_tools(
    run, ledger, time_limit
):
    """A tool that returns success after its claim was given up (nothing killed it: a
    threads pool) is recorded unknown, with the time limit as the reason and not the
    database (a chaos run's checker tells them apart); the control, with no limit, succeeds."""
    outcome, view = run("sleeps", {"seconds": 1.5}, lease=3.0, time_limit=time_limit)
    if not time_limit:
        assert view.operation.status is Status.SUCCEEDED
        return
    assert (outcome.state, outcome.status) == ("unknown", Status.UNKNOWN)
    (unknown,) = [e for e in ledger.events(view.scope, view.tool_call_id) if e.kind == "unknown"]
    assert unknown.detail["reason"].startswith("TimeLimitPassed") and view.current.result is None


def test_read_only__a_read_while_committed_bytes_cannot_land_is_refused_not_stale(
    ledger, scope, tmp_path, monkeypatch
):
    """An append committed whose bytes the sandbox cannot take now (a full disk): a read of
    the file ran anyway and returned what the append replaces, as the file, succeeded (a
    cold review). It fails now, saying why; once the bytes land, it reads them."""
    import errno

    from toolledger.builtin_tools import BUILTINS
    from toolledger.effects import Effects

    builtins = Registry(list(BUILTINS))
    executor = Executor(
        ledger, builtins, Sandbox(tmp_path), worker_id="w", lease_seconds=30,
        leases=LeaseKeeper(ledger, 30, 0.0),
    )  # fmt: skip
    real = Effects._land_append

    def full_disk(self: Effects, *args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Effects, "_land_append", full_disk)
    ledger.submit(
        scope, "a1", "append_file", {"path": "log.txt", "content": "x\n"}, approved_by="al"
    )
    outcome = executor.execute(scope, "append_file:a1", 1)
    assert ledger.get(scope, "a1").operation.status is Status.SUCCEEDED  # the receipt: given
    assert not (tmp_path / scope / "log.txt").exists(), outcome  # its bytes: not landed
    read = executor.run_read_only(scope, builtins.get("read_file"), {"path": "log.txt"})
    assert read[0] is Status.FAILED and read[1]["error"] == "not_settled", read
    monkeypatch.setattr(Effects, "_land_append", real)  # the disk has room again
    status, result = executor.run_read_only(scope, builtins.get("read_file"), {"path": "log.txt"})
    assert status is Status.SUCCEEDED and result["content"] == "x\n", result


def _builtin_executor(ledger: Ledger, root: Path, lock_wait: float = 2.0) -> Executor:
    return Executor(
        ledger, Registry(list(BUILTINS)), Sandbox(root, lock_wait=lock_wait).prepare(), worker_id="w",
        lease_seconds=30, leases=LeaseKeeper(ledger, 30, 0.0),
    )  # fmt: skip


def _committed_not_landed(
    executor: Executor, scope: str, cid: str, path: str, content: str, monkeypatch: Any
) -> None:
    """A write_file committed succeeded whose bytes wait in the pending area (its landing
    failed, as a crash or a full disk leaves it): settle, or a read, lands them."""
    from toolledger.effects import Effects

    real = Effects.publish

    def cannot(self: Effects, *args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    executor.ledger.submit(
        scope, cid, "write_file", {"path": path, "content": content}, approved_by="al"
    )
    monkeypatch.setattr(Effects, "publish", cannot)
    try:
        executor.execute(scope, f"write_file:{cid}", 1)
    finally:
        monkeypatch.setattr(Effects, "publish", real)
    assert executor.ledger.get(scope, cid).operation.status is Status.SUCCEEDED


def test_sweep__committed_bytes_a_frozen_lander_keeps_from_landing_show_in_a_gauge(
    fresh_db_url, scope, tmp_path, monkeypatch
):
    """A lander frozen holding a path's lock: the call reads succeeded, its file is absent,
    and each pass said ``busy`` only in its log line (a cold review).
    ``toolledger_sweep_unlanded_paths`` says how many paths the last pass could not land,
    and 0 once they land."""
    from toolledger.ledger import metrics as counters

    name = "toolledger_sweep_unlanded_paths"
    ledger = Ledger(fresh_db_url)
    counters.disable()
    own = counters.enable()
    try:
        executor = _builtin_executor(ledger, tmp_path, lock_wait=0.2)
        _committed_not_landed(executor, scope, "w1", "held.txt", "payload", monkeypatch)

        def swept() -> float | None:
            sweep(ledger, executor.registry, executor.sandbox, grace_seconds=0,
                  requeue_after=60, publish=None)  # fmt: skip
            return own.registry.get_sample_value(name)

        with effects_of(executor.sandbox)._path_lock(path_hash(scope, "held.txt")):  # frozen
            assert swept() == 1
            assert not (tmp_path / scope / "held.txt").exists()
        assert swept() == 0
        assert (tmp_path / scope / "held.txt").read_text() == "payload"
    finally:
        counters.disable()
        ledger.close()


def _retried_by_the_sweep(executor: Executor, scope: str, cid: str, path: str) -> None:
    """A write_file of ``path`` ("old") whose executor died before its tool ran: the sweep
    proves it absent and authorises its attempt 2 by itself (not published)."""
    ledger = executor.ledger
    args = {"path": path, "content": "old"}
    ledger.submit(scope, cid, "write_file", args, approved_by="al")
    ledger.claim(scope, f"write_file:{cid}", 1, worker_id="dead", lease_seconds=0.05)
    time.sleep(0.1)
    sweep(ledger, executor.registry, executor.sandbox, grace_seconds=0, requeue_after=60,
          publish=None)  # fmt: skip
    assert ledger.get(scope, cid).operation.authorized_attempts == 2


def test_auto_retry__a_newer_write_landing_while_it_is_reconciled_is_not_written_over(
    fresh_db_url, scope, tmp_path, monkeypatch
):
    """write_file's reconciler read the file, then asked whether bytes wait for it: a newer
    committed write that landed between the two was seen by neither, and the automatic
    retry's older bytes landed over it (a cold review). Asked first now, it is seen."""
    ledger = Ledger(fresh_db_url)
    try:
        executor = _builtin_executor(ledger, tmp_path)
        # Given c1, retried by the sweep; then c2, a newer write of the same file,
        # committed, its bytes not landed yet
        _retried_by_the_sweep(executor, scope, "c1", "a.txt")
        _committed_not_landed(executor, scope, "c2", "a.txt", "new", monkeypatch)
        # When attempt 2's reconciler finds a.txt missing, and a settle lands c2 just then
        real, landed = Sandbox.sha256, []

        def racing(self: Sandbox, at: str, path: str) -> str | None:
            found = real(self, at, path)
            if path == "a.txt" and not landed:
                landed.append(effects_of(executor.sandbox).settle(ledger).landed)
            return found

        monkeypatch.setattr(Sandbox, "sha256", racing)
        outcome = executor.execute(scope, "write_file:c1", 2)
        # Then the retry writes nothing: the world moved on, and the newer bytes stand
        assert landed == [1]
        assert (tmp_path / scope / "a.txt").read_text() == "new"
        assert outcome.status is Status.FAILED
        assert ledger.get(scope, "c1").current.result["error"] == "superseded"
    finally:
        ledger.close()


def test_reconcile__a_file_holding_the_bytes_while_a_newer_write_waits_proves_nothing(
    fresh_db_url, scope, tmp_path, monkeypatch
):
    """helper-88: a.txt held X; w2 (Y) committed, its lander frozen holding the path's lock;
    w1 (X), asked after w2, died after its claim. The sweep's reconciler found X and recorded
    w1 succeeded; w2's Y then landed, and the receipt stayed untrue, ``verify`` ok. Bytes that
    wait on the path make the file say nothing: the fence proves w1 not applied."""
    ledger = Ledger(fresh_db_url)
    try:
        executor = _builtin_executor(ledger, tmp_path, lock_wait=0.2)
        ledger.submit(scope, "w0", "write_file", {"path": "a.txt", "content": "X"},
                      approved_by="al")  # fmt: skip
        executor.execute(scope, "write_file:w0", 1)
        _committed_not_landed(executor, scope, "w2", "a.txt", "Y", monkeypatch)
        ledger.submit(scope, "w1", "write_file", {"path": "a.txt", "content": "X"},
                      approved_by="al")  # fmt: skip
        ledger.claim(scope, "write_file:w1", 1, worker_id="dead", lease_seconds=0.05)
        time.sleep(0.1)
        with effects_of(executor.sandbox)._path_lock(path_hash(scope, "a.txt")):  # w2's lander
            summary = sweep(ledger, executor.registry, executor.sandbox, grace_seconds=0,
                            requeue_after=60, publish=None)  # fmt: skip
        assert summary.marked_unknown == 1 and summary.from_reconciler == 0, summary
        assert summary.busy == 1  # said, not passed over in silence
        first = ledger.get(scope, "w1").executions[0]
        assert first.status is Status.FAILED and first.result["error"] == "not_applied"
        # and once w2's bytes land, nothing of w1 is written over them
        sweep(ledger, executor.registry, executor.sandbox, grace_seconds=0, requeue_after=60,
              publish=None)  # fmt: skip
        assert (tmp_path / scope / "a.txt").read_text() == "Y"
        w1 = ledger.get(scope, "w1")
        for attempt in range(2, w1.operation.authorized_attempts + 1):
            executor.execute(scope, "write_file:w1", attempt)
        assert (tmp_path / scope / "a.txt").read_text() == "Y"
        assert ledger.get(scope, "w1").operation.status is Status.FAILED
    finally:
        ledger.close()


class AutoRetryCheckCut(Ledger):
    def retried_automatically(self, claim: Any) -> bool:
        raise SoftTimeLimitExceeded()


@pytest.mark.parametrize("where", ["its ledger read", "its reconciler"])
def test_auto_retry__the_soft_time_limit_before_it_runs_is_never_started_not_superseded(
    fresh_db_url, scope, tmp_path, monkeypatch, where
):
    """helper-92: an automatic retry asks the ledger, then its reconciler, before its tool
    runs; the soft time limit in the first left the task (attempt 2 left running, nothing on
    record), and in the second read "superseded: the target changed" for good, the target
    unchanged. Both are "never started" now, as before any tool: the sweep decides."""
    ledger = Ledger(fresh_db_url)
    cut = AutoRetryCheckCut(fresh_db_url) if where == "its ledger read" else ledger
    try:
        executor = _builtin_executor(ledger, tmp_path)
        _retried_by_the_sweep(executor, scope, "c1", "a.txt")
        if where == "its reconciler":

            def out_of_time(self: Sandbox, at: str, path: str) -> str | None:
                raise SoftTimeLimitExceeded()

            monkeypatch.setattr(Sandbox, "sha256", out_of_time)
        retry = Executor(cut, executor.registry, executor.sandbox, worker_id="w",
                         lease_seconds=30, leases=LeaseKeeper(cut, 30, 0.0))  # fmt: skip
        outcome = retry.execute(scope, "write_file:c1", 2)
        assert outcome.state == "stale", outcome
        second = ledger.get(scope, "c1").executions[-1]
        assert (second.attempt, second.status) == (2, Status.RUNNING)  # not "superseded"
        assert pending_files(executor.sandbox) == [f"{second.execution_id}.spool"]
        assert not (tmp_path / scope / "a.txt").exists()
    finally:
        if cut is not ledger:
            cut.close()
        ledger.close()


def test_auto_retry__a_write_staged_while_it_is_reconciled_stops_it(
    fresh_db_url, scope, tmp_path, monkeypatch
):
    """The reconciler asks again after it finds the file missing: a newer write staged
    between its first question and its read (its execution running, to commit before the
    retry does) would land under the retry's older bytes. Cannot tell: nothing written."""
    ledger = Ledger(fresh_db_url)
    try:
        executor = _builtin_executor(ledger, tmp_path)
        _retried_by_the_sweep(executor, scope, "c1", "a.txt")
        ledger.submit(scope, "c3", "write_file", {"path": "a.txt", "content": "newer"},
                      approved_by="al")  # fmt: skip
        c3 = ledger.claim(scope, "write_file:c3", 1, worker_id="w3", lease_seconds=30)
        assert c3 is not None
        real, staged = Sandbox.sha256, []

        def racing(self: Sandbox, at: str, path: str) -> str | None:
            if path == "a.txt" and not staged:  # c3's tool writes while the file is read
                staging = effects_of(executor.sandbox).staging(scope, c3.execution_id, None)
                staged.append(staging.write_atomic(scope, "a.txt", b"newer"))
                staging.seal()
            return real(self, at, path)

        monkeypatch.setattr(Sandbox, "sha256", racing)
        outcome = executor.execute(scope, "write_file:c1", 2)
        assert staged and outcome.status is Status.FAILED
        assert ledger.get(scope, "c1").current.result["error"] == "superseded"
        assert not (tmp_path / scope / "a.txt").exists()
    finally:
        ledger.close()


def test_auto_retry__its_revoked_predecessors_late_stage_does_not_stop_it(
    fresh_db_url, scope, tmp_path
):
    """Attempt 1's executor, frozen between its lease check and its stage, woke after the
    sweep revoked it, proved it absent and authorised attempt 2, and staged its write (its
    check had passed). Attempt 2's reconciler counted those bytes as waiting on the path and
    it ended ``superseded``, nothing written, its receipt saying the target changed (a cold
    review). A revoked execution's bytes never land: they do not count, and are dropped."""
    ledger = Ledger(fresh_db_url)
    try:
        executor = _builtin_executor(ledger, tmp_path)
        _retried_by_the_sweep(executor, scope, "c1", "a.txt")
        zombie = ledger.get(scope, "c1").executions[0]
        assert zombie.status is not Status.RUNNING
        staging = effects_of(executor.sandbox).staging(scope, zombie.execution_id, None)
        staging.write_atomic(scope, "a.txt", b"old")
        staging.seal()
        outcome = executor.execute(scope, "write_file:c1", 2)
        assert outcome.status is Status.SUCCEEDED, ledger.get(scope, "c1").current.result
        assert (tmp_path / scope / "a.txt").read_text() == "old"
        assert effects_of(executor.sandbox).settle(ledger).landed == 0
        assert pending_files(executor.sandbox) == []  # the zombie's bytes dropped, not landed
    finally:
        ledger.close()


def test_auto_retry__a_reconciler_failing_before_it_stops_it_and_keeps_its_text_at_debug(
    fresh_db_url, scope, tmp_path, monkeypatch, caplog
):
    """Cannot tell whether the world moved on: nothing written. The reconciler's own text
    (a tool's, which may quote the call's arguments) is logged at DEBUG only (a cold review
    found a reconciler's message reaching WARNING lines)."""
    ledger = Ledger(fresh_db_url)
    try:
        executor = _builtin_executor(ledger, tmp_path)
        _retried_by_the_sweep(executor, scope, "c1", "a.txt")

        def failing(self: Sandbox, at: str, path: str) -> str | None:
            raise RuntimeError("driver broke reading a.txt, content='SECRET-hunter2'")

        monkeypatch.setattr(Sandbox, "sha256", failing)
        caplog.set_level("DEBUG", logger="toolledger")
        outcome = executor.execute(scope, "write_file:c1", 2)
        assert outcome.status is Status.FAILED
        assert ledger.get(scope, "c1").current.result["error"] == "superseded"
        assert not (tmp_path / scope / "a.txt").exists()
        said = [r for r in caplog.records if "SECRET" in r.getMessage()]
        assert said and {r.levelname for r in said} == {"DEBUG"}
        assert any(
            "before its retry: RuntimeError" in r.getMessage() and r.levelname == "WARNING"
            for r in caplog.records
        )
    finally:
        ledger.close()


def test_read_only__a_path_whose_committed_bytes_wait_is_not_read_stale(
    ledger, scope, tmp_path, monkeypatch
):
    """A write committed (its receipt says succeeded) whose bytes cannot land before a read:
    its lander frozen holding the path's lock, or the ledger unable to say what is
    committed. The read returned the bytes it replaces (a cold review); it fails
    ``not_settled`` now, and reads the new bytes once they land. Other paths read."""
    from toolledger.effects import Effects

    executor = _builtin_executor(ledger, tmp_path, lock_wait=0.2)
    read_file = executor.registry.get("read_file")
    ledger.submit(scope, "v1", "write_file", {"path": "a.txt", "content": "v1"}, approved_by="al")
    executor.execute(scope, "write_file:v1", 1)
    ledger.submit(scope, "b", "write_file", {"path": "b.txt", "content": "b"}, approved_by="al")
    executor.execute(scope, "write_file:b", 1)
    _committed_not_landed(executor, scope, "v2", "a.txt", "v2", monkeypatch)
    effects = effects_of(executor.sandbox)
    with effects._path_lock(path_hash(scope, "a.txt")):  # a frozen lander holds it
        status, result = executor.run_read_only(scope, read_file, {"path": "a.txt"})
        assert status is Status.FAILED and result["error"] == "not_settled", result
        assert "lander holds the path" in result["message"]
        other = executor.run_read_only(scope, read_file, {"path": "b.txt"})
        assert other[0] is Status.SUCCEEDED and other[1]["content"] == "b", other
    real = Effects.settle  # the ledger cannot answer: no settle, no question answered
    monkeypatch.setattr(Effects, "settle", _raises_operational)
    monkeypatch.setattr(Ledger, "effect_states", _raises_operational)
    status, result = executor.run_read_only(scope, read_file, {"path": "a.txt"})
    assert status is Status.FAILED and result["error"] == "not_settled", result
    other = executor.run_read_only(scope, read_file, {"path": "b.txt"})  # nothing waits there
    assert other[0] is Status.SUCCEEDED, other
    monkeypatch.undo()
    assert Effects.settle is real
    status, result = executor.run_read_only(scope, read_file, {"path": "a.txt"})
    assert status is Status.SUCCEEDED and result["content"] == "v2", result


def _raises_operational(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise sa.exc.OperationalError("SELECT", {}, Exception("the ledger is away"))


def test_settle__through_another_ledger_keeps_the_bytes_it_does_not_know(
    ledger, fresh_db_url, scope, tmp_path, monkeypatch
):
    """A process pointed at the right sandbox and another ledger (an unset TOOLLEDGER_DB
    makes the embedded one) removed every staged effect it could not find as "never
    claimed": committed bytes of succeeded calls never landed, unflagged (a cold review).
    Another ledger's stages are kept; the right ledger's settle lands them."""
    executor = _builtin_executor(ledger, tmp_path)
    _committed_not_landed(executor, scope, "w", "w.txt", "kept", monkeypatch)
    waiting = pending_files(executor.sandbox)
    assert waiting
    other = Ledger(fresh_db_url)
    try:
        wrong = _builtin_executor(other, tmp_path)
        landing = effects_of(wrong.sandbox).settle(other)
        assert (landing.strangers, landing.discarded, landing.landed) == (len(waiting), 0, 0)
        read = wrong.run_read_only(scope, wrong.registry.get("read_file"), {"path": "w.txt"})
        assert read[0] is Status.FAILED  # no such file yet: what that ledger can tell
        summary = sweep(other, wrong.registry, wrong.sandbox, grace_seconds=0, requeue_after=60,
                        publish=None)  # fmt: skip
        assert summary.strangers == len(waiting) and summary.dropped == 0  # said, and kept
    finally:
        other.close()
    assert pending_files(executor.sandbox) == waiting
    assert effects_of(executor.sandbox).settle(ledger).landed == 1
    assert (tmp_path / scope / "w.txt").read_text() == "kept"


def test_settle__through_another_ledger_keeps_a_spooled_result_it_does_not_know(
    spooled, ledger, fresh_db_url, tmp_path
):
    """helper-97: a settle through the wrong ledger kept another's stages but deleted its
    spooled results (``state is None`` fell through to the removal): the right ledger never
    learned the call had succeeded, and it ended unknown for a person while the world held
    its effect. Kept and said now; the right ledger's settle records it."""
    _outcome, view, spool_file = spooled()
    other = Ledger(fresh_db_url)
    try:
        landing = effects_of(Sandbox(tmp_path)).settle(other)
    finally:
        other.close()
    assert landing.strangers >= 1 and spool_file.exists()
    landing = effects_of(Sandbox(tmp_path)).settle(ledger)
    assert landing.recorded == 1 and not spool_file.exists()
    current = ledger.get(view.scope, view.tool_call_id).current
    assert current.status is Status.SUCCEEDED and not current.reconciled
    assert (tmp_path / view.scope / "r.txt").read_text() == "v"


def test_settle__a_spooled_claim_that_never_committed_is_removed_a_strangers_result_kept(
    ledger, tmp_path
):
    """A claim whose commit its executor could not learn spools "not started" before anyone
    knows whether the execution exists: where the ledger has no such execution, the claim
    never committed and nothing ran, and the spool goes (the mend that kept a stranger's
    spooled result kept these too, and CI's chaos run found six never settled). Any other
    spool of an execution the ledger does not know is another ledger's: kept."""
    from toolledger.effects import CLAIM_UNKNOWN

    effects = effects_of(Sandbox(tmp_path))
    never, stranger = "01a24d00-0000-7000-8000-000000000001", "01a24d00-0000-7000-8000-000000000002"
    late = {"not_started": True, "absent": True, "worker_id": "w", "spool": f"{never}:1"}
    effects.spool(never, {"execution_id": never, "lease_token": "t", "status": "not_started",
                          "reason": CLAIM_UNKNOWN, "late": late})  # fmt: skip
    effects.spool(stranger, {"execution_id": stranger, "lease_token": "t", "status": "failed",
                             "result": {"error": "boom"}, "error": "boom"})  # fmt: skip
    landing = effects.settle(ledger)
    # kept an hour: its claim's statement may still be at the server, committing later, and
    # the spool is then what ends the call not_applied by itself (helper-103)
    assert pending_files(Sandbox(tmp_path)) == [f"{never}.spool", f"{stranger}.spool"]
    assert (landing.strangers, landing.left) == (1, 1)
    hours_ago = time.time() - 2 * 3600
    os.utime(effects.pending_dir / f"{never}.spool", (hours_ago, hours_ago))
    landing = effects.settle(ledger)
    assert pending_files(Sandbox(tmp_path)) == [f"{stranger}.spool"]
    assert landing.strangers == 1
    # a leftover of an execution this ledger does not know goes only after a day
    left = effects.pending_dir / f"{never}.spool.tmp4242.0a1b2c3d"
    left.write_bytes(b"{")
    os.utime(left, (hours_ago, hours_ago))
    assert effects.settle(ledger).leftovers == 0 and left.exists()
    days_ago = time.time() - 25 * 3600
    os.utime(left, (days_ago, days_ago))
    assert effects.settle(ledger).leftovers == 1 and not left.exists()


def test_settle__an_unsure_claim_that_commits_after_a_settle_still_ends_not_applied(
    run, ledger, db_url, tmp_path, monkeypatch
):
    """helper-103: the claim's statement still at the server when a settle ran: the spool was
    dropped, the claim committed after it, and the call ended unknown for a person instead of
    failed not_applied by itself."""
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.001)
    flaky = ClaimNeverCommitted(db_url)
    outcome, view = run("ok", executor_ledger=flaky)
    flaky.close()
    assert outcome.state == "unsure" and not view.executions
    effects_of(Sandbox(tmp_path)).settle(ledger)  # before the claim lands
    claim = flaky.lost
    assert claim is not None
    assert ledger.claim(*claim["args"], **claim["kwargs"]) is not None  # it lands now
    expire_lease(ledger, outcome.execution_id)
    summary = sweep(
        ledger, REGISTRY, Sandbox(tmp_path), grace_seconds=0, requeue_after=60, publish=None
    )
    assert summary.spooled_results >= 1  # (the module's other calls are swept too)
    done = ledger.get(view.scope, view.tool_call_id).current
    assert (done.status, done.result["error"]) == (Status.FAILED, "not_applied")


def test_settle__a_spooled_never_started_against_a_persons_success_since_is_flagged(
    run, ledger, db_url, tmp_path, monkeypatch
):
    """The settle records a spooled "not started" in two steps (unknown, then the evidence);
    a person who resolved the call succeeded between them was never told the executor's word
    against it (helper-102): the call goes back to the inbox, contradicted."""
    monkeypatch.setattr("toolledger.worker.pipeline.TERMINAL_BACKOFF_SECONDS", 0.001)
    flaky = ClaimCommitUnknowable(db_url)
    outcome, view = run("ok", executor_ledger=flaky, lease=30)
    flaky.close()
    assert outcome.state == "unsure"
    marked = ledger.mark_unknown

    def then_a_person(execution_id: str, **kwargs: Any) -> Any:
        done = marked(execution_id, **kwargs)
        ledger.resolve(execution_id, Status.SUCCEEDED, by="dana", evidence="I saw it run")
        return done

    monkeypatch.setattr(ledger, "mark_unknown", then_a_person)
    effects_of(Sandbox(tmp_path)).settle(ledger)
    call = ledger.get(view.scope, view.tool_call_id)
    assert call.current.status is Status.SUCCEEDED  # nothing overwritten: she decides again
    assert call.operation.review == Review.CONTRADICTED
