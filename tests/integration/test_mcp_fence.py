"""The proxy's forward, driven directly: a call revoked while its proxy was frozen between
claim and send is never sent upstream, and the proxy records that it was not (which proves
the call not applied); a call still held is sent exactly once. An upstream tool named like a
registered one is never run as the registered one. On both backends."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
from mcp import types
from mcp.shared.exceptions import MCPError

from toolledger.builtin_tools import BUILTINS
from toolledger.ledger.errors import InvalidArguments, InvalidIdentifier, NotFound
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.mcp.common import CallIdentity
from toolledger.mcp.proxy import Proxy, _validator, ledger_name
from toolledger.recovery import humans
from toolledger.recovery.reconcile import late_result
from toolledger.sandbox import Sandbox
from toolledger.tools import Absent, Registry, UnknownTool
from toolledger.worker.pipeline import Executor


class Upstream:
    """Stands in for the upstream session: counts what reaches it."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def send_request(self, request: Any, _result_type: Any) -> types.CallToolResult:
        self.sent.append(request)
        return types.CallToolResult(content=[types.TextContent(type="text", text="charged")])


def proxy_for(ledger: Ledger, upstream: Upstream) -> Proxy:
    proxy = object.__new__(Proxy)  # only what _forward uses
    proxy.ledger, proxy.upstream, proxy.lease, proxy.time_limit = ledger, upstream, 30.0, 20.0
    proxy.idempotent, proxy.worker_id = set(), "mcp-proxy@test:1"
    return proxy


def claimed(ledger: Ledger, scope: str, call_id: str) -> Any:
    ledger.submit(scope, call_id, ledger_name("charge"), {"cents": 5}, approved_by="host")
    claim = ledger.claim(scope, f"mcp.charge:{call_id}", 1, worker_id="mcp-proxy@test:1")
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
    assert upstream.sent[0].params.name == "charge"  # the upstream's own name
    assert upstream.sent[0].params.meta == {
        "toolledger/idempotency_key": "mcp.charge:c2",
        "toolledger/service_key": f"{scope}/mcp.charge:c2",
    }
    assert ledger.get(scope, "c2").operation.status is Status.SUCCEEDED


class ErringUpstream(Upstream):
    async def send_request(self, request: Any, _result_type: Any) -> types.CallToolResult:
        self.sent.append(request)
        raise MCPError(-32000, "boom secret=hunter2")


