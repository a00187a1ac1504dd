"""Receipts wake their waiters: NOTIFY in the transaction that writes one (Postgres).

A trigger on ``operations`` sends ``NOTIFY toolledger_receipts, '["scope", "key"]'`` when a
call's status becomes one a waiter can return (succeeded, failed, rejected, unknown). Being a
trigger, it fires on every path that writes a status — the one-statement fast path included —
and, like every NOTIFY, is delivered only if that transaction commits. On SQLite nothing
changes in the schema: the ledger rings its doorbells after the commit (ledger.doorbell).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

CHANNEL = "toolledger_receipts"

FUNCTION = f"""
CREATE OR REPLACE FUNCTION toolledger_notify_receipt() RETURNS trigger AS $$
BEGIN
  PERFORM pg_notify('{CHANNEL}', json_build_array(NEW.scope, NEW.idempotency_key)::text);
  RETURN NULL;
END
$$ LANGUAGE plpgsql
"""

TRIGGER = """
CREATE TRIGGER operations_notify_receipt
AFTER UPDATE OF status ON operations
FOR EACH ROW
WHEN (NEW.status IS DISTINCT FROM OLD.status
      AND NEW.status IN ('succeeded', 'failed', 'rejected', 'unknown'))
EXECUTE FUNCTION toolledger_notify_receipt()
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(FUNCTION)
    op.execute(TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER IF EXISTS operations_notify_receipt ON operations")
    op.execute("DROP FUNCTION IF EXISTS toolledger_notify_receipt()")
