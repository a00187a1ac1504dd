"""A tool's result is stored as the JSON round trip of what it returned; the shortcut for flat
results of plain values must give exactly what the round trip gives (types included)."""

from __future__ import annotations

import enum
import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from toolledger.ledger.inputs import storable_object, valid_line, valid_text


class Colour(enum.IntEnum):
    RED = 1


class Name(enum.StrEnum):
    A = "a"


def _round_trip(result: Any) -> dict[str, Any]:
    """The definition: the JSON round trip, every lone surrogate written as its escape; what
    is not JSON (or cannot be made storable) as its ascii() text."""
    value = result if isinstance(result, dict) else {"result": result}
    try:
        return valid_text(json.loads(json.dumps(value, allow_nan=False)))  # type: ignore[no-any-return]
    except (TypeError, ValueError, RecursionError):
        try:
            shown = ascii(result)[:2000]
        except (TypeError, ValueError, RecursionError):
            shown = f"({type(result).__name__} could not be shown)"
        return {"result_repr": shown, "warning": "tool result was not JSON"}


def _typed(value: Any) -> Any:
    """``value`` with every scalar's exact type beside it (True == 1 == 1.0 in Python)."""
    if isinstance(value, dict):
        return {(type(k).__name__, k): _typed(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [type(value).__name__, *(_typed(v) for v in value)]
    return (type(value).__name__, value)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**62, max_value=2**65).map(lambda n: n * (-1) ** (n & 1)),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
    st.lists(st.sampled_from(["\udcff", "\ud800", "\U0001f600", "a", "é"])).map("".join),
    st.sampled_from([Colour.RED, Name.A, b"bytes"]),
)
keys = st.one_of(
    st.text(),
    st.sampled_from(["\udcff", "é"]),
    st.integers(),
    st.booleans(),
    st.sampled_from([Name.A, 1.5, None]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(keys, inner, max_size=3),
    ),
    max_leaves=8,
)


@given(st.one_of(values, st.dictionaries(keys, scalars, max_size=5)))
def test_json_safe__equals_the_round_trip_and_can_be_stored(result):
    got, want = storable_object(result), _round_trip(result)
    if "result_repr" in want:
        assert got == want
    else:
        assert _typed(got) == _typed(want)
    json.dumps(got, ensure_ascii=False).encode("utf-8")  # what a database is sent


def test_valid_text__escapes_lone_surrogates_only():
    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    assert valid_text(name) == "caf\\udce9"
    assert valid_text({name: [name, 1, "ok"]}) == {"caf\\udce9": ["caf\\udce9", 1, "ok"]}
    assert valid_text("\U0001f600 é") == "\U0001f600 é"  # a valid pair, non-ASCII: as is


def name_with_surrogate() -> str:
    return b"caf\xe9".decode("utf-8", "surrogateescape")


def test_json_safe__the_shortcut_copies_and_refuses_what_it_cannot_vouch_for():
    flat = {"path": "f", "bytes_written": 4, "ok": True, "none": None}
    got = storable_object(flat)
    assert got == flat and got is not flat  # the tool may keep and change its own dict
    assert _typed(storable_object({"n": Colour.RED})) == _typed({"n": 1})  # IntEnum -> int
    assert _typed(storable_object({"s": Name.A})) == _typed({"s": "a"})  # str enum -> str
    assert _typed(storable_object({1: "x"})) == _typed({"1": "x"})  # keys become strings
    assert "result_repr" in storable_object({"f": math.nan})  # NaN is not JSON
    assert storable_object({"t": (1, 2)}) == {"t": [1, 2]}
    # past 4,300 digits json.dumps refuses an int (and ascii() too): shown by its type, never
    # a result the ledger cannot store
    assert storable_object(2**20000)["result_repr"] == "(int could not be shown)"
    assert storable_object({"n": 10**4300})["result_repr"] == "(dict could not be shown)"

    # not JSON, shown by ascii(): no surrogate reaches the ledger that way either
    class Named:
        def __repr__(self) -> str:
            return "Named(" + b"caf\xe9\x00".decode("utf-8", "surrogateescape") + ")"

    # (a NUL is ASCII and stays: JSON columns keep it)
    assert storable_object({"x": Named()})["result_repr"] == "{'x': Named(caf\\udce9\x00)}"
    # a tuple, a key that collides once escaped, a depth the walk cannot take
    assert storable_object({"t": (name_with_surrogate(),)}) == {"t": ["caf\\udce9"]}
    collide = {name_with_surrogate(): 1, "caf\\udce9": 2}
    assert storable_object(collide)["warning"] == "tool result was not JSON"
    deep: Any = "\udcff"
    for _ in range(700):
        deep = [deep]
    json.dumps(storable_object(deep), ensure_ascii=False).encode("utf-8")  # storable, not raised
    # a file name with an undecodable byte, flat: no shortcut past the escape
    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    assert storable_object({"name": name}) == {"name": "caf\\udce9"}
    assert storable_object({name: 1}) == {"caf\\udce9": 1}
    big = {"n": 2**64, "m": -(2**63) - 1}
    assert storable_object(big) == _round_trip(big)


def test_valid_line__a_text_column_takes_neither_a_lone_surrogate_nor_a_nul():
    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    assert valid_line(None) is None
    assert valid_line(f"no {name}\x00 here") == "no caf\\udce9\\x00 here"
    assert valid_line("plain é") == "plain é"