def test_forward__an_upstream_error_is_recorded_never_logged(
    ledger: Ledger, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The upstream's error message ("boom secret=hunter2") reached the log at WARNING, where
    no call's contents go (a cold review). The person deciding the unknown call reads it in
    the ledger; the log says its class and code."""
    claim = claimed(ledger, scope, "c9")
    with caplog.at_level(logging.DEBUG):
        anyio.run(proxy_for(ledger, ErringUpstream())._forward, claim)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "MCPError (code -32000)" in logged and "hunter2" not in logged
    view = ledger.get(scope, "c9")
    assert view.operation.status is Status.UNKNOWN
    (marked,) = [e for e in ledger.events(scope, "c9") if e.kind == "unknown"]
    assert marked.detail["reason"].endswith("MCPError (code -32000): boom secret=hunter2")


def test_forward__stopped_between_claim_and_send_is_recorded_failed_not_sent(
    ledger: Ledger, scope: str
) -> None:
    """SIGTERM (the whole run cancelled) while the lease is being confirmed: nothing was sent,
    and the proxy records so (``failed``, not sent) instead of leaving the call running."""
    upstream = Upstream()
    claim = claimed(ledger, scope, "c3")
    proxy = proxy_for(ledger, upstream)
    real = proxy._db

    async def stalled_renewal(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn == ledger.renew_lease:
            await anyio.sleep(30)
        return await real(fn, *args, **kwargs)

    proxy._db = stalled_renewal  # type: ignore[method-assign]

    async def stopped() -> None:
        with anyio.move_on_after(0.3):
            await proxy._forward(claim)

    anyio.run(stopped)
    assert upstream.sent == []
    (ex,) = ledger.get(scope, "c3").executions
    assert ex.status is Status.FAILED
    assert ex.result is not None and "not sent upstream" in ex.result["content"][0]["text"]


def test_forward__a_lease_the_database_cannot_confirm_is_recorded_not_sent(
    ledger: Ledger, scope: str
) -> None:
    """helper-93: the database failed the lease's confirmation just before the send: nothing
    was sent, nothing recorded, and the sweep made the call unknown ("possibly applied", for
    a person). Recorded failed, not sent, as when the proxy is stopped there."""
    upstream = Upstream()
    claim = claimed(ledger, scope, "c4")
    proxy = proxy_for(ledger, upstream)
    real, failed = proxy._db, []

    async def busy_once(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn == ledger.renew_lease and not failed:
            failed.append(1)
            raise sa.exc.OperationalError("UPDATE", {}, Exception("database is locked"))
        return await real(fn, *args, **kwargs)

    proxy._db = busy_once  # type: ignore[method-assign]
    anyio.run(proxy._forward, claim)
    assert failed and upstream.sent == []
    (ex,) = ledger.get(scope, "c4").executions
    assert ex.status is Status.FAILED
    assert ex.result is not None and "not sent upstream" in ex.result["content"][0]["text"]


def test_forward__its_own_commit_unanswered_then_unreadable_is_not_called_late(
    ledger: Ledger, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finish commits and its answer is lost, the re-read fails too: the next try finds
    the row no longer running. That was taken for a revocation (a late result recorded on the
    call's own success, as the worker did: a cold review); the row is read first now."""
    monkeypatch.setattr("toolledger.mcp.proxy.RECORD_BACKOFF_SECONDS", 0.01)
    upstream = Upstream()
    claim = claimed(ledger, scope, "c4")
    real_finish, real_states = ledger.finish, ledger.effect_states
    calls = {"finish": 0, "blind": 1}

    def finish(*args: Any, **kwargs: Any) -> Any:
        calls["finish"] += 1
        done = real_finish(*args, **kwargs)
        if calls["finish"] == 1:
            raise sa.exc.OperationalError("COMMIT", {}, Exception("connection reset"))
        return done

    def effect_states(ids: Any) -> Any:
        if calls["blind"]:
            calls["blind"] -= 1
            raise sa.exc.OperationalError("SELECT", {}, Exception("server closed"))
        return real_states(ids)

    monkeypatch.setattr(ledger, "finish", finish)
    monkeypatch.setattr(ledger, "effect_states", effect_states)
    anyio.run(proxy_for(ledger, upstream)._forward, claim)
    assert len(upstream.sent) == 1
    assert ledger.get(scope, "c4").operation.status is Status.SUCCEEDED
    kinds = [e.kind for e in ledger.events(scope, "c4")]
    assert kinds.count("succeeded") == 1 and "evidence" not in kinds


def finish_failing(
    ledger: Ledger,
    monkeypatch: pytest.MonkeyPatch,
    failures: int,
    before_success: Any = None,
) -> dict[str, int]:
    """The ledger's finish fails ``failures`` times (nothing committed), then runs
    (``before_success`` first); returns the count of tries."""
    real_finish = ledger.finish
    tries = {"n": 0}

    def finish(*args: Any, **kwargs: Any) -> Any:
        tries["n"] += 1
        if tries["n"] <= failures:
            raise sa.exc.OperationalError("UPDATE", {}, Exception("server closed"))
        if before_success is not None:
            before_success()
        return real_finish(*args, **kwargs)

    monkeypatch.setattr(ledger, "finish", finish)
    return tries


def test_record__a_stale_fence_on_the_last_try_keeps_the_result_as_evidence(
    ledger: Ledger, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every try failed and every re-read too, then the last try met a stale fence (the sweep
    had revoked the call): the result was dropped (a cold review of the mend above). A stale
    fence is a definite answer: the result is kept as the call's evidence."""
    monkeypatch.setattr("toolledger.mcp.proxy.RECORD_BACKOFF_SECONDS", 0.001)
    claim = claimed(ledger, scope, "c5")

    def revoked() -> None:  # the sweep, before the sixth try
        ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")

    tries = finish_failing(ledger, monkeypatch, 5, before_success=revoked)

    def blind(_ids: Any) -> Any:
        raise sa.exc.OperationalError("SELECT", {}, Exception("server closed"))

    monkeypatch.setattr(ledger, "effect_states", blind)
    anyio.run(proxy_for(ledger, Upstream())._forward, claim)
    assert tries["n"] == 6
    monkeypatch.undo()
    assert "evidence" in [e.kind for e in ledger.events(scope, "c5")]
    (ex,) = ledger.get(scope, "c5").executions  # the late result settled the unknown call
    assert (ex.status, ex.reconciled) == (Status.SUCCEEDED, True)


def test_record__a_stop_during_the_back_off_still_records_the_answer(
    ledger: Ledger, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while the terminal write waited to try again: the upstream's answer was lost,
    nothing recorded, not even logged (a cold review). The record is shielded now."""
    monkeypatch.setattr("toolledger.mcp.proxy.RECORD_BACKOFF_SECONDS", 0.5)
    claim = claimed(ledger, scope, "c6")
    finish_failing(ledger, monkeypatch, 1)

    async def stopped() -> None:
        with anyio.move_on_after(0.2):  # within the back-off
            await proxy_for(ledger, Upstream())._forward(claim)

    anyio.run(stopped)
    monkeypatch.undo()
    assert ledger.get(scope, "c6").operation.status is Status.SUCCEEDED


def schema_proxy(ledger: Ledger, schema: dict[str, Any]) -> Proxy:
    proxy = proxy_for(ledger, Upstream())
    proxy.validators = {"t": _validator(types.Tool(name="t", input_schema=schema))}
    return proxy


class SlowValidator:
    """A validator that takes a second: a schema expensive to apply."""

    def iter_errors(self, _instance: Any) -> Any:
        time.sleep(1.0)
        return iter(())


def checked_ticking(
    proxy: Proxy, args: dict[str, Any], ident: CallIdentity
) -> tuple[InvalidArguments | None, int]:
    """``proxy._check_new`` of ``args`` for the tool ``t``, beside a task that ticks every
    50 ms on the same loop: its refusal (None if taken) and how often the loop ticked."""
    ticks: list[float] = []

    async def checking() -> InvalidArguments | None:
        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            try:
                await proxy._check_new("t", args, ident)
            except InvalidArguments as exc:
                return exc
            finally:
                tg.cancel_scope.cancel()
        return None

    return anyio.run(checking), len(ticks)


def test_schema_check__runs_off_the_loop_and_is_bounded(
    ledger: Ledger, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check ran on the proxy's event loop: one call with 5,000 objects under
    ``uniqueItems`` held every other request, and the lease renewals, for 32 s (a cold
    review). It runs in a thread now (the loop goes on), within 5 s, else refused."""
    ident = CallIdentity(scope, "s1")
    proxy = schema_proxy(ledger, {"type": "object"})
    proxy.validators["t"] = SlowValidator()  # type: ignore[assignment]
    refused, ticks = checked_ticking(proxy, {}, ident)
    assert refused is None and ticks >= 10  # the loop ran while the check did
    monkeypatch.setattr("toolledger.mcp.proxy.SCHEMA_CHECK_SECONDS", 0.2)
    with pytest.raises(InvalidArguments, match=r"could not be checked .* within 0\.2 s"):
        anyio.run(proxy._check_new, "t", {}, ident)
    unique = schema_proxy(ledger, {"properties": {"xs": {"type": "array", "uniqueItems": True}}})
    monkeypatch.setattr("toolledger.mcp.proxy.SCHEMA_CHECK_SECONDS", 5.0)
    many = {"xs": [{"k": i} for i in range(6000)]}  # pairwise: about a minute
    anyio.run(unique._check_new, "t", many, ident)  # within the bound: taken


EVIL = "^(a|aa)+$"  # backtracks exponentially on a run of a's that does not end right


@pytest.mark.parametrize(
    ("schema", "args"),
    [
        ({"properties": {"s": {"type": "string", "pattern": EVIL}}}, {"s": "a" * 60 + "!"}),
        ({"patternProperties": {EVIL: {"type": "string"}}}, {"a" * 60 + "!": "x"}),
        ({"patternProperties": {EVIL: {}}, "additionalProperties": False}, {"a" * 60 + "!": 1}),
        # a set opening with ":" too (sent to re as a POSIX class look-alike, it was unbounded)
        ({"properties": {"s": {"pattern": "^(a|aa)+[:]?$"}}}, {"s": "a" * 60 + "!"}),
    ],
    ids=["pattern", "patternProperties", "additionalProperties", "colon-set"],
)
def test_schema_check__a_pattern_that_backtracks_is_bounded_and_holds_nothing(
    ledger: Ledger, scope: str, monkeypatch: pytest.MonkeyPatch, schema: Any, args: Any
) -> None:
    """Python's ``re`` holds the GIL while it backtracks: an upstream's ``^(a|aa)+$`` and a
    model's 60 a's froze the proxy's loop, every other call, the lease renewals and SIGTERM
    for good, past the check's bound (a cold review). The searches are bounded by the check's
    deadline and let the loop run meanwhile; the call is refused, nothing recorded."""
    monkeypatch.setattr("toolledger.mcp.proxy.SCHEMA_CHECK_SECONDS", 1.0)
    proxy = schema_proxy(ledger, {"type": "object", **schema})
    threads = threading.active_count()
    began = time.monotonic()
    refused, ticks = checked_ticking(proxy, args, CallIdentity(scope, "evil"))
    assert refused is not None and re.search(r"could not be checked .* within 1 s", str(refused))
    assert time.monotonic() - began < 10 and ticks >= 10  # the loop ran meanwhile
    # and the check's thread ended by the deadline too (abandoned, it matched on for ever)
    wait_until = time.monotonic() + 5
    while threading.active_count() > threads and time.monotonic() < wait_until:
        time.sleep(0.05)
    assert threading.active_count() <= threads
    with pytest.raises(NotFound):
        ledger.get(scope, "evil")
    fine = {k.replace("!", ""): v for k, v in args.items()}
    fine = {k: (v.replace("!", "") if isinstance(v, str) else v) for k, v in fine.items()}
    anyio.run(proxy._check_new, "t", fine, CallIdentity(scope, "fine"))  # a match: taken


def nested_list(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


#: A chain of 41 definitions, each naming the next twice (``$ref`` and ``$dynamicRef``):
#: jsonschema's walk for ``unevaluatedProperties`` follows both, by itself, 2^40 times.
CHAIN = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}", "$dynamicRef": f"#/$defs/d{i + 1}"}
         for i in range(40)} | {"d40": {}}  # fmt: skip

#: Recursive schemas whose check is exponential in what the model sends, and what it sends.
RECURSIVE = {
    # each level of a list that fails at its leaf is tried twice: 2^30 keywords
    "anyOf-cycle": (
        {"properties": {"t": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"anyOf": [
            {"type": "array", "items": {"$ref": "#/$defs/n"}},
            {"type": "array", "items": {"$ref": "#/$defs/n"}}]}}},
        {"t": nested_list(30)},
    ),
    # valid, and each level applied twice all the same: 2^40
    "allOf-cycle": (
        {"properties": {"t": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"allOf": [
            {"items": {"$ref": "#/$defs/n"}}, {"items": {"$ref": "#/$defs/n"}}]}}},
        {"t": nested_list(40)},
    ),
    "unevaluated-chain": ({"unevaluatedProperties": False, "$ref": "#/$defs/d0", "$defs": CHAIN},
                          {}),
}  # fmt: skip


