"""A tool's own validators and check refuse hostile arguments as input (InvalidToolArguments:
nothing recorded, exit 6), whatever they raise to do it, never as an internal error."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, field_validator

from toolledger.ledger.errors import InputError
from toolledger.sandbox import Sandbox
from toolledger.tools import InvalidToolArguments, ToolContext, ToolError, make_tool


class When(BaseModel):
    when: datetime

    @field_validator("when", mode="before")
    @classmethod
    def iso(cls, v: Any) -> datetime:
        return datetime.fromisoformat(v)  # TypeError for a number: not a ValidationError


def stamp(args: When, ctx: ToolContext) -> dict[str, Any]:
    return {"when": args.when.isoformat()}


def test_parse__a_validators_type_error_is_a_refusal_on_one_line() -> None:
    with pytest.raises(InvalidToolArguments) as caught:
        make_tool(stamp).parse({"when": 5})
    assert str(caught.value) == (
        "invalid arguments for stamp: TypeError: fromisoformat: argument must be str"
    )


def test_parse__pydantics_own_refusals_are_unchanged() -> None:
    with pytest.raises(InvalidToolArguments, match="when: Value error, Invalid isoformat"):
        make_tool(stamp).parse({"when": "not a date"})
    parsed = make_tool(stamp).parse({"when": "2020-01-02"})
    assert isinstance(parsed, When) and parsed.when == datetime(2020, 1, 2)


@pytest.mark.parametrize(
    ("raised", "says"),
    [
        (KeyError("x\ny"), "stamp refused its arguments: KeyError: 'x\\ny'"),
        (ValueError("too\n  far"), "stamp refused its arguments: ValueError: too far"),
        (ToolError("no such\naccount"), "stamp refused its arguments: no such account"),
        (TypeError(), "stamp refused its arguments: TypeError"),
    ],
)
def test_refuse__what_a_check_raises_to_refuse_is_a_refusal(
    tmp_path: Path, raised: Exception, says: str
) -> None:
    def check(args: When, ctx: ToolContext) -> None:
        raise raised

    t = make_tool(stamp, check=check)
    with pytest.raises(InvalidToolArguments) as caught:
        t.refuse(t.parse({"when": "2020-01-02"}), ToolContext("s", Sandbox(tmp_path)))
    assert str(caught.value) == says


def test_refuse__input_errors_go_on_as_they_are_and_others_are_not_refusals(
    tmp_path: Path,
) -> None:
    mine = InputError("path refused")

    def refusing(args: When, ctx: ToolContext) -> None:
        raise mine

    def broken(args: When, ctx: ToolContext) -> None:
        raise OSError(5, "Input/output error")

    ctx, parsed = ToolContext("s", Sandbox(tmp_path)), When.model_validate({"when": "2020-01-02"})
    with pytest.raises(InputError) as caught:
        make_tool(stamp, check=refusing).refuse(parsed, ctx)
    assert caught.value is mine
    with pytest.raises(OSError):  # a fault of the sandbox, not the arguments
        make_tool(stamp, check=broken).refuse(parsed, ctx)
    make_tool(stamp).refuse(parsed, ctx)  # no check: nothing to refuse
