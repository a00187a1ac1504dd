"""Invariant 5: the event and the state change commit together or not at all."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.helpers import row_counts
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status

FAIL_TRIGGER = {
    "postgresql": [
        """CREATE FUNCTION tl_injected_failure() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN RAISE EXCEPTION 'injected failure'; END $$""",
        "CREATE TRIGGER tl_injected BEFORE {op} ON {table} "
        "FOR EACH ROW EXECUTE FUNCTION tl_injected_failure()",
    ],
    "sqlite": [
        "CREATE TRIGGER tl_injected BEFORE {op} ON {table} "
        "BEGIN SELECT RAISE(ABORT, 'injected failure'); END",
    ],
}


def inject_failure(ledger: Ledger, op: str, table: str) -> None:
    with ledger.engine.begin() as conn:
        for statement in FAIL_TRIGGER[ledger.dialect]:
            conn.exec_driver_sql(statement.format(op=op, table=table))


# Each transition writes the execution row first, then the operation row, then the event.
# Failing the second or the third write must leave neither of the others visible.
WRITES = [("UPDATE", "operations"), ("INSERT", "execution_events")]


@pytest.mark.parametrize(
    ("op", "table"), WRITES, ids=["operation-write-fails", "event-write-fails"]
)
@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "generic"])
def test_atomicity__terminal_write(fresh_db_url, op, table, fast_path):
    ledger = Ledger(fresh_db_url, fast_path=fast_path)
    ledger.submit("s", "c1", "write_file", {"path": "a", "content": "b"}, approved_by="a")
    claim = ledger.claim("s", "write_file:c1", 1, worker_id="w")
    counts = row_counts(ledger.engine)
    inject_failure(ledger, op, table)
    with pytest.raises(sa.exc.DBAPIError, match="injected failure"):
        ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"ok": True})
    assert row_counts(ledger.engine) == counts
    row = ledger.execution(claim.execution_id)
    assert (row.status, row.result) == (Status.RUNNING, None)
    assert ledger.operation("s", "write_file:c1").status is Status.RUNNING
    ledger.close()


@pytest.mark.parametrize(
    ("op", "table"), WRITES, ids=["operation-write-fails", "event-write-fails"]
)
def test_atomicity__mark_unknown(fresh_db_url, op, table):
    ledger = Ledger(fresh_db_url)
    ledger.submit("s", "c1", "write_file", {"path": "a", "content": "b"}, approved_by="a")
    claim = ledger.claim("s", "write_file:c1", 1, worker_id="w")
    counts = row_counts(ledger.engine)
    inject_failure(ledger, op, table)
    with pytest.raises(sa.exc.DBAPIError, match="injected failure"):
        ledger.mark_unknown(claim.execution_id, reason="t", actor="t")
    assert row_counts(ledger.engine) == counts
    assert ledger.execution(claim.execution_id).status is Status.RUNNING
    ledger.close()


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "generic"])
def test_atomicity__claim_event_fails_no_claim_left(fresh_db_url, fast_path):
    ledger = Ledger(fresh_db_url, fast_path=fast_path)
    ledger.submit("s", "c1", "write_file", {"path": "a", "content": "b"}, approved_by="a")
    counts = row_counts(ledger.engine)
    inject_failure(ledger, "INSERT", "execution_events")
    with pytest.raises(sa.exc.DBAPIError, match="injected failure"):
        ledger.claim("s", "write_file:c1", 1, worker_id="w")
    assert row_counts(ledger.engine) == counts
    assert ledger.operation("s", "write_file:c1").status is Status.APPROVED
    ledger.close()
