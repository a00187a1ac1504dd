"""``run_tool`` classifies whatever a tool raises into something the ledger can store."""

from __future__ import annotations

from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded
from pydantic import BaseModel

from toolledger.ledger.transitions import Status
from toolledger.sandbox import Sandbox
from toolledger.tools import OutcomeUnknown, ToolContext, ToolError, make_tool
from toolledger.worker.pipeline import run_tool


class NoArgs(BaseModel):
    pass


def _run(fn: Any, tmp_path: Any) -> tuple[Status, Any, Any]:
    return run_tool(make_tool(fn), {}, ToolContext("s", Sandbox(tmp_path)))


class LateText(Exception):
    def __str__(self) -> str:
        raise SoftTimeLimitExceeded()


class Unshowable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_run_tool__the_time_limit_while_reading_an_error_is_unknown_not_a_failure(tmp_path):
    def late(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
        raise LateText()

    status, result, error = _run(late, tmp_path)
    assert (status, result) == (Status.UNKNOWN, None)
    assert error == "SoftTimeLimitExceeded: while reading LateText"


def test_run_tool__an_error_that_cannot_be_shown_is_shown_by_its_class(tmp_path):
    def fails(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
        raise Unshowable()

    class Unknowable(OutcomeUnknown, Unshowable):
        pass

    def cannot_tell(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
        raise Unknowable()

    assert _run(fails, tmp_path) == (
        Status.FAILED,
        {"error": "Unshowable", "message": "(Unshowable could not be shown)"},
        "Unshowable: (Unshowable could not be shown)",
    )
    assert _run(cannot_tell, tmp_path)[0] is Status.UNKNOWN


def test_run_tool__a_failure_detail_is_stored_as_a_result_is(tmp_path):
    name = b"caf\xe9".decode("utf-8", "surrogateescape")

    def reports(args: NoArgs, ctx: ToolContext) -> dict[str, Any]:
        raise ToolError(f"cannot copy {name}\x00", files=(name,))

    status, result, error = _run(reports, tmp_path)
    assert status is Status.FAILED and error == "cannot copy caf\\udce9\\x00"
    assert result == {
        "error": "tool_error",
        "message": "cannot copy caf\\udce9\x00",
        "files": ["caf\\udce9"],
    }
