"""``EffectState.holds_own_write``: the one answer the executor, the settle of a spool and the
MCP proxy ask after a commit whose answer was lost (its commit, or a revocation?)."""

from __future__ import annotations

import pytest

from toolledger.ledger.records import EffectState
from toolledger.ledger.transitions import Status

S, F, U, R = Status.SUCCEEDED, Status.FAILED, Status.UNKNOWN, Status.RUNNING


def state(status: Status, *, reconciled: bool = False, seq: int = 0) -> EffectState:
    return EffectState("e1", "s", "k", 1, status, reconciled, "t", (), seq)


@pytest.mark.parametrize(
    ("row", "meant", "held"),
    [
        (state(S, seq=7), S, True),  # its own commit, its own succeeded event
        (state(F), F, True),  # only the token's holder commits an unreconciled failed
        (state(U), U, True),  # the same truth whoever wrote it
        (state(S, seq=7), F, False),  # another status: not this write
        (state(F), S, False),
        (state(U), S, False),  # revoked: the sweep marked it
        (state(U), F, False),
        (state(R), S, False),  # not written yet
        (state(S, reconciled=True), S, False),  # a reconciler's or a human's word
        (state(F, reconciled=True), F, False),
        (state(U, reconciled=True), U, False),
        (state(S, seq=0), S, False),  # no succeeded event of its own
    ],
)
def test_holds_own_write(row: EffectState, meant: Status, held: bool) -> None:
    assert row.holds_own_write(meant) is held
