"""Transcript repair, property-based: whatever the file, repair either refuses it (an
InputError, or the ledger's own refusal of a call it does not hold or that conflicts: exit 3-6,
one line, the file untouched), or writes a file that is the old one with text inserted, that
parses, that answers every call, and that a second repair leaves byte for byte as it is.

Generated: transcripts in the three formats, as JSON (bare list or wrapped, any indent, ASCII
or not) and JSONL (LF or CRLF, last newline or not); text and ids from all of Unicode,
surrogates, U+2028/U+2029/U+0085 and controls included; ids the ledger holds (with their
arguments) and ids it does not; arbitrary JSON-ish values (huge integers, NaN, deep nesting)
put in arbitrary places; text-level damage (duplicate keys, stray bytes, cut files, lines
joined or split); and arbitrary bytes.

Examples: ``EXAMPLES`` per property in the default run (a few seconds in all); the ``large``
profile runs 100 times as many: ``HYPOTHESIS_PROFILE=large`` for every property here, or the
``large``-marked variants (``pytest -m large``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.unit.repair_support import (
    FORMATS,
    KNOWN,
    TOOL,
    answered_ids,
    args_of,
    calls_items,
    items_of,
    known_ledger,
    only_insertions,
    results_items,
    text_item,
    wrap,
)
from toolledger.cli.common import exit_code_of
from toolledger.ledger.errors import LedgerError
from toolledger.ledger.ledger import Ledger
from toolledger.recovery.transcript import repair_file

SCOPE = "properties"
#: Examples per property in the default run.
EXAMPLES = 400

_COMMON = {
    "deadline": None,
    "database": None,  # nothing written into the work tree; a failure prints its seed
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("repair", max_examples=EXAMPLES, **_COMMON)
settings.register_profile("large", max_examples=100 * EXAMPLES, **_COMMON)
#: The profile in force here: HYPOTHESIS_PROFILE=large selects the large one.
PROFILE = settings.get_profile(
    "large" if os.environ.get("HYPOTHESIS_PROFILE") == "large" else "repair"
)
LARGE = settings.get_profile("large")
#: pytest-timeout's limit per test: the large profile takes minutes (about 6 for transcripts).
LONG = pytest.mark.timeout(1800)
TIMEOUT = LONG if PROFILE is LARGE else pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ledger(sqlite_url: str) -> Iterator[Ledger]:
    yield from known_ledger(sqlite_url, SCOPE)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="repair-props-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- strategies

#: Characters that broke, or could break, a reader: line ends of every kind, NUL, quotes,
#: escapes, a BOM, a lone surrogate, bidi overrides.
NASTY = '\u2028\u2029\x85\x0b\x0c\x1c\r\n\x00"\\\ufeff\u202e/'
SURROGATES = "\udcff\ud800"
chars = st.one_of(st.sampled_from(NASTY + SURROGATES), st.characters(exclude_categories=()))
texts = st.text(chars, max_size=10)
ids = st.one_of(st.sampled_from(sorted(KNOWN)), st.text(chars, max_size=6), st.just("call_new"))
#: Text UTF-8 can carry (no surrogate): with the ledger's ids, transcripts that repair.
clean_texts = st.text(
    st.one_of(st.sampled_from(NASTY), st.characters(exclude_categories=("Cs",))), max_size=10
)


#: Stands for an integer of 5000 digits, which json.dumps cannot write: replaced in the text.
HUGE = "<huge integer>"


def _deep(n: int) -> Any:
    value: Any = []
    for _ in range(n):
        value = [value]
    return value


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**63 - 2, max_value=2**64),
    st.just(HUGE),
    st.floats(),  # NaN and infinities included
    texts,
    st.integers(60, 70).map(_deep),
)
json_ish = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(texts, kids, max_size=3),
    max_leaves=6,
)


@st.composite
def a_call(draw: st.DrawFn, ids: st.SearchStrategy[str]) -> tuple[str, str, Any]:
    cid = draw(ids)
    known = cid in KNOWN and draw(st.integers(0, 9)) > 0  # mostly its true arguments
    args = args_of(cid) if known else draw(st.dictionaries(texts, json_ish, max_size=2))
    return cid, TOOL if known or draw(st.booleans()) else draw(texts), args


@st.composite
def transcript_items(
    draw: st.DrawFn, fmt: str, texts: st.SearchStrategy[str], ids: st.SearchStrategy[str] | None
) -> list[Any]:
    """A transcript of the right shape: turns of text, calls, and results for some calls.
    ``ids`` None: each call a different one of the ledger's."""
    items: list[Any] = []
    pool = list(draw(st.permutations(sorted(KNOWN))))
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["user", "assistant", "calls", "calls"]))
        if kind != "calls" or (ids is None and not pool):
            items.append(text_item(fmt, kind if kind != "calls" else "user", draw(texts)))
            continue
        if ids is None:
            n = draw(st.integers(1, 3))
            taken, pool = pool[:n], pool[n:]
            calls = [draw(a_call(st.just(cid))) for cid in taken]
        else:
            calls = draw(st.lists(a_call(ids), min_size=1, max_size=3, unique_by=lambda c: c[0]))
        items += calls_items(fmt, calls)
        answered = [c[0] for c in calls if draw(st.integers(0, 2)) == 0]
        results = results_items(fmt, [(a, draw(texts)) for a in answered])
        if fmt == "anthropic":
            follow = draw(st.sampled_from(["results", "results+text", "empty", "text", "none"]))
            if follow == "empty":  # an empty user turn after the calls
                results = [{"role": "user", "content": []}]
            elif follow == "text":
                results = [{"role": "user", "content": draw(texts)}]
            elif follow == "none":
                results = []
            elif follow == "results+text":  # results, then what the user said
                blocks = results[0]["content"] if results else []
                text = {"type": "text", "text": draw(texts)}
                results = [{"role": "user", "content": [*blocks, text]}]
        items += results
    return items


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


