import pytest

from toolledger.ledger.errors import InvalidStatus, InvalidTransition
from toolledger.ledger.transitions import (
    REVIEW,
    TRANSITIONS,
    Status,
    check_transition,
    parse_status,
)

# The spec's state machine, written out as a matrix independent of ledger.transitions:
# row = from (None = not recorded), columns in this order, 1 = allowed.
COLUMNS = ["pending_approval", "approved", "rejected", "running", "succeeded", "failed", "unknown"]
# fmt: off
MATRIX = {
    None:               "1 1 0 0 0 0 0",
    "pending_approval": "0 1 1 0 0 0 0",
    "approved":         "0 0 0 1 1 0 0",
    "rejected":         "0 0 0 0 0 0 0",
    "running":          "0 0 0 0 1 1 1",
    "succeeded":        "0 0 0 0 0 1 0",
    "failed":           "0 1 0 0 1 0 0",
    "unknown":          "0 1 0 0 1 1 0",
}
# fmt: on
EXPECTED = {
    (Status(old) if old else None, Status(new)): flag == "1"
    for old, row in MATRIX.items()
    for new, flag in zip(COLUMNS, row.split(), strict=True)
}


@pytest.mark.parametrize(("old", "new"), sorted(EXPECTED, key=str))
def test_transition__every_pair(old, new):
    if EXPECTED[(old, new)]:
        check_transition(old, new)
    else:
        with pytest.raises(InvalidTransition):
            check_transition(old, new)


def test_transition__table_is_exactly_the_spec():
    assert {pair for pair, ok in EXPECTED.items() if ok} == set(TRANSITIONS)


def test_transition__nothing_leaves_a_final_state_but_a_review():
    assert not [new for (old, new) in TRANSITIONS if old is Status.REJECTED]
    # succeeded is left only by a human's review of a flagged call, and only to failed
    assert {(o, n) for (o, n) in TRANSITIONS if o is Status.SUCCEEDED} <= REVIEW
    assert {(Status.SUCCEEDED, Status.FAILED), (Status.FAILED, Status.SUCCEEDED)} == REVIEW


def test_transition__only_approved_can_start_running():
    assert {old for (old, new) in TRANSITIONS if new is Status.RUNNING} == {Status.APPROVED}


def test_status__outside_the_vocabulary_refused():
    with pytest.raises(InvalidStatus):
        parse_status("done")
    assert parse_status("unknown") is Status.UNKNOWN
