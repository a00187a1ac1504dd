"""The proxy's forward, driven directly: a call revoked while its proxy was frozen between
claim and send is never sent upstream, and the proxy records that it was not (which proves
the call not applied); a call still held is sent exactly once. On both backends."""

from __future__ import annotations

from typing import Any

import anyio
from mcp import types

from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.mcp.proxy import Proxy
from toolledger.recovery.reconcile import late_result
from toolledger.tools import Absent


class Upstream:
    """Stands in for the upstream session: counts what reaches it."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def send_request(self, request: Any, _result_type: Any) -> types.CallToolResult:
        self.sent.append(request)
        return types.CallToolResult(content=[types.TextContent(type="text", text="charged")])


def proxy_for(ledger: Ledger, upstream: Upstream) -> Proxy:
    proxy = object.__new__(Proxy)  # only what _forward uses
    proxy.ledger, proxy.upstream, proxy.lease = ledger, upstream, 30.0
    proxy.idempotent, proxy.worker_id = set(), "mcp-proxy@test:1"
    return proxy


def claimed(ledger: Ledger, scope: str, call_id: str) -> Any:
    ledger.submit(scope, call_id, "charge", {"cents": 5}, approved_by="host")
    claim = ledger.claim(scope, f"charge:{call_id}", 1, worker_id="mcp-proxy@test:1")
    assert claim is not None
    return claim


def test_forward__a_call_revoked_before_its_send_is_never_sent(ledger: Ledger, scope: str) -> None:
    upstream = Upstream()
    claim = claimed(ledger, scope, "c1")
    ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")  # frozen
    anyio.run(proxy_for(ledger, upstream)._forward, claim)  # ... and wakes
    assert upstream.sent == []
    assert isinstance(late_result(ledger.events(scope, "c1")), Absent)  # provably not applied
    assert ledger.get(scope, "c1").operation.status is Status.UNKNOWN  # the sweep settles it


def test_forward__a_call_still_held_is_sent_once_and_finished(ledger: Ledger, scope: str) -> None:
    upstream = Upstream()
    claim = claimed(ledger, scope, "c2")
    anyio.run(proxy_for(ledger, upstream)._forward, claim)
    assert len(upstream.sent) == 1
    assert upstream.sent[0].params.meta == {"toolledger/idempotency_key": "charge:c2"}
    assert ledger.get(scope, "c2").operation.status is Status.SUCCEEDED
