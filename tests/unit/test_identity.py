import hashlib
import uuid

import pytest

from toolledger.ledger.errors import ArgumentsTooLarge, InvalidArguments, InvalidIdentifier
from toolledger.ledger.identity import (
    args_sha256,
    canonical_json,
    check_args,
    check_call,
    check_registered_name,
    check_scope,
    check_tool_name,
    default_key,
    new_execution_id,
    new_lease_token,
)


def test_canonical_hash__key_order_does_not_matter():
    a = {"path": "a.txt", "content": "done", "opts": {"x": 1, "y": [1, 2]}}
    b = {"opts": {"y": [1, 2], "x": 1}, "content": "done", "path": "a.txt"}
    assert canonical_json(a) == canonical_json(b)
    assert args_sha256(a) == args_sha256(b)


def test_canonical_hash__non_ascii_kept_not_escaped():
    text = canonical_json({"content": "診断 é ✓"})
    assert text == '{"content":"診断 é ✓"}'
    assert "\\u" not in text
    assert args_sha256({"content": "診断 é ✓"}) == hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_canonical_hash__separators_have_no_spaces():
    assert canonical_json({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_canonical_hash__nan_and_infinity_refused(bad):
    with pytest.raises(InvalidArguments):
        args_sha256({"x": bad})


def test_canonical_hash__unserialisable_refused():
    with pytest.raises(InvalidArguments):
        args_sha256({"x": object()})


def test_default_key__is_tool_colon_tool_call_id():
    assert default_key("write_file", "call_abc") == "write_file:call_abc"


@pytest.mark.parametrize(
    ("tool", "call_id"), [("", "call_1"), ("write_file", ""), ("write_file", "  ")]
)
def test_default_key__empty_tool_or_id_refused(tool, call_id):
    with pytest.raises(InvalidIdentifier):
        default_key(tool, call_id)


def test_key__is_never_the_hash():
    # Two independent requests with equal arguments are two actions: their keys differ,
    # and neither key is (or contains) the hash of the arguments.
    args = {"path": "report.txt", "content": "done"}
    k1, sha1 = check_call("s", "call_1", "write_file", args)
    k2, sha2 = check_call("s", "call_2", "write_file", args)
    assert sha1 == sha2
    assert k1 != k2
    assert sha1 not in k1 and sha1 not in k2


@pytest.mark.parametrize("scope", ["demo", "agent-run_42", "a.b", "A1", "x" * 128])
def test_scope__safe_names_accepted(scope):
    assert check_scope(scope) == scope


@pytest.mark.parametrize(
    "scope", ["", "..", ".", "a/b", "../x", "a..b", "-x", "x" * 129, "a b", "a\x00b", "é", "/abs"]
)
def test_scope__unsafe_names_refused(scope):
    with pytest.raises(InvalidIdentifier):
        check_scope(scope)


@pytest.mark.parametrize(
    "name", ["mcp.charge", "mcp.admin.tools.list", "mcp.user-profile/update", "mcp." + "x" * 128]
)
def test_tool_name__a_proxied_name_may_hold_the_dot_and_slash_mcp_allows(name):
    assert check_tool_name(name) == name


@pytest.mark.parametrize(
    "name", ["admin.tools.list", "a/b", "mcp." + "x" * 129, "mcp.a b", "mcp.", "mcp.a:b", "x" * 65]
)
def test_tool_name__outside_both_forms_refused(name):
    with pytest.raises(InvalidIdentifier, match="is not 1-64 of"):
        check_tool_name(name)
    with pytest.raises(InvalidIdentifier):
        check_registered_name(name)


@pytest.mark.parametrize("args", [[1, 2], "text", 3, None])
def test_args__must_be_an_object(args):
    with pytest.raises(InvalidArguments):
        check_args(args)


def test_args__over_the_cap_refused_at_the_cap_accepted():
    args = {"c": "x" * 100}
    size = len(canonical_json(args).encode())
    assert check_args(args, max_bytes=size)
    with pytest.raises(ArgumentsTooLarge):
        check_args(args, max_bytes=size - 1)


def test_execution_id__uuid7_unique_and_time_ordered():
    ids = [new_execution_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    parsed = [uuid.UUID(i) for i in ids]
    assert {p.version for p in parsed} == {7}
    assert {p.variant for p in parsed} == {uuid.RFC_4122}
    stamps = [p.int >> 80 for p in parsed]
    assert stamps == sorted(stamps)


def test_lease_token__random_and_fits_its_column():
    tokens = {new_lease_token() for _ in range(1000)}
    assert len(tokens) == 1000
    assert all(len(t) == 32 for t in tokens)
