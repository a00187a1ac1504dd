"""Tools whose effect is a payment outside the sandbox: what the fence does not cover.

``charge``'s reconciler asks a payment service that is down: each ask waits the service's
connect timeout (``TEST_RECONCILE_SECONDS``) and cannot tell, so its unknown calls wait for a
human, as documented, and every sweep pass asks again. ``careful_charge`` checks
``ctx.lease_lost`` before it charges, as the README asks of a tool that cannot undo its
effect, and writes each charge to ``TEST_CHARGES_LOG``.

Load with ``TOOLLEDGER_TOOLS=tests.payment_tools``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from pydantic import BaseModel

from toolledger.tools import Finding, ToolContext, tool


class ChargeArgs(BaseModel):
    amount: int


def ask_payment_service(args: ChargeArgs, ctx: ToolContext) -> Finding:
    time.sleep(float(os.environ.get("TEST_RECONCILE_SECONDS", "0")))
    return None  # no answer: it cannot tell


@tool(idempotent=False, reconcile=ask_payment_service)
def charge(args: ChargeArgs, ctx: ToolContext) -> dict[str, Any]:
    """Charge a card: an effect outside the sandbox, reconciled by asking the service."""
    return {"charged": args.amount, "key": ctx.idempotency_key}


@tool(idempotent=False)
def careful_charge(args: ChargeArgs, ctx: ToolContext) -> dict[str, Any]:
    """Charge a card, unless this execution's lease is lost: then nothing is charged."""
    if ctx.lease_lost.is_set():
        raise RuntimeError("lease lost: not charging")
    with open(os.environ["TEST_CHARGES_LOG"], "a") as log:
        log.write(f"{ctx.execution_id} {args.amount}\n")
    return {"charged": args.amount, "key": ctx.idempotency_key}
