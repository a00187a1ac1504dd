"""The proxy's check of arguments against an upstream tool's ``inputSchema``."""

from __future__ import annotations

import mcp.types as types
import pytest

from toolledger.ledger.errors import InvalidArguments
from toolledger.mcp.proxy import _check_arguments, _validator


def tool(schema: dict[str, object]) -> types.Tool:
    return types.Tool(name="t", input_schema=schema)


def test_a_schema_that_is_not_one_is_not_checked_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = tool({"type": "object", "properties": {"a": {"type": 5}}})
    assert _validator(broken) is None
    assert "its inputSchema is not a JSON Schema" in caplog.text
    _check_arguments("t", None, {"a": "anything"})  # forwarded as the upstream would take it


def test_the_refusal_names_where_and_cuts_a_long_value() -> None:
    nested = tool(
        {
            "type": "object",
            "properties": {"rows": {"type": "array", "items": {"type": "integer"}}},
        }
    )
    validator = _validator(nested)
    assert validator is not None
    _check_arguments("t", validator, {"rows": [1, 2]})
    with pytest.raises(InvalidArguments, match=r"at 'rows/1': 'x' is not of type 'integer'$"):
        _check_arguments("t", validator, {"rows": [1, "x"]})
    with pytest.raises(InvalidArguments) as refused:
        _check_arguments("t", validator, {"rows": ["y" * 10_000]})
    assert len(str(refused.value)) < 450 and str(refused.value).endswith("…")


def test_the_schema_dialect_it_names_is_the_one_used() -> None:
    draft4 = tool(
        {
            "$schema": "http://json-schema.org/draft-04/schema#",
            "type": "object",
            "properties": {"n": {"type": "number", "maximum": 3, "exclusiveMaximum": True}},
        }
    )  # draft 4's boolean exclusiveMaximum: not a valid 2020-12 schema
    validator = _validator(draft4)
    assert validator is not None
    with pytest.raises(InvalidArguments, match="maximum"):
        _check_arguments("t", validator, {"n": 3})


def test_unique_items_by_json_equality() -> None:
    """The proxy's own ``uniqueItems`` (linear: its cost is checked against the 5 s bound in
    ``test_mcp_fence.py``) keeps JSON Schema's equality: key order does not matter, 1 and 1.0
    are one, true and 1 not."""
    validator = _validator(
        tool({"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}})
    )
    assert validator is not None
    _check_arguments("t", validator, {"xs": [{"k": i, "v": [i, str(i)]} for i in range(3000)]})
    _check_arguments("t", validator, {"xs": [True, 1, "1", None, [1], {"a": 1}]})
    for same in (
        [{"a": 1, "b": 2}, {"b": 2, "a": 1}],
        [1, 1.0],
        [[1, {"x": None}], [1, {"x": None}]],
    ):
        with pytest.raises(InvalidArguments, match="non-unique"):
            _check_arguments("t", validator, {"xs": same})


def test_a_schema_it_cannot_apply_leaves_the_arguments_unchecked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An unresolvable ``$ref`` passes ``check_schema`` and raises only when applied: every
    call of that tool failed with an internal error (a cold review); it is forwarded as the
    upstream would take it, as for a schema that is not one."""
    remote = tool(
        {"type": "object", "properties": {"a": {"$ref": "https://example.invalid/a.json"}}}
    )
    validator = _validator(remote)
    assert validator is not None
    _check_arguments("t", validator, {"a": 1})
    assert "its inputSchema cannot be applied" in caplog.text


def test_relisted__no_output_schema_the_proxys_own_answers_would_break():
    """The proxy answers "not finished yet", "unknown" or a human's resolution with structured
    content of its own; a host's SDK checked it against the upstream's outputSchema and raised
    (a cold review): the proxy lists its tools without one."""
    from types import SimpleNamespace

    import mcp.types as types

    from toolledger.mcp.proxy import Proxy

    tool = types.Tool(
        name="charge",
        input_schema={"type": "object"},
        output_schema={"type": "object", "required": ["charged"]},
    )
    listed = Proxy._relisted(SimpleNamespace(idempotent=set()), tool)  # type: ignore[arg-type]
    assert listed.output_schema is None and listed.annotations is not None
    assert listed.annotations.idempotent_hint is False and listed.input_schema == tool.input_schema


def test_no_contents__a_malformed_result_is_named_not_quoted():
    """pydantic's message for a malformed upstream result quotes it (``input_value=…``), and
    it reached a WARNING line, where no call's contents go."""
    import mcp.types as types
    import pydantic

    from toolledger.mcp.proxy import _no_contents

    try:
        types.CallToolResult.model_validate({"content": [{"type": "weird", "secret": "s3cr3t"}]})
    except pydantic.ValidationError as exc:
        said = _no_contents(exc)
    else:
        raise AssertionError("the result was taken")
    assert said.startswith("a malformed result (") and "s3cr3t" not in said, said
    assert _no_contents(OSError("pipe closed")) == "OSError: pipe closed"


def test_reply__a_contradicted_upstream_result_says_the_dispute_to_the_model() -> None:
    """The proxy rebuilds the upstream's own blocks from a receipt: the dispute the receipt's
    content carries (``toolledger``) was dropped, and the model read "charged $10" alone
    (a cold review)."""
    from toolledger.ledger.receipts import DISPUTED_MESSAGE, disputed
    from toolledger.ledger.records import Receipt
    from toolledger.ledger.transitions import Status
    from toolledger.mcp.proxy import reply

    upstream = {"content": [{"type": "text", "text": "charged $10"}], "isError": False}
    flagged = Receipt(
        Status.SUCCEEDED, disputed(upstream), "e1", "s", "c1", review="contradicted", disputed=True
    )
    texts = [b.text for b in reply(flagged).content if b.type == "text"]
    assert texts == ["charged $10", DISPUTED_MESSAGE]
    plain = Receipt(Status.SUCCEEDED, upstream, "e1", "s", "c1")
    assert [b.text for b in reply(plain).content if b.type == "text"] == ["charged $10"]
    # a call flagged contradicted about another attempt: this receipt is not disputed
    other = Receipt(Status.SUCCEEDED, upstream, "e2", "s", "c1", review="contradicted")
    assert [b.text for b in reply(other).content if b.type == "text"] == ["charged $10"]