def cpu_burnt(seconds: float) -> float:
    """CPU seconds this process (all its threads) uses over the next ``seconds``."""
    before = time.process_time()
    time.sleep(seconds)
    return time.process_time() - before


@pytest.mark.parametrize(("schema", "args"), RECURSIVE.values(), ids=RECURSIVE.keys())
def test_schema_check__a_recursive_schema_is_refused_and_its_check_stops_there(
    ledger: Ledger, scope: str, monkeypatch: pytest.MonkeyPatch, schema: Any, args: Any
) -> None:
    """Refused at the bound, the check of an exponential recursive schema went on in its
    abandoned thread: a core busy for hours, and the proxy's exit waiting for it (a cold
    review). The check stops itself at the deadline now: the CPU it burns ends with it."""
    monkeypatch.setattr("toolledger.mcp.proxy.SCHEMA_CHECK_SECONDS", 1.0)
    proxy = schema_proxy(ledger, {"type": "object", **schema})
    threads = threading.active_count()
    began = time.monotonic()
    refused, ticks = checked_ticking(proxy, args, CallIdentity(scope, "deep"))
    took = time.monotonic() - began
    assert refused is not None and re.search(r"could not be checked .* within 1 s", str(refused))
    # the loop ran meanwhile (a blocked loop ticks once; the check holds the GIL between
    # its switches, and on a loaded machine the loop got 5 ticks in its second: CI)
    assert took < 5 and ticks >= 3
    time.sleep(0.5)  # the thread's next step is past its deadline; what it held is freed
    burnt = cpu_burnt(1.0)
    assert burnt < 0.3, f"{burnt:.2f} CPU seconds burnt in the second after the refusal"
    assert threading.active_count() <= threads  # and its thread is gone
    with pytest.raises(NotFound):
        ledger.get(scope, "deep")


