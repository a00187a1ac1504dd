"""The ledger behind the Model Context Protocol: ``toolledger mcp serve`` and ``mcp proxy``.

- ``serve``: a stdio MCP server whose tools are the registered toolledger tools. Every
  ``tools/call`` is submitted through :class:`toolledger.client.AsyncClient` (approved by the
  server's ``--approved-by``: whether a call may run is the MCP host's decision, made before
  it sends the call), executed by the workers, and answered with its receipt.
- ``proxy``: a stdio MCP server in front of another one (its child, over stdio). Every
  ``tools/call`` is recorded in the ledger, claimed by the proxy under a lease, forwarded
  upstream once with its idempotency key in ``_meta``, and finished with the upstream's
  result; the same call again is answered from the ledger, never forwarded again.

Which call is which comes from the request's ``_meta`` (:data:`META_TOOL_CALL_ID`,
:data:`META_SCOPE`); without them, a call is its JSON-RPC request in this server's session
(``toolledger.mcp.common.call_identity``). Nothing here is imported until a ``mcp`` command
runs: the ``mcp`` package is the optional extra ``toolledger[mcp]``.
"""

from __future__ import annotations

#: Request ``_meta`` key: the tool call's id (the model's, or the host's). The same id again
#: is the same call: its receipt is replayed, nothing runs twice.
META_TOOL_CALL_ID = "toolledger/tool_call_id"
#: Request ``_meta`` key: the scope (tenant, agent run) the call belongs to.
META_SCOPE = "toolledger/scope"
#: Upstream request ``_meta`` key (``proxy``): the call's idempotency key, for an upstream
#: that can refuse a key it has seen.
META_IDEMPOTENCY_KEY = "toolledger/idempotency_key"
#: Upstream request ``_meta`` key (``proxy``): ``SCOPE/KEY``, unique across the ledger's
#: scopes, where the idempotency key is unique within its scope only: the key to deduplicate by.
META_SERVICE_KEY = "toolledger/service_key"
#: Result ``_meta`` keys: where the answer came from.
META_STATUS = "toolledger/status"
META_EXECUTION_ID = "toolledger/execution_id"
META_RECONCILED = "toolledger/reconciled"
#: Result ``_meta`` key: the flag a person must settle (``contradicted``…), or null.
META_REVIEW = "toolledger/review"
#: Seconds a call waits for its receipt before it is answered with its status instead: under
#: the 60 s most hosts give a request (the TypeScript SDK's default), so the answer reaches the
#: host before it gives up. At 60 it never did: the host saw a timeout, and its retry of a call
#: it had not named ran the upstream tool a second time (a cold review).
DEFAULT_TIMEOUT = 45.0

__all__ = [
    "DEFAULT_TIMEOUT",
    "META_EXECUTION_ID",
    "META_IDEMPOTENCY_KEY",
    "META_RECONCILED",
    "META_REVIEW",
    "META_SCOPE",
    "META_SERVICE_KEY",
    "META_STATUS",
    "META_TOOL_CALL_ID",
]