def _put(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    parent = value
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = new
    return value


@st.composite
def serialised(draw: st.DrawFn, fmt: str, items: list[Any]) -> bytes:
    container = draw(st.sampled_from(["json", "json-list", "jsonl"]))
    ascii_ = draw(st.booleans())
    if container == "jsonl":
        newline = draw(st.sampled_from(["\n", "\r\n"]))
        text = newline.join(json.dumps(i, ensure_ascii=ascii_) for i in items)
        text += newline if draw(st.booleans()) else ""
    else:
        value = items if container == "json-list" else wrap(fmt, items)
        indent = draw(st.sampled_from([None, 0, 2, "\t"]))
        seps = draw(st.sampled_from([None, (",", ":")]))
        text = json.dumps(value, ensure_ascii=ascii_, indent=indent, separators=seps)
        if draw(st.booleans()):  # structural newlines only: json.dumps escapes those in strings
            text = text.replace("\n", "\r\n")
    text = text.replace(json.dumps(HUGE), "9" * 5000)
    bom = "\ufeff" if draw(st.integers(0, 9)) == 0 else ""
    return (bom + text).encode("utf-8", "surrogatepass")  # a lone surrogate: invalid UTF-8


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """The bytes of a transcript, damaged the way files and attackers damage them."""
    how = draw(st.sampled_from(["insert", "cut", "truncate", "duplicate-key", "line-end"]))
    at = draw(st.integers(0, len(data)))
    if how == "insert":
        return data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
    if how == "cut":
        return data[:at] + data[at + draw(st.integers(1, 8)) :]
    if how == "truncate":
        return data[:at]
    if how == "duplicate-key":
        key = draw(st.sampled_from([b'"messages"', b'"content"', b'"id"', b'"role"', b'"input"']))
        for sep in (b": ", b":"):
            if key + sep in data:
                return data.replace(key + sep, key + sep + b"1, " + key + sep, 1)
        return data
    newline = draw(st.sampled_from([b"\n", b"\r\n", "\u2028".encode(), b"\x0c", b""]))
    return data.replace(b"\n", newline, draw(st.integers(1, 3)))


@st.composite
def transcripts(draw: st.DrawFn) -> bytes:
    """Clean (repairable: text UTF-8 can carry, each call one the ledger holds, mostly with
    its arguments), wild (any text and id), with arbitrary values in arbitrary places, or
    damaged as bytes."""
    fmt = draw(st.sampled_from(FORMATS))
    mode = draw(st.sampled_from(["clean", "clean", "wild", "values", "bytes"]))
    if mode == "clean":
        items = draw(transcript_items(fmt, clean_texts, None))
    else:
        items = draw(transcript_items(fmt, texts, ids))
    if mode == "values":  # something arbitrary, somewhere
        for _ in range(draw(st.integers(1, 2))):
            path = draw(st.sampled_from(list(_paths(items))[1:]))
            items = _put(items, path, draw(json_ish))
    data = draw(serialised(fmt, items))
    return draw(damaged(data)) if mode == "bytes" else data


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------------------- the property


def check(ledger: Ledger, workdir: Path, data: bytes) -> None:
    path = workdir / "t.json"
    path.write_bytes(data)
    try:
        report = repair_file(path, ledger, SCOPE)
    except LedgerError as exc:
        code = exit_code_of(exc)
        event(f"refused: exit {code} ({type(exc).__name__})")
        assert code in (3, 4, 5, 6), f"exit {code}: {exc}"  # never "would not read back"
        message = str(exc)
        assert message and "\n" not in message and "\r" not in message, message
        assert path.read_bytes() == data, "a refused transcript was changed"
        assert [p.name for p in workdir.iterdir()] == ["t.json"], "a temporary file was left"
        return
    event(f"repaired: {len(report.inserted)} inserted" if report.changed else "nothing to do")
    assert [p.name for p in workdir.iterdir()] == ["t.json"], "a temporary file was left"
    out = path.read_bytes()
    if not report.changed:
        assert out == data
        return
    assert only_insertions(data, out), "repair changed something besides inserting"
    for ch in ("\u2028", "\u2029", "\x85"):  # what it inserts has them escaped
        assert out.decode("utf-8").count(ch) == data.decode("utf-8").count(ch)
    assert report.format is not None
    answered = answered_ids(report.format, items_of(out))  # a plain JSON reader agrees
    assert {i["tool_call_id"] for i in report.inserted} <= set(answered)
    again = repair_file(path, ledger, SCOPE)
    assert not again.changed and again.calls == again.answered_before == report.calls
    assert path.read_bytes() == out, "a second repair changed the repaired transcript"


@TIMEOUT
@PROFILE
@given(data=transcripts())
def test_repair__transcripts_refused_or_repaired_for_good(ledger, workdir, data):
    check(ledger, workdir, data)


#: Bytes of any kind, and text of any kind (surrogates written as CESU-style bytes).
arbitrary = st.one_of(st.binary(max_size=500), st.text(chars, max_size=80).map(_utf8))


@TIMEOUT
@PROFILE
@given(data=arbitrary)
def test_repair__arbitrary_bytes(ledger, workdir, data):
    check(ledger, workdir, data)


@pytest.mark.large
@LONG
@LARGE
@given(data=transcripts())
def test_repair__transcripts_large(ledger, workdir, data):
    check(ledger, workdir, data)


@pytest.mark.large
@LONG
@LARGE
@given(data=arbitrary)
def test_repair__arbitrary_bytes_large(ledger, workdir, data):
    check(ledger, workdir, data)


def test_the_generator_reaches_every_outcome(ledger, workdir):
    """Guard against a generator that only ever produces refusals: it does make transcripts
    that are repaired, refused as input, and calls the ledger does not hold (derandomised)."""
    from hypothesis import find

    def outcome(data: bytes) -> str:
        path = workdir / "t.json"
        path.write_bytes(data)
        try:
            return "repaired" if repair_file(path, ledger, SCOPE).changed else "unchanged"
        except LedgerError as exc:
            return type(exc).__name__

    for wanted in ("repaired", "TranscriptError", "NotFound"):
        find(
            transcripts(),
            lambda data, wanted=wanted: outcome(data) == wanted,
            settings=settings(PROFILE, max_examples=2000, derandomize=True),
        )
