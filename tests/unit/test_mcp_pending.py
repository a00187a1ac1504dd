"""What a "not finished yet" answer promises holds: a call kept in the connection's own scope
(``mcp-<session>``) is found after a reconnect only with that scope, and the answer says so (a
cold review's host asked again on a new connection and the tool ran twice)."""

from __future__ import annotations

from toolledger.mcp.common import META_SCOPE, META_TOOL_CALL_ID, call_identity, pending_result


def _message(result) -> str:
    return str(result.structured_content["message"])


def test_pending__a_call_in_the_connections_own_scope_names_the_scope_to_send():
    ident = call_identity({META_TOOL_CALL_ID: "call_1"}, 7, scope="mcp-abc", session="abc")
    assert ident.named_by_host and ident.session_scope
    said = _message(pending_result(ident, "running"))
    assert "After a reconnect" in said and "'mcp-abc'" in said and META_SCOPE in said


def test_pending__a_scope_the_host_or_the_server_fixed_needs_no_more():
    for meta, scope in (
        ({META_TOOL_CALL_ID: "call_1", META_SCOPE: "mine"}, "mcp-abc"),  # the host's
        ({META_TOOL_CALL_ID: "call_1"}, "team"),  # mcp serve --scope team
    ):
        ident = call_identity(meta, 7, scope=scope, session="abc")
        assert not ident.session_scope
        said = _message(pending_result(ident, "running"))
        assert "will not run again" in said and "After a reconnect" not in said


def test_pending__a_named_call_never_invites_the_model_to_call_again():
    """The text is the model's, and a model's next call has a new id: a new call. "Call the
    tool again with the same toolledger/tool_call_id" invited it, and with a host naming
    calls by the model's ids (``mcp_call_meta``) the tool ran a second time."""
    for meta, scope in (
        ({META_TOOL_CALL_ID: "call_1"}, "mcp-abc"),  # the connection's own scope
        ({META_TOOL_CALL_ID: "call_1", META_SCOPE: "mine"}, "mcp-abc"),
    ):
        ident = call_identity(meta, 7, scope=scope, session="abc")
        for status in ("running", "unanswered"):
            said = _message(pending_result(ident, status))
            assert "Call the tool again" not in said, said
            assert "Do not make a new call of the tool" in said and "'call_1'" in said, said


def test_pending__an_unnamed_call_is_told_not_to_ask_again():
    ident = call_identity({}, 7, scope="mcp-abc", session="abc")
    assert not ident.named_by_host
    assert "Do not call the tool again" in _message(pending_result(ident, "running"))


def test_proxy__the_database_failing_its_wait_answers_unanswered_not_an_error():
    """The proxy's wait for a call it forwards met the database failing: it answered a
    JSON-RPC error, and a model reading an error calls again, under a new request id where
    the host names none, forwarded again: two charges (a cold review of the day's diff). It
    answers the call not finished, ``unanswered``, told not to call again. (The subprocess
    test in tests/integration/test_mcp.py meets the failure wherever the wait is; this one
    meets it at the wait's read, every time.)"""
    import anyio
    import sqlalchemy as sa

    from toolledger.mcp.proxy import Proxy

    class Failing:
        async def wait(self, *_a, **_kw):
            raise sa.exc.OperationalError("SELECT", {}, Exception("connection refused"))

    async def answer():
        proxy = Proxy(
            Failing(), None, None, [], None, anyio.Event(),  # type: ignore[arg-type]
            scope="s", session="abc", approved_by="mcp", idempotent=set(), lease=30.0,
            timeout=5.0, time_limit=60.0,
        )  # fmt: skip
        ident = call_identity({META_SCOPE: "s"}, 7, scope="s", session="abc")
        return await proxy._answer(ident)

    result = anyio.run(answer)
    assert not result.is_error
    said = result.structured_content
    assert said["status"] == "unanswered" and said["finished"] is False
    assert "Do not call the tool again" in said["message"]


def test_proxy__a_wait_the_database_stopped_answering_answers_unanswered():
    """A wait that timed out while the database refused its re-reads (``ReceiptTimeout``
    with ``unanswered``) was answered "it is running", the last answer given as current; it
    is ``unanswered`` now, as a wait the database failed at once."""
    import anyio

    from toolledger.client import ReceiptTimeout
    from toolledger.mcp.proxy import Proxy

    class Unanswered:
        async def wait(self, scope, tool_call_id, **_kw):
            raise ReceiptTimeout(scope, tool_call_id, "running", 5.0, unanswered=True)

    async def answer():
        proxy = Proxy(
            Unanswered(), None, None, [], None, anyio.Event(),  # type: ignore[arg-type]
            scope="s", session="abc", approved_by="mcp", idempotent=set(), lease=30.0,
            timeout=5.0, time_limit=60.0,
        )  # fmt: skip
        ident = call_identity({META_SCOPE: "s"}, 8, scope="s", session="abc")
        return await proxy._answer(ident)

    result = anyio.run(answer)
    said = result.structured_content
    assert not result.is_error and said["status"] == "unanswered", said
    assert "Do not call the tool again" in said["message"]


def test_serve_instructions__never_invite_a_new_call_for_one_not_finished():
    """The server's instructions may reach the model (hosts put them in its context): "ask
    again with the same id" invites a call the model can only make under a new id."""
    from toolledger.mcp.serve import INSTRUCTIONS

    assert "ask again with the same id" not in INSTRUCTIONS
    assert "a new tool call (a new id) would run the tool again" in INSTRUCTIONS