def test_schema_check__a_check_given_up_early_stops_at_once(
    ledger: Ledger, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check whose wait is cancelled before its bound (SIGTERM stops the proxy) is cut short
    too: abandoned, it ran on to the bound, holding the proxy's exit until then."""
    monkeypatch.setattr("toolledger.mcp.proxy.SCHEMA_CHECK_SECONDS", 30.0)
    schema, args = RECURSIVE["anyOf-cycle"]
    proxy = schema_proxy(ledger, {"type": "object", **schema})

    async def given_up() -> None:
        with anyio.move_on_after(0.3):
            await proxy._check_new("t", args, CallIdentity(scope, "cut"))

    anyio.run(given_up)
    time.sleep(0.5)
    burnt = cpu_burnt(1.0)
    assert burnt < 0.3, f"{burnt:.2f} CPU seconds burnt in the second after the check was given up"


def test_schema_check__an_ordinary_recursive_schema_is_checked_as_before(
    ledger: Ledger, scope: str
) -> None:
    """Recursive schemas are common (a filter of and/or/eq): what the step check costs them
    is a clock read a keyword, not a refusal."""
    expr = {"anyOf": [
        {"type": "object", "properties": {"and": {"type": "array", "items": {"$ref": "#/$defs/e"}}},
         "required": ["and"]},
        {"type": "object", "properties": {"eq": {"type": "array", "maxItems": 2}},
         "required": ["eq"]}]}  # fmt: skip
    proxy = schema_proxy(
        ledger, {"type": "object", "properties": {"f": {"$ref": "#/$defs/e"}}, "$defs": {"e": expr}}
    )
    fine = {"f": {"and": [{"eq": ["a", 1]}, {"and": [{"eq": ["b", 2]}]}]}}
    anyio.run(proxy._check_new, "t", fine, CallIdentity(scope, "f1"))
    with pytest.raises(InvalidArguments, match=r"at 'f/and/0/eq': \[1, 2, 3\] is too long$"):
        anyio.run(
            proxy._check_new, "t", {"f": {"and": [{"eq": [1, 2, 3]}]}}, CallIdentity(scope, "f2")
        )


def test_schema_check__a_recorded_call_is_answered_whatever_the_schema_says_now(
    ledger: Ledger, scope: str
) -> None:
    """After the upstream's schema changed, a call already recorded (and run) was answered
    "arguments refused … nothing recorded" (a cold review): read as never run, it invites a
    second charge. A recorded call goes on to the ledger's replay (or conflict)."""
    strict = schema_proxy(
        ledger, {"type": "object", "required": ["currency"], "properties": {"amount": {}}}
    )
    ledger.submit(scope, "paid", ledger_name("t"), {"amount": 5}, approved_by="host")
    anyio.run(strict._check_new, "t", {"amount": 5}, CallIdentity(scope, "paid"))  # no refusal
    with pytest.raises(InvalidArguments, match="'currency' is a required property"):
        anyio.run(strict._check_new, "t", {"amount": 5}, CallIdentity(scope, "new"))


def test_proxied__an_upstream_write_file_is_never_run_as_the_built_in(
    ledger: Ledger, scope: str, tmp_path: Path
) -> None:
    """What the proxy records for an upstream tool called ``write_file``, left approved and
    unclaimed (the proxy died, or lost its upstream, after the submit), is handed to a worker
    by the sweep's re-publish: the worker does not know the tool and runs nothing. A retry is
    refused (no worker could run it); the built-in of that name stays the built-in."""
    args = {"path": "notes.txt", "content": "meeting at 3"}
    key = ledger.submit(scope, "up-1", ledger_name("write_file"), args, approved_by="mcp")
    assert key.operation.tool == "mcp.write_file"
    registry = Registry(list(BUILTINS))
    sandbox = Sandbox(tmp_path / "sandbox")
    executor = Executor(ledger, registry, sandbox, worker_id="w", lease_seconds=30)
    outcome = executor.execute(scope, key.operation.idempotency_key, 1)
    assert outcome.status is Status.FAILED and outcome.result is not None
    assert outcome.result["error"] == "refused"
    assert not (sandbox.root / scope / "notes.txt").exists()
    with pytest.raises(UnknownTool, match="the MCP proxy forwards"):
        humans.retry(ledger, registry, lambda *_: {}, scope, "up-1", by="al", accept_duplicate=True)
    assert ledger.get(scope, "up-1").operation.authorized_attempts == 1


def test_proxied__no_registered_tool_can_take_a_proxied_name() -> None:
    (builtin,) = [t for t in BUILTINS if t.name == "write_file"]
    with pytest.raises(InvalidIdentifier):
        Registry([dataclasses.replace(builtin, name=ledger_name("write_file"))])


@pytest.mark.parametrize(
    ("pattern", "values"),
    [
        ("^[a-z]+$", ["abc", "aB", ""]),
        (r"^\d{3}$", ["123", "12a", "١٢٣"]),
        ("(?i)^ab$", ["AB", "ac"]),
        ("^[[:alpha:]]+$", ["abc", "a]", ":]"]),  # a set then "]" to re: so it stays
        ("^[[:digit:]]{3}$", ["123", "d]d]d]"]),
        (r"^\w+@\w+\.com$", ["a@b.com", "a@b.org", "é@ü.com"]),
        # braces that open no quantifier: literal to re, fuzzy matching to regex
        ("^(?:abc){e<=1}$", ["abd", "abc{e<=1}"]),
        ("^(?:ab){s<=1}$", ["ax", "ab{s<=1}"]),
        (r"^a{2,3}\{x$", ["aa{x", "aaaa{x", "a{x"]),
    ],
)
@pytest.mark.filterwarnings("ignore:Possible nested set:FutureWarning")  # re's, on [[:
def test_schema_check__patterns_answer_as_before(
    ledger: Ledger, pattern: str, values: list[str]
) -> None:
    """The bounded search (regex) gives the answers Python's re gave: regex read POSIX classes
    where re reads a set of characters (a cold review)."""
    import jsonschema

    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    proxy = schema_proxy(ledger, schema)
    for value in values:
        before = jsonschema.Draft202012Validator(schema).is_valid({"s": value})  # re, no deadline
        refused, _ticks = checked_ticking(proxy, {"s": value}, CallIdentity("s", "p"))
        assert (refused is None) == before, (pattern, value, refused)


def test_mark_expired__of_one_call_touches_no_other(ledger: Ledger, scope: str) -> None:
    """What a proxy asked about a call runs: that call's expired executions only, the rest
    left to the sweep."""
    for call_id in ("e1", "e2"):
        ledger.submit(scope, call_id, ledger_name("charge"), {"cents": 5}, approved_by="host")
        claim = ledger.claim(
            scope, f"mcp.charge:{call_id}", 1, worker_id="mcp-proxy@dead:1", lease_seconds=0.05
        )
        assert claim is not None
    time.sleep(0.2)
    marked = ledger.mark_expired(actor="mcp-proxy", call=(scope, "mcp.charge:e1"))
    assert [m.idempotency_key for m in marked] == ["mcp.charge:e1"]
    assert ledger.get(scope, "e1").operation.status is Status.UNKNOWN
    assert ledger.get(scope, "e2").operation.status is Status.RUNNING
