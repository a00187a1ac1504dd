"""Example user tool: a call to a downstream service that honours idempotency keys.

The contract (see toolledger/tools.py): send ``ctx.service_key`` with the request, so the
downstream itself refuses a duplicate; and reconcile by asking the downstream for its
receipt under that same key — never by sending the request again. ``ctx.service_key`` is
``SCOPE/IDEMPOTENCY_KEY``: the idempotency key alone is unique within its scope only, and two
conversations' ``call_1`` would be one charge (this example sent it alone until 2026-12-06).
Load it with ``PYTHONPATH=. TOOLLEDGER_TOOLS=examples.downstream_tool`` from the repository
root: the ``toolledger`` console script does not put the current directory on ``sys.path``.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from toolledger.ledger.transitions import Status
from toolledger.tools import Evidence, ToolContext, ToolError, tool


class Downstream(Protocol):
    """What the service offers: a keyed request, and a lookup of receipts by key."""

    def charge(self, key: str, account: str, cents: int) -> dict[str, Any]: ...
    def receipt(self, key: str) -> dict[str, Any] | None: ...


class InMemoryPayments:
    """A stand-in for the real service (tests and the example only)."""

    def __init__(self) -> None:
        self.receipts: dict[str, dict[str, Any]] = {}

    def charge(self, key: str, account: str, cents: int) -> dict[str, Any]:
        if key not in self.receipts:  # the downstream deduplicates by key, too
            self.receipts[key] = {
                "charge_id": f"ch_{len(self.receipts) + 1}",
                "account": account,
                "cents": cents,
            }
        return self.receipts[key]

    def receipt(self, key: str) -> dict[str, Any] | None:
        return self.receipts.get(key)


SERVICE: Downstream = InMemoryPayments()


class ChargeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    account: str = Field(description="Account to charge.")
    cents: int = Field(gt=0, description="Amount, in cents.")


def reconcile_charge(args: ChargeArgs, ctx: ToolContext) -> Evidence | None:
    """Ask the downstream for its receipt under the original key. No receipt: no evidence
    (the call stays unknown for a human); a receipt for other terms: no evidence either."""
    assert ctx.service_key is not None
    found = SERVICE.receipt(ctx.service_key)
    if found is None or (found["account"], found["cents"]) != (args.account, args.cents):
        return None
    return Evidence(
        Status.SUCCEEDED,
        found,
        {"method": "downstream receipt under the idempotency key", "charge_id": found["charge_id"]},
    )


@tool(idempotent=True, reconcile=reconcile_charge)
def charge_account(args: ChargeArgs, ctx: ToolContext) -> dict[str, Any]:
    """Charge an account. Idempotent through the downstream's own idempotency key."""
    if ctx.service_key is None:
        raise ToolError("a charge needs an idempotency key")
    return SERVICE.charge(ctx.service_key, args.account, args.cents)
