"""Order on one path, with the interleaving that broke it driven by hand.

A lander lists the pending area, then asks the ledger. Y stages on the path after the listing
and commits (seq 2) before X commits (seq 3, after Y: the path's advisory lock), and both
before the ledger answers. The answer says X committed; Y was not listed. Landing X now
would put seq 3 before seq 2 in the file (what 6 executors on 2 paths did, about once in 500
appends)."""

from __future__ import annotations

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
