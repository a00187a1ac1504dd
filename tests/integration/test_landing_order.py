"""Order on one path, with the interleaving that broke it driven by hand.

A lander lists the pending area, then asks the ledger. Y stages on the path after the listing
and commits (seq 2) before X commits (seq 3, after Y: the path's advisory lock), and both
before the ledger answers. The answer says X committed; Y was not listed. Landing X now
would put seq 3 before seq 2 in the file (what 6 executors on 2 paths did, about once in 500
appends)."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any

from toolledger.effects import Commit, effects_of
from toolledger.ledger.identity import new_execution_id
from toolledger.ledger.records import EffectState
from toolledger.ledger.transitions import Status
from toolledger.sandbox import Sandbox

SCOPE, PATH = "me", "log.txt"


def _stage(sb: Sandbox, data: bytes) -> tuple[str, list[Any]]:
    eid = new_execution_id()
    staging = effects_of(sb).staging(SCOPE, eid, None)
    staging.append(SCOPE, PATH, data)
    return eid, staging.seal()


def _succeeded(eid: str, staged: list[Any], seq: int) -> EffectState:
    return EffectState(
        execution_id=eid, scope=SCOPE, idempotency_key=f"k-{seq}", attempt=1,
        status=Status.SUCCEEDED, reconciled=False, lease_token="t",
        effects=tuple(s.to_json() for s in staged), seq=seq,
    )  # fmt: skip


class RacingBook:
    """The ledger as the lander sees it: while it answers the first question, Y stages on
    the path and commits (seq 2), then X commits (seq 3)."""

    def __init__(self, sb: Sandbox, x: tuple[str, list[Any]]) -> None:
        self.sb, self.x, self.y = sb, x, None
        self.states: dict[str, EffectState] = {}

    def effect_states(self, execution_ids: list[str]) -> dict[str, EffectState]:
        if self.y is None:  # the interleaving, between the listing and the answer
            self.y = _stage(self.sb, b"y\n")
            self.states[self.y[0]] = _succeeded(*self.y, seq=2)
            self.states[self.x[0]] = _succeeded(*self.x, seq=3)
        return {e: self.states[e] for e in execution_ids if e in self.states}

    def record_not_landed(self, execution_id: str, detail: dict[str, Any]) -> None:
        raise AssertionError(f"{execution_id} not landed: {detail}")


def test_order__an_effect_staged_after_the_listing_and_committed_first_lands_first(tmp_path):
    sb = Sandbox(tmp_path / "sb").prepare()
    (tmp_path / "sb" / SCOPE).mkdir()
    w_eid, w_staged = _stage(sb, b"w\n")  # the lander's own, committed first (seq 1)
    x = _stage(sb, b"x\n")  # running when listed
    book = RacingBook(sb, x)
    effects = effects_of(sb)
    effects.publish(Commit(w_eid, 1, SCOPE, "k-1", 1), w_staged, book)
    effects.settle(book)  # whatever was left lands now
    assert (tmp_path / "sb" / SCOPE / PATH).read_bytes() == b"w\ny\nx\n"  # seq 1, 2, 3
    assert not any(effects.pending_dir.iterdir())


class TwiceRacingBook(RacingBook):
    """As ``RacingBook``, and N stages on the path (running) during the first answer; during
    the second, M stages and commits (seq 4), then N commits (seq 5). M is in neither listing:
    N, though the second answer shows it committed, must wait for it."""

    def __init__(self, sb: Sandbox, x: tuple[str, list[Any]]) -> None:
        super().__init__(sb, x)
        self.n: tuple[str, list[Any]] | None = None
        self.m: tuple[str, list[Any]] | None = None

    def effect_states(self, execution_ids: list[str]) -> dict[str, EffectState]:
        if self.y is None:
            self.n = _stage(self.sb, b"n\n")  # running: no state yet
        elif self.m is None and self.n is not None:
            self.m = _stage(self.sb, b"m\n")
            self.states[self.m[0]] = _succeeded(*self.m, seq=4)
            self.states[self.n[0]] = _succeeded(*self.n, seq=5)
        return super().effect_states(execution_ids)


def test_order__a_commit_newer_than_the_first_answer_waits_for_one_not_listed(tmp_path):
    sb = Sandbox(tmp_path / "sb").prepare()
    (tmp_path / "sb" / SCOPE).mkdir()
    w_eid, w_staged = _stage(sb, b"w\n")
    book = TwiceRacingBook(sb, _stage(sb, b"x\n"))
    effects = effects_of(sb)
    landing = effects.publish(Commit(w_eid, 1, SCOPE, "k-1", 1), w_staged, book)
    assert landing.landed == 3 and landing.left == 1  # w, y, x; n waits (m unlisted)
    effects.settle(book)
    assert (tmp_path / "sb" / SCOPE / PATH).read_bytes() == b"w\ny\nx\nm\nn\n"  # seq 1 to 5
    assert not any(effects.pending_dir.iterdir())


def _stage_as(sb: Sandbox, kind: str, data: bytes) -> tuple[str, list[Any]]:
    eid = new_execution_id()
    staging = effects_of(sb).staging(SCOPE, eid, None)
    getattr(staging, "write_atomic" if kind == "write" else "append")(SCOPE, PATH, data)
    return eid, staging.seal()


class FlaggingBook:
    """Every listed execution succeeded, in the order given; flags are noted."""

    def __init__(self, staged: list[tuple[str, list[Any]]]) -> None:
        self.states = {e: _succeeded(e, st, seq=i + 1) for i, (e, st) in enumerate(staged)}
        self.flags: dict[str, list[dict[str, Any]]] = {}

    def effect_states(self, execution_ids: list[str]) -> dict[str, EffectState]:
        return {e: self.states[e] for e in execution_ids if e in self.states}

    def record_not_landed(self, execution_id: str, detail: dict[str, Any]) -> None:
        self.flags.setdefault(execution_id, []).append(detail)


def test_order__effects_a_write_that_cannot_land_replaces_are_kept_aside_and_flagged(tmp_path):
    # x writes, a appends, w writes the path, all committed; then the path became a folder
    # (another call wrote PATH/x). The older x and a were dropped as replaced by w before w
    # was known to land: w alone was kept aside and flagged, a's bytes gone, its call
    # unflagged though it never took effect (a cold review).
    sb = Sandbox(tmp_path / "sb").prepare()
    (tmp_path / "sb" / SCOPE).mkdir()
    x, a = _stage_as(sb, "write", b"X\n"), _stage_as(sb, "append", b"A-line\n")
    w = _stage_as(sb, "write", b"W\n")
    (tmp_path / "sb" / SCOPE / PATH).mkdir()
    book = FlaggingBook([x, a, w])
    effects = effects_of(sb)
    landing = effects.settle(book)
    assert (landing.landed, landing.discarded, landing.refused) == (0, 0, 3)
    assert sorted(book.flags) == sorted([x[0], a[0], w[0]])
    assert "replaced by the write of seq 3" in book.flags[a[0]][0]["reason"]
    kept = {p.name: p.read_bytes() for p in effects.pending_dir.iterdir()}
    assert sorted(kept.values()) == [b"A-line\n", b"W\n", b"X\n"]
    assert all(name.endswith(".refused") for name in kept)
    effects.settle(book)  # nothing aside is taken up again
    assert sum(len(f) for f in book.flags.values()) == 3


def test_order__effects_a_landed_write_replaces_are_dropped_unflagged(tmp_path):
    sb = Sandbox(tmp_path / "sb").prepare()
    (tmp_path / "sb" / SCOPE).mkdir()
    staged = [_stage_as(sb, "write", b"X\n"), _stage_as(sb, "append", b"A\n")]
    staged += [_stage_as(sb, "write", b"W\n"), _stage_as(sb, "append", b"B\n")]
    book = FlaggingBook(staged)
    effects = effects_of(sb)
    landing = effects.settle(book)
    assert (landing.landed, landing.discarded, landing.refused) == (2, 2, 0)
    assert (tmp_path / "sb" / SCOPE / PATH).read_bytes() == b"W\nB\n"
    assert not book.flags and not any(effects.pending_dir.iterdir())


def test_order__a_write_left_for_later_keeps_the_effects_it_replaces(tmp_path, monkeypatch):
    # an error of a moment before the write's checks: nothing is decided, nothing dropped
    sb = Sandbox(tmp_path / "sb").prepare()
    (tmp_path / "sb" / SCOPE).mkdir()
    staged = [_stage_as(sb, "append", b"A\n"), _stage_as(sb, "write", b"W\n")]
    book = FlaggingBook(staged)
    effects = effects_of(sb)
    real = sb.target_stat

    def full(*args: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sb, "target_stat", full)
    landing = effects.settle(book)
    assert (landing.landed, landing.discarded, landing.refused) == (0, 0, 0)
    assert len(list(effects.pending_dir.iterdir())) == 2
    monkeypatch.setattr(sb, "target_stat", real)
    landing = effects.settle(book)
    assert (landing.landed, landing.discarded) == (1, 1)
    assert (tmp_path / "sb" / SCOPE / PATH).read_bytes() == b"W\n"


def _append_then_write(tmp_path: Path) -> tuple[Sandbox, list[Any], FlaggingBook]:
    """An append, then a write, committed on PATH: the write replaces the append."""
    sb = Sandbox(tmp_path / "sb").prepare()
    (tmp_path / "sb" / SCOPE).mkdir()
    staged = [_stage_as(sb, "append", b"A\n"), _stage_as(sb, "write", b"W\n")]
    return sb, staged, FlaggingBook(staged)


def _rename_to_path_fails(monkeypatch: Any, error: OSError) -> Any:
    """``os.rename`` onto PATH raises ``error`` (after the write's checks); the real one."""
    real = os.rename

    def failing(src: Any, dst: Any, **kw: Any) -> None:
        if dst == PATH:
            raise error
        real(src, dst, **kw)

    monkeypatch.setattr(os, "rename", failing)
    return real


def test_order__a_write_refused_after_its_check_flags_the_effects_it_replaced(
    tmp_path, monkeypatch
):
    # the folder made between the write's check and its rename: the older effects were
    # renamed aside already (so that a crash after the rename cannot land them); their calls
    # are flagged all the same, and their bytes kept (until 2026-12-07 they were gone)
    sb, staged, book = _append_then_write(tmp_path)
    _rename_to_path_fails(monkeypatch, IsADirectoryError(21, "Is a directory"))
    landing = effects_of(sb).settle(book)
    assert (landing.landed, landing.discarded, landing.refused) == (0, 0, 2)
    assert sorted(book.flags) == sorted(e for e, _ in staged)
    assert "replaced by the write of seq 2" in book.flags[staged[0][0]][0]["reason"]
    kept = sorted(p.read_bytes() for p in effects_of(sb).pending_dir.iterdir())
    assert kept == [b"A\n", b"W\n"]


def test_order__a_write_whose_rename_fails_for_a_moment_keeps_the_effects_it_replaces(
    tmp_path, monkeypatch
):
    # a cold review of 2026-12-06's diff: the older effects dropped, the write's rename then
    # failed with an error of a moment (ENOSPC): it was left for the next settle, which knew
    # nothing of what it replaced; once its target was a folder only the write was flagged,
    # the succeeded append's bytes gone and its call unflagged. Flagged at the failure then
    # (though the write might land later); kept, renamed for the write, since 2026-12-07:
    # the next settle knows what the write replaces, and flags it only if it cannot land
    sb, staged, book = _append_then_write(tmp_path)
    real = _rename_to_path_fails(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    landing = effects_of(sb).settle(book)
    assert (landing.landed, landing.discarded, landing.refused) == (0, 0, 0)
    assert not book.flags
    monkeypatch.setattr(os, "rename", real)
    (tmp_path / "sb" / SCOPE / PATH).mkdir()  # then its target is a folder
    later = effects_of(sb).settle(book)
    assert (later.landed, later.refused) == (0, 2)
    assert sorted(book.flags) == sorted(e for e, _ in staged)  # both calls told


def test_order__a_write_left_for_a_moment_then_landed_drops_what_it_replaced_unflagged(
    tmp_path, monkeypatch
):
    sb, _staged, book = _append_then_write(tmp_path)
    real = _rename_to_path_fails(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    effects_of(sb).settle(book)
    monkeypatch.setattr(os, "rename", real)
    later = effects_of(sb).settle(book)
    assert (later.landed, later.discarded, later.refused) == (1, 1, 0)
    assert (tmp_path / "sb" / SCOPE / PATH).read_bytes() == b"W\n"
    assert not book.flags and not any(effects_of(sb).pending_dir.iterdir())


def test_pending_on__counts_the_bytes_of_executions_running_or_committed_only(tmp_path):
    # bytes a revoked (or failed, or reconciled) execution staged never land: with the
    # ledger's word they do not make a path "pending" (its own automatic retry ended
    # superseded on them: a cold review); running, committed, unknown to the ledger, or a
    # ledger that cannot answer: they count (cannot tell)
    from dataclasses import replace

    sb = Sandbox(tmp_path / "sb").prepare()
    (tmp_path / "sb" / SCOPE).mkdir()
    eid, staged = _stage_as(sb, "write", b"Z\n")
    effects = effects_of(sb)
    done = _succeeded(eid, staged, seq=1)

    def says(state: EffectState | None) -> Any:
        return lambda ids: {} if state is None else {eid: state}

    def away(ids: list[str]) -> dict[str, EffectState]:
        raise OSError("the database is away")

    for status in (Status.UNKNOWN, Status.FAILED):
        assert not effects.pending_on(SCOPE, PATH, says(replace(done, status=status, seq=0)))
    assert not effects.pending_on(SCOPE, PATH, says(replace(done, reconciled=True, seq=0)))
    assert effects.pending_on(SCOPE, PATH, says(replace(done, status=Status.RUNNING, seq=0)))
    assert effects.pending_on(SCOPE, PATH, says(done))
    assert effects.pending_on(SCOPE, PATH, says(None))
    assert effects.pending_on(SCOPE, PATH, away)
    assert effects.pending_on(SCOPE, PATH)  # no ledger to ask: every staged byte counts
    assert not effects.pending_on(SCOPE, "other.txt", away)


class Killed(BaseException):
    """The lander's process killed where this is raised (nothing of it runs on)."""


def test_order__a_crash_between_the_drop_and_the_rename_keeps_what_the_write_replaced(
    tmp_path, monkeypatch
):
    # Given an append, then a write, committed on PATH, whose lander is killed after it
    # dropped the append (replaced by the write) and before the write's rename (a cold
    # review: SIGKILLed there, the append's stage was gone; the target made a folder before
    # the next settle, only the write was flagged: the succeeded append's bytes were lost
    # and its call unflagged, verify ok)
    sb, staged, book = _append_then_write(tmp_path)
    real = os.rename

    def killed(src: Any, dst: Any, **kw: Any) -> None:
        if dst == PATH:
            raise Killed
        real(src, dst, **kw)

    monkeypatch.setattr(os, "rename", killed)
    with contextlib.suppress(Killed):
        effects_of(sb).settle(book)
    monkeypatch.setattr(os, "rename", real)
    # When the target is a folder at the next settle
    (tmp_path / "sb" / SCOPE / PATH).mkdir()
    landing = effects_of(sb).settle(book)
    # Then both calls are flagged and both effects' bytes kept aside, for a person
    assert (landing.landed, landing.refused) == (0, 2)
    assert sorted(book.flags) == sorted(e for e, _ in staged)
    assert "replaced by the write of seq 2" in book.flags[staged[0][0]][0]["reason"]
    kept = sorted(p.read_bytes() for p in effects_of(sb).pending_dir.iterdir())
    assert kept == [b"A\n", b"W\n"]


def test_order__a_crash_after_the_rename_never_lands_what_the_write_replaced(tmp_path, monkeypatch):
    # Given the same, killed just after the write's rename (the append dropped before it)
    sb, _staged, book = _append_then_write(tmp_path)
    real = os.rename

    def killed_after(src: Any, dst: Any, **kw: Any) -> None:
        real(src, dst, **kw)
        if dst == PATH:
            raise Killed

    monkeypatch.setattr(os, "rename", killed_after)
    with contextlib.suppress(Killed):
        effects_of(sb).settle(book)
    monkeypatch.setattr(os, "rename", real)
    # When the next settle runs, Then the append never lands over the write, nothing is left
    landing = effects_of(sb).settle(book)
    assert landing.landed == 0 and not book.flags
    assert (tmp_path / "sb" / SCOPE / PATH).read_bytes() == b"W\n"
    assert not any(effects_of(sb).pending_dir.iterdir())


def test_order__two_crashes_before_two_writes_keep_what_both_replaced(tmp_path, monkeypatch):
    # Given an append and a write committed on PATH, a lander killed between the drop and the
    # rename (the append renamed for the write of seq 2), then a newer write (seq 3) and a
    # lander killed there too (the older write renamed for it)
    sb = Sandbox(tmp_path / "sb").prepare()
    (tmp_path / "sb" / SCOPE).mkdir()
    staged = [_stage_as(sb, "append", b"A\n"), _stage_as(sb, "write", b"W1\n")]
    real = os.rename

    def killed(src: Any, dst: Any, **kw: Any) -> None:
        if dst == PATH:
            raise Killed
        real(src, dst, **kw)

    monkeypatch.setattr(os, "rename", killed)
    with contextlib.suppress(Killed):
        effects_of(sb).settle(FlaggingBook(staged))
    staged.append(_stage_as(sb, "write", b"W2\n"))
    book = FlaggingBook(staged)
    with contextlib.suppress(Killed):
        effects_of(sb).settle(book)
    monkeypatch.setattr(os, "rename", real)
    _a_folder_in_the_way_keeps_and_flags_all_three(tmp_path, sb, book, staged)


def _a_folder_in_the_way_keeps_and_flags_all_three(
    tmp_path: Path, sb: Sandbox, book: FlaggingBook, staged: list[tuple[str, list[Any]]]
) -> None:
    """When the target is a folder at the next settle, Then the append and both writes are
    kept and flagged, none dropped."""
    (tmp_path / "sb" / SCOPE / PATH).mkdir()
    landing = effects_of(sb).settle(book)
    assert (landing.landed, landing.discarded, landing.refused) == (0, 0, 3)
    assert sorted(book.flags) == sorted(e for e, _ in staged)
    kept = sorted(p.read_bytes() for p in effects_of(sb).pending_dir.iterdir())
    assert kept == [b"A\n", b"W1\n", b"W2\n"]


def test_order__a_crash_between_two_renames_of_one_drop_keeps_what_it_had_renamed(
    tmp_path, monkeypatch
):
    """Before: the older write was renamed for the newer first, the append (named for that
    older write) after it; killed between the two, the next settle found no write of seq 2
    staged, dropped the append as landed, and flagged only the two writes."""
    # Given an append renamed for the write of seq 2 by a lander killed before that write's
    # rename; then a newer write (seq 3), whose lander is killed between the two renames of
    # its drop (the older write's and the append's, renamed for seq 3)
    sb = Sandbox(tmp_path / "sb").prepare()
    (tmp_path / "sb" / SCOPE).mkdir()
    staged = [_stage_as(sb, "append", b"A\n"), _stage_as(sb, "write", b"W1\n")]
    real = os.rename
    renames: list[str] = []

    def killed_at(second_of_drop: bool) -> Any:
        def rename(src: Any, dst: Any, **kw: Any) -> None:
            renames.append(str(dst))
            if dst == PATH or (second_of_drop and len(renames) == 2):
                raise Killed
            real(src, dst, **kw)

        return rename

    monkeypatch.setattr(os, "rename", killed_at(False))
    with contextlib.suppress(Killed):
        effects_of(sb).settle(FlaggingBook(staged))
    staged.append(_stage_as(sb, "write", b"W2\n"))
    book = FlaggingBook(staged)
    renames.clear()
    monkeypatch.setattr(os, "rename", killed_at(True))
    with contextlib.suppress(Killed):
        effects_of(sb).settle(book)
    monkeypatch.setattr(os, "rename", real)
    assert all(".replaced-3-" in r for r in renames)  # killed inside the drop for seq 3
    _a_folder_in_the_way_keeps_and_flags_all_three(tmp_path, sb, book, staged)
