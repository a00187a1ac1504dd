"""A worker that does not load a call's tool (not yet restarted in a rolling deploy that added
it) leaves the call approved for one that does, for ``tool_wait`` after its authorisation;
past it, the call fails "unknown tool", as every such call did at once before 2026-12-07 (its
id spent, the model told of a failure for a tool the deployment has)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from toolledger.ledger import metrics as counters
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.models import executions
from toolledger.ledger.transitions import Status
from toolledger.sandbox import Sandbox
from toolledger.tools import Registry, ToolContext, make_tool
from toolledger.worker.pipeline import Executor


class NoArgs(BaseModel):
    pass


def added_tool(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
    return {"ran": True}


NEW = Registry([make_tool(added_tool)])  # a worker of the new release
OLD = Registry([])  # a worker not yet restarted


def _executor(ledger: Ledger, registry: Registry, sandbox: Sandbox, wait: float) -> Executor:
    return Executor(ledger, registry, sandbox, worker_id="w", lease_seconds=30, tool_wait=wait)


def _executions(ledger: Ledger, scope: str) -> int:
    with ledger.engine.connect() as conn:
        return conn.execute(
            sa.select(sa.func.count()).where(executions.c.scope == scope)
        ).scalar_one()


#: A wait short enough to pass in a test (the default is 900 s).
SHORT = 1.0


def _wait_past(seconds: float) -> None:
    time.sleep(seconds + 1.0)  # by the database's clock, which the ledger's events carry


@pytest.fixture
def counted() -> Iterator[Any]:
    """This process's metrics, in memory, for one test."""
    counters.disable()
    try:
        yield counters.enable()
    finally:
        counters.disable()


@pytest.mark.parametrize("named", [True, False], ids=["message names the tool", "it does not"])
def test_a_worker_without_the_tool__leaves_the_call_for_one_with_it(
    ledger: Ledger, scope: str, tmp_path: Any, named: bool, counted: Any
) -> None:
    ledger.submit(scope, "c1", "added_tool", {}, approved_by="al")
    key, sandbox = "added_tool:c1", Sandbox(tmp_path)
    tool = "added_tool" if named else None
    # When a worker that does not load the tool is handed the call
    left = _executor(ledger, OLD, sandbox, 900).execute(scope, key, 1, tool=tool)
    # Then it does not claim it: still approved, no execution, counted
    assert left.state == "left" and left.execution_id is None
    assert counted.registry.get_sample_value("toolledger_calls_left_total") == 1.0
    assert ledger.get(scope, "c1").operation.status is Status.APPROVED
    assert _executions(ledger, scope) == 0
    # And a worker that loads it runs it, once
    done = _executor(ledger, NEW, sandbox, 900).execute(scope, key, 1, tool=tool)
    assert done.state == "finished" and done.status is Status.SUCCEEDED
    assert ledger.get(scope, "c1").current.result == {"ran": True}
    assert _executions(ledger, scope) == 1


def test_past_the_wait__the_call_fails_unknown_tool(
    ledger: Ledger, scope: str, tmp_path: Any
) -> None:
    ledger.submit(scope, "c1", "added_tool", {}, approved_by="al")
    left = _executor(ledger, OLD, Sandbox(tmp_path), SHORT)
    assert left.execute(scope, "added_tool:c1", 1, tool="added_tool").state == "left"
    _wait_past(SHORT)
    out = _executor(ledger, OLD, Sandbox(tmp_path), SHORT).execute(
        scope, "added_tool:c1", 1, tool="added_tool"
    )
    assert out.status is Status.FAILED and "unknown tool" in out.result["message"]
    assert ledger.get(scope, "c1").operation.status is Status.FAILED


def test_a_retry_authorised_now__is_waited_for_again(
    ledger: Ledger, scope: str, tmp_path: Any
) -> None:
    # Given a call approved long ago, whose first attempt failed and was retried just now
    ledger.submit(scope, "c1", "added_tool", {}, approved_by="al")
    _wait_past(SHORT)
    sandbox = Sandbox(tmp_path)
    first = _executor(ledger, OLD, sandbox, SHORT).execute(scope, "added_tool:c1", 1)
    assert first.status is Status.FAILED
    ledger.authorize_retry(scope, "c1", by="al")
    # When a worker without the tool is handed the retry
    out = _executor(ledger, OLD, sandbox, SHORT).execute(scope, "added_tool:c1", 2)
    # Then it is left for a worker that has it, the wait counted from the retry
    assert out.state == "left"
    assert ledger.get(scope, "c1").operation.status is Status.APPROVED


def test_wait_0__fails_at_once_as_before(ledger: Ledger, scope: str, tmp_path: Any) -> None:
    ledger.submit(scope, "c1", "added_tool", {}, approved_by="al")
    out = _executor(ledger, OLD, Sandbox(tmp_path), 0).execute(
        scope, "added_tool:c1", 1, tool="added_tool"
    )
    assert out.status is Status.FAILED and "unknown tool" in out.result["message"]


def test_an_upstream_tool_of_the_mcp_proxy__is_never_left(
    ledger: Ledger, scope: str, tmp_path: Any
) -> None:
    # no worker runs a proxied tool: a proxy sends it; one handed it fails it, as before
    ledger.submit(scope, "c1", "mcp.charge", {}, approved_by="al")
    out = _executor(ledger, OLD, Sandbox(tmp_path), 900).execute(scope, "mcp.charge:c1", 1)
    assert out.status is Status.FAILED


def test_a_message_naming_another_tool__the_ledger_decides(
    ledger: Ledger, scope: str, tmp_path: Any
) -> None:
    # The header is a label: a message naming a tool the worker loads while the call is to
    # another is claimed, and the claim's tool, the ledger's, is what runs (here: unknown).
    ledger.submit(scope, "c1", "added_tool", {}, approved_by="al")
    loads_other = Registry([make_tool(added_tool, name="other_tool")])
    out = _executor(ledger, loads_other, Sandbox(tmp_path), 900).execute(
        scope, "added_tool:c1", 1, tool="other_tool"
    )
    assert out.status is Status.FAILED and "unknown tool" in out.result["message"]
